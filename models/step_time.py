"""Step time of one training iteration, with its breakdown. Pure functions.

Per pipeline stage and microbatch: the GEMMs of every layer (efficiency by shape), flash
attention, memory-bound kernels, recompute, and the TP / CP / EP collectives on NVLink or the
network depending on where the group lands (Megatron's rank order tp-cp-ep-dp-pp). Then the
pipeline schedule (1F1B or interleaved: bubble (p-1)/(v·m) for equal stages), PP send/recv, the
DP gradient reduce-scatter / all-reduce and parameter all-gather with the part that overlaps
with backward / forward, and the optimizer step.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Sequence

from advisor.catalog.specs import ClusterSpec, ModelSpec, TrainConfig
from advisor.models.constants import DEFAULT, Constants
from advisor.models.flops import attention_core_flops_per_token, qk_norm_width
from advisor.models.memory import plan_params
from advisor.models.quant import quant
from advisor.search_spaces.layout import pipeline_plan, rank_kinds
from advisor.models.moe import moe_layer_time


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


def collective_time(kind: str, nbytes: float, n: int, bw_gbs: float, latency: float) -> float:
    """NCCL ring-style cost of a collective over n ranks moving nbytes per rank (the full buffer)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw = bw_gbs * 1e9
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n * nbytes / bw + 2 * latency * (n - 1) ** 0.5
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n * nbytes / bw + latency * (n - 1) ** 0.5
    if kind == "p2p":
        return nbytes / bw + latency
    raise ValueError(kind)


@dataclass
class Link:
    bw_gbs: float
    latency: float
    inter_node: bool


def group_link(cluster: ClusterSpec, stride: int, size: int, c: Constants) -> Link:
    """Link a group of `size` ranks spaced `stride` apart uses: NVLink when it fits in the job's
    share of one NVLink domain (`ClusterSpec.domain_gpus`: an HGX node, or the GPUs of an NVL72
    rack, over its 4-GPU trays). Across domains, the k ranks of the group that share a domain
    drive k NICs at once (NCCL runs one
    ring / channel per NIC; a node's boundary hop carries the group's traffic over all of them), so
    the group's per-rank bandwidth is k NICs' worth, at most the NVLink rate: nccl-tests on DGX
    H100 (8 x 400 Gb/s per node) show multi-node all-reduce bus bandwidths near the NVLink one
    with full nodes, and ~50 GB/s with one rank per node."""
    span = stride * size
    gpn = cluster.domain_gpus
    if size <= 1 or span <= gpn:
        return Link(cluster.intra_node_bw_gbs * c.nvlink_efficiency, c.intra_latency_s, False)
    per_node = max(1, min(size, gpn // stride)) if stride < gpn else 1
    bw = min(cluster.intra_node_bw_gbs, per_node * cluster.inter_node_bw_gbs)
    return Link(bw * c.network_efficiency, c.inter_latency_s, True)


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
             "fp8_fwd_s", "fp8_bwd_s") + _MOE + _MOE_PARTS + _EP_IDLE


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


def loss_bytes_per_logit(model: ModelSpec, c: Constants) -> float:
    """HBM bytes per logit of the loss's memory-bound kernels, forward (the backward is 2x): the
    softmax / cross entropy's 6, plus a read and a write of the logits for a final soft-capping
    (tanh, Gemma 2)."""
    return 6.0 + (c.norm_passes * c.bytes_activation if model.final_logit_softcap else 0.0)


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
    # windowed layer's queries see only their window (flops.keys_per_query)
    window = model.layer_window(layer)
    attn_flops = attention_core_flops_per_token(model, cfg.seq, layer=layer) * T / t
    attn = attn_flops / bf16_peak / c.attention_efficiency
    st.attention_s += attn
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
    if cfg.tp_comm_overlap:
        tp *= 1.0 - c.tp_overlap_fraction
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
            ring = (cfg.cp - 1) * collective_time("p2p", kv_elems * e, 2, cp_link.bw_gbs, cp_link.latency)
            st.cp_comm_s += max(0.0, ring - attn)
    st.overhead_s += c.layer_overhead_s
    return g + attn + mb + fp8_fwd


def stage_times(model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, c: Constants = DEFAULT) -> list[StageTime]:
    tp_link = group_link(cluster, 1, cfg.tp, c)
    cp_link = group_link(cluster, cfg.tp, cfg.cp, c)
    ep_link = group_link(cluster, cfg.etp, cfg.ep, c)
    etp_link = group_link(cluster, 1, cfg.etp, c)
    stage_span = cfg.tp * cfg.cp * cfg.dp
    gpu = cluster.gpu
    hbm = gpu.hbm_bandwidth_gbs * 1e9
    bf16_peak = gpu.bf16_tflops * 1e12
    e = c.bytes_activation
    T = cfg.seq / cfg.cp * cfg.mbs
    plan = pipeline_plan(model, cfg)
    per_kind: dict[int, tuple[StageTime, list[float]]] = {}  # one layer's forward costs by its kind
    out = []
    for stage, kinds in enumerate(rank_kinds(model, plan)):
        st = StageTime(stage=stage)
        util = [0.0, 0.0]
        for i, n in kinds.items():
            if i not in per_kind:  # i represents its kind
                one = StageTime(stage=stage)
                u1 = [0.0, 0.0]
                layer_forward(model, i, cfg, cluster, c, one, tp_link, cp_link, ep_link, etp_link, u1)
                per_kind[i] = (one, u1)
            one, u1 = per_kind[i]
            for name in ADDITIVE_TERMS:
                setattr(st, name, getattr(st, name) + n * getattr(one, name))
            util[0] += n * u1[0]
            util[1] += n * u1[1]
        # backward: 2x the GEMMs (data and weight gradients), attention x2.5, memory-bound x2,
        # communication again (TP, CP, EP are symmetric); forward-only costs of recompute on top.
        attn_f, gemm_f, mb_f = st.attention_s, st.gemm_s, st.memory_bound_s
        fp8_f, fp8_b = st.fp8_fwd_s, st.fp8_bwd_s
        comm_f = st.tp_comm_s + st.cp_comm_s + st.ep_comm_s
        st.forward_s = gemm_f + attn_f + mb_f + fp8_f
        st.backward_s = 2 * gemm_f + c.attention_backward_factor * attn_f + 2 * mb_f + fp8_b
        st.gemm_s = 3 * gemm_f
        st.attention_s = attn_f * (1 + c.attention_backward_factor)
        st.memory_bound_s = 3 * mb_f + fp8_f + fp8_b
        st.tp_comm_s *= 2
        st.cp_comm_s *= 2
        st.ep_comm_s *= 2
        if cfg.recompute == "full":
            st.recompute_s = gemm_f + attn_f + mb_f + fp8_f + comm_f
        elif cfg.recompute == "selective":
            st.recompute_s = attn_f  # core attention (Megatron's default selective module)
        st.backward_s += st.recompute_s
        # the embedding and the loss sit on the first and last stage unless a pipeline layout
        # places them elsewhere (with virtual chunks: in the rank's first / last chunk)
        if stage == plan.embedding_rank:  # embedding lookup and its gradient (memory-bound)
            st.memory_bound_s += 3 * T * model.hidden_size * e / (hbm * c.hbm_efficiency)
        if stage == plan.loss_rank:  # output layer, logits and cross entropy
            # the output layer is Megatron's ColumnParallelLinear, BF16 also under fp8
            tt, u = gemm_time(T, model.hidden_size, model.vocab_size / cfg.tp, bf16_peak, hbm, c,
                              c.gemm_efficiency_max)
            st.gemm_s += 3 * tt
            st.forward_s += tt
            st.backward_s += 2 * tt
            # weighted like the layers' GEMMs (forward seconds, a third of their gemm_s)
            util[0] += tt * u
            util[1] += tt
            st.memory_bound_s += 3 * T * model.vocab_size / cfg.tp * loss_bytes_per_logit(model, c) / (hbm * c.hbm_efficiency)
            st.tp_comm_s += 2 * collective_time("all_reduce", T * 4 * 3, cfg.tp, tp_link.bw_gbs, tp_link.latency)
        # PP send/recv: activations to the next stage, gradients to the previous one, once per
        # virtual chunk (with interleaving the last stage also feeds stage 0's next chunk)
        if cfg.pp > 1:
            boundary_bytes = T * model.hidden_size * e / (cfg.tp if cfg.sequence_parallel else 1)
            nxt = stage + 1 if stage + 1 < cfg.pp else (0 if cfg.vp > 1 else None)
            prv = stage - 1 if stage > 0 else (cfg.pp - 1 if cfg.vp > 1 else None)
            for other in (nxt, prv):
                if other is None:
                    continue
                # the same position in both stages: rank k·span + j, in NVLink domain rank // domain_gpus
                gpn = cluster.domain_gpus
                inter = (stage * stage_span) // gpn != (other * stage_span) // gpn
                link = (Link(cluster.inter_node_bw_gbs * c.network_efficiency, c.inter_latency_s, True) if inter
                        else Link(cluster.intra_node_bw_gbs * c.nvlink_efficiency, c.intra_latency_s, False))
                p2p = cfg.vp * collective_time("p2p", boundary_bytes, 2, link.bw_gbs, link.latency)
                # the interleaved schedule overlaps its send/recv with compute (overlap_p2p_comm)
                st.pp_p2p_s += p2p * (1.0 - c.pp_overlap_fraction) if cfg.vp > 1 else p2p
        # gradient accumulation outside the GEMMs: each microbatch's backward adds every weight
        # gradient of the stage into its fp32 main-grad buffer (memory-bound, per parameter; the
        # routed experts' part is in their MoE phase, models/moe.py)
        if c.grad_accum_bytes_per_param > 0:
            dense = _stage_param_counts(model, cfg)[stage][0]
            acc = dense * c.grad_accum_bytes_per_param / (hbm * c.hbm_efficiency)
            st.memory_bound_s += acc
            st.backward_s += acc
        st.gemm_utilization = util[0] / util[1] if util[1] else 0.0
        out.append(st)
    return out


def _per_stage(v: float | Sequence[float], n: int, what: str) -> list[float]:
    vals = [float(v)] * n if isinstance(v, (int, float)) else [float(x) for x in v]
    if len(vals) != n or not all(0.0 < x <= 1.0 for x in vals):
        raise ValueError(f"{what}: need {n} clock ratios in (0, 1], got {v!r}")
    return vals


def at_clocks(stages: Sequence[StageTime], sm_clock: float | Sequence[float] = 1.0,
              mem_clock: float | Sequence[float] = 1.0, c: Constants = DEFAULT) -> list[StageTime]:
    """Copies of `stages` (times at the maximum clocks) with stage k at SM clock ratio sm_clock[k]
    and memory clock ratio mem_clock[k] (advisor.models.dvfs: GEMM / attention / recompute stretch
    by compute_stretch, memory-bound kernels by memory_stretch; communication is unchanged)."""
    from advisor.models.dvfs import compute_stretch, memory_stretch

    sm = _per_stage(sm_clock, len(stages), "sm_clock")
    mem = _per_stage(mem_clock, len(stages), "mem_clock")
    out = []
    for st, x, y in zip(stages, sm, mem):
        if x == 1.0 and y == 1.0:
            out.append(st)
            continue
        fc, fm = compute_stretch(x, c), memory_stretch(x, y, c)
        busy = st.gemm_s + st.attention_s + st.memory_bound_s
        mix = ((st.gemm_s + st.attention_s) * fc + st.memory_bound_s * fm) / busy if busy else 1.0
        new = copy.copy(st)
        new.gemm_s, new.attention_s, new.recompute_s = st.gemm_s * fc, st.attention_s * fc, st.recompute_s * fc
        new.memory_bound_s, new.forward_s, new.backward_s = st.memory_bound_s * fm, st.forward_s * mix, st.backward_s * mix
        # the breakdown's parts of those categories: fp8 casts are memory-bound; each MoE term
        # stretches by its own parts (GEMMs at the SM clock, memory-bound kernels by memory_stretch,
        # host launch time not at all); the MoE dispatch is communication
        new.fp8_fwd_s, new.fp8_bwd_s = st.fp8_fwd_s * fm, st.fp8_bwd_s * fm
        for term, comp, mem in (("moe_router_s", "moe_router_compute_s", "moe_router_memory_s"),
                                ("moe_permute_s", None, "moe_permute_memory_s"),
                                ("moe_expert_gemm_s", "moe_expert_compute_s", "moe_expert_memory_s")):
            g, b = getattr(st, comp) if comp else 0.0, getattr(st, mem)
            setattr(new, term, getattr(st, term) + g * (fc - 1.0) + b * (fm - 1.0))
            if comp:
                setattr(new, comp, g * fc)
            setattr(new, mem, b * fm)
        out.append(new)
    return out


def step_time(model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, c: Constants = DEFAULT,
              sm_clock: float | Sequence[float] = 1.0, mem_clock: float | Sequence[float] = 1.0,
              stages: Sequence[StageTime] | None = None) -> StepTime:
    """Step time at the GPUs' maximum clocks, or with each pipeline stage at the given SM and
    memory clock ratios (one number for all stages or one per stage; e.g. the clocks a power cap
    holds, advisor.models.dvfs). `stages`: stage_times() of this layout, when the caller has them."""
    full = list(stages) if stages is not None else stage_times(model, cluster, cfg, c)
    stages = at_clocks(full, sm_clock, mem_clock, c)
    mem_stretch = [st.memory_bound_s / f.memory_bound_s if f.memory_bound_s else 1.0
                   for st, f in zip(stages, full)]
    m = cfg.num_microbatches
    totals = [s.total_s for s in stages]
    slow = max(totals)
    fill_drain = (sum(totals) - slow) / cfg.vp
    pipeline = m * slow + fill_drain
    bubble = fill_drain
    # DP: gradients (fp32 main grads) and, with the distributed optimizer, the parameter all-gather
    dp_link = group_link(cluster, cfg.tp * cfg.cp, cfg.dp, c)
    edp = cfg.expert_dp
    edp_link = group_link(cluster, cfg.ep * cfg.etp, edp, c)
    dp_total = dp_exposed = opt = 0.0
    gb = c.dp_grad_reduce_bytes
    for st, (dense, experts) in zip(stages, _stage_param_counts(model, cfg)):
        d = cfg.dp * cfg.cp
        if cfg.distributed_optimizer:
            grad = (collective_time("reduce_scatter", dense * gb, d, dp_link.bw_gbs, dp_link.latency)
                    + collective_time("reduce_scatter", experts * gb, edp, edp_link.bw_gbs, edp_link.latency))
            gather = (collective_time("all_gather", dense * 2, d, dp_link.bw_gbs, dp_link.latency)
                      + collective_time("all_gather", experts * 2, edp, edp_link.bw_gbs, edp_link.latency))
            shard = dense / d + experts / edp
        else:
            grad = (collective_time("all_reduce", dense * gb, d, dp_link.bw_gbs, dp_link.latency)
                    + collective_time("all_reduce", experts * gb, edp, edp_link.bw_gbs, edp_link.latency))
            gather = 0.0
            shard = dense + experts
        per_mb_bwd = st.backward_s + st.tp_comm_s / 2
        per_mb_fwd = st.forward_s + st.tp_comm_s / 2
        exp_grad = max(0.0, grad - per_mb_bwd * c.dp_overlap_efficiency) if cfg.overlap_grad_reduce else grad
        exp_gather = (max(0.0, gather - per_mb_fwd * c.dp_overlap_efficiency)
                      if cfg.overlap_param_gather else gather)
        dp_total = max(dp_total, grad + gather)
        dp_exposed = max(dp_exposed, exp_grad + exp_gather)
        opt = max(opt, shard * c.optimizer_bytes_per_param / (hbm_bw(cluster) * c.hbm_efficiency)
                  * mem_stretch[st.stage])
    total = pipeline + dp_exposed + opt + c.step_overhead_s
    return StepTime(step_time_s=total, pipeline_s=pipeline, bubble_s=bubble, dp_comm_s=dp_total,
                    dp_exposed_s=dp_exposed, optimizer_s=opt, overhead_s=c.step_overhead_s,
                    stages=stages, num_microbatches=m)


@lru_cache(maxsize=4096)
def _stage_param_counts(model: ModelSpec, cfg: TrainConfig) -> tuple[tuple[float, float], ...]:
    """(dense, expert) parameters of each pipeline stage (step_time is evaluated at many clocks)."""
    return tuple((dense, experts) for dense, experts, _ in
                 plan_params(model, pipeline_plan(model, cfg), cfg.tp, cfg.ep * cfg.etp))


def hbm_bw(cluster: ClusterSpec) -> float:
    return cluster.gpu.hbm_bandwidth_gbs * 1e9
