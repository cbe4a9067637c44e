"""Every constant of the analytical model, in one place, with where it comes from.

"measured" means measured by this project on its GPU machines (data under data/ or
../shared/gpu/FACTS.md at the time of writing); "Megatron" means the convention of Megatron-LM's
code; everything else names its published source. `advisor fit` re-fits the ones marked
(fitted) against measurements; the values here are the defaults before any calibration.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

GIB = 2**30


@dataclass(frozen=True)
class Constants:
    # ---- memory -------------------------------------------------------------------------------
    # Bytes per parameter, mixed precision with fp32 master weights and Adam (Megatron; ZeRO paper
    # Rajbhandari et al. 2020 §3.1): bf16 weights 2 + fp32 main grads 4 + fp32 master 4 + m 4 + v 4.
    bytes_weight: float = 2.0
    bytes_grad: float = 4.0
    bytes_optimizer: float = 12.0
    # Transient of the optimizer step per parameter of the shard it updates: one fp32 tensor of the
    # shard's size. te stack (bf16 gradient buffers): megatron-core's distributed optimizer makes
    # the fp32 main grads, shard_main_param.grad = shard_model_grad.float(), freed by the next
    # zero_grad; local stack (fp32 gradient buffers, .float() is no copy): torch's foreach AdamW
    # allocates its sqrt(v) denominator for the whole group. It is the optimizer phase's own peak:
    # the last backward has freed the activations and the logits (models.memory: the stage's peak
    # is the larger phase). Measured on the te runner's per-phase records (memory_phases:
    # static_gib at the step start, which still holds the previous step's main grads, less the
    # model's weights + grads + optimizer states): 4.1-4.2 B per shard parameter on the 11 dense
    # stages without interleaving (data/measurements/h100x4-te*.jsonl); peak allocated = 18 B/param
    # of static state + 4.0 B/param on every local MoE proxy at small micro-batches
    # (data/measurements/h100x1-moe*.jsonl).
    bytes_optimizer_transient: float = 4.0
    # ... and with FP8 primary weights (TrainConfig.fp8_param_gather) the optimizer step's peak rises
    # above the step start's by 2 B per linear-layer parameter of the rank's optimizer shard (its
    # updated weights re-quantized to TE's FP8 data + transpose while the old ones are held), 0 without
    # them. Measured (memory_phases: optimizer_peak_gib - static_gib) on te FP8 runs with them: +0.8 GiB
    # llama3-8b 8L DP4, +1.7 DP2 and TP2 DP1, llama3-70b 4L +1.7 DP4 / TP4 DP1, +3.4 TP2 DP1, GPT-3
    # 2.7B DP2 +2.4, the Qwen3 proxy 6L EP2 DP2 +3.4-3.5 (1.97-2.13 B per shard linear parameter;
    # data/measurements/h100x4-te.jsonl, h200x2-te.jsonl); +0.0 on all 31 runs without them. (The
    # other MoE runs' excess, DeepSeek-V2-Lite proxy +2.8, Mixtral TP4 +2.7, OLMoE +1.5 GiB, is not
    # checked term by term.) Measured on Hopper only and applied as it is on every GPU: not scaled
    # with the copies TE keeps (GPUSpec.fp8_transposed_copy), so on Blackwell, where there is no
    # transpose, it may be about half of it (unmeasured).
    bytes_fpg_step_transient: float = 2.0
    # fp8 training keeps an fp8 copy (and its transpose, for Hopper's TN-only FP8 GEMMs) of each
    # linear-layer weight (Transformer Engine): 1 + 1 bytes per weight. Per copy (half of it) it and
    # the casts' writes (fp8_cast_*_bytes) scale with the copies TE keeps of a per-tensor-scaled FP8
    # operand: data + transpose where the GPU's FP8 GEMMs are TN-only (Hopper), data alone where they
    # take either layout (Blackwell), a property of the GPU (GPUSpec.fp8_transposed_copy), not of a
    # profile; the block-scaled formats (MXFP8, NVFP4, FP8 blockwise) quantize along each axis apart:
    # 2 copies on every GPU (models/quant.py copies).
    bytes_fp8_weight_copy: float = 2.0
    # Bytes per activation element (bf16).
    bytes_activation: float = 2.0
    # Bytes per saved input of an FP8 GEMM under fp8 (Transformer Engine keeps the FP8 copy it
    # made for the forward GEMM for the wgrad GEMM of the backward).
    bytes_fp8_activation: float = 1.0
    # Bytes per logit of each fp32 tensor the cross entropy holds besides the bf16 logits (fp32:
    # Megatron's vocab-parallel cross entropy upcasts its logits, VocabParallelCrossEntropy.
    # calculate_logits_max: vocab_parallel_logits.float()), one microbatch at a time; how many
    # such tensors each implementation holds: models.memory.CROSS_ENTROPY_FP32_COPIES.
    bytes_logits_fp32: float = 4.0
    # Runtime buffers inside torch's caching allocator that no named term holds, GiB: the cuBLAS
    # workspace and Transformer Engine's workspaces (measured: 0.16 GiB allocated after a cuBLAS
    # GEMM and a TE Linear BF16 / FP8 forward + backward, step "te" of
    # data/microbench/h100x4-outside-memory.jsonl, `torchrun --nproc_per_node 4
    # bench/outside_memory_gpu.py OUT`) (fitted; the profiles' own). Memory outside the allocator
    # (CUDA context, NCCL) is not this: models/outside_memory.py, the constants below.
    runtime_overhead_gib: float = 0.16
    # ---- memory outside torch's allocator (models/outside_memory.py) -------------------------------
    # Measured on 4 x H100 SXM (one node, NVLink), torch 2.11, NCCL 2.28.9 (24 channels), TE 2.20.2,
    # device used - torch reserved (cudaMemGetInfo): data/microbench/h100x4-outside-memory.jsonl
    # (`torchrun --nproc_per_node 4 bench/outside_memory_gpu.py OUT`) and
    # data/microbench/h100x4-outside-memory-mcore.jsonl (`torchrun --nproc_per_node 4
    # bench/outside_memory_megatron_gpu.py OUT TP PP CP EP`); `python bench/memory_edge.py --outside`
    # solves and checks them. The per-communicator memory is per-channel NCCL state and buffers
    # (NCCL_MAX_NCHANNELS=4 cuts a communicator to ~0.1 GiB): at 8 GPUs per node (more NVLink
    # channels) and across nodes (network proxy buffers) it was NOT measured; these values are the
    # 4-GPU single-node ones.
    # The CUDA context (0.61) and the cuBLAS handle (+0.06): steps "ctx", "cublas".
    cuda_context_gib: float = 0.67
    # The world communicator, init + its first all-reduce: step "world" (+0.83).
    nccl_world_gib: float = 0.83
    # A communicator megatron-core opens with eager init, before its first collective: one of more
    # than one rank 0.19, one of a single rank 0.38 (least squares over megatron-core's 20 groups of
    # the TP1 / TP2 / PP2 / EP4 layouts: 5.2-6.5 GiB for "groups_created", residual < 0.02 GiB).
    nccl_comm_gib: float = 0.19
    nccl_comm_single_gib: float = 0.38
    # The connection buffers a group of more than one rank sets up at its first use: a collective
    # (+0.28 per megatron group's first all-reduce; +0.00 for all-gather / reduce-scatter on a
    # connected one), p2p send / recv (+0.44, step "p2p"), all-to-all (+0.75, step "a2a").
    nccl_connect_gib: float = 0.28
    nccl_p2p_connect_gib: float = 0.44
    nccl_a2a_connect_gib: float = 0.75
    # What a transformer layer keeps for the backward beyond the tensors models/memory.py counts
    # for every stack (those of Transformer Engine's fused layers), in tensors of the named width
    # per token (models/memory.STACK_LAYER_KEEPS: the defaults are the local stack's column,
    # TE_SETTINGS sets the te column). Not fitted: counted from the source of the layers.
    # megatron-core's local MLP computes a gated unit unfused (transformer/mlp.py, glu():
    # activation_func(x_glu) * (x_linear + glu_linear_offset)): silu keeps its input (a view of
    # the FC1 output, kept anyway) and the product keeps the silu output and the new tensor
    # x_linear + 0.0, two FFN-wide tensors that TE's fused SwiGLU (which keeps only its input)
    # does not allocate.
    glu_kept_copies: float = 2.0
    # The local attention splits the QKV GEMM output into q, k, v views (torch.split without TE's
    # SplitAlongDim); RoPE writes new q and k, and the value view SDPA keeps holds the whole QKV
    # output alive: q and k once more (1: kept, 0: TE's fused attention, whose inputs are the
    # tensors it keeps).
    qkv_output_kept: float = 1.0
    # Caching-allocator fragmentation, as a fraction of the peak allocated bytes (fitted). The te
    # profile sets 0: its reserved-but-unallocated memory is the physical term below.
    fragmentation: float = 0.08
    # ---- torch's caching allocator: reserved but unallocated at the peak (models/allocator_memory.py)
    # Fitted on peak reserved - peak allocated of every pipeline stage of the measured runs (te and
    # local, 334 stages), non-negative least squares: `python bench/memory_edge.py --allocator`
    # (fit and leave-one-architecture-out). Ranges in models/allocator_memory.py (RANGES).
    # What stays reserved whatever the layout: 20 MiB segments of the 1-10 MiB requests, 2 MiB
    # rounding of the large pool, blocks of other streams (GiB).
    alloc_reserved_base_gib: float = 1.33
    # Fraction of the stage's largest transient block (fp32 logits of the cross entropy, FC1 output)
    # that stays cached but unusable: a freed block cannot serve a larger request, so a new segment
    # is cudaMalloc'ed and the old one stays reserved.
    alloc_reserved_block: float = 0.54
    # One dropless MoE layer's token buffers (variable size every micro-batch) that stay reserved, per
    # sqrt(MoE layers of the stage) (allocator_memory.reserved_free_gib). Per stack, least squares on its
    # MoE stages (measured less the base and block parts; `python bench/moe_allocator.py --pipeline`,
    # p 0.5): the local stack 0.971 (59 stages, 6 architectures), here; the te stack's (1.641, 29
    # stages) is moe.MOE_TE_SETTINGS.
    alloc_reserved_moe: float = 0.97
    # With expandable segments (TrainConfig.expandable_segments) the whole term (GiB): segments grow
    # by mapped pages, so no freed block strands and the 20 MiB small-request segments are pages of
    # the one segment too. Measured: te-l8b-alloc-33 (llama3-8b[8L] DP4 mbs4 BF16, expandable on,
    # data/measurements/h100x4-te.jsonl): peak reserved - peak allocated 0.44 GiB (max over the 4
    # ranks; 0.27-0.44), against 3.85 GiB for te-l8b-alloc-32, the same layout with them off.
    alloc_reserved_expandable_gib: float = 0.44
    # Megatron FSDP (TrainConfig.fsdp): FSDP units whose parameters are all-gathered (and, in the
    # backward, whose full gradients wait for their reduce-scatter) at once: the one computing and the
    # next one, prefetched (megatron-core 0.19 distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py:
    # all-gather with prefetch=True in FORWARD_PASS_ORDER, and BACKWARD_PASS_ORDER in the backward;
    # the unit's gradient is reduce-scattered after its backward). Not measured (no FSDP run).
    fsdp_units_in_flight: float = 2.0
    # A layout is feasible when its fullest stage's memory upper bound leaves this much of the GPU's
    # memory free. A fixed amount, not a share of the GPU: the band (models/memory_band.py) already
    # scales its uncertainty with the predicted bytes (a ratio of the allocated peak, the allocator's
    # cache term), and what the margin is for does not grow with the HBM (another CUDA context,
    # driver and NCCL buffers past those measured). 4 GiB is the 5% of an H100 (79.65 GiB) every
    # OOM record in data/ was checked with; those records need none (python bench/memory_edge.py
    # --margin 0: 0 of 26 OOMs predicted to fit). As a share it was 9 GiB on a GB200, 14 on a GB300.
    memory_margin_gib: float = 4.0
    # FP8 primary weights (TrainConfig.fp8_param_gather) on Hopper: every step TE casts the rank's
    # shard of each linear weight from the fp32 master to FP8 with its transpose
    # (cast_transpose_general_kernel, one call per weight, on the compute stream): seconds per weight of
    # the rank's optimizer shard (all of them without the distributed optimizer), not bandwidth-bound
    # (the same time on an H100 and an H200). Measured, kernel profiles: llama3-8b[8L] / llama3-70b[4L]
    # on one H200 (DP1, session 34: x1-h200-te-s34c / -s34f) 129.5 / 248.7 ms a step for 1.745 / 3.423 B
    # weights = 74.2 / 72.7 ps; on 4 x H100 with DP4 (session 27: x4-te-s27d / -s27e, the with / without
    # pairs) 33.6 / 65.4 ms for a quarter of them = 77.0 / 76.4 ps; mean 75.1. Session 27 had read the
    # H100 pairs as 45 B per weight held at HBM bandwidth, which one GPU (DP1) puts 5.5x low.
    # Blackwell's FP8 GEMMs take either layout (no transpose): not applied there.
    fp8_param_cast_s: float = 7.5e-11

    # ---- compute ------------------------------------------------------------------------------
    # Best sustained fraction of dense bf16 peak for large GEMMs before power capping:
    # measured 788-798 TFLOP/s of 989 on H100/H200 for 8192^3 bf16 (device KINDS.md) = 0.80.
    gemm_efficiency_max: float = 0.80
    # fp8 GEMMs reach a lower fraction of their (2x) peak: cuBLASLt FP8 GEMMs of 8192^3 reach
    # ~1300-1450 of 1979 TFLOP/s on H100 SXM (NVIDIA Transformer Engine / cuBLAS benchmarks), 0.65-0.73.
    gemm_efficiency_max_fp8: float = 0.65
    # GEMM efficiency saturates with each dimension d as d / (d + gemm_half_dim) (fitted).
    gemm_half_dim: float = 96.0
    # The same for FP8 GEMMs: at twice the rate per byte a tile needs about twice the work to hide its
    # loads (start: 2 x gemm_half_dim).
    gemm_half_dim_fp8: float = 192.0
    # ---- fp8 under Transformer Engine (TE's Linear / LayerNormLinear / LayerNormMLP modules) ---------
    # Which GEMMs run in FP8: the linear layers of attention (QKV, output projection) and MLP (FC1, FC2,
    # routed and shared experts). Core attention, the embedding, the output layer (Megatron's
    # ColumnParallelLinear, not a TE module) and the router stay BF16 (TE fp8_autocast defaults;
    # Megatron-core's fp8 docs). Per FP8 GEMM TE writes an FP8 copy of its input and the transpose
    # Hopper's FP8 wgrad GEMM needs (cast_transpose: read 2 B, write 1 + 1 B per element), and in the
    # backward the same for the output gradient; the read of the input is fused into the norm /
    # activation that produced it where TE fuses (LayerNormLinear, LayerNormMLP).
    fp8_cast_fwd_bytes: float = 2.0  # extra HBM bytes per element of each FP8 GEMM input, forward
    fp8_cast_bwd_bytes: float = 4.0  # extra HBM bytes per element of each FP8 GEMM output gradient
    # Per FP8 GEMM call: scaling-factor / amax bookkeeping kernels, seconds (TE's delayed scaling
    # launches a few small kernels per GEMM; fitted).
    fp8_gemm_overhead_s: float = 8e-6
    # NVFP4 GEMMs (Blackwell, E2M1 with an E4M3 scale per 16 elements), fraction of the dense FP4
    # peak: no measurement of ours (no Blackwell GPU); start: the FP8 fraction, fitted on the
    # published NVFP4 rows (bench/fit_blackwell.py, whose prior is the measured B200 FP4 GEMM)
    gemm_efficiency_max_fp4: float = 0.65
    # at 4x the BF16 rate per byte read a tile needs ~4x the work to hide its loads (4 x gemm_half_dim)
    gemm_half_dim_fp4: float = 384.0
    # The FP4 rate TE's NVFP4 GEMMs issue at, per BF16 rate of the same SMs at the same clock.
    # TE runs them through cuBLASLt, whose block-scaled FP4 kernels use the K=64 MMA (tcgen05.mma
    # kind::mxf4nvf4.block_scale.block16, the SM100 atom SM100_MMA_MXF4 with a K-extent of 64
    # elements): 2x the FP8 rate, 4x BF16, on Blackwell (B200 / GB200) and Blackwell Ultra (B300 /
    # GB300) alike. Blackwell Ultra's 6x (GB300 / B300 datasheets: 15 PF dense FP4) is issued only by
    # the SM103-only K=96 form (CUTLASS example 89_sm103_fp4_ultra_gemm, schedules
    # KernelTmaWarpSpecialized*SmBlockScaledMxNvf4UltraVs16Sm103 lowering to SM103_MXF4_ULTRA_SS_VS:
    # NVIDIA/cutlass issue 3358; HazyResearch/ThunderKittens PR 201 adds that K96 form for B300).
    # Measured: cuBLASLt NVFP4 (torch._scaled_mm, e2m1 x e2m1, E4M3 scales per 16) on a GB300 at
    # 8192^3 runs 8,427-8,622 TFLOP/s, "the doubled (~8 PF-class) ceiling above FP8's ~3,859"
    # (cfregly/ai-performance-engineering, docs/gb300-nvfp4-dual2sm.md): 2.2x its FP8 GEMM, 0.79 of
    # 4 x 2,713 (the K64 rate at the maximum clock) but 0.53 of the 6x 16,279. So on GB300 the
    # NVFP4 GEMMs of a TE run gain over FP8 what they gain on GB200 (the published llama3.1-405b
    # NVFP4 / FP8 step-time ratios: 1.38x GB200, 1.35x GB300). The GEMM rate is
    # fp4_tflops x min(1, this / (its FP4 / BF16 ratio)) (quant.nvfp4_gemm_tflops); MFU stays against the GPU's FP4 peak (quant.mfu_peak_tflops).
    # A stack whose NVFP4 GEMMs issue the K96 form would set 6.
    nvfp4_gemm_rate_bf16: float = 4.0
    # NVFP4 casts (TE NVFP4BlockScaling, the recipe of Megatron-Bridge's NVFP4 performance runs):
    # per GEMM input an amax pass (the tensor's amax and that of its 16-point random Hadamard
    # transform, for the column-wise copy wgrad reads) and a cast writing the row-wise and the
    # Hadamard-transformed column-wise E2M1 copies with their E4M3 scales; per output gradient the
    # same with stochastic rounding. The rounding, the transform and the scale encoding make these
    # kernels slower than their bytes: TE 2.19's NVFP4Quantizer on GB200 (7,928 GB/s peak) takes
    # 18.61 us (round to nearest) / 31.33 us (stochastic) for a 2048 x 7168 BF16 tensor (pytorch/ao,
    # benchmarks/prototype/nvfp4_training/README.md, "CuteDSL kernels - comparison vs
    # TransformerEngine", linear full pipeline, standard math) = 10.05 / 16.92 bytes per element at
    # peak bandwidth. Entered as those bytes (the time they take at the peak, whatever the step's
    # hbm_efficiency); a lower bound at training sizes (that tensor, 29 MB, fits in L2).
    nvfp4_quantize_input_bytes: float = 10.05
    nvfp4_quantize_grad_bytes: float = 16.92
    # Flash-attention forward efficiency relative to dense peak (FlashAttention-2 paper reports
    # 50-73% of peak forward on A100/H100); backward does 2.5x the forward FLOPs.
    # Since the window fit: the efficiency of full causal attention at the reference shape (seq 8192,
    # head dim 128; models/attention.py prices other shapes from the kernels' tiles relative to it).
    attention_efficiency: float = 0.55
    attention_backward_factor: float = 2.5
    # Learned attention sinks (ModelSpec.attention_sinks, gpt-oss; TE softmax_type "learnable"): the
    # backward's extra time per query token per attention head (a GPU's local heads), whatever the
    # head dim and window. cuDNN 9.14 runs them as a separate dO.O pass
    # (cudnn::fusion::compute_dot_do_o_specialized) far below HBM bandwidth. Measured, not fitted:
    # one H200 (the H100's GH100 die), TE 2.20.2 attention alone, learnable minus vanilla backward
    # (`bash bench/te_device.sh sinks`, data/microbench/h200x1-attention-sinks.jsonl): 1.31-1.57 ns over
    # gpt-oss's 64 x 64 and llama3-8b's 32 x 128 heads at 4K / 8K, full and 128-token windows, mean
    # 1.46; in the gpt-oss proxy's steps (data/measurements/h200x1-te.jsonl) the dO.O kernel alone
    # 1.6-1.8 ns. Measured on Hopper, applied on every GPU and stack: Blackwell's kernel is not
    # measured (the Blackwell gpt-oss rows' change rests on it), and the local runner drops the sinks.
    attention_sink_bwd_s: float = 1.46e-9
    # Fixed cost of one fused-attention thread block besides its tiles, in tile-times: pipeline fill
    # and drain, its Q (forward) / K, V (backward) load and O / dK, dV store, and the per-row
    # memory-bound passes (dO.O preprocess, dQ accumulator clear + convert, GQA dK / dV reduction:
    # ~20-30 x head_dim bytes per row and head, ~3 tile-times of a 128-row block on H100). Plausible
    # 1-8. Fitted on TE's measured window / full attention at the te profile's attention_efficiency
    # (bench/fit_window_attention.py: 4.75 at 0.527, session 29's te refit; 4.79 at 0.524; 5.14 at 0.492, the te refit
    # with the host issue floor; 4.87 at 0.516; 5.26 at the 0.480 before the session-22 te refit).
    attention_edge_tiles: float = 4.75
    # Fused attention's efficiency at head dim 256 relative to 128 (FA3's 256 kernels: 128 x 80 / 64 x 80
    # tiles with one consumer warpgroup in the backward vs 64 x 128 with two). Plausible 0.6-1.0;
    # fitted on the one head-dim-256 shape measured (Gemma 2 9B, 16q / 8kv), forward + backward, with
    # the softmax's SFU time (step_time.softmax_stretch: 0.889 at head dim 256 on H100) priced
    # apart: bench/fit_window_attention.py (0.698 at the te profile's attention_efficiency 0.527; 0.700 at 0.524;
    # 0.725 at 0.492; 0.706 at 0.516; 0.826 before the SFU term, which it now excludes).
    attention_hdim256_efficiency: float = 0.698
    # The softmax's exponentials run on the special function units (SFU, MUFU.EX2), not the tensor
    # cores: one per attention score forward, and one again backward (P recomputed), against
    # 2·(d_qk + d_v) tensor FLOPs per score forward and attention_backward_factor times that
    # backward (step_time.softmax_stretch). Their time over the tensor time per score forward, r,
    # is 0.5 on an H100 at head dim 128 (16 exponentials vs 4096 dense BF16 FLOPs per clock per SM
    # (CUDA C++ Programming Guide throughput table; Together AI's FlashAttention-4 blog), 512 FLOPs
    # per score): the GPU and head size attention_efficiency is defined (and was fitted) at, so
    # an H100 at head dim 128 keeps its attention time; B200 / GB200 (r 0.88-0.98: tensor rate
    # 2.25-2.5x H100's, about as many exponentials per second) are slower per FLOP, B300 / GB300
    # (SFU rate doubled: r 0.41-0.46) about as fast as an H100 per FLOP.
    attention_exp_ratio_ref: float = 0.5
    # The fused attention kernel's rate against the length L it works on (queries and keys): as
    # L / (L + attention_half_tokens). cuDNN causal attention (TE's on Hopper), forward + backward,
    # head dim 128, on our H100: 409 (4K), 486-510 (8K), 525-547 (16K), 559-587 (32K) TFLOP/s
    # (models/profile_fit.TE_PRIOR's source) fit 606 x L / (L + 1,938) within 1.6%. Prices the
    # shorter chunks of context parallelism's ring (step_time.layer_forward).
    attention_half_tokens: float = 1940.0
    # Fraction of peak HBM bandwidth that elementwise / normalisation kernels reach (fitted;
    # measured device-to-device copy: 4.3 of 4.8 TB/s on H200 = 0.9, kernels reach less).
    hbm_efficiency: float = 0.70
    # Bytes of HBM traffic per token per layer for the memory-bound ops (norms, residual adds,
    # rotary, activation function, bias/dropout), in units of hidden_size x bytes_activation,
    # forward; backward costs 2x. Counted from Megatron's local spec kernels: 2 norms (r+w 2 each),
    # 2 residual adds (3 each), rotary on q,k (~2), activation on ffn handled separately.
    elementwise_hidden_passes: float = 16.0
    elementwise_ffn_passes: float = 3.0  # swiglu / gelu: read gate (+up), write out
    # One normalisation (or tanh soft-capping) kernel: reads its input and writes its output once,
    # in units of its width x bytes_activation (as each norm counts in elementwise_hidden_passes).
    # Priced for what the 2 pre-norms don't cover: post-norms, q / k norms, final logit capping.
    norm_passes: float = 2.0
    # Fixed per-layer per-microbatch kernel-launch and framework overhead, seconds (fitted).
    layer_overhead_s: float = 60e-6
    # Fixed per-step overhead (optimizer bookkeeping, python, synchronisation), seconds (fitted).
    step_overhead_s: float = 0.02
    # ---- host issue time (the CPU launching a layer's kernels; step_time.layer_host_s) -----------
    # Eager PyTorch issues every kernel and collective from the CPU; the GPU runs ahead of nothing,
    # so a stage's microbatch takes at least the host's issue time of its layers, and where the GPU
    # work is shorter the difference is time with no kernel on the GPU (NVML utilization below
    # 100%: GPT-3 2.7B's TP2 / CP2 TE runs, 82-86%). Seconds per layer and microbatch, forward +
    # backward, on the CPU our runs had; 0 (not priced) where a profile has not fitted them.
    # Source of the scale: megatron-core's SequentialMLP on this H100 VM takes 0.7-1.3 ms of host
    # time per expert MLP of ~20 kernels and their autograd (moe_sequential_expert_s: ~40 us per
    # op); a TE transformer layer is ~4 such blocks (norm + QKV, core attention, projection +
    # residual, norm + MLP + residual) plus DDP's per-parameter gradient hooks: ~3 ms.
    host_layer_s: float = 0.0
    # ... per TP collective the layer issues (forward + backward: 10 with sequence parallelism, 2
    # all-gathers + 2 reduce-scatters forward, their 4 transposes and the 2 re-gathers backward; 4
    # all-reduces without), each a torch.distributed call and TE's buffer handling around it: our
    # NCCL micro-benchmark times a small call from an idle GPU at 65-90 us, host issue included
    # (data/microbench/h100x4-nccl-bw.jsonl).
    host_collective_s: float = 0.0
    # ... per step of context parallelism's p2p ring (cp steps forward + backward per layer and
    # microbatch): TE's AttnFuncWithCPAndKVP2P issues each step's send / recv, chunk views, fused
    # attention call and the fp32 output / LSE (dQ / dKV) merges from Python (~20 ops at ~40 us).
    host_cp_step_s: float = 0.0
    # ... per FP8 GEMM (forward, dgrad and wgrad of each TE linear layer): TE's quantize and
    # scaling-bookkeeping calls around it (a few ops at ~40 us).
    host_fp8_gemm_s: float = 0.0
    # Optimizer step: HBM bytes per parameter of the local optimizer shard, counted from the kernels
    # of this project's runner (megatron-core 0.19.2 without apex / Transformer Engine: torch's
    # foreach AdamW and megatron's local multi-tensor fallbacks, bf16 params with fp32 main params
    # and fp32 main grads): zero the grad buffer (w 4), grad norm (r 4), clip (dst.copy_(src *
    # coeff): r 4 w 4 r 4 w 4 = 16; untrained models' grad norm is above the clip of 1), AdamW
    # foreach (p *= 1 - lr·wd 8, m.lerp_ 12, v *= b2 8, v.addcmul_ 12, sqrt 8, div 8, add eps 8,
    # p.addcdiv_ 16 = 80; its sqrt temporary is the measured 3.6-4 B/param optimizer transient,
    # bytes_optimizer_transient), copy main -> bf16 params (r 4 w 2) = 110 (94 without the clip).
    # A fused Adam (TE / apex FusedAdam, the te stack: models/profile_fit.TE_SETTINGS) reads grad 4,
    # master 4, m 4, v 4 and writes master 4, m 4, v 4, bf16 weight 2 = 30.
    optimizer_bytes_per_param: float = 110.0
    # Gradient accumulation outside the GEMMs, HBM bytes per parameter of the stage per microbatch:
    # without gradient_accumulation_fusion (it needs apex or TE; the runner sets it False) megatron
    # DDP's backward hook adds each bf16 weight gradient into the fp32 main grad
    # (param.main_grad.add_(param.grad): r 4 + 2, w 4 = 10). With the fusion (te stack) the wgrad
    # GEMM accumulates into main_grad itself: 0. For MoE proxies (billions of expert parameters,
    # few tokens each) this and the optimizer are 20-30% of the step (docs/power.md, "MoE").
    grad_accum_bytes_per_param: float = 10.0

    # ---- communication ------------------------------------------------------------------------
    # Achieved fraction of link bandwidth for large collectives (NCCL busbw / link bw; nccl-tests
    # on H100 NVLink4 report ~360-390 GB/s all-reduce busbw of 450 = ~0.8; 400G IB ~0.85).
    nvlink_efficiency: float = 0.80
    network_efficiency: float = 0.85
    # Per-collective latency, seconds (NCCL small-message latency ~10-30 us inside a node, more
    # across nodes).
    intra_latency_s: float = 15e-6
    inter_latency_s: float = 40e-6
    # Activation offloading's copies (TrainConfig.cpu_offload_layers; models/offload.py), two
    # constants fitted on the 4 x H100 PCIe Gen5 records of session 26 (te-l8bo-offload-01..08:
    # llama3-8b[16L] DP4, 2-12 of 16 layers offloaded; bench/activation_knobs_check.py --fit).
    # host_link_efficiency: the fraction of the host link (GPUSpec.host_link_gbs) one GPU's pinned
    # cudaMemcpyAsync achieves while every GPU of the node copies at once. Plausible range 0.35-0.92:
    # alone, PCIe's TLP headers cap a Gen5 x16 link near 0.93 and nvbandwidth / bandwidthTest report
    # 0.80-0.90 on H100 SXM hosts; four GPUs copying at once share the host's root ports and memory
    # (two GPUs per x16 uplink would halve it). Fitted 0.70 (leave-one-run-out 0.57-0.73), about
    # 44 GB/s per GPU. GH200 / GB200's NVLink-C2C takes the same fraction (not measured there).
    host_link_efficiency: float = 0.70
    # offload_overlap: the fraction of the other layers' compute the copies of a pass run beside
    # (exposed = N t_c - offload_overlap (L - 2) t_layer). TE 2.x (transformer_engine/pytorch/
    # cpu_offload.py, OffloadSynchronizer) issues every D2H and H2D copy on one offload stream, each
    # layer's D2H after that layer's forward (waiting on its tensors' events), each reload only after
    # offload_stream.wait_stream(compute) at layer L - 1 - N + i's backward, into per-tensor pinned
    # buffers allocated each step (retain_pinned_cpu_buffers=False): the copies start late and
    # queue, so less than the whole window hides them. Plausible range 0.3-1.0 (1: the window
    # fully used). Fitted 0.45 (leave-one-run-out 0.35-0.75; it trades against host_link_efficiency).
    offload_overlap: float = 0.45
    # Fraction of the hideable TP communication (1 - 1 / (2 tp) of it: the last chunk of TE's
    # pipelined reduce-scatter has no GEMM beside it) hidden when tp_comm_overlap is on (needs
    # Transformer Engine user buffers; Megatron reports most of it hidden).
    tp_overlap_fraction: float = 0.7
    # Fraction of the backward re-gather of the sequence-parallel input (2 all-gathers per layer,
    # step_time.layer_forward) left exposed: it is issued before the dgrad GEMM and can run behind
    # it (fitted per stack; 1: none hidden, the start).
    sp_regather_exposed: float = 1.0
    # Per ring step of context parallelism, per layer and microbatch, forward + backward: HBM passes
    # over the rank's attention output in fp32 (T x heads x head dim x 4 B) that Transformer Engine's
    # p2p ring makes to merge each step's partial result: forward the output / LSE correction (read
    # the step's output, read and write the fp32 accumulator: ~2.5), backward the dQ accumulation in
    # fp32 (read + write: 2), dK / dV (~1 with GQA), the output and its gradient read again (~1): ~6.
    # Fitted per stack (te: on its CP runs; range 0-40).
    cp_step_passes: float = 6.0
    # Fraction of the eligible window actually used to hide DP communication (fitted).
    dp_overlap_efficiency: float = 0.8
    # Compute lost to the SMs NCCL's kernels take while an overlapped DP collective runs: a collective
    # hidden behind compute for H seconds slows that compute by this share of H (models.step_time.
    # step_arrays, `collective_contention_s`). NCCL runs one CTA per channel, each on its own SM, and
    # caps them with NCCL_MIN_CTAS / NCCL_MAX_CTAS (ncclConfig_t min_ctas / max_ctas, NCCL 2.17+;
    # docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html); PyTorch exposes them because
    # "it affects the communication-computation overlap for NCCL kernels" (pytorch/pytorch PR 97394).
    # With 8-32 channels on NVLink / NVSwitch systems (not measured here) a GEMM sharing the GPU keeps
    # (SMs - channels) / SMs of its rate: 8 / 132 = 0.06 .. 32 / 132 = 0.24 on H100 SXM, 8 / 148 = 0.05
    # .. 32 / 148 = 0.22 on B200 / GB200. Range 0 .. 0.25. 0 until fitted (bench/fsdp_check.py --fit:
    # the published FSDP rows against the same GPUs' non-FSDP rows; docs/calibration.md, "FSDP").
    # Simplifications while it is 0: the lost seconds are in dp_exposed_s, so the power model prices
    # them as a communication phase (not compute) and they do not stretch at lower SM clocks.
    collective_sm_share: float = 0.0
    # Bytes per gradient element in the DP reduce-scatter / all-reduce: 4 with fp32 reduction
    # (Megatron-LM's default for bf16, this project's runner: grad_reduce_in_fp32=True), 2 in the
    # Megatron-Bridge / NeMo performance recipes (grad_reduce_in_fp32=False).
    dp_grad_reduce_bytes: float = 4.0
    # Fraction of the PP send/recv time hidden behind compute (Megatron's overlap_p2p_comm with the
    # interleaved schedule; the 1F1B schedule waits on it). Start: 0 (fitted per stack).
    pp_overlap_fraction: float = 0.0

    # ---- power and clocks: DVFS (models/dvfs.py) -----------------------------------------------
    # Fitted by bench/dvfs_fit.py on the H100 load sweep (data/dvfs/h100x1-sweep.*: square GEMMs,
    # GEMM duty cycles, memory-bound kernels and GEMM/copy mixes at the 700 W default cap, NVML at
    # 50 Hz and the energy counter per load); transformer-shaped GEMMs and one elementwise chain
    # of the same sweep are held out (docs/measurement.md, "DVFS"). Powers are fractions of
    # the GPU's power span (GPUSpec.power_span_w: TDP - idle_w, or the span of the board that runs the
    # same chip at the same clocks), so that they carry to other GPUs (an assumption for all but
    # H100 / H200, which share the GH100 die). The ranges are those of bench/dvfs_fit.py's bounds.
    # Voltage relative to its value at the maximum clock falls by vf_slope per unit of clock ratio
    # (linear V-f curve; fitted, range 0.05-1.5; CMOS: V ~ 0.7-1.1 V over a GPU's clock range).
    vf_slope: float = 0.331
    # ... down to this floor (the V-f table's lowest voltage; not observable in our sweep, whose
    # clocks stay >= 0.65 of the maximum; set to 0.65 = ~0.7 V / ~1.07 V, typical of 4-5 nm GPUs).
    vf_min_voltage: float = 0.65
    # Lowest clock the power limiter may choose, relative to the maximum: H100 SXM5 supported
    # clocks 345-1980 MHz (measured, data/dvfs/h100x1-nvidia-smi-supported-clocks.txt).
    min_clock_ratio: float = 345.0 / 1980.0
    # Share of a GEMM's (and attention's) time at the maximum clock that scales with the SM clock;
    # the rest does not (fitted, range 0.1-1: measured 8192^3 bf16 GEMMs run 686 TFLOP/s at
    # 1,410 MHz and 803 at 1,950: throughput ~ clock^0.5).
    gemm_clock_share: float = 0.415
    # Share of a memory-bound kernel's time that scales with the SM clock (the rest with the HBM
    # clock, which the power cap leaves alone on H100 / H200: 2,619 / 3,201 MHz throughout).
    memory_sm_clock_share: float = 0.145
    # Clock tree and awake baseline at the maximum clock (fitted; measured 121 W with a CUDA
    # context and nothing running at 1,980 MHz vs 72 W deep idle on H100).
    clock_power: float = 0.0646
    # Switching power of a saturating GEMM at the maximum clock and voltage (fitted; a GEMM at full
    # clock draws ~950-1,000 W on H100, measured in 10-25 ms bursts under the 700 W cap).
    gemm_power: float = 1.363
    # GEMM power falls as utilisation^exponent (fitted, range 0.3-1: small GEMMs move more bytes
    # per FLOP; measured 256^3 .. 1024^3 GEMMs draw 168-673 W uncapped).
    gemm_power_exponent: float = 0.699
    # fp8 GEMMs: switching power per unit of utilisation relative to bf16 (fitted on one sweep point:
    # 8192^3 fp8 at the cap held 1,290 MHz at 1,240 TFLOP/s).
    fp8_gemm_power: float = 0.997
    # Flash attention's switching power at the maximum clock (fitted on one sweep point: causal
    # SDPA at the cap held 1,710 MHz).
    attention_power: float = 1.101
    # Memory-bound kernels at the GPU's peak HBM bandwidth: SM-side switching power and HBM power,
    # both in proportion to the bandwidth reached (fitted; measured copy / add / an elementwise
    # chain at 2.4-3.1 TB/s of 3.35: 461-536 W uncapped on H100).
    memory_sm_power: float = 0.0
    memory_hbm_power: float = 0.744
    # The HBM bandwidth fraction that prices a training step's memory-bound kernels (norms,
    # residual adds, activations, MoE permutes, gradient accumulation, the optimizer): measured
    # 3.05-3.06 TB/s of 3.35 for the sweep's elementwise add and chain (0.91; a plain copy 0.73).
    # Not the step model's hbm_efficiency: that is a time constant each profile fits (0.70 default,
    # 0.75-0.95 in local fits that differ only in where the optimizer starts: the dense runs cannot
    # pin it), and the power of a kernel must not depend on which time fit won.
    memory_power_bandwidth: float = 0.91
    # NCCL collectives and p2p (SMs polling and copying, NVLink) and waiting in a pipeline bubble or
    # for a peer: fitted on the 43 campaign runs with the power model given each run's measured step
    # (`python bench/power_check.py --fit --calibration local data/measurements/h200x4-campaign.jsonl
    # data/measurements/h100x1-campaign.jsonl`, with peak_overshoot); `advisor fit` refits them per
    # calibration (ranges 0.02-0.8, 0.005-1).
    comm_power: float = 0.570
    wait_power: float = 0.0837
    # Window over which the power limiter averages (fitted on the GEMM duty cycles: bursts of
    # 10-250 ms are averaged with the gaps between them, 1 s bursts are capped on their own).
    limiter_window_s: float = 0.0325
    # Sampled peaks (20-50 Hz) under a cap: the busiest phase's power at the clock held, plus this
    # fraction (the limiter's clock oscillation): measured peak / mean of the 14 capped steady loads
    # of the H100 sweep 1.13-1.34, mean 1.22 (data/dvfs/h100x1-sweep.jsonl); `advisor fit` refits it.
    peak_overshoot: float = 0.185
    # Instantaneous ripple above the steady value when not capped (measured 1.01-1.02 on the
    # uncapped sweep loads).
    power_ripple: float = 1.02
    # The power sensor's own averaging window: NVML's instant power field (186) on A100 / H100
    # averages ~25 ms (Yang et al., "Accurate and Convenient Energy Measurements for GPUs", SC'24,
    # arXiv 2312.02741). A microbatch longer than it is resolved by the 20-50 Hz samples: an
    # uncapped GPU's sampled peak is the backward pass (power_arrays.sampled_stretch), not the
    # microbatch's average.
    power_sensor_window_s: float = 0.025
    # Share of a microbatch's launch / host gaps that fall in its backward pass: the autograd
    # engine issues the backward's kernels from C++ (a few us each) where the forward's eager
    # Python ops cost tens of us of host time each on our VM (bench/host_issue.py), and the MoE
    # dispatcher's token-count sync is forward-only. Plausible 0.05-0.35; fitted on the uncapped
    # MoE runs' sampled peaks, leave one file out 0.08-0.14 (`python bench/moe_peak_check.py`).
    backward_gap_share: float = 0.1
    # Steady temperature T = idle_temp + c_per_w * (P - P_idle): measured 0.041-0.051 C/W with an
    # idle temperature of 36-39 C on 4 x H200 (FACTS.md burn table).
    idle_temp_c: float = 38.0
    c_per_w: float = 0.046
    # Margin below the slowdown temperature where thermal throttling risk starts, C.
    thermal_margin_c: float = 15.0

    # ---- throttle risk score (a 0-1 presentation scale, not physics; not fitted) ---------------
    # The score puts each cause in its own third of the scale, in the order of harm: sustained
    # power throttling in [0.67, 1] (high), brief spikes over the cap in [0.34, 0.66] (medium),
    # approaching the cap in [0, 0.33] (low); labels: high >= 0.66, medium >= 0.33.
    # Sustained: 0.67 plus 3.3 per unit of slowdown, so 10% slower steps reach 1.0.
    throttle_risk_sustained_base: float = 0.67
    throttle_risk_per_slowdown: float = 3.3
    # Spikes: 0.34 plus up to 0.32 as the GEMM-phase demand exceeds the cap, the full 0.32 at 20%
    # over it (chosen; for scale, measured capped peaks overshoot the cap by 7-8%, power_overshoot).
    throttle_risk_spike_base: float = 0.34
    throttle_risk_spike_span: float = 0.32
    throttle_spike_full_excess: float = 0.2  # fraction of the cap
    # Below the cap: up to 0.33 as the peak demand goes from 70% of the cap (start) over the
    # remaining 30% (span) to the cap.
    throttle_risk_low_span: float = 0.33
    throttle_low_start: float = 0.7  # fraction of the cap
    throttle_low_range: float = 0.3  # fraction of the cap: 1 - throttle_low_start
    throttle_label_high: float = 0.66
    throttle_label_medium: float = 0.33

    # ---- mixture of experts (models/moe.py) --------------------------------------------------
    # Measured means our runner on 1 x H100 (megatron-core 0.19.2 local spec, no TE):
    # data/measurements/h100x1-moe*.jsonl, each sub-step timed alone (runners/moe_probe.py). The
    # defaults are those runs' fit on all four proxy shapes (`python bench/moe_check.py
    # --constants-out models/data/moe_local_fit.json`, rounded), on the local profile's step
    # constants, refitted with the local stack's per-parameter gradient accumulation and optimizer
    # traffic (grad_accum_bytes_per_param). The local profile was refitted with these defaults
    # (its two Mixtral rows on 4 x H200 see them); the json holds the same fit on that refitted
    # profile (in sample 5.4% vs 6.2% with these defaults): fed back, the two fits move each
    # other's constants to their bounds, so the defaults stay at the first round; (fitted)
    # = in moe.MOE_LOCAL_FIT with that range; the Transformer Engine stack's own values are
    # moe.MOE_TE_SETTINGS / MOE_TE_FIT.
    # Router: HBM passes over the fp32 T x E scores (softmax write/read, top-k, aux loss, their
    # backward) (fitted; 2-40).
    moe_router_passes: float = 4.32
    # Router launch cost per layer and microbatch, forward + backward: ~30 small kernels
    # (softmax, top-k, scatter, aux loss) that the host launches in turn; measured 0.3-2.5 ms per
    # layer-microbatch, growing with E (fitted; 10 us - 5 ms, and 0-50 us per expert).
    moe_router_overhead_s: float = 0.00022
    moe_router_per_expert_s: float = 1.2e-05
    # Permute + unpermute, forward + backward, in HBM passes over the routed activations T·k·h:
    # megatron-core's unfused permutation (index_select, scatter_add with fp32 probabilities,
    # their index_add / gather backward); Transformer Engine's fused permutation needs ~4 (fitted; 2-80).
    moe_permute_passes: float = 29.7
    # ... plus a launch cost per layer-microbatch (routing-map sort, token counts copied to the
    # host) and, with the alltoall dispatcher and more than one local expert, per local expert
    # (the split / cat re-sort of chunks by expert) (fitted; 10 us - 10 ms; 0-100 us per expert).
    moe_permute_overhead_s: float = 0.00092
    moe_permute_per_expert_s: float = 1.5e-05
    # Fraction of the dispatch / combine all-to-all left exposed (1 = none hidden). Our runner
    # overlaps nothing; Megatron's --overlap-moe-expert-parallel-comm (1F1B all-to-all overlap,
    # used by the DeepSeek-V3 recipes) and shared-expert overlap hide most of it (fitted; 0.05-1).
    moe_a2a_exposed: float = 1.0
    # Expert GEMMs reach grouped_gemm_fraction(n) = n / (n + moe_gemm_half_tokens) of the rate the
    # dense GEMM model gives for the same h and f, times moe_gemm_efficiency (grouped kernels of
    # unequal groups vs one dense GEMM). Measured with torch._grouped_mm on H100: the experts
    # phase runs 163-320 TFLOP/s at 256-1024 tokens/expert (h 2048), 395-470 at 1024-2048 (h 4096),
    # its GEMMs faster: the phase also holds the expert weights' gradient accumulation (10 B/param
    # per microbatch: 23 ms of the 68 ms per step of the Qwen3 proxy at mbs 1) and its launch costs
    # (fitted; 16-4096; 0.3-1).
    moe_gemm_half_tokens: float = 159.0
    moe_gemm_efficiency: float = 1.0
    # ... and by the expert's FFN width f (per ETP rank): f / (f + moe_gemm_half_ffn); 0 = no such
    # loss (one grouped kernel: this runner's torch._grouped_mm); the te profile's value: models/moe.py
    # MOE_TE_SETTINGS (TE's GroupedLinear: one cuBLAS GEMM per expert; moe.expert_width_fraction).
    moe_gemm_half_ffn: float = 0.0
    moe_gemm_reference_tokens: float = 4096.0  # the token count the dense GEMM model is asked at (convention)
    # Expert activation and probability weighting, forward + backward, in HBM passes over the
    # routed T·k·f elements: SwiGLU reads 2f writes f, the fp32 probability product writes f in
    # fp32 and casts it back; backward ~2x (fitted; 2-40).
    moe_expert_elementwise_passes: float = 21.2
    # Per layer-microbatch launch cost of the experts phase (token counts copied to the host,
    # offsets, ~10 kernels) (fitted; 1 us - 5 ms).
    moe_expert_overhead_s: float = 0.00075
    # Grouped GEMM off (megatron-core's SequentialMLP): the host launches each local expert's MLP
    # (~20 kernels and their autograd) in turn; the phase takes at least this per local expert,
    # forward + backward. Measured 0.7-1.3 ms per expert on the H100 VM (fitted; 50 us - 5 ms).
    moe_sequential_expert_s: float = 0.00081
    # Grouped GEMM on: host seconds per local expert per layer-microbatch, forward + backward, that
    # the experts phase takes at least. 0 for one grouped kernel over all experts (this runner's
    # torch._grouped_mm; TE's CUTLASS grouped GEMM). Transformer Engine's GroupedLinear in BF16 on
    # Hopper (TE 2.x general_grouped_gemm -> nvte_multi_stream_cublas_gemm) issues one cuBLASLt GEMM
    # per expert, each with its own descriptors and heuristic query, for fc1 and fc2 forward and
    # their dgrad and wgrad: 6 calls per expert (the te profile's value: models/moe.py MOE_TE_SETTINGS).
    moe_grouped_expert_host_s: float = 0.0
    # ... and what a quantized format (FP8 through TE) adds to it per local expert per
    # layer-microbatch: TE's GroupedLinear (transformer_engine/pytorch/module/grouped_linear.py,
    # TE 2.x) quantizes each expert's input apart (tex.fused_multi_quantize: one kernel, but one
    # quantized tensor with its own scale / amax / transpose built on the host per expert, for fc1
    # and fc2 forward and their gradient outputs backward), fetches each expert's FP8 weight
    # workspace in a Python loop (get_weight_workspace) and hands each expert's scale-inverse to
    # its cuBLASLt GEMM: ~10 host objects and calls per expert (0 where no GroupedLinear issues
    # the experts one by one; the te profile's value: models/moe.py MOE_TE_SETTINGS).
    moe_fp8_expert_host_s: float = 0.0
    # The host's issue time of a MoE layer's fixed launches beyond a dense layer's (host_layer_s),
    # per layer-microbatch, forward + backward: the router (gating GEMM, top-k, softmax, aux loss),
    # the token counts and their sync, the permutation and its index bookkeeping, the dispatcher's
    # collectives, the combine, the shared experts. Enters the stage's host issue time with each
    # local expert's (moe_grouped_expert_host_s): models/moe.py MoELayerTime.host. A VM host cost
    # (moe.MOE_HOST): 0 here and in the shipped te profile, our VM's in moe.MOE_TE_VM_HOST.
    moe_layer_host_s: float = 0.0
    # The token dispatcher's collectives per layer-microbatch each cost, beyond their bytes, one small
    # NCCL call's time from an idle GPU: megatron-core synchronises on the token counts before the
    # dispatch (its cuda_sync_point, the splits copied to the host), so the queue is empty and each
    # call's host issue and launch lie on the critical path. Our VM: the median <= 1 MiB all-to-all
    # of the NCCL micro-benchmark over 2 and 4 H100s, 72-78 us (data/microbench/h100x4-nccl-bw.jsonl,
    # bench/nccl_bw_gpu.py; host issue included; flat in the group size: per call, not per peer).
    # A VM host cost: the te profile ships 0 (NVIDIA's hosts) and profile_fit.on_vm applies this to
    # our runs (moe.MOE_HOST, moe.dispatch_calls counts the calls).
    moe_dispatch_call_s: float = 73.7e-6
    # ... and per step, each expert weight tensor's share of the optimizer / gradient loops over
    # parameter tensors (SequentialMLP keeps 2 tensors per expert, grouped experts 2 per layer):
    # measured 0.2-0.35 ms per tensor (step time outside the MoE layers, sequential vs grouped)
    # (fitted; 1 us - 2 ms).
    moe_sequential_tensor_step_s: float = 0.00065
    # Trained aux-loss routers: the busiest expert carries this fraction more than the mean load
    # (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts",
    # arXiv 2408.15664, report maximal violations of a few tenths for aux-loss routers and a few
    # hundredths with their loss-free bias). Not fitted: our runs' routers are untrained (their
    # at-init skew, 1.1-8x, is recorded in moe_probe.load); plausible 0.1-0.7.
    moe_router_skew: float = 0.3
    # Activations of a MoE layer per routed token, in elements: hidden-sized (permuted input and
    # expert output before the combine) and FFN-sized (fc1 output f, activation f, weighted copy
    # f; gated adds f); per token the router keeps fp32 logits / probabilities / scores over E
    # (moe_act_router_fp32 fp32 copies) (fitted on memory; 1-4, 2-6, 1-6).
    moe_act_hidden_per_token: float = 1.5
    moe_act_ffn_per_token: float = 5.15
    moe_act_router_fp32: float = 2.87
    # ... and, per routed token, the hidden-sized token buffers a MoE layer holds beside what it
    # saves while it runs (the permutation's output, the all-to-alls' outputs, the experts' output
    # before the combine, the unsort's output; and their gradients in its backward): freed before
    # the next layer, so they add to the peak only where one layer's working set sits on top of
    # the rest, the recompute working set of full recompute (models.memory). Measured with the te
    # stack (MOE_TE_SETTINGS, models/moe.py): 0 here, where unmeasured.
    moe_transient_hidden_per_token: float = 0.0
    # --moe-router-fusion: TE's fused score / top-k / aux-loss kernels read the fp32 T x E logits
    # once forward and once backward (transformer_engine.pytorch.router, fused_topk_with_score_function
    # and fused_compute_score_for_moe_aux_loss), instead of moe_router_passes unfused passes.
    moe_router_fused_passes: float = 2.0
    # ... and their launch cost per layer-microbatch, forward + backward: a few fused kernels, or a
    # CUDA-graph replay of the router (the Qwen3 recipes' "TE cuda graphs attn/moe_router/
    # moe_preprocess", published_fit.csv notes), instead of ~30 unfused kernels growing with E
    # (set, not fitted: ~10 launches at ~5 us).
    moe_router_fused_overhead_s: float = 5e-5
    # --moe-permute-fusion (TrainConfig.moe_permute_fusion; Megatron-Bridge's MoE recipes set it,
    # megatron-core's default is off): TE's moe_permute / moe_unpermute / sort_chunks_by_index, one
    # read and one write of the routed tokens each way (~4 passes forward + backward; 6.2 as fitted
    # with the te profile's MoE constants on the published rows, moe.MOE_TE_FIT's first fit), a few
    # launches per layer-microbatch and no per-expert chunk loop.
    moe_permute_fused_passes: float = 6.2
    moe_permute_fused_overhead_s: float = 5e-5
    # DeepEP (megatron-core's flex dispatcher, DeepEP backend), its normal kernels' published
    # bottleneck bandwidths (deepseek-ai/DeepEP, docs/legacy.md "Performance", H800 with ~160 GB/s
    # NVLink and one CX7 400 Gb/s (~50 GB/s) NIC per GPU, 4096 tokens, h 7168, top-8): in a node
    # EP8 dispatch 153 / combine 158 GB/s NVLink (0.96 of the link); across nodes, counting each
    # token once per node it goes to, EP16 43, EP32 58/57, EP64 51/50 GB/s RDMA (0.86-1.16 of the
    # NIC; 1.0 taken).
    deepep_nvlink_efficiency: float = 0.96
    deepep_rdma_efficiency: float = 1.0

    def usable_memory_gib(self, gpu_memory_gib: float) -> float:
        """What a layout's memory may reach by default: the GPU's memory less memory_margin_gib."""
        return gpu_memory_gib - self.memory_margin_gib

    def replace(self, **changes) -> "Constants":
        return replace(self, **changes)

    def to_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


DEFAULT = Constants()


# Block-scaled and per-tensor formats of the linear layers' GEMM operands (models/quant.py):
# name -> (bytes per element, elements per scale, bytes per scale, amax pass). The amax pass is one
# extra read of the BF16 tensor before its cast: per-tensor *current* scaling computes the scale
# from this tensor's own amax (TE Float8CurrentScaling), and NVFP4 from its per-tensor FP32 global
# scale (TE NVFP4BlockScaling); delayed scaling takes the scale from the amax history (fused in the
# cast) and the block formats compute each block's scale inside the cast kernel. Sources: OCP
# Microscaling Formats (MX) v1.0 (MXFP8: E4M3 elements, one E8M0 scale per 32); NVIDIA, "Pretraining
# LLMs with NVFP4" (arXiv 2509.25149) and TE's NVFP4BlockScaling (E2M1, one E4M3 scale per 16, 16x16
# 2D blocks for weights, random Hadamard transforms and stochastic rounding fused in the cast);
# TE Float8BlockScaling (1x128 activation / 128x128 weight blocks, FP32 scales); DeepSeek-V3 report.
QUANT_FORMATS: dict[str, tuple[float, int, float, bool]] = {
    "fp8": (1.0, 0, 0.0, False),
    "fp8-tensorwise": (1.0, 0, 0.0, True),
    "fp8-blockwise": (1.0, 128, 4.0, False),
    "mxfp8": (1.0, 32, 1.0, False),
    "nvfp4": (0.5, 16, 1.0, True),
}
