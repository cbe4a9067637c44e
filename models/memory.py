"""Memory per GPU for each pipeline stage: weights, gradients, optimizer states, activations,
logits, runtime overhead. Pure functions of (model, config, constants).

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", Table 2) generalised to GQA / MLA, SwiGLU and MoE, with flash attention (no
s x s score matrix is stored; this is what Megatron runs with TE or SDPA attention).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from functools import lru_cache

import numpy as np

from advisor.catalog.specs import QUANTS, GPUSpec, ModelSpec, TrainConfig
from advisor.models.constants import DEFAULT, GIB, Constants
from advisor.models.flops import embedding_params, layer_params, output_params, qk_norm_width
from advisor.models.moe import moe_activation_elements, routed_tokens
from advisor.models.allocator_memory import dense_block_bytes, logits_block_bytes, moe_buffer_bytes, reserved_free_gib
from advisor.models.outside_memory import outside_allocator_arrays
from advisor.models.quant import saved_input_bytes, weight_copy_bytes
from advisor.models.recompute import partial_activations
from advisor.models.stages import Memo, Stages, gather_blocks, layer_shape_config, memo_for
from advisor.search_spaces.columns import RECOMPUTE_CODES, Layouts, extra_codes, unique_rows
from advisor.search_spaces.layout import (PipelinePlan, in_flight_chunks, in_flight_layers, layer_kind_counts,
                                          pipeline_plan, rank_kinds, stage_layers)


@dataclass(frozen=True)
class StageMemory:
    stage: int
    layers: int
    params: int  # parameters held by one GPU of this stage
    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float
    logits_gib: float  # the loss stage's: logits, the cross entropy's tensors, the final norm's saved tensors
    overhead_gib: float  # runtime buffers inside torch's allocator (Constants.runtime_overhead_gib)
    step_transient_gib: float = 0.0  # optimizer-step transient beyond the activations and logits (peak = the larger phase)
    # memory outside torch's allocator (CUDA context, NCCL communicators: models/outside_memory.py);
    # not in total_gib, which is what torch's allocator reserves (what the runs measure)
    outside_gib: float = 0.0
    # torch's caching allocator: reserved but unallocated at the peak (models/allocator_memory.py);
    # in total_gib (the runs measure peak reserved)
    reserved_free_gib: float = 0.0
    # the same term with expandable segments off (equal to it where they are off; not in total_gib):
    # with them on, a non-periodic layout strands at most what the caching allocator would
    # (models.memory_band.Band.reserved_free_interval)
    reserved_free_off_gib: float = 0.0

    @property
    def total_gib(self) -> float:
        """What torch's caching allocator holds at the stage's peak."""
        return (self.weights_gib + self.grads_gib + self.optimizer_gib + self.activations_gib
                + self.logits_gib + self.overhead_gib + self.step_transient_gib + self.reserved_free_gib)

    @property
    def device_gib(self) -> float:
        """The GPU's memory in use at the stage's peak: the allocator's and what lies outside it."""
        return self.total_gib + self.outside_gib

    def to_dict(self) -> dict:
        """dataclasses.asdict plus total_gib (the fields are numbers: no copies)."""
        d = {f: getattr(self, f) for f in _MEMORY_FIELDS}
        d["total_gib"] = self.total_gib
        d["device_gib"] = self.device_gib
        return d


_MEMORY_FIELDS = tuple(f.name for f in fields(StageMemory))


def stage_params(model: ModelSpec, cfg: TrainConfig, layers: range | tuple[int, ...], stage: int) -> tuple[float, float]:
    """(dense params, expert params) held by one GPU of the stage: its transformer layers, plus the
    word embeddings on the stage that holds the embedding and the output layer on the one that
    holds the loss (the first and last stage, unless a pipeline layout places them elsewhere)."""
    plan = pipeline_plan(model, cfg)
    return _stage_params(model, layer_kind_counts(model, layers), stage == plan.embedding_rank,
                         stage == plan.loss_rank, plan.embedding_rank != plan.loss_rank, cfg.tp, cfg.ep * cfg.etp)[:2]


def linear_params(model: ModelSpec, cfg: TrainConfig, layers: range | tuple[int, ...]) -> float:
    """Weights of the TE linear layers one GPU holds for these layers (attention, MLP, experts):
    the ones that get FP8 copies under fp8."""
    return _stage_params(model, layer_kind_counts(model, layers), False, False, False, cfg.tp, cfg.ep * cfg.etp)[2]


@lru_cache(maxsize=4096)
def plan_params(model: ModelSpec, plan: PipelinePlan, tp: int, ep_etp: int) -> tuple[tuple[float, float, float], ...]:
    """(dense, expert, linear) params of every rank of a pipeline plan (see _stage_params)."""
    split = plan.embedding_rank != plan.loss_rank
    return tuple(_stage_params(model, kinds, r == plan.embedding_rank, r == plan.loss_rank, split, tp, ep_etp)
                 for r, kinds in enumerate(rank_kinds(model, plan)))


def _stage_params(model: ModelSpec, kinds: dict[int, int], embedding: bool, loss: bool, split: bool,
                  tp: int, ep_etp: int) -> tuple[float, float, float]:
    """(dense, expert, linear) params: linear = the weights of the TE linear layers (attention,
    MLP, experts), the ones that get FP8 copies under fp8 (not the embedding / output layer)."""
    dense = 0.0
    experts = 0.0
    linear = 0.0
    for i, n in kinds.items():
        lp = layer_params(model, i)
        dense += n * ((lp.attention + lp.dense_mlp + lp.shared_experts) / tp + lp.router + lp.norms)
        experts += n * lp.experts / ep_etp
        linear += n * ((lp.attention + lp.dense_mlp + lp.shared_experts) / tp + lp.experts / ep_etp)
    dense += float(outside_layer_params(model, embedding, loss, split, tp))
    return dense, experts, linear


def outside_layer_params(model: ModelSpec, embedding, loss, split, tp):
    """Parameters per GPU outside the transformer layers (no Megatron FSDP unit holds them): the
    embedding on the `embedding` stage, the output layer and final norm on the `loss` stage, and
    there Megatron's copy of tied word embeddings when the two are on different ranks (`split`).
    Floats or arrays."""
    tied = model.vocab_size * model.hidden_size if model.tied_embeddings else 0
    return (np.where(embedding, embedding_params(model) / tp, 0.0)
            + np.where(loss, output_params(model) / tp + np.where(split, tied / tp, 0.0), 0.0))


# fp32 tensors of the logits' shape (s x b x V / TP) the loss stage holds at the cross entropy's
# peak, besides the bf16 logits, per implementation (TrainConfig.cross_entropy_impl):
# - "unfused": megatron-core's tensor_parallel/cross_entropy.py upcasts the logits once
#   (VocabParallelCrossEntropy.calculate_logits_max: .float()), then subtracts the max, exps and
#   normalises in place, and its backward writes the gradient into that softmax in place: 1.
# - "native": megatron-core's fusions/fused_cross_entropy.py upcasts the same way, but its
#   jit-fused calculate_predicted_logits returns exp_logits as a new fp32 tensor while the copy
#   lives (and its backward builds the gradient out of place from the saved softmax): 2.
#   Measured: 9.3-10.3 B per logit on the 50 dense stages of the te runner's runs (native; python
#   bench/memory_terms.py data/measurements/*.jsonl --stack te --dense, before this term).
# - "te": Transformer Engine's parallel_cross_entropy (pytorch/cross_entropy.py, a Triton kernel)
#   takes the bf16 logits as they are: 0 (but see CROSS_ENTROPY_BF16_COPIES).
CROSS_ENTROPY_FP32_COPIES: dict[str, int] = {"unfused": 1, "native": 2, "te": 0}
# bf16 tensors of the logits' shape each implementation keeps beside the logits: TE 2.20's
# parallel_cross_entropy saves a copy of its input for the backward unless called with
# overwrite_input=True (pytorch/triton/cross_entropy.py cross_entropy_forward: saved_input =
# torch.empty(_input.shape) unless overwrite_input; the backward writes the gradient into that
# copy), and megatron-core 0.19's te_parallel_cross_entropy does not pass it: 1. Measured peak
# reserved (x4-te-s27c, TE's cross entropy; python bench/te_check.py --rows) against predicted
# without / with the copy: llama3-8b[8L] mbs4 43.9 GiB vs 39.7 / 43.7, mbs8 69.4 vs 60.7 / 68.5;
# nemotron4-15b[8L] (256K vocabulary) mbs2 60.2 vs 56.1 / 60.0; llama3-70b[4L] mbs2 55.1 vs 52.2 / 54.2.
# The copy is recent: TE PR 3193 (FP32 gradients no longer written into the bf16 input) and PR 3273
# (2026-07, the compact softmax statistics) made it; earlier TE wrote the gradient into the logits
# in place (no copy), so published runs of older containers held 2 B per logit less than this.
CROSS_ENTROPY_BF16_COPIES: dict[str, int] = {"unfused": 0, "native": 0, "te": 1}


def logits_bytes_per_logit(model: ModelSpec, c: Constants = DEFAULT, impl: str = "unfused") -> float:
    """Bytes per logit the loss stage holds: the bf16 logits and the fp32 and bf16 tensors of the
    cross entropy `impl` (CROSS_ENTROPY_FP32_COPIES, CROSS_ENTROPY_BF16_COPIES), plus the uncapped
    logits a final soft-capping (tanh) keeps for its backward."""
    return (c.bytes_activation * (1 + CROSS_ENTROPY_BF16_COPIES[impl])
            + CROSS_ENTROPY_FP32_COPIES[impl] * c.bytes_logits_fp32
            + (c.bytes_activation if model.final_logit_softcap else 0.0))


# What one transformer layer keeps for the backward beyond the tensors layer_activation_bytes
# counts for every stack (those of Transformer Engine's fused layers, the te stack), per stack:
# Constants fields, the local column their defaults, the te column in profile_fit.TE_SETTINGS.
# - glu_kept_copies, FFN-wide tensors: megatron-core's local MLP runs a gated unit unfused
#   (transformer/mlp.py glu(): activation_func(x_glu) * (x_linear + glu_linear_offset)): F.silu
#   keeps its input (a view of the FC1 output, already counted), the product keeps the silu
#   output and the new tensor x_linear + 0.0: 2. TE's fused SwiGLU keeps only its input: 0.
# - qkv_output_kept: the local SelfAttention splits the QKV GEMM output with torch.split (views;
#   TE's SplitAlongDim only exists with TE), RoPE (unfused: apply_rope_fusion off) writes new q
#   and k, and the value view that SDPA keeps (runners/megatron_worker.SDPAttention; native GQA,
#   the runner's default since env.attention; ADVISOR_SDPA_GQA=repeat keeps 2 (a - kv) heads
#   more instead, not modelled) holds the whole QKV output alive: q and k once more, 1. Without
#   RoPE or q / k norms only the query is a new tensor, and only where query.reshape cannot view
#   the grouped split (more than one query group and head per group on the GPU). MLA: not
#   counted (its local path is not measured). TE's fused attention keeps its own inputs: 0.
# Checked on the local records' stages without recompute: python bench/memory_terms.py
# data/measurements/*.jsonl --stack local --dense.
STACK_LAYER_KEEPS: dict[str, dict[str, float]] = {
    "local": {"glu_kept_copies": 2.0, "qkv_output_kept": 1.0},
    "te": {"glu_kept_copies": 0.0, "qkv_output_kept": 0.0},
}


def stack_layer_elements(model: ModelSpec, layer: int, cfg: TrainConfig, c: Constants = DEFAULT) -> float:
    """Elements (bf16) one layer keeps per microbatch on one GPU beyond the te stack's tensors
    (STACK_LAYER_KEEPS), without recompute."""
    s, b, t = cfg.seq / cfg.cp, cfg.mbs, cfg.tp
    out = 0.0
    if c.qkv_output_kept and model.mla is None:
        a, kv, hd = model.num_attention_heads, model.kv_heads, model.head_dim
        if model.position_embedding == "rope" or qk_norm_width(model):
            heads = a + kv  # new q and k besides the QKV output the value view keeps
        else:
            heads = a if kv // t > 1 and a != kv else 0  # the query's reshape copy
        out += c.qkv_output_kept * s * b * heads * hd / t
    if model.activation == "swiglu" and c.glu_kept_copies:
        if model.is_moe_layer(layer):
            ffn = model.moe.shared_ffn_hidden_size  # routed experts: moe.py's fitted counts
        elif model.moe is not None and model.moe.dense_ffn_hidden_size and layer < model.moe.first_dense_layers:
            ffn = model.moe.dense_ffn_hidden_size
        else:
            ffn = model.ffn_hidden_size
        out += c.glu_kept_copies * s * b * (ffn or 0) / t
    return out


def layer_activation_bytes(model: ModelSpec, layer: int, cfg: TrainConfig, c: Constants = DEFAULT,
                           recompute: str | None = None) -> float:
    """Bytes of activations one transformer layer stores for one microbatch on one GPU (with
    `recompute` instead of the config's mode when given)."""
    s = cfg.seq / cfg.cp
    b = cfg.mbs
    h = model.hidden_size
    t = cfg.tp
    sp = t if cfg.sequence_parallel else 1
    e = c.bytes_activation
    sbh = s * b * h
    if (cfg.recompute if recompute is None else recompute) == "full":
        return e * sbh / sp  # only the layer input is kept
    # two norm inputs (residual stream) and two norm outputs (inputs of the QKV and FC1 GEMMs),
    # stored sharded with sequence parallelism. Selective recompute (Megatron's default module,
    # core_attn) re-runs flash attention, which stores no score matrix, so it saves ~nothing here.
    # Under fp8 Transformer Engine saves the inputs of its FP8 GEMMs as FP8 copies (`gemm_in`, 1
    # byte: TE 2.x Linear / LayerNormLinear keep only the column-wise (transposed) data wgrad
    # reads, or the row-wise local shard when sequence parallelism re-gathers it; `ln_out` /
    # `inputmat.update_usage(rowwise_usage=False)` before save_for_backward). Where that input is
    # a tensor no other op saves (the norm outputs, which the fused norm writes in FP8, and the
    # activation output, whose function keeps its own input) the BF16 copy is freed: 1 byte
    # instead of 2. The attention output is also kept by the attention itself (TE's FusedAttnFunc
    # saves q, k, v and out in BF16 for its backward): under fp8 its FP8 copy comes on top (3
    # bytes); under bf16 the projection saves the same tensor (2). Measured on the te runner's
    # FP8 / BF16 pairs: bench/memory_fp8_pairs.py.
    # A MoE layer's pre-MLP norm is a module of its own (no LayerNormLinear behind it): its output
    # is the input of the router's gating GEMM, which megatron-core runs outside TE's FP8
    # (moe_utils.py RouterGatingLinearFunction.forward: ctx.save_for_backward(inp, weight, bias)),
    # and of the permutation, which saves only indices; so it stays in BF16 under fp8 (2 bytes,
    # not an FP8 GEMM input). Measured: the FP8 snapshot te-mix-snap-21 (Mixtral proxy, EP1 ETP2
    # SP mbs8) holds 4 x 128 MiB BF16 rmsnorm outputs (1 per MoE layer, T x h) beside the QKV's
    # FP8 ln_out (python bench/memory_snapshot.py); the model had them at 1 byte (-0.25 GiB).
    norm_out_bf16 = sbh / sp if model.is_moe_layer(layer) else 0.0
    elems = 2 * sbh / sp + norm_out_bf16
    gemm_in = 2 * sbh / sp - norm_out_bf16
    # post-norms (Gemma 2/3, GLM-4) keep their inputs too (the attention / MLP outputs, sharded
    # with SP), and q / k norms the unnormalised q and k. Flash attention stores no score matrix,
    # so a window (local attention) leaves the stored activations as they are: q, k, v, output
    # and the softmax statistics, whatever the number of keys each query saw.
    elems += (model.norms_per_layer - 2) * sbh / sp + s * b * qk_norm_width(model) / t
    a = model.num_attention_heads
    if model.mla is not None:
        m = model.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        elems += s * b * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim)  # latents (replicated)
        elems += s * b * a * (2 * qk + m.v_head_dim) / t  # q, k, v
        attn_out = s * b * a * m.v_head_dim / t
    else:
        hd = model.head_dim
        elems += s * b * (a + 2 * model.kv_heads) * hd / t  # q, k, v
        attn_out = s * b * a * hd / t
    elems += attn_out  # kept by the attention (BF16), the projection's input under bf16
    quantized = cfg.precision != "bf16"
    if quantized:
        gemm_in += attn_out  # the projection's FP8 copy
    gated = model.activation == "swiglu"
    if model.is_moe_layer(layer):
        moe_elems, moe_gemm_in = moe_activation_elements(model, cfg, c)  # models/moe.py
        elems += moe_elems
        gemm_in += moe_gemm_in
    else:
        ffn = model.ffn_hidden_size
        if model.moe is not None and model.moe.dense_ffn_hidden_size and layer < model.moe.first_dense_layers:
            ffn = model.moe.dense_ffn_hidden_size
        elems += (2 if gated else 1) * s * b * ffn / t  # FC1 output
        gemm_in += s * b * ffn / t  # activation output (FC2 input)
    elems += stack_layer_elements(model, layer, cfg, c)
    gemm_bytes = saved_input_bytes(cfg.quant_code, c) if quantized else e
    return e * elems + gemm_bytes * gemm_in


@dataclass(frozen=True)
class ContiguousSplit:
    """A pipeline split by `counts` contiguous layers per rank (stage_memory's `layer_counts`: any
    split a placement tries), a rank's virtual chunks taken as equal; a PipelinePlan's fields."""

    pp: int
    vp: int
    counts: tuple[int, ...]
    embedding_rank: int = 0

    @property
    def loss_rank(self) -> int:
        return self.pp - 1

    @property
    def rank_layers(self) -> tuple[range, ...]:
        starts = np.concatenate([[0], np.cumsum(self.counts)]).tolist()
        return tuple(range(a, b) for a, b in zip(starts[:-1], starts[1:]))


def layouts_of(model: ModelSpec, cfg: TrainConfig, layer_counts: list[int] | None = None) -> Layouts:
    """`cfg` as a Layouts of one row, with the split of `layer_counts` (contiguous layers per
    stage; IllegalLayout when they are not cfg.pp stages adding up to the model's layers)."""
    L = Layouts.of(model, [cfg])
    if layer_counts is None:
        return L
    stage_layers(model, cfg, list(layer_counts))  # the split's checks
    return dataclasses.replace(L, plans=[ContiguousSplit(cfg.pp, cfg.vp, tuple(int(n) for n in layer_counts))])


# ------------------------------------------------------------------------------------------------
# memory per stage, on arrays of layouts (models/stages.py); one layout is an array of one
# ------------------------------------------------------------------------------------------------

def stage_memory(model: ModelSpec, cfg: TrainConfig, c: Constants = DEFAULT,
                 layer_counts: list[int] | None = None, gpu: GPUSpec | None = None) -> list[StageMemory]:
    """Memory of one GPU in every pipeline stage, for the config's split or `layer_counts`
    (contiguous layers per stage; virtual chunks then taken as equal). `gpu`: the GPU the copies
    of the FP8 weights depend on (memory_arrays; None: Hopper-like)."""
    L = layouts_of(model, cfg, layer_counts)
    S = Stages(L)
    memory_arrays(model, L, c, memo_for(model, None, c), S, gpu)
    return stage_memory_of(S, 0, c)


def peak_memory_gib(model: ModelSpec, cfg: TrainConfig, c: Constants = DEFAULT, gpu: GPUSpec | None = None) -> float:
    """The fullest stage's memory per GPU (the total of stage_memory, without building it)."""
    L = Layouts.of(model, [cfg])
    return float(memory_arrays(model, L, c, memo_for(model, None, c), Stages(L), gpu)[0][0])


def peak_memory_many(model: ModelSpec, L: Layouts, c: Constants = DEFAULT, gpu: GPUSpec | None = None) -> np.ndarray:
    """peak_memory_gib of every row of L."""
    return memory_arrays(model, L, c, memo_for(model, None, c), Stages(L), gpu)[0]


def activation_table(memo: Memo, key) -> np.ndarray:
    """[K, 4]: one layer's activation bytes per kind with full recompute and without
    (layer_activation_bytes; selective recompute stores what no recompute does), its dropless
    MoE token buffers (allocator_memory.moe_buffer_bytes; 0 for a dense layer) and the MoE
    layer's transient token buffers while it runs (moe_transient_bytes), for a layer
    shape (tp, cp, mbs, seq, ep, etp, sp, quant code, (grouped GEMM, router, capacity factor, padding))."""
    def make():
        cfg = layer_shape_config(key)
        moe = moe_buffer_bytes(memo.model, cfg, memo.c)
        work = moe_transient_bytes(memo.model, cfg, memo.c)
        return np.array([[layer_activation_bytes(memo.model, i, cfg, memo.c, "full"),
                          layer_activation_bytes(memo.model, i, cfg, memo.c, "none"),
                          moe if memo.model.is_moe_layer(i) else 0.0,
                          work if memo.model.is_moe_layer(i) else 0.0] for i in memo.kinds])
    return memo.get("activations", key, make)


def moe_transient_bytes(model: ModelSpec, cfg: TrainConfig, c: Constants) -> float:
    """Bytes of the hidden-sized token buffers one MoE layer holds on the busiest GPU while it runs,
    beside what it saves (Constants.moe_transient_hidden_per_token per routed token, the routed
    tokens at the busiest rank's load and gathered over expert TP); 0 for a dense model."""
    if not model.is_moe or not c.moe_transient_hidden_per_token:
        return 0.0
    return (c.moe_transient_hidden_per_token * routed_tokens(model, cfg, c) * model.hidden_size * cfg.etp
            * c.bytes_activation)


def activation_keys(L: Layouts, memo: Memo, S: Stages) -> tuple[np.ndarray, np.ndarray, list[tuple]]:
    """(activation_table of every distinct layer shape of L, [keys, K, 4]; each stage's index into
    it; the layer shapes, activation_table's keys)."""
    routers = [(e[1], e[2], e[3], e[4]) for e in L.extras]  # grouped GEMM, router, capacity factor, padding
    first, inv = unique_rows([L.tp, L.cp, L.mbs, L.seq, L.ep, L.etp, L.sp, L.fp8, extra_codes(L, routers)])
    keys = [(int(L.tp[i]), int(L.cp[i]), int(L.mbs[i]), int(L.seq[i]), int(L.ep[i]), int(L.etp[i]), bool(L.sp[i]),
             int(L.fp8[i]), routers[i]) for i in first]
    return np.stack([activation_table(memo, kk) for kk in keys]), inv[S.row], keys


def offloaded_kinds(memo: Memo, n: int) -> np.ndarray:
    """[K] layers of each kind among the first n of the model: the ones whose activations
    Transformer Engine's default offload synchronizer moves to the host (TrainConfig.cpu_offload_layers)."""
    return memo.get("offloaded", n, lambda: memo.per_kind([layer_kind_counts(memo.model, range(n))])[0])


def offloaded_activation_bytes(L: Layouts, memo: Memo, S: Stages) -> np.ndarray:
    """[S] bytes of activations per microbatch the offloaded layers (TrainConfig.cpu_offload_layers,
    pp = 1: one microbatch of each layer in flight) store, which leave the GPU: TE's
    DefaultOffloadSynchronizer frees layer i's copy before layer L - N + i's forward and reloads it
    from layer L - 1 - N + i's backward on, so the layers the GPU holds at once never exceed the
    L - N it keeps (its docstring: "activation memory usage is equal to (num_layers -
    num_offloaded_layers) * T"); offloading refuses recompute, so the layer keeps all it saves.
    0 where no layer is offloaded. Also what each GPU's process pins on the host."""
    if L.offload is None:
        return np.zeros(S.total)
    per_key, key, _ = activation_keys(L, memo, S)
    n = L.offload[S.row]
    first, inv = unique_rows([n])
    cnt = np.stack([offloaded_kinds(memo, int(n[i])) for i in first])[inv]
    return sum(cnt[:, j] * per_key[:, j, 1][key] for j in range(per_key.shape[1]))


def in_flight_table(memo: Memo, plan, m: int) -> np.ndarray:
    """[pp, K] layer-microbatches of each kind whose activations each rank holds at its peak
    (layout.in_flight_layers; a ContiguousSplit: the rank's layers times its chunks' in-flight
    microbatches over vp)."""
    def make():
        if isinstance(plan, ContiguousSplit):
            cfg = TrainConfig(pp=plan.pp, vp=plan.vp, gbs=m)
            share = np.array([sum(in_flight_chunks(cfg, r)) / plan.vp for r in range(plan.pp)])
            return memo.counts(plan) * share[:, None]
        return memo.per_kind(in_flight_layers(memo.model, plan, m))
    return memo.get("in_flight", (plan, m), make)


def output_in_flight_table(memo: Memo, plan, m: int) -> np.ndarray:
    """[pp] chunk-microbatches whose output tensor each rank keeps at its peak when the pipeline
    does not free them once sent (TrainConfig.deallocate_pipeline_outputs off; megatron-core
    pipeline_parallel/schedules.py: output_tensors of every chunk-microbatch stay until its
    backward, deallocate_output_tensor only empties their .data when the option is on): the
    chunk-microbatches in flight (layout.in_flight_chunks) but the last virtual chunk of the last
    rank, whose output is the loss. 0 without a pipeline (forward_backward_no_pipelining)."""
    def make():
        if plan.pp == 1:
            return np.zeros(1)
        cfg = TrainConfig(pp=plan.pp, vp=plan.vp, gbs=m)
        return np.array([float(outputs_in_flight(cfg, r)) for r in range(plan.pp)])
    return memo.get("outputs_in_flight", (plan.pp, plan.vp, m), make)


def outputs_in_flight(cfg: TrainConfig, rank: int) -> int:
    """Stage outputs pipeline rank `rank` keeps at its peak with deallocate_pipeline_outputs off
    (output_in_flight_table, for one layout): its chunk-microbatches in flight but the loss's."""
    if cfg.pp == 1:
        return 0
    chunks = in_flight_chunks(cfg, rank)
    return sum(chunks[:-1] if rank == cfg.pp - 1 else chunks)


def unit_param_table(memo: Memo, tp: int, ep_etp: int) -> np.ndarray:
    """[K] parameters one GPU holds of one layer of each kind (dense / TP + experts / (EP x ETP)):
    a Megatron FSDP unit (megatron-core's fsdp_unit_modules: TransformerLayer, MoETransformerLayer)."""
    return memo.get("unit_params", (tp, ep_etp), lambda: np.array(
        [sum(_stage_params(memo.model, {i: 1}, False, False, False, tp, ep_etp)[:2]) for i in memo.kinds]))


def fsdp_terms(model: ModelSpec, L: Layouts, memo: Memo, S: Stages, c: Constants, counts, last,
               weights, grads, total, shard):
    """(weights, grads) bytes per stage with Megatron FSDP (TrainConfig.fsdp, optim_grads_params):
    the stage's weights (BF16 and quantized copies) and gradients sharded as its optimizer states are
    (shard / total: params / (DP x CP), experts / their expert-DP group), plus the units in flight
    gathered whole (Constants.fsdp_units_in_flight x the largest unit's params x the stage's weight
    and gradient bytes per param): a layer, or the embedding (first stage) / the output layer (loss
    stage), which are gathered on their own when used. Rows without FSDP keep weights and grads."""
    r = S.row
    ee = L.ep * L.etp
    first, inv = unique_rows([L.tp, ee])
    tables = np.stack([unit_param_table(memo, int(L.tp[i]), int(ee[i])) for i in first])
    unit = np.where(counts > 0, tables[inv[r]], 0.0).max(axis=1)
    tp_r = L.tp[r]
    unit = np.maximum(unit, np.where(S.k == 0, embedding_params(model) / tp_r, 0.0))
    unit = np.maximum(unit, np.where(last, output_params(model) / tp_r, 0.0))
    per = np.where(total > 0, 1.0 / np.maximum(total, 1.0), 0.0)
    frac = shard * per
    n = c.fsdp_units_in_flight * unit * per
    on = L.fsdp[r]
    return np.where(on, weights * (frac + n), weights), np.where(on, grads * (frac + n), grads)


def stage_param_arrays(L: Layouts, memo: Memo, S: Stages) -> np.ndarray:
    """[S, 3] (dense, expert, linear) parameters one GPU of every stage holds (plan_params)."""
    hit = S.cache.get("params")
    if hit is None:
        plans = L.plans
        ee = L.ep * L.etp
        hit = S.cache["params"] = gather_blocks(
            [L.plan, L.tp, ee], lambda i: memo.get("params", (plans[L.plan[i]], int(L.tp[i]), int(ee[i])), lambda: np.array(
                plan_params(memo.model, plans[L.plan[i]], int(L.tp[i]), int(ee[i])), float)), S)
    return hit


def memory_arrays(model: ModelSpec, L: Layouts, c: Constants, memo: Memo, S: Stages,
                  gpu: GPUSpec | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(peak GiB per row, StageMemory.total_gib per stage); S.cache["memory"]: the StageMemory
    parts per stage (stage_memory_of). `gpu`: the GPU, whose FP8 GEMMs decide how many copies TE
    keeps of a per-tensor-scaled FP8 weight (GPUSpec.fp8_transposed_copy: 2 on Hopper, 1 on
    Blackwell; None: Hopper-like, 2).

    Per stage, bytes: weights = params x bytes_weight + linear params x the quantized copy;
    gradients = params x bytes_grad; optimizer = bytes_optimizer x its shard (params / DP with the
    distributed optimizer); activations = sum over kinds of in-flight layer-microbatches x one
    layer's bytes, plus the largest layer without recompute under full recompute (its working
    set), x (1 + fragmentation); logits on the loss stage; the optimizer step's transient copy of
    its gradient shard counts where it exceeds the activations and logits together (the two phases
    of the step: peak = the larger)."""
    m = L.num_microbatches
    r, k = S.row, S.k
    per_key, key, keys = activation_keys(L, memo, S)
    K = per_key.shape[1]
    full = (L.recompute == RECOMPUTE_CODES["full"])[r]
    plans = L.plans
    params = stage_param_arrays(L, memo, S)
    flight = gather_blocks([L.plan, m], lambda i: in_flight_table(memo, plans[L.plan[i]], int(m[i])), S)
    counts = S.counts(memo)
    dense, experts, linear = params[:, 0], params[:, 1], params[:, 2]
    fp8_copy = np.array([weight_copy_bytes(q, c, gpu) for q in range(len(QUANTS))])[L.fp8][r]
    d = (L.dp * L.cp)[r]
    edp = L.expert_dp[r]
    total = dense + experts
    shard = np.where(L.dist_opt[r], dense / d + experts / edp, total)
    opt = c.bytes_optimizer * shard
    transient = c.bytes_optimizer_transient * shard
    if L.fpg is not None:  # FP8 primary weights: the shard's linear weights re-quantized in the step
        linear_shard = params[:, 2] * np.divide(shard, total, out=np.zeros(len(r)), where=total > 0)
        transient = transient + np.where(L.fpg[r], c.bytes_fpg_step_transient * linear_shard, 0.0)
    if not L.partial_recompute:
        acts = np.zeros(len(r))
        for j in range(K):  # a layer's bytes per kind with the stage's recompute mode
            acts = acts + flight[:, j] * np.where(full, per_key[:, j, 0][key], per_key[:, j, 1][key])
        whole = counts
    else:  # partial recompute (models/recompute.py): block layers, selective modules
        acts, whole = partial_activations(L, memo, S, keys, key, per_key, flight, counts)
    if L.offload is not None:  # activation offloading: the offloaded layers' activations live on the host
        acts = acts - offloaded_activation_bytes(L, memo, S)
    # the stage outputs the pipeline keeps (deallocate_pipeline_outputs off): s / CP x b x h BF16 each,
    # / TP with sequence parallelism (the residual stream as it is sent)
    if L.dpo is None or not L.dpo.all():
        outs = gather_blocks([L.pp, L.vp, m], lambda i: output_in_flight_table(memo, plans[L.plan[i]], int(m[i])), S)
        kept = outs * (L.seq / L.cp * L.mbs * model.hidden_size / np.where(L.sp, L.tp, 1))[r] * c.bytes_activation
        acts = acts + (kept if L.dpo is None else np.where(L.dpo[r], 0.0, kept))
    if full.any():  # the recompute working set: the largest layer of the stage without recompute
        work = np.full(len(r), -np.inf)
        for j in range(K):  # ... with a MoE layer's transient token buffers while it re-runs
            work = np.where(whole[:, j] > 0, np.maximum(work, per_key[:, j, 1][key] + per_key[:, j, 3][key]), work)
        # block recompute of some of the layers (recompute_layers): a microbatch's backward frees its
        # kept layers (the chunk's last ones) before it re-runs a recomputed one, so the working set
        # does not raise the stage's peak (its backward's start); only where every layer is recomputed
        # (measured: x4-te-s26-recompute, llama3-8b[16L] PP2 block 4 of 8: 30.8 / 31.9 GiB per stage,
        # 31.5 / 32.7 with the working set on top)
        every = (whole >= counts).all(axis=1)
        working = np.where(full & every & np.isfinite(work), work, 0.0)
    else:
        working = np.zeros(len(r))
    last = k == L.pp[r] - 1
    T = (L.seq / L.cp * L.mbs)[r]
    # bf16 logits + the cross entropy's fp32 tensors (one microbatch at a time), and the final norm's
    # two saved tensors of that microbatch: its input (the last layer's output, which no layer keeps)
    # and its output, the output layer's saved input (s / CP x b x h BF16 each, / TP with sequence
    # parallelism: the output layer re-gathers its input in the backward)
    ce = L.per_cross_entropy(lambda impl: logits_bytes_per_logit(model, c, impl))[r]
    final_norm = 2 * T * model.hidden_size / np.where(L.sp[r], L.tp[r], 1) * c.bytes_activation
    logits = np.where(last, T * model.vocab_size / L.tp[r] * ce + final_norm, 0.0)
    # FP8 primary weights (TrainConfig.fp8_param_gather; megatron-core fp8_param with the distributed
    # optimizer's fp8_param_gather, TE Float8Tensor parameters): the linear layers' weights exist
    # only as TE's FP8 copies (the copy above: data + transpose, data alone on Blackwell), no BF16
    # weight; the fp32 master copy stays in the optimizer's shard.
    bf16_linear = linear * c.bytes_weight
    if L.fpg is not None:
        bf16_linear = np.where(L.fpg[r], 0.0, bf16_linear)
    weights = (total - linear) * c.bytes_weight + bf16_linear + linear * fp8_copy
    grads = total * c.bytes_grad
    if L.fsdp is not None and L.fsdp.any():  # Megatron FSDP: weights and gradients sharded too
        weights, grads = fsdp_terms(model, L, memo, S, c, counts, last, weights, grads, total, shard)
    f = 1.0 + c.fragmentation
    # torch's caching allocator: reserved but unallocated (models/allocator_memory.py): the stage's
    # largest transient block (the loss stage's logits tensor, a dense layer's FC1 output) and its
    # dropless MoE layers' token buffers
    tp_r, cp_r, mbs_r, seq_r = L.tp[r], L.cp[r], L.mbs[r], L.seq[r]
    # bytes per logit of the largest logits tensor each cross entropy allocates: its fp32 copy where
    # it makes one (megatron-core's upcast), else the bf16 logits (Transformer Engine's kernel)
    ce_b = L.per_cross_entropy(lambda impl: c.bytes_logits_fp32 if CROSS_ENTROPY_FP32_COPIES[impl]
                               else c.bytes_activation)[r]
    block = np.where(counts.sum(axis=1) > 0, dense_block_bytes(model, tp_r, cp_r, mbs_r, seq_r), 0.0)
    block = np.where(last, np.maximum(block, logits_block_bytes(model, tp_r, cp_r, mbs_r, seq_r, ce_b)), block)
    moe_layers = np.zeros(len(r))
    moe_bytes = np.zeros(len(r))
    for j in range(K):
        moe_layers = moe_layers + np.where(per_key[:, j, 2][key] > 0, counts[:, j], 0.0)
        moe_bytes = np.maximum(moe_bytes, per_key[:, j, 2][key])
    xseg = L.xseg[r] if L.xseg is not None else False
    reserved_off = reserved_free_gib(block, moe_layers, moe_bytes, c)
    reserved = np.where(xseg, c.alloc_reserved_expandable_gib, reserved_off)
    # the stage's peak is the larger of its two phases, not a sum of their maxima: the forward-backward
    # schedule holds the activations and the loss stage's logits; the optimizer step runs after the
    # last backward has freed both and holds its transient instead
    # the recompute working set (a layer re-run in the backward) and the loss stage's logits do not
    # coexist: the loss's backward, the output layer's and the final norm's free the logits before
    # the last layer's backward re-runs it (x4-te-s26-recompute, llama3-8b[16L] PP2, block 8 of 8:
    # the loss stage measured 27.9 GiB, predicted 28.9 with the two added)
    acts = acts + np.maximum(0.0, working - logits)  # what the working set adds beyond the logits
    held = (acts + logits) * f
    stage_bytes = weights + grads + opt + np.maximum(held, transient) + reserved * GIB
    peak = np.maximum.reduceat(stage_bytes, S.start) / GIB + c.runtime_overhead_gib
    # StageMemory's fields, and its total_gib (what a Prediction prints and decides feasibility by)
    parts = {"weights_gib": weights / GIB, "grads_gib": grads / GIB, "optimizer_gib": opt / GIB,
             "activations_gib": acts * f / GIB, "logits_gib": logits * f / GIB,
             "step_transient_gib": np.maximum(0.0, transient - held) / GIB,
             "reserved_free_gib": reserved, "reserved_free_off_gib": reserved_off,
             # dropless MoE buffers whose size follows the routing (allocator_memory.moe_buffer_bytes):
             # the step's allocations change from micro-batch to micro-batch (memory_band.periodic_layout)
             "routing_sized": moe_layers * moe_bytes > 0,
             "outside_gib": outside_allocator_arrays(L.tp[r], L.pp[r], L.cp[r], L.dp[r], L.ep[r], L.etp[r], k,
                                                     model.is_moe, L.fp8[r] != 0, c,
                                                     L.lazy[r] if L.lazy is not None else False)}
    total_gib = (parts["weights_gib"] + parts["grads_gib"] + parts["optimizer_gib"] + parts["activations_gib"]
                 + parts["logits_gib"] + c.runtime_overhead_gib + parts["step_transient_gib"]
                 + parts["reserved_free_gib"])
    S.cache["memory"] = (parts, total, counts.sum(axis=1))
    return peak, total_gib


def stage_memory_of(S: Stages, i: int, c: Constants) -> list[StageMemory]:
    """The StageMemory of every stage of row i (after memory_arrays on S)."""
    parts, params, layers = S.cache["memory"]
    mat = S.cache.get("memory_matrix")
    if mat is None:
        mat = S.cache["memory_matrix"] = np.stack(
            [layers, params] + [parts[k] for k in ("weights_gib", "grads_gib", "optimizer_gib", "activations_gib",
                                                   "logits_gib", "step_transient_gib", "outside_gib",
                                                   "reserved_free_gib", "reserved_free_off_gib")], 1)
    over = c.runtime_overhead_gib
    return [StageMemory(stage=k, layers=int(n), params=int(p), weights_gib=w, grads_gib=g, optimizer_gib=o,
                        activations_gib=a, logits_gib=lg, overhead_gib=over, step_transient_gib=t, outside_gib=out,
                        reserved_free_gib=rf, reserved_free_off_gib=rf_off)
            for k, (n, p, w, g, o, a, lg, t, out, rf, rf_off) in enumerate(S.rows(mat, i).tolist())]

