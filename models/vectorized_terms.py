"""The analytical model on arrays of layouts, the terms before power: per-distinct-shape memos of
the reference functions, memory per stage, stage times (dense and MoE), the step at the clocks
the caps hold, and the data-parallel terms. models/vectorized.py adds the power / DVFS fixed point
and the calibration on top; tests/test_vectorized.py holds both to the per-layout reference.
Layout of the arrays: see models/vectorized.py."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from advisor.catalog.specs import MOE_KNOBS, ClusterSpec, ModelSpec, TrainConfig
from advisor.models.constants import Constants
from advisor.models.memory import stage_param_arrays
from advisor.models.power import STAGE_POWER_FIELDS
from advisor.models.stages import Memo, Stages, quant_fields
from advisor.models.step_time import ADDITIVE_TERMS, StageTime, loss_bytes_per_logit
from advisor.search_spaces.columns import Layouts, extra_codes, unique_rows

# StageTime fields that are sums over a stage's layers of one layer's forward costs (the ones
# step_time.stage_times adds up per layer kind), and every StageTime field after `stage`, in its
# order (a stage row is StageTime(stage, *row)); the StagePower fields the arrays hold (stage and
# the SM clock in MHz are derived when a row becomes a StagePower)
UNIT_FIELDS = ADDITIVE_TERMS
STAGE_FIELDS = tuple(f.name for f in dataclasses.fields(StageTime) if f.name != "stage")
STEP_FIELDS = ("step_time_s", "pipeline_s", "bubble_s", "dp_comm_s", "dp_exposed_s", "optimizer_s")
POWER_FIELDS = tuple(f for f in STAGE_POWER_FIELDS if f not in ("stage", "sm_clock_mhz"))


# ------------------------------------------------------------------------------------------------
# what is computed once per distinct value, by the per-layer functions
# ------------------------------------------------------------------------------------------------

def layer_units(memo: Memo, key) -> tuple[np.ndarray, np.ndarray]:
    """([K, len(UNIT_FIELDS)] one layer's forward costs per kind (step_time.layer_forward), [K, 2]
    GEMM utilisation sums) for a layer shape (tp, cp, mbs, seq, ep, etp, sp, quant code, TP
    overlap, MoE knobs, microbatches where they matter)."""
    def make():
        from advisor.models.step_time import StageTime, group_link, layer_forward

        tp, cp, mbs, seq, ep, etp, sp, fp8, tpo, knobs, m = key
        cfg = TrainConfig(tp=tp, cp=cp, mbs=mbs, seq=seq, ep=ep, etp=etp, sequence_parallel=sp,
                          **quant_fields(fp8), tp_comm_overlap=tpo, gbs=m * mbs, **dict(zip(MOE_KNOBS, knobs)))
        cl, c = memo.cluster, memo.c
        links = (group_link(cl, 1, tp, c), group_link(cl, tp, cp, c), group_link(cl, etp, ep, c),
                 group_link(cl, 1, etp, c))
        vals = np.zeros((len(memo.kinds), len(UNIT_FIELDS)))
        util = np.zeros((len(memo.kinds), 2))
        for j, i in enumerate(memo.kinds):
            one = StageTime(stage=0)
            u = [0.0, 0.0]
            layer_forward(memo.model, i, cfg, cl, c, one, *links, u)
            vals[j] = [getattr(one, f) for f in UNIT_FIELDS]
            util[j] = u
        return vals, util
    return memo.get("units", key, make)


def loss_terms(memo: Memo, T: float, tp: int) -> tuple[float, float, float]:
    """The output layer's GEMM (seconds, achieved fraction) and the loss's TP all-reduce."""
    def make():
        from advisor.models.step_time import collective_time, gemm_time, group_link

        m, cl, c = memo.model, memo.cluster, memo.c
        gpu = cl.gpu
        tt, u = gemm_time(T, m.hidden_size, m.vocab_size / tp, gpu.bf16_tflops * 1e12,
                          gpu.hbm_bandwidth_gbs * 1e9, c, c.gemm_efficiency_max)
        link = group_link(cl, 1, tp, c)
        ar = 2 * collective_time("all_reduce", T * 4 * 3, tp, link.bw_gbs, link.latency)
        return (tt, u, ar)
    return memo.get("loss", (T, tp), make)


def stage_times(model: ModelSpec, cluster: ClusterSpec, L: Layouts, c: Constants, memo: Memo, S: Stages
                ) -> dict[str, np.ndarray]:
    """step_time.stage_times of every row: flat per-stage arrays of the StageTime fields."""
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
    first, inv = unique_rows([L.tp, L.cp, L.mbs, L.seq, L.ep, L.etp, L.sp, L.fp8, L.tp_overlap, codes,
                               np.where(per_m, m, 0)])
    units, utils = [], []
    for i in first:
        knobs = tuple(extras[i])
        key = (int(L.tp[i]), int(L.cp[i]), int(L.mbs[i]), int(L.seq[i]), int(L.ep[i]), int(L.etp[i]),
               bool(L.sp[i]), int(L.fp8[i]), bool(L.tp_overlap[i]), knobs,
               int(m[i]) if per_m[i] else 1)
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
    fp8_f, fp8_b = out["fp8_fwd_s"], out["fp8_bwd_s"]
    comm_f = out["tp_comm_s"] + out["cp_comm_s"] + out["ep_comm_s"]
    out["forward_s"] = gemm_f + attn_f + mb_f + fp8_f
    backward = 2 * gemm_f + c.attention_backward_factor * attn_f + 2 * mb_f + fp8_b
    out["gemm_s"] = 3 * gemm_f
    out["attention_s"] = attn_f * (1 + c.attention_backward_factor)
    mb = 3 * mb_f + fp8_f + fp8_b
    out["tp_comm_s"] = out["tp_comm_s"] * 2
    out["cp_comm_s"] = out["cp_comm_s"] * 2
    out["ep_comm_s"] = out["ep_comm_s"] * 2
    rc = L.recompute[r]
    recompute = np.where(rc == 2, gemm_f + attn_f + mb_f + fp8_f + comm_f, np.where(rc == 1, attn_f, 0.0))
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
        fw = out["forward_s"]
        fw[rows_last] = fw[rows_last] + tt
        backward[rows_last] = backward[rows_last] + 2 * tt
        util0[rows_last] = util0[rows_last] + tt * u
        util1[rows_last] = util1[rows_last] + tt
        mb[rows_last] = mb[rows_last] + 3 * Tl * model.vocab_size / tpl * loss_bytes_per_logit(model, c) / (hbm * c.hbm_efficiency)
        tpc = out["tp_comm_s"]
        tpc[rows_last] = tpc[rows_last] + ar
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
    if c.grad_accum_bytes_per_param > 0:
        params = stage_param_arrays(L, memo, S)
        acc = params[:, 0] * c.grad_accum_bytes_per_param / (hbm * c.hbm_efficiency)
        mb = mb + acc
        backward = backward + acc
    out["memory_bound_s"] = mb
    out["backward_s"] = backward
    with np.errstate(divide="ignore", invalid="ignore"):
        out["gemm_utilization"] = np.where(util1 != 0, util0 / util1, 0.0)
    return out


def _total(st: dict[str, np.ndarray]) -> np.ndarray:
    return (st["gemm_s"] + st["attention_s"] + st["memory_bound_s"] + st["recompute_s"] + st["tp_comm_s"]
            + st["cp_comm_s"] + st["ep_comm_s"] + st["pp_p2p_s"] + st["overhead_s"])


def at_clocks(full: dict[str, np.ndarray], x: np.ndarray, c: Constants) -> dict[str, np.ndarray]:
    """step_time.at_clocks with stage s at SM clock ratio x[s] (memory clock at its maximum)."""
    if np.all(x == 1.0):
        return full
    one = x == 1.0
    fc = c.gemm_clock_share / x + (1.0 - c.gemm_clock_share)
    s = c.memory_sm_clock_share
    fm = s / x + (1.0 - s) / 1.0
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
    put("fp8_fwd_s", full["fp8_fwd_s"] * fm)
    put("fp8_bwd_s", full["fp8_bwd_s"] * fm)
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
    """Per-stage DP traffic and optimizer terms that do not depend on the clocks."""

    grad: np.ndarray
    gather: np.ndarray
    opt_base: np.ndarray


def _coll(kind: str, nbytes, n, bw_gbs, lat):
    """step_time.collective_time on arrays."""
    n = np.asarray(n, float)
    bw = bw_gbs * 1e9
    with np.errstate(divide="ignore", invalid="ignore"):
        if kind == "all_reduce":
            v = 2.0 * (n - 1) / n * nbytes / bw + 2 * lat * (n - 1) ** 0.5
        else:
            v = (n - 1) / n * nbytes / bw + lat * (n - 1) ** 0.5
    return np.where((n <= 1) | (nbytes <= 0), 0.0, v)


def _group_link(cluster: ClusterSpec, stride, size, c: Constants):
    """step_time.group_link on arrays: (bandwidth GB/s, latency)."""
    gpn = cluster.domain_gpus
    stride, size = np.asarray(stride), np.asarray(size)
    span = stride * size
    intra = (size <= 1) | (span <= gpn)
    per_node = np.where(stride < gpn, np.maximum(1, np.minimum(size, gpn // np.maximum(stride, 1))), 1)
    bw = np.minimum(cluster.intra_node_bw_gbs, per_node * cluster.inter_node_bw_gbs)
    return (np.where(intra, cluster.intra_node_bw_gbs * c.nvlink_efficiency, bw * c.network_efficiency),
            np.where(intra, c.intra_latency_s, c.inter_latency_s))


def dp_terms(model: ModelSpec, cluster: ClusterSpec, L: Layouts, c: Constants, memo: Memo, S: Stages) -> DPTerms:
    r, k = S.row, S.k
    params = stage_param_arrays(L, memo, S)
    dense, experts = params[:, 0], params[:, 1]
    dbw, dlat = _group_link(cluster, L.tp * L.cp, L.dp, c)
    edp = L.expert_dp
    ebw, elat = _group_link(cluster, L.ep * L.etp, edp, c)
    dbw, dlat, ebw, elat, edp = dbw[r], dlat[r], ebw[r], elat[r], edp[r]
    d = (L.dp * L.cp)[r]
    gb = c.dp_grad_reduce_bytes
    dist = L.dist_opt[r]
    grad = np.where(dist, _coll("reduce_scatter", dense * gb, d, dbw, dlat) + _coll("reduce_scatter", experts * gb, edp, ebw, elat),
                    _coll("all_reduce", dense * gb, d, dbw, dlat) + _coll("all_reduce", experts * gb, edp, ebw, elat))
    gather = np.where(dist, _coll("all_gather", dense * 2, d, dbw, dlat) + _coll("all_gather", experts * 2, edp, ebw, elat),
                      0.0)
    shard = np.where(dist, dense / d + experts / edp, dense + experts)
    opt_base = shard * c.optimizer_bytes_per_param / (cluster.gpu.hbm_bandwidth_gbs * 1e9 * c.hbm_efficiency)
    return DPTerms(grad, gather, opt_base)


def step_time(L: Layouts, c: Constants, S: Stages, full: dict, at: dict, dp: DPTerms) -> dict[str, np.ndarray]:
    """step_time.step_time of every row from its stages at full clocks (`full`) and at the clocks
    held (`at`): per-row arrays of STEP_FIELDS plus 'totals' (per stage)."""
    r = S.row
    m = L.num_microbatches
    with np.errstate(divide="ignore", invalid="ignore"):
        mem_stretch = np.where(full["memory_bound_s"] != 0, at["memory_bound_s"] / full["memory_bound_s"], 1.0)
    totals = _total(at)
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
    opt = np.maximum(0.0, S.max(dp.opt_base * mem_stretch))
    total = pipeline + dp_exposed + opt + c.step_overhead_s
    return {"step_time_s": total, "pipeline_s": pipeline, "bubble_s": fill, "dp_comm_s": dp_total,
            "dp_exposed_s": dp_exposed, "optimizer_s": opt, "totals": totals, "slow": slow}
