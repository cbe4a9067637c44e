"""Step time of one training iteration, with its breakdown. Pure functions.

Per pipeline stage and microbatch: the GEMMs of every layer (efficiency by shape), flash attention,
memory-bound kernels, recompute, and the TP / CP / EP collectives on NVLink or the network depending on
where the group lands (Megatron's rank order tp-cp-ep-dp-pp). Then the pipeline schedule (1F1B or
interleaved: bubble (p-1)/(v·m) for equal stages), PP send/recv, the DP gradient reduce-scatter /
all-reduce and parameter all-gather with the part that overlaps with backward / forward, and the optimizer step.
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Sequence

import numpy as np

from advisor.catalog.specs import MOE_KNOBS, QUANTS, ClusterSpec, ModelSpec, TrainConfig
from advisor.models.attention import attention_seconds, softmax_stretch  # noqa: F401  (their home was here)
from advisor.models.collectives import COLLECTIVES, Link, bus_factor, collective_time, group_link, group_links  # noqa: F401, E501
from advisor.models.constants import DEFAULT, Constants
from advisor.models.flops import attention_core_flops_per_token, qk_norm_width
from advisor.models.fsdp_time import FSDPTerms, fsdp_exposed_per_microbatch, fsdp_stage_terms
from advisor.models.memory import outside_layer_params, stage_param_arrays
from advisor.models.moe import moe_layer_time
from advisor.models.offload import offload_wait_arrays
from advisor.models.quant import fp8_transposed_copy, quant
from advisor.models.recompute import recompute_time
from advisor.models.stages import Memo, Stages, memo_for, quant_fields
from advisor.search_spaces.columns import Layouts, extra_codes, unique_rows


def _sat(d: float, half: float) -> float:
    return d / (d + half)


def gemm_time(m: float, k: float, n: float, peak_flops: float, hbm_bw: float, c: Constants,
              eff_max: float, in_bytes: float = 2.0, half_dim: float | None = None) -> tuple[float, float]:
    """(seconds, achieved fraction of eff_max) of one (m x k) @ (k x n) GEMM: the larger of its
    compute time (efficiency by shape) and the time to move its operands (`in_bytes` per input
    element: 2 for BF16, 1 for FP8) and its BF16 output through HBM."""
    if m <= 0 or k <= 0 or n <= 0:
        return 0.0, 0.0
    hd = c.gemm_half_dim if half_dim is None else half_dim
    shape = _sat(m, hd) * _sat(k, hd) * _sat(n, hd)
    flops = 2.0 * m * k * n
    t_compute = flops / (peak_flops * eff_max * shape)
    t_memory = (in_bytes * (m * k + k * n) + 2.0 * m * n) / (hbm_bw * c.hbm_efficiency)
    t = max(t_compute, t_memory)
    return t, flops / (t * peak_flops * eff_max)


@dataclass
class StageTime:
    """Seconds per microbatch on one GPU of a stage (all its virtual chunks together)."""

    stage: int
    gemm_s: float = 0.0
    attention_s: float = 0.0
    memory_bound_s: float = 0.0
    recompute_s: float = 0.0
    tp_comm_s: float = 0.0
    cp_comm_s: float = 0.0
    ep_comm_s: float = 0.0
    pp_p2p_s: float = 0.0
    overhead_s: float = 0.0
    # fp8 cast / transpose kernels and scaling bookkeeping (per microbatch, forward and backward);
    # counted in memory_bound_s, kept apart for the breakdown
    fp8_fwd_s: float = 0.0
    fp8_bwd_s: float = 0.0
    attention_bwd_extra_s: float = 0.0  # backward-only attention (the sinks' dO.O pass), in attention_s
    forward_s: float = 0.0  # compute part of the forward pass (for DP overlap windows)
    backward_s: float = 0.0
    gemm_utilization: float = 0.0  # achieved / best GEMM rate, time-weighted (drives power)
    # MoE sub-steps, forward + backward (already inside the categories above; models/moe.py)
    moe_router_s: float = 0.0
    moe_permute_s: float = 0.0
    moe_dispatch_s: float = 0.0
    moe_expert_gemm_s: float = 0.0
    # their parts at the SM clock and memory-bound (the rest, host launch time, does not stretch)
    moe_router_compute_s: float = 0.0
    moe_router_memory_s: float = 0.0
    moe_permute_memory_s: float = 0.0
    moe_expert_compute_s: float = 0.0
    moe_expert_memory_s: float = 0.0
    # the experts' work (compute, memory-bound; at the maximum clocks) the busiest EP rank does
    # beyond the mean rank: the step follows the busiest, the other ranks of the EP group wait for
    # it in the combine all-to-all (models/power.py: the stage's mean power and energy are the
    # mean rank's, measured 4 x H100 EP runs draw 580-650 W per GPU where the busiest draws ~690)
    moe_ep_idle_compute_s: float = 0.0
    moe_ep_idle_memory_s: float = 0.0
    # the host's issue time of the stage's layers (not GPU time: layer_host_s), and the part of it
    # the GPU waits for beyond its own work (max(0, host - the rest); inside overhead_s)
    host_s: float = 0.0
    host_wait_s: float = 0.0

    @property
    def total_s(self) -> float:
        return (self.gemm_s + self.attention_s + self.memory_bound_s + self.recompute_s + self.tp_comm_s
                + self.cp_comm_s + self.ep_comm_s + self.pp_p2p_s + self.overhead_s)

    @property
    def compute_s(self) -> float:
        return self.gemm_s + self.attention_s + self.recompute_s

    @property
    def comm_s(self) -> float:
        return self.tp_comm_s + self.cp_comm_s + self.ep_comm_s + self.pp_p2p_s


_MOE = ("moe_router_s", "moe_permute_s", "moe_dispatch_s", "moe_expert_gemm_s")
_MOE_PARTS = ("moe_router_compute_s", "moe_router_memory_s", "moe_permute_memory_s", "moe_expert_compute_s",
              "moe_expert_memory_s")
_EP_IDLE = ("moe_ep_idle_compute_s", "moe_ep_idle_memory_s")
ADDITIVE_TERMS = ("gemm_s", "attention_s", "memory_bound_s", "tp_comm_s", "cp_comm_s", "ep_comm_s", "overhead_s",
             "fp8_fwd_s", "fp8_bwd_s", "attention_bwd_extra_s") + _MOE + _MOE_PARTS + _EP_IDLE + ("host_s",)


@dataclass
class StepTime:
    step_time_s: float
    pipeline_s: float
    bubble_s: float
    dp_comm_s: float  # total DP communication
    dp_exposed_s: float  # the part not hidden behind compute
    optimizer_s: float
    overhead_s: float
    stages: list[StageTime] = field(default_factory=list)
    num_microbatches: int = 1

    @property
    def bubble_fraction(self) -> float:
        """Share of the pipeline's time a stage idles, averaged over the stages: the fill and
        drain, plus the wait on a slower stage when the stages are unequal (an uneven split).
        Equal stages: (p - 1) / (v·m + p - 1), always below 1."""
        if self.pipeline_s <= 0 or not self.stages:
            return 0.0
        busy = self.num_microbatches * sum(s.total_s for s in self.stages) / len(self.stages)
        return max(0.0, 1.0 - busy / self.pipeline_s)

    def breakdown(self) -> dict:
        """Seconds per step by category, summed over microbatches of the slowest stage."""
        slow = max(self.stages, key=lambda s: s.total_s)
        m = self.num_microbatches
        return {
            "gemm_s": slow.gemm_s * m,
            "attention_s": slow.attention_s * m,
            "memory_bound_s": slow.memory_bound_s * m,
            "recompute_s": slow.recompute_s * m,
            "tp_comm_s": slow.tp_comm_s * m,
            "cp_comm_s": slow.cp_comm_s * m,
            "ep_comm_s": slow.ep_comm_s * m,
            "pp_p2p_s": slow.pp_p2p_s * m,
            "layer_overhead_s": slow.overhead_s * m,
            "fp8_cast_s": (slow.fp8_fwd_s + slow.fp8_bwd_s) * m,  # part of memory_bound_s
            "pipeline_bubble_s": self.bubble_s,
            "dp_comm_total_s": self.dp_comm_s,
            "dp_comm_exposed_s": self.dp_exposed_s,
            "optimizer_s": self.optimizer_s,
            "step_overhead_s": self.overhead_s,
            "slowest_stage": slow.stage,
            "stage_time_per_microbatch_s": [s.total_s for s in self.stages],
            **{k: getattr(slow, k) * m for k in _MOE},
        }

    def to_dict(self) -> dict:
        d = asdict(self)
        d["breakdown"] = self.breakdown()
        return d


# HBM bytes per logit (s x b x V / TP) of the loss's memory-bound kernels, forward and backward
# together, per cross entropy implementation (TrainConfig.cross_entropy_impl), read off each
# implementation's kernels (the tensors as models/memory.py's CROSS_ENTROPY_*_COPIES count them):
# - "unfused": megatron-core tensor_parallel/cross_entropy.py, one eager op per line: the upcast
#   (read 2 + write 4), max (4), subtract the max in place (8), exp in place (8), sum (4), divide in
#   place (8) = 38 forward; the backward's in-place multiply by the loss gradient (8) and the
#   upcast's backward cast to bf16 (4 + 2) = 14: 52.
# - "native": megatron-core fusions/fused_cross_entropy.py: the same tensors as "unfused" (its
#   jit-fused functions keep the fp32 upcast, a new exp_logits and the softmax), measured 3-4 B
#   per logit (at the peak bandwidth) lighter than "unfused" on the same layouts (x4-te-s28a,
#   llama3-8b[8L] DP4 mbs4: BF16 0.896 s per step against 0.900 unfused and 0.835 TE; FP8 0.724
#   against 0.731 and 0.662-0.667): 48.
# - "te": Transformer Engine's parallel_cross_entropy (Triton): the online-softmax statistics (read 2),
#   then one kernel that reads the logits again and writes the gradient into its saved copy (2 + 2)
#   = 6 forward; the backward scales that gradient by the loss gradient in place (2 + 2): 10.
# Measured (x4-te-s27a/c/d, TE 2.20.2 on 4 x H100, same layout with "unfused" and "te", the step
# time apart x HBM bandwidth / logits per GPU): 47.6-57.4 B per logit at the peak bandwidth over six
# pairs (llama3-8b[8L] / [16L] BF16 and FP8, seq 4K / 8K, mbs 1-4; llama3-70b[4L] FP8), i.e.
# 33-40 at the te profile's hbm_efficiency (0.70); read off the kernels: 52 - 10 = 42; "native"
# against "te": 48.6 / 48.3 B per logit at the peak bandwidth (BF16 / FP8, x4-te-s28a).
LOSS_BYTES_PER_LOGIT: dict[str, float] = {"unfused": 52.0, "native": 48.0, "te": 10.0}


def loss_bytes_per_logit(model: ModelSpec, c: Constants, impl: str = "unfused") -> float:
    """HBM bytes per logit of the loss's memory-bound kernels, forward and backward together
    (LOSS_BYTES_PER_LOGIT[impl]), plus a read and a write of the logits, each way, for a final
    soft-capping (tanh, Gemma 2)."""
    return LOSS_BYTES_PER_LOGIT[impl] + (3 * c.norm_passes * c.bytes_activation if model.final_logit_softcap else 0.0)


def layer_forward(model: ModelSpec, layer: int, cfg: TrainConfig, cluster: ClusterSpec, c: Constants,
                   st: StageTime, tp_link: Link, cp_link: Link, ep_link: Link, etp_link: Link,
                   util_acc: list[float]) -> float:
    """Add one layer's forward costs for one microbatch to `st`; returns forward compute seconds.
    FP8 (Transformer Engine): the linear layers' GEMMs run in FP8 at the FP8 peak, with the cast /
    transpose traffic and per-GEMM scaling overhead of `Constants.fp8_*` (forward share here, the
    backward share in `st.fp8_cast_s`); core attention and the router stay BF16."""
    gpu = cluster.gpu
    q = quant(gpu, cfg.quant_code, c)  # the linear layers' format (None: bf16)
    fp8 = q is not None
    bf16_peak = gpu.bf16_tflops * 1e12
    hbm = gpu.hbm_bandwidth_gbs * 1e9
    t = cfg.tp
    T = cfg.seq / cfg.cp * cfg.mbs  # tokens per microbatch on this GPU (a CP rank holds seq / cp)
    h = model.hidden_size
    a = model.num_attention_heads
    e = c.bytes_activation
    gated = model.activation == "swiglu"
    cast = [0.0, 0.0, 0]  # fp8: forward cast bytes, backward cast bytes, GEMM calls per forward

    def gemm(m, k, n, count=1, linear=True):
        """A GEMM of the layer; `linear`: a TE linear layer (FP8 under fp8), else BF16."""
        if fp8 and linear:
            tt, u = gemm_time(m, k, n, q.peak_flops, hbm, c, q.efficiency, in_bytes=q.in_bytes, half_dim=q.half_dim)
            cast[0] += m * k * count * q.cast_fwd_bytes
            cast[1] += m * n * count * q.cast_bwd_bytes
            cast[2] += count
        else:
            tt, u = gemm_time(m, k, n, bf16_peak, hbm, c, c.gemm_efficiency_max)
        util_acc[0] += tt * u * count
        util_acc[1] += tt * count
        return tt * count

    g = 0.0
    if model.mla is not None:
        ml = model.mla
        qk = ml.qk_nope_head_dim + ml.qk_rope_head_dim
        if ml.q_lora_rank:
            g += gemm(T, h, ml.q_lora_rank) + gemm(T, ml.q_lora_rank, a * qk / t)
        else:
            g += gemm(T, h, a * qk / t)
        g += gemm(T, h, ml.kv_lora_rank + ml.qk_rope_head_dim)
        g += gemm(T, ml.kv_lora_rank, a * (ml.qk_nope_head_dim + ml.v_head_dim) / t)
        g += gemm(T, a * ml.v_head_dim / t, h)
    else:
        hd = model.head_dim
        g += gemm(T, h, (a + 2 * model.kv_heads) * hd / t) + gemm(T, a * hd / t, h)
    ffn_for_elementwise = 0.0
    if model.is_moe_layer(layer):
        # models/moe.py: router, permute, dispatch, experts, shared experts (forward + backward);
        # entered here in forward-equivalent seconds (stage_times triples GEMM and memory-bound
        # time and doubles communication for the backward), per-term times kept as they are
        def rate(m_, k_, n_, linear=True):
            if fp8 and linear:
                return gemm_time(m_, k_, n_, q.peak_flops, hbm, c, q.efficiency, in_bytes=q.in_bytes,
                                 half_dim=q.half_dim)
            return gemm_time(m_, k_, n_, bf16_peak, hbm, c, c.gemm_efficiency_max)
        mt = moe_layer_time(model, cfg, cluster, c, rate, ep_link, etp_link, collective_time)
        g += mt.gemm / 3
        util_acc[0] += mt.gemm_flops_util / 3
        util_acc[1] += mt.gemm / 3
        if fp8:  # the experts' FP8 casts, as `gemm` counts them for the other linear layers
            cast[0] += mt.fp8_cast_elems[0] * q.cast_fwd_bytes
            cast[1] += mt.fp8_cast_elems[1] * q.cast_bwd_bytes
            cast[2] += mt.fp8_gemm_calls
        st.memory_bound_s += mt.memory_bound / 3
        st.ep_comm_s += mt.comm / 2
        st.overhead_s += mt.overhead
        st.host_s += mt.host
        st.moe_router_s += mt.router
        st.moe_permute_s += mt.permute
        st.moe_dispatch_s += mt.dispatch
        st.moe_expert_gemm_s += mt.expert
        st.moe_router_compute_s += mt.router_gemm
        st.moe_router_memory_s += mt.router_mem
        st.moe_permute_memory_s += mt.permute_mem
        st.moe_expert_compute_s += mt.expert_gemm
        st.moe_expert_memory_s += mt.expert_mem
        spare = 1.0 - 1.0 / mt.imbalance if mt.imbalance > 1.0 else 0.0
        st.moe_ep_idle_compute_s += mt.expert_gemm * spare
        st.moe_ep_idle_memory_s += mt.expert_mem * spare
    else:
        ffn = model.ffn_hidden_size
        if model.moe is not None and model.moe.dense_ffn_hidden_size and layer < model.moe.first_dense_layers:
            ffn = model.moe.dense_ffn_hidden_size
        f = ffn / t
        g += gemm(T, h, (2 if gated else 1) * f) + gemm(T, f, h)
        ffn_for_elementwise = f
    st.gemm_s += g
    # flash attention (BF16 also under fp8): each of the T local queries of a CP rank attends over
    # the whole causal context (load-balanced CP holds seq / cp queries and exchanges K, V), so the
    # work per GPU is (work per token at the full sequence) x T / tp, whatever the CP split; a
    # windowed layer's queries see only their window (flops.keys_per_query). The kernels compute
    # whole tiles along the band's edges and pay a fixed cost per thread block (models/attention.py:
    # shape_factor, 1 at attention_efficiency's reference shape); under CP's ring each step is a
    # kernel call of its own (a sliding-window layer's all-gather CP: one call)
    window = model.layer_window(layer)
    attn_flops = attention_core_flops_per_token(model, cfg.seq, layer=layer) * T / t
    # CP's ring: priced below by the chunks' kernel rate (attention_half_tokens), not as extra calls
    attn = attention_seconds(model, attn_flops, cfg.seq, window, gpu, c)
    if cfg.cp > 1 and not (window and model.window_type == "sliding"):
        # TE's p2p ring runs each step's attention on a chunk of seq / cp keys (the rank's two
        # load-balanced halves): the fused kernel's rate grows with the length it works on as
        # L / (L + attention_half_tokens), so the ring's chunks run slower than one whole-sequence call
        full, chunk = cfg.seq, cfg.seq / cfg.cp
        attn *= (full / (full + c.attention_half_tokens)) / (chunk / (chunk + c.attention_half_tokens))
    st.attention_s += attn
    st.attention_bwd_extra_s += T * (a / t) * c.attention_sink_bwd_s if model.attention_sinks else 0.0
    # memory-bound kernels; norms beyond the two pre-norms (post-norms) and the q / k norms each
    # read and write their input once
    sp = t if cfg.sequence_parallel else 1
    mb_bytes = e * T * (c.elementwise_hidden_passes * h / sp + c.elementwise_ffn_passes * ffn_for_elementwise)
    mb_bytes += e * T * c.norm_passes * ((model.norms_per_layer - 2) * h / sp + qk_norm_width(model) / t)
    mb = mb_bytes / (hbm * c.hbm_efficiency)
    st.memory_bound_s += mb
    fp8_fwd = 0.0
    if fp8:  # casts / transposes (memory-bound) and scaling bookkeeping: forward and backward
        fp8_fwd = cast[0] / (hbm * c.hbm_efficiency) + cast[2] * c.fp8_gemm_overhead_s
        st.fp8_fwd_s += fp8_fwd
        st.fp8_bwd_s += cast[1] / (hbm * c.hbm_efficiency) + 2 * cast[2] * c.fp8_gemm_overhead_s
    # TP collectives: 2 per layer (all-reduce, or all-gather + reduce-scatter with SP)
    tp_bytes = T * h * e
    tp = 2 * collective_time("all_reduce", tp_bytes, t, tp_link.bw_gbs, tp_link.latency)
    if cfg.sequence_parallel and t > 1:
        # With SP, per layer: forward 2 all-gathers of the column-parallel layers' inputs (QKV,
        # FC1) and 2 reduce-scatters, backward the same in reverse (entered here at half: the step
        # doubles TP communication for the backward), plus the inputs all-gathered again in the
        # backward for the weight gradient (TE's LayerNormLinear / LayerNormMLP, megatron's
        # LinearWithGradAccumulationAndAsyncCommunication keep only their sequence shard), issued
        # before the dgrad GEMM. Under FP8 TE casts those inputs before it gathers them
        # (quantized all-gather): they travel at the format's bytes per element.
        gin = collective_time("all_gather", T * h * (q.in_bytes if fp8 else e), t, tp_link.bw_gbs, tp_link.latency)
        gbf = collective_time("all_gather", tp_bytes, t, tp_link.bw_gbs, tp_link.latency)
        tp += (1.0 + c.sp_regather_exposed) * gin - gbf
    if cfg.tp_comm_overlap:
        # TE's userbuffers split each GEMM into tp chunks: the all-gather's ring exchange moves the
        # next chunk while the GEMM of the one it has runs (all of it can hide: the first chunk is
        # local), the pipelined reduce-scatter sends each chunk's result while the next chunk's GEMM
        # runs (the last chunk's has nothing to hide behind): at most 1 - 1 / (2 tp) of the TP
        # communication (half all-gather, half reduce-scatter) is hidden
        tp *= 1.0 - c.tp_overlap_fraction * (1.0 - 0.5 / t)
    st.tp_comm_s += tp
    # CP: ring exchange of K and V, overlapped with the attention compute. Transformer Engine
    # refuses a sliding window with the ring (cp_comm_type p2p: "The context parallel running
    # configs cannot support sliding window attetnion!", attn_forward_func_with_cp in
    # transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py): a windowed
    # layer runs cp_comm_type all_gather, K and V of the whole sequence gathered before its
    # attention (and dK, dV reduce-scattered after the backward), not overlapped.
    if cfg.cp > 1:
        if model.mla is not None:
            kv_elems = T * a * (model.mla.qk_nope_head_dim + model.mla.qk_rope_head_dim + model.mla.v_head_dim) / t
        else:
            kv_elems = T * 2 * model.kv_heads * model.head_dim / t
        if window and model.window_type == "sliding":  # (chunked: no TE window; the ring)
            st.cp_comm_s += collective_time("all_gather", kv_elems * e * cfg.cp, cfg.cp, cp_link.bw_gbs,
                                            cp_link.latency)
        else:
            # Transformer Engine's p2p ring (AttnFuncWithCPAndKVP2P): cp steps, each the attention
            # of one K / V chunk (~attn / cp) while the next chunk travels; a step's transfer hides
            # only behind that step's attention. Each step also merges its partial result in fp32
            # (the output and LSE corrections forward, dQ / dK / dV accumulation backward):
            # cp_step_passes HBM passes over the rank's fp32 attention output per step, forward +
            # backward (entered at a third: the step triples memory-bound time for the backward)
            step = collective_time("p2p", kv_elems * e, 2, cp_link.bw_gbs, cp_link.latency)
            st.cp_comm_s += (cfg.cp - 1) * max(0.0, step - attn / cfg.cp)
            q_width = a * (model.mla.v_head_dim if model.mla is not None else model.head_dim) / t
            st.memory_bound_s += cfg.cp * c.cp_step_passes * T * q_width * 4.0 / (hbm * c.hbm_efficiency) / 3
    st.overhead_s += c.layer_overhead_s
    st.host_s += layer_host_s(cfg, c, cast[2], bool(window and model.window_type == "sliding"))
    return g + attn + mb + fp8_fwd


def layer_host_s(cfg: TrainConfig, c: Constants, fp8_gemms: int = 0, cp_all_gather: bool = False) -> float:
    """Host (CPU) seconds to issue one layer's kernels and collectives for one microbatch, forward +
    backward (Constants.host_*): the layer's own ops, its TP collectives (10 with sequence
    parallelism, 4 all-reduces without), CP's ring steps (or a windowed layer's all-gather and
    reduce-scatter), and the FP8 GEMMs (`fp8_gemms` per forward, x3 with dgrad and wgrad)."""
    n_tp = (10 if cfg.sequence_parallel else 4) if cfg.tp > 1 else 0
    h = c.host_layer_s + c.host_fp8_gemm_s * 3 * fp8_gemms
    if cfg.cp > 1:
        if cp_all_gather:
            n_tp += 2
        else:
            h += c.host_cp_step_s * cfg.cp
    return h + c.host_collective_s * n_tp


# StageTime fields that are sums over a stage's layers of one layer's forward costs (the ones
# step_time.stage_times adds up per layer kind), and every StageTime field after `stage`, in its
# order (a stage row is StageTime(stage, *row)); the StagePower fields the arrays hold (stage and
# the SM clock in MHz are derived when a row becomes a StagePower)
UNIT_FIELDS = ADDITIVE_TERMS
STAGE_FIELDS = tuple(f.name for f in dataclasses.fields(StageTime) if f.name != "stage")
STEP_FIELDS = ("step_time_s", "pipeline_s", "bubble_s", "dp_comm_s", "dp_exposed_s", "optimizer_s")


# ------------------------------------------------------------------------------------------------
# stage times and the step on arrays of layouts (models/stages.py); one layout is an array of one.
# What does not depend on the pipeline split (one layer's forward costs for a layer shape, the
# output layer) is computed once per distinct value by the per-layer functions above.
# ------------------------------------------------------------------------------------------------

def layer_links(memo: Memo, tp: int, cp: int, ep: int, etp: int) -> list[Link]:
    """The links of a layer's TP, CP, EP and expert-TP groups (Megatron's rank order tp-cp-ep-dp-pp)."""
    return memo.get("links", (tp, cp, ep, etp), lambda: group_links(
        memo.cluster, np.array([1, tp, etp, 1]), np.array([tp, cp, ep, etp]), memo.c).groups())


def layer_units(memo: Memo, key) -> tuple[np.ndarray, np.ndarray]:
    """([K, len(UNIT_FIELDS)] one layer's forward costs per kind (step_time.layer_forward), [K, 2]
    GEMM utilisation sums) for a layer shape (tp, cp, mbs, seq, ep, etp, sp, quant code, TP
    overlap, MoE knobs, microbatches where they matter, gradient accumulation fusion of a MoE layer)."""
    def make():
        tp, cp, mbs, seq, ep, etp, sp, fp8, tpo, knobs, m, gaf = key
        cfg = TrainConfig(tp=tp, cp=cp, mbs=mbs, seq=seq, ep=ep, etp=etp, sequence_parallel=sp,
                          **quant_fields(fp8), tp_comm_overlap=tpo, gbs=m * mbs, gradient_accumulation_fusion=gaf,
                          **dict(zip(MOE_KNOBS, knobs)))
        links = layer_links(memo, tp, cp, ep, etp)
        vals = np.zeros((len(memo.kinds), len(UNIT_FIELDS)))
        util = np.zeros((len(memo.kinds), 2))
        for j, i in enumerate(memo.kinds):
            one = StageTime(stage=0)
            u = [0.0, 0.0]
            layer_forward(memo.model, i, cfg, memo.cluster, memo.c, one, *links, u)
            vals[j] = [getattr(one, f) for f in UNIT_FIELDS]
            util[j] = u
        return vals, util
    return memo.get("units", key, make)


def loss_terms(memo: Memo, T: float, tp: int) -> tuple[float, float, float]:
    """The output layer's GEMM (seconds, achieved fraction) and the loss's TP all-reduce."""
    def make():
        m, cl, c = memo.model, memo.cluster, memo.c
        gpu = cl.gpu
        tt, u = gemm_time(T, m.hidden_size, m.vocab_size / tp, gpu.bf16_tflops * 1e12,
                          gpu.hbm_bandwidth_gbs * 1e9, c, c.gemm_efficiency_max)
        link = layer_links(memo, tp, 1, 1, 1)[0]
        ar = 2 * collective_time("all_reduce", T * 4 * 3, tp, link.bw_gbs, link.latency)
        return (tt, u, ar)
    return memo.get("loss", (T, tp), make)


def stage_time_arrays(model: ModelSpec, cluster: ClusterSpec, L: Layouts, c: Constants, memo: Memo, S: Stages
                      ) -> dict[str, np.ndarray]:
    """stage_times of every row: flat per-stage arrays of the StageTime fields."""
    gpu = cluster.gpu
    r, k = S.row, S.k
    hbm = gpu.hbm_bandwidth_gbs * 1e9
    e = c.bytes_activation
    m = L.num_microbatches
    extras = L.extras
    codes = extra_codes(L, extras)
    seq_mlp = (np.array([not x[1] for x in extras], bool) if not L.same_extras
               else np.full(len(extras), not extras[0][1]) if extras else False)
    # the microbatch count matters to a MoE layer with SequentialMLP (its per-step host work) and
    # with the 1F1B all-to-all overlap (the first and last microbatch have no partner)
    per_m = seq_mlp | (np.array([x[5] for x in extras], bool) if not L.same_extras
                       else np.full(len(extras), bool(extras[0][5])) if extras else False)
    gaf = L.grad_fusion & model.is_moe  # only the experts' own accumulation is a per-layer term
    first, inv = unique_rows([L.tp, L.cp, L.mbs, L.seq, L.ep, L.etp, L.sp, L.fp8, L.tp_overlap, codes,
                               np.where(per_m, m, 0), gaf])
    units, utils = [], []
    for i in first:
        knobs = tuple(extras[i])
        key = (int(L.tp[i]), int(L.cp[i]), int(L.mbs[i]), int(L.seq[i]), int(L.ep[i]), int(L.etp[i]),
               bool(L.sp[i]), int(L.fp8[i]), bool(L.tp_overlap[i]), knobs,
               int(m[i]) if per_m[i] else 1, bool(gaf[i]))
        u, ut = layer_units(memo, key)
        units.append(u)
        utils.append(ut)
    U = np.stack(units)           # [keys, K, F]
    UT = np.stack(utils)          # [keys, K, 2]
    key = inv[r]                  # each stage's layer shape
    counts = S.counts(memo)       # [S, K]
    K = counts.shape[1]
    cols = [counts[:, j] for j in range(K)]
    out: dict[str, np.ndarray] = {}
    for fi, name in enumerate(UNIT_FIELDS):
        acc = np.zeros(S.total)
        for j in range(K):
            u = U[:, j, fi]
            if u.any():
                acc = acc + cols[j] * u[key]
        out[name] = acc
    util0 = np.zeros(S.total)
    util1 = np.zeros(S.total)
    for j in range(K):
        util0 = util0 + cols[j] * UT[:, j, 0][key]
        util1 = util1 + cols[j] * UT[:, j, 1][key]
    attn_f, gemm_f, mb_f = out["attention_s"], out["gemm_s"], out["memory_bound_s"]
    fp8_f, fp8_b, attn_b = out["fp8_fwd_s"], out["fp8_bwd_s"], out["attention_bwd_extra_s"]
    comm_f = out["tp_comm_s"] + out["cp_comm_s"] + out["ep_comm_s"]
    out["forward_s"] = gemm_f + attn_f + mb_f + fp8_f
    backward = 2 * gemm_f + c.attention_backward_factor * attn_f + attn_b + 2 * mb_f + fp8_b
    # the transformer layers' forward and backward with their collectives (no loss, no recompute yet)
    layers_f, layers_b = out["forward_s"] + comm_f, backward + comm_f
    out["gemm_s"] = 3 * gemm_f
    out["attention_s"] = attn_f * (1 + c.attention_backward_factor) + attn_b
    mb = 3 * mb_f + fp8_f + fp8_b
    for name in ("tp_comm_s", "cp_comm_s", "ep_comm_s"):  # the backward's collectives mirror the forward's
        out[name] = out[name] * 2
    rc = L.recompute[r]  # partial recompute (Layouts.rc_layers / rc_modules): models/recompute.py
    recompute = (np.where(rc == 2, layers_f, np.where(rc == 1, attn_f, 0.0)) if not L.partial_recompute
                 else recompute_time(model, L, memo, S, U, UNIT_FIELDS, key, counts, hbm))
    out["recompute_s"] = recompute
    backward = backward + recompute
    T = (L.seq / L.cp * L.mbs)[r]
    emb = k == 0
    mb = np.where(emb, mb + 3 * T * model.hidden_size * e / (hbm * c.hbm_efficiency), mb)
    last = k == L.pp[r] - 1
    rows_last = np.flatnonzero(last)
    if len(rows_last):
        Tl, tpl = T[rows_last], L.tp[r][rows_last]
        pairs, pinv = np.unique(np.stack([Tl, tpl.astype(float)], 1), axis=0, return_inverse=True)
        terms = np.array([loss_terms(memo, float(a), int(b)) for a, b in pairs])[pinv.reshape(-1)]
        tt, u, ar = terms[:, 0], terms[:, 1], terms[:, 2]
        g = out["gemm_s"]
        g[rows_last] = g[rows_last] + 3 * tt
        out["forward_s"][rows_last] += tt
        backward[rows_last] = backward[rows_last] + 2 * tt
        util0[rows_last] = util0[rows_last] + tt * u
        util1[rows_last] = util1[rows_last] + tt
        ce = L.per_cross_entropy(lambda impl: loss_bytes_per_logit(model, c, impl))[r][rows_last]
        mb[rows_last] = mb[rows_last] + Tl * model.vocab_size / tpl * ce / (hbm * c.hbm_efficiency)
        out["tp_comm_s"][rows_last] += ar
    # PP send/recv
    pp, vp = L.pp[r], L.vp[r]
    p2p = np.zeros(S.total)
    bbytes = T * model.hidden_size * e / np.where(L.sp, L.tp, 1)[r]
    span = (L.tp * L.cp * L.dp)[r]
    gpn = cluster.domain_gpus
    inter_bw, inter_lat = cluster.inter_node_bw_gbs * c.network_efficiency, c.inter_latency_s
    intra_bw, intra_lat = cluster.intra_node_bw_gbs * c.nvlink_efficiency, c.intra_latency_s
    for other, ok in ((np.where(k + 1 < pp, k + 1, 0), (pp > 1) & ((k + 1 < pp) | (vp > 1))),
                      (np.where(k > 0, k - 1, pp - 1), (pp > 1) & ((k > 0) | (vp > 1)))):
        inter = (k * span) // gpn != (other * span) // gpn
        bw = np.where(inter, inter_bw, intra_bw)
        lat = np.where(inter, inter_lat, intra_lat)
        one = vp * (bbytes / (bw * 1e9) + lat)
        one = np.where(vp > 1, one * (1.0 - c.pp_overlap_fraction), one)
        p2p = np.where(ok, p2p + one, p2p)
    out["pp_p2p_s"] = p2p
    # gradient accumulation outside the wgrad GEMMs (gradient_accumulation_fusion off): DDP's hook
    # adds each weight gradient into the main grad, c.grad_accum_bytes_per_param per parameter of
    # the stage and microbatch
    unfused = ~L.grad_fusion[r]
    if c.grad_accum_bytes_per_param > 0 and unfused.any():
        params = stage_param_arrays(L, memo, S)
        acc = np.where(unfused, params[:, 0] * c.grad_accum_bytes_per_param / (hbm * c.hbm_efficiency), 0.0)
        mb = mb + acc
        backward = backward + acc
    out["memory_bound_s"] = mb
    out["backward_s"] = backward
    with np.errstate(divide="ignore", invalid="ignore"):
        out["gemm_utilization"] = np.where(util1 != 0, util0 / util1, 0.0)
    out["overhead_s"] = out["overhead_s"] + offload_wait_arrays(cluster, L, c, memo, S, layers_f, layers_b)
    # the host issues kernels no faster than layer_host_s each layer: the GPU runs ahead of nothing,
    # so where its own work is shorter it waits for the host (no kernel: NVML utilization < 100%)
    out["host_wait_s"] = np.maximum(0.0, out["host_s"] - total_arrays(out))
    out["overhead_s"] = out["overhead_s"] + out["host_wait_s"]
    return out


def total_arrays(st: dict[str, np.ndarray]) -> np.ndarray:
    """StageTime.total_s of every stage."""
    return (st["gemm_s"] + st["attention_s"] + st["memory_bound_s"] + st["recompute_s"] + st["tp_comm_s"]
            + st["cp_comm_s"] + st["ep_comm_s"] + st["pp_p2p_s"] + st["overhead_s"])


def at_clocks_arrays(full: dict[str, np.ndarray], x: np.ndarray, c: Constants, y: np.ndarray | float = 1.0
                     ) -> dict[str, np.ndarray]:
    """`full` (stage times at the maximum clocks) with stage s at SM clock ratio x[s] and memory
    clock ratio y[s] (models.dvfs: GEMM / attention / recompute stretch by compute_stretch,
    memory-bound kernels by memory_stretch; communication is unchanged): forward and backward by
    the busy time's mix of the two, each MoE term by its own parts (GEMMs at the SM clock,
    memory-bound kernels by memory_stretch, host launch time not at all; the dispatch is
    communication), the fp8 casts as memory-bound."""
    y = np.broadcast_to(np.asarray(y, float), np.shape(x))
    if np.all(x == 1.0) and np.all(y == 1.0):
        return full
    one = (x == 1.0) & (y == 1.0)
    fc = c.gemm_clock_share / x + (1.0 - c.gemm_clock_share)
    s = c.memory_sm_clock_share
    fm = s / x + (1.0 - s) / y
    busy = full["gemm_s"] + full["attention_s"] + full["memory_bound_s"]
    with np.errstate(divide="ignore", invalid="ignore"):
        mix = np.where(busy != 0, ((full["gemm_s"] + full["attention_s"]) * fc + full["memory_bound_s"] * fm) / busy,
                       1.0)
    out = dict(full)

    def put(name, v):
        out[name] = np.where(one, full[name], v)

    put("gemm_s", full["gemm_s"] * fc)
    put("attention_s", full["attention_s"] * fc)
    put("recompute_s", full["recompute_s"] * fc)
    put("memory_bound_s", full["memory_bound_s"] * fm)
    put("forward_s", full["forward_s"] * mix)
    put("backward_s", full["backward_s"] * mix)
    for name, f in (("fp8_fwd_s", fm), ("fp8_bwd_s", fm), ("attention_bwd_extra_s", fc)):
        put(name, full[name] * f)
    # the host's wait at these clocks: what the host's issue time exceeds the slower GPU work by
    wait = np.maximum(0.0, full["host_s"] - (total_arrays(out) - full["host_wait_s"]))
    put("overhead_s", full["overhead_s"] - full["host_wait_s"] + wait)
    put("host_wait_s", wait)
    for term, comp, mem in (("moe_router_s", "moe_router_compute_s", "moe_router_memory_s"),
                            ("moe_permute_s", None, "moe_permute_memory_s"),
                            ("moe_expert_gemm_s", "moe_expert_compute_s", "moe_expert_memory_s")):
        g = full[comp] if comp else 0.0
        b = full[mem]
        put(term, full[term] + g * (fc - 1.0) + b * (fm - 1.0))
        if comp:
            put(comp, g * fc)
        put(mem, b * fm)
    return out


@dataclass
class DPTerms:
    """Per-stage DP traffic and optimizer terms that do not depend on the clocks; `fsdp`: Megatron
    FSDP's per-micro-batch gathers and reduce-scatters (models.fsdp_time; None: no row has FSDP)."""

    grad: np.ndarray
    gather: np.ndarray
    opt_base: np.ndarray
    fsdp: FSDPTerms | None = None

    def take(self, sm: np.ndarray) -> "DPTerms":
        """The terms of stages `sm`."""
        return DPTerms(self.grad[sm], self.gather[sm], self.opt_base[sm], self.fsdp.take(sm) if self.fsdp else None)


# QUANTS codes whose FP8 primary weights are Float8Tensors whose transposes TE builds where the GPU's
# FP8 GEMMs are TN-only (Hopper; GPUSpec.fp8_transposed_copy) (delayed and current scaling)
FP8_TRANSPOSE_QUANTS = tuple(QUANTS.index(q) for q in ("fp8", "fp8-tensorwise"))


def dp_terms(model: ModelSpec, cluster: ClusterSpec, L: Layouts, c: Constants, memo: Memo, S: Stages) -> DPTerms:
    r, k = S.row, S.k
    params = stage_param_arrays(L, memo, S)
    dense, experts, lin = params[:, 0], params[:, 1], params[:, 2] - params[:, 1]  # lin: the dense linear weights
    dl = group_links(cluster, L.tp * L.cp, L.dp, c)
    edp = L.expert_dp
    el = group_links(cluster, L.ep * L.etp, edp, c)
    dbw, dlat, ebw, elat, edp = dl.bw_gbs[r], dl.latency[r], el.bw_gbs[r], el.latency[r], edp[r]
    d = (L.dp * L.cp)[r]
    gb = c.dp_grad_reduce_bytes
    dist = L.dist_opt[r]
    fpg = L.fpg[r] if L.fpg is not None else 0.0  # FP8 primary weights gather at 1 B each (TrainConfig.fp8_param_gather)
    fsdp = None
    if L.fsdp is not None and L.fsdp[r].any():  # Megatron FSDP: the units' traffic per micro-batch (models.fsdp_time)
        on = L.fsdp[r]
        outside = outside_layer_params(model, k == 0, k == L.pp[r] - 1, L.pp[r] > 1, L.tp[r])
        fsdp = fsdp_stage_terms(on, dense - outside, experts, lin, fpg, S.counts(memo).sum(axis=1), d,
                                Link(dbw, dlat, dl.inter_node[r]), edp, Link(ebw, elat, el.inter_node[r]), c)
        # the parameters outside the units keep the distributed optimizer's once-per-step terms
        dense, experts, lin = np.where(on, outside, dense), np.where(on, 0.0, experts), np.where(on, 0.0, lin)
    grad = np.where(dist, collective_time("reduce_scatter", dense * gb, d, dbw, dlat) + collective_time("reduce_scatter", experts * gb, edp, ebw, elat),
                    collective_time("all_reduce", dense * gb, d, dbw, dlat) + collective_time("all_reduce", experts * gb, edp, ebw, elat))
    gather = np.where(dist, collective_time("all_gather", dense * 2 - lin * fpg, d, dbw, dlat) + collective_time("all_gather", experts * (2 - fpg), edp, ebw, elat), 0.0)
    shard = np.where(dist, params[:, 0] / d + params[:, 1] / edp, params[:, 0] + params[:, 1])
    hbm = cluster.gpu.hbm_bandwidth_gbs * 1e9 * c.hbm_efficiency
    opt_base = shard * c.optimizer_bytes_per_param / hbm
    if L.fpg is not None and fp8_transposed_copy(cluster.gpu):
        # FP8 primary weights: each step the rank's shard of every FP8 linear weight cast from its master
        # with its transpose (Constants.fp8_param_cast_s; delayed / current scaling; none on Blackwell)
        tr = L.fpg[r].astype(bool) & np.isin(L.fp8[r], FP8_TRANSPOSE_QUANTS)
        lin_shard = np.where(dist, (params[:, 2] - params[:, 1]) / d + params[:, 1] / edp, params[:, 2])
        opt_base = opt_base + np.where(tr, lin_shard * c.fp8_param_cast_s, 0.0)
    return DPTerms(grad, gather, opt_base, fsdp)


def collective_contention_s(hidden_s: np.ndarray | float, sm_share: float) -> np.ndarray:
    """Seconds the compute loses to NCCL's kernels while `hidden_s` seconds of collectives run behind
    it: they hold `sm_share` of the SMs (Constants.collective_sm_share), so that much of the compute
    the window held is done after it, at the full rate. 0 where nothing is hidden or the share is 0."""
    return np.maximum(0.0, np.asarray(hidden_s, float)) * sm_share


def step_arrays(L: Layouts, c: Constants, S: Stages, full: dict, at: dict, dp: DPTerms) -> dict[str, np.ndarray]:
    """step_time of every row from its stages at full clocks (`full`) and at the clocks
    held (`at`): per-row arrays of STEP_FIELDS plus 'totals' (per stage)."""
    r = S.row
    m = L.num_microbatches
    with np.errstate(divide="ignore", invalid="ignore"):
        mem_stretch = np.where(full["memory_bound_s"] != 0, at["memory_bound_s"] / full["memory_bound_s"], 1.0)
    totals = total_arrays(at)
    slow = S.max(totals)
    fill = (S.sum(totals) - slow) / L.vp
    pipeline = m * slow + fill
    half = at["tp_comm_s"] / 2
    per_bwd = at["backward_s"] + half
    per_fwd = at["forward_s"] + half
    exp_grad = np.where(L.overlap_grad[r], np.maximum(0.0, dp.grad - per_bwd * c.dp_overlap_efficiency), dp.grad)
    exp_gather = np.where(L.overlap_param[r], np.maximum(0.0, dp.gather - per_fwd * c.dp_overlap_efficiency),
                          dp.gather)
    dp_total = np.maximum(0.0, S.max(dp.grad + dp.gather))
    dp_exposed = np.maximum(0.0, S.max(exp_grad + exp_gather))
    if dp.fsdp is not None:  # Megatron FSDP: each micro-batch's gathers and reduce-scatters, what compute leaves exposed
        f = dp.fsdp
        dp_total = dp_total + m * S.max(f.gather * 2 + f.reduce)
        dp_exposed = dp_exposed + m * S.max(fsdp_exposed_per_microbatch(f, per_fwd, per_bwd, c.dp_overlap_efficiency))
    # the SMs NCCL takes from the compute it hides behind (Constants.collective_sm_share)
    dp_exposed = dp_exposed + collective_contention_s(dp_total - dp_exposed, c.collective_sm_share)
    opt = np.maximum(0.0, S.max(dp.opt_base * mem_stretch))
    total = pipeline + dp_exposed + opt + c.step_overhead_s
    return {"step_time_s": total, "pipeline_s": pipeline, "bubble_s": fill, "dp_comm_s": dp_total,
            "dp_exposed_s": dp_exposed, "optimizer_s": opt, "totals": totals, "slow": slow}


# ------------------------------------------------------------------------------------------------
# the per-layout API: a layout is a Layouts of one row
# ------------------------------------------------------------------------------------------------

def stage_arrays(stages: Sequence[StageTime]) -> dict[str, np.ndarray]:
    """StageTime objects as the per-stage arrays of their fields."""
    return {f: np.array([getattr(s, f) for s in stages], float) for f in STAGE_FIELDS}


def stage_objects(d: dict[str, np.ndarray], start: int, pp: int) -> list[StageTime]:
    """The StageTime objects of stages start .. start + pp - 1 of per-stage arrays."""
    mat = np.stack([d[f][start:start + pp] for f in STAGE_FIELDS], 1)
    return [StageTime(k, *vals) for k, vals in enumerate(mat.tolist())]


class OneLayout:
    """`cfg` as a Layouts of one row, with what the step needs of it at any clocks (its stage times
    at the maximum clocks and DP terms, made once: the power fixed point asks for the step at
    many clocks)."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, c: Constants):
        self.model, self.cluster, self.cfg, self.c = model, cluster, cfg, c
        self.L = Layouts.of(model, [cfg])
        self.S = Stages(self.L)
        self.memo = memo_for(model, cluster, c)
        self._full = self._dp = None

    @property
    def full(self) -> dict[str, np.ndarray]:
        if self._full is None:
            self._full = stage_time_arrays(self.model, self.cluster, self.L, self.c, self.memo, self.S)
        return self._full

    @property
    def dp(self) -> DPTerms:
        if self._dp is None:
            self._dp = dp_terms(self.model, self.cluster, self.L, self.c, self.memo, self.S)
        return self._dp


@lru_cache(maxsize=256)
def one_layout(model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, c: Constants) -> OneLayout:
    return OneLayout(model, cluster, cfg, c)


def stage_times(model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, c: Constants = DEFAULT) -> list[StageTime]:
    """Time per microbatch of every pipeline stage of `cfg` at the maximum clocks."""
    return stage_objects(one_layout(model, cluster, cfg, c).full, 0, cfg.pp)


def _per_stage(v: float | Sequence[float], n: int, what: str) -> np.ndarray:
    vals = [float(v)] * n if isinstance(v, (int, float)) else [float(x) for x in v]
    if len(vals) != n or not all(0.0 < x <= 1.0 for x in vals):
        raise ValueError(f"{what}: need {n} clock ratios in (0, 1], got {v!r}")
    return np.array(vals)


def at_clocks(stages: Sequence[StageTime], sm_clock: float | Sequence[float] = 1.0,
              mem_clock: float | Sequence[float] = 1.0, c: Constants = DEFAULT) -> list[StageTime]:
    """`stages` (times at the maximum clocks) with stage k at SM clock ratio sm_clock[k] and memory
    clock ratio mem_clock[k] (at_clocks_arrays)."""
    x = _per_stage(sm_clock, len(stages), "sm_clock")
    y = _per_stage(mem_clock, len(stages), "mem_clock")
    full = stage_arrays(stages)
    at = at_clocks_arrays(full, x, c, y)
    out = stage_objects(at, 0, len(stages))
    for k, st in enumerate(stages):
        out[k].stage = st.stage
    return out


def step_time(model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, c: Constants = DEFAULT,
              sm_clock: float | Sequence[float] = 1.0, mem_clock: float | Sequence[float] = 1.0,
              stages: Sequence[StageTime] | None = None) -> StepTime:
    """Step time at the GPUs' maximum clocks, or with each pipeline stage at the given SM and
    memory clock ratios (one number for all stages or one per stage; e.g. the clocks a power cap
    holds, advisor.models.dvfs). `stages`: stage_times() of this layout, when the caller has them."""
    one = one_layout(model, cluster, cfg, c)
    full = stage_arrays(stages) if stages is not None else one.full
    pp = len(full["gemm_s"])
    at = at_clocks_arrays(full, _per_stage(sm_clock, pp, "sm_clock"), c, _per_stage(mem_clock, pp, "mem_clock"))
    st = step_arrays(one.L, c, one.S, full, at, one.dp)
    out = stage_objects(at, 0, pp)
    if stages is not None:
        for k, s in enumerate(stages):
            out[k].stage = s.stage
    return StepTime(**{f: float(st[f][0]) for f in STEP_FIELDS}, overhead_s=c.step_overhead_s, stages=out,
                    num_microbatches=cfg.num_microbatches)
