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

from advisor.catalog.specs import MOE_KNOBS, QUANTS, ClusterSpec, ModelSpec, TrainConfig, quant_parts
from advisor.models.constants import DEFAULT, GIB, Constants
from advisor.models.memory import logits_bytes_per_logit
from advisor.models.power import STAGE_POWER_FIELDS
from advisor.models.quant import weight_copy_bytes
from advisor.models.step_time import ADDITIVE_TERMS, StageTime, loss_bytes_per_logit
from advisor.search_spaces.columns import RECOMPUTE_CODES, Layouts, extra_codes, unique_rows  # noqa: F401 (Layouts: API)

# StageTime fields that are sums over a stage's layers of one layer's forward costs (the ones
# step_time.stage_times adds up per layer kind), and every StageTime field after `stage`, in its
# order (a stage row is StageTime(stage, *row)); the StagePower fields the arrays hold (stage and
# the SM clock in MHz are derived when a row becomes a StagePower)
UNIT_FIELDS = ADDITIVE_TERMS
STAGE_FIELDS = tuple(f.name for f in dataclasses.fields(StageTime) if f.name != "stage")
STEP_FIELDS = ("step_time_s", "pipeline_s", "bubble_s", "dp_comm_s", "dp_exposed_s", "optimizer_s")
POWER_FIELDS = tuple(f for f in STAGE_POWER_FIELDS if f not in ("stage", "sm_clock_mhz"))


def _quant_fields(code) -> dict:
    """TrainConfig precision fields of a QUANTS code (the `fp8` column of Layouts)."""
    precision, recipe = quant_parts(int(code))
    return {"precision": precision, "fp8_recipe": recipe}


# ------------------------------------------------------------------------------------------------
# what is computed once per distinct value, by the reference functions
# ------------------------------------------------------------------------------------------------

def _kinds(model: ModelSpec) -> list[int]:
    from advisor.search_spaces.layout import kind_representatives

    return sorted(set(kind_representatives(model)))


class _Memo:
    """Per (model, cluster, constants): one layer's forward costs per layer shape and kind, a
    layer's activation bytes, the loss stage's output layer, a plan's per-stage counts."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, c: Constants):
        self.model, self.cluster, self.c = model, cluster, c
        self.kinds = _kinds(model)
        self.units: dict = {}
        self.acts: dict = {}
        self.loss: dict = {}
        self.plan_blocks: dict = {}
        self.flight: dict = {}
        self.params: dict = {}

    def unit(self, key) -> tuple[np.ndarray, np.ndarray]:
        """([K, len(UNIT_FIELDS)] one layer's forward costs per kind, [K, 2] GEMM utilisation sums)."""
        hit = self.units.get(key)
        if hit is None:
            from advisor.models.step_time import StageTime, layer_forward, group_link

            tp, cp, mbs, seq, ep, etp, sp, fp8, tpo, knobs, m = key
            cfg = TrainConfig(tp=tp, cp=cp, mbs=mbs, seq=seq, ep=ep, etp=etp, sequence_parallel=sp,
                              **_quant_fields(fp8), tp_comm_overlap=tpo, gbs=m * mbs,
                              **dict(zip(MOE_KNOBS, knobs)))
            cl, c = self.cluster, self.c
            links = (group_link(cl, 1, tp, c), group_link(cl, tp, cp, c), group_link(cl, etp, ep, c),
                     group_link(cl, 1, etp, c))
            vals = np.zeros((len(self.kinds), len(UNIT_FIELDS)))
            util = np.zeros((len(self.kinds), 2))
            for j, i in enumerate(self.kinds):
                one = StageTime(stage=0)
                u = [0.0, 0.0]
                layer_forward(self.model, i, cfg, cl, c, one, *links, u)
                vals[j] = [getattr(one, f) for f in UNIT_FIELDS]
                util[j] = u
            hit = self.units[key] = (vals, util)
        return hit

    def act(self, key) -> np.ndarray:
        """[K, 2]: a layer's activation bytes per kind with full recompute and without (memory.
        layer_activation_bytes: selective recompute stores what no recompute does)."""
        hit = self.acts.get(key)
        if hit is None:
            from advisor.models.memory import layer_activation_bytes

            tp, cp, mbs, seq, ep, etp, sp, fp8, (router, cf, pad) = key
            cfg = TrainConfig(tp=tp, cp=cp, mbs=mbs, seq=seq, ep=ep, etp=etp, sequence_parallel=sp,
                              **_quant_fields(fp8), moe_router=router, moe_capacity_factor=cf,
                              moe_pad_to_capacity=pad)
            hit = self.acts[key] = np.array([[layer_activation_bytes(self.model, i, cfg, self.c, "full"),
                                              layer_activation_bytes(self.model, i, cfg, self.c, "none")]
                                             for i in self.kinds])
        return hit

    def loss_terms(self, T: float, tp: int) -> tuple[float, float, float]:
        """The output layer's GEMM (seconds, achieved fraction) and the loss's TP all-reduce."""
        hit = self.loss.get((T, tp))
        if hit is None:
            from advisor.models.step_time import collective_time, gemm_time, group_link

            m, cl, c = self.model, self.cluster, self.c
            gpu = cl.gpu
            tt, u = gemm_time(T, m.hidden_size, m.vocab_size / tp, gpu.bf16_tflops * 1e12,
                              gpu.hbm_bandwidth_gbs * 1e9, c, c.gemm_efficiency_max)
            link = group_link(cl, 1, tp, c)
            ar = 2 * collective_time("all_reduce", T * 4 * 3, tp, link.bw_gbs, link.latency)
            hit = self.loss[(T, tp)] = (tt, u, ar)
        return hit

    def counts(self, plan) -> np.ndarray:
        """[pp, K] layers of each kind per rank of a plan."""
        hit = self.plan_blocks.get(plan)
        if hit is None:
            from advisor.search_spaces.layout import rank_kinds

            pos = {i: j for j, i in enumerate(self.kinds)}
            hit = np.zeros((plan.pp, len(self.kinds)))
            for r, kinds in enumerate(rank_kinds(self.model, plan)):
                for i, n in kinds.items():
                    hit[r, pos[i]] = n
            self.plan_blocks[plan] = hit
        return hit

    def in_flight(self, plan, m: int) -> np.ndarray:
        """[pp, K] layer-microbatches of each kind in flight per rank (memory.in_flight_layers)."""
        hit = self.flight.get((plan, m))
        if hit is None:
            from advisor.search_spaces.layout import in_flight_layers

            pos = {i: j for j, i in enumerate(self.kinds)}
            hit = np.zeros((plan.pp, len(self.kinds)))
            for r, w in enumerate(in_flight_layers(self.model, plan, m)):
                for i, n in w.items():
                    hit[r, pos[i]] = n
            self.flight[(plan, m)] = hit
        return hit

    def plan_params(self, plan, tp: int, ep_etp: int) -> np.ndarray:
        """[pp, 3] (dense, expert, linear) parameters per rank (memory.plan_params)."""
        hit = self.params.get((plan, tp, ep_etp))
        if hit is None:
            from advisor.models.memory import plan_params

            hit = self.params[(plan, tp, ep_etp)] = np.array(plan_params(self.model, plan, tp, ep_etp), float)
        return hit


_MEMOS: dict = {}


def memo_for(model: ModelSpec, cluster: ClusterSpec, c: Constants) -> _Memo:
    key = (id(model), id(cluster), id(c))
    hit = _MEMOS.get(key)
    if hit is None or hit.model is not model or hit.cluster is not cluster or hit.c is not c:
        if len(_MEMOS) > 64:
            _MEMOS.clear()
        hit = _MEMOS[key] = _Memo(model, cluster, c)
    return hit


def _gather_blocks(cols: Sequence[np.ndarray], block_of, S: "Stages") -> np.ndarray:
    """Flat per-stage rows of per-key [pp, ...] blocks: the rows with the same values in `cols`
    share the block `block_of(r)` of their first row r; stage s of row r gets its row k."""
    first, inv = unique_rows(cols)
    blocks = [block_of(int(r)) for r in first]
    sizes = np.array([len(b) for b in blocks], np.int64)
    off = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    flat = np.concatenate(blocks, axis=0)
    return flat[off[inv[S.row]] + S.k]


# ------------------------------------------------------------------------------------------------
# memory
# ------------------------------------------------------------------------------------------------

def peak_memory_gib(model: ModelSpec, L: Layouts, c: Constants = DEFAULT, cluster: ClusterSpec | None = None
                    ) -> np.ndarray:
    """memory.peak_memory_gib of every row: the fullest stage's memory per GPU."""
    st = Stages(L)
    memo = memo_for(model, cluster, c)
    return memory_arrays(model, L, c, memo, st)[0]


def memory_arrays(model: ModelSpec, L: Layouts, c: Constants, memo: _Memo, S: "Stages") -> tuple[np.ndarray, np.ndarray]:
    """(peak GiB per row, per-stage peak bytes (without the runtime overhead))."""
    m = L.num_microbatches
    r, k = S.row, S.k
    routers = [(e[2], e[3], e[4]) for e in L.extras]  # router, capacity factor, padding
    first, inv = unique_rows([L.tp, L.cp, L.mbs, L.seq, L.ep, L.etp, L.sp, L.fp8, extra_codes(L, routers)])
    per_key = np.stack([memo.act((int(L.tp[i]), int(L.cp[i]), int(L.mbs[i]), int(L.seq[i]), int(L.ep[i]),
                                  int(L.etp[i]), bool(L.sp[i]), int(L.fp8[i]), routers[i])) for i in first])
    key = inv[r]
    K = per_key.shape[1]
    full = (L.recompute == RECOMPUTE_CODES["full"])[r]
    # a layer's bytes per kind, per stage, with the stage's recompute mode
    lb0 = [np.where(full, per_key[:, j, 0][key], per_key[:, j, 1][key]) for j in range(K)]
    plans = L.plans
    params = _params(L, memo, S)
    flight = _gather_blocks([L.plan, m], lambda i: memo.in_flight(plans[L.plan[i]], int(m[i])), S)
    counts = S.counts(memo)
    dense, experts, linear = params[:, 0], params[:, 1], params[:, 2]
    fp8_copy = np.array([weight_copy_bytes(q, c) for q in range(len(QUANTS))])[L.fp8][r]
    d = (L.dp * L.cp)[r]
    edp = L.expert_dp[r]
    total = dense + experts
    shard = np.where(L.dist_opt[r], dense / d + experts / edp, total)
    opt = c.bytes_optimizer * shard
    transient = c.bytes_optimizer_transient * shard
    acts = np.zeros(len(r))
    for j in range(K):
        acts = acts + flight[:, j] * lb0[j]
    if full.any():  # the recompute working set: the largest layer of the stage without recompute
        work = np.full(len(r), -np.inf)
        for j in range(K):
            work = np.where(counts[:, j] > 0, np.maximum(work, per_key[:, j, 1][key]), work)
        acts = np.where(full & np.isfinite(work), acts + np.where(np.isfinite(work), work, 0.0), acts)
    last = k == L.pp[r] - 1
    T = (L.seq / L.cp * L.mbs)[r]
    logits = np.where(last, T * model.vocab_size / L.tp[r] * logits_bytes_per_logit(model, c), 0.0)
    weights = total * c.bytes_weight + linear * fp8_copy
    grads = total * c.bytes_grad
    f = 1.0 + c.fragmentation
    stage_bytes = weights + grads + opt + np.maximum(acts * f, transient) + logits * f
    peak = np.maximum.reduceat(stage_bytes, S.start) / GIB + c.runtime_overhead_gib
    # memory.StageMemory's fields, and its total_gib (what a Prediction prints and decides feasibility by)
    parts = {"weights_gib": weights / GIB, "grads_gib": grads / GIB, "optimizer_gib": opt / GIB,
             "activations_gib": acts * f / GIB, "logits_gib": logits * f / GIB,
             "step_transient_gib": np.maximum(0.0, transient - acts * f) / GIB}
    total_gib = (parts["weights_gib"] + parts["grads_gib"] + parts["optimizer_gib"] + parts["activations_gib"]
                 + parts["logits_gib"] + c.runtime_overhead_gib + parts["step_transient_gib"])
    S.cache["memory"] = (parts, total, counts.sum(axis=1))
    return peak, total_gib


# ------------------------------------------------------------------------------------------------
# stage times
# ------------------------------------------------------------------------------------------------

def _params(L: Layouts, memo: _Memo, S: "Stages") -> np.ndarray:
    """[S, 3] (dense, expert, linear) parameters of every stage (memory.plan_params)."""
    hit = S.cache.get("params")
    if hit is None:  # memory._stage_params, term by term
        from advisor.models.flops import embedding_params, layer_params, output_params

        model = L.model
        r, k = S.row, S.k
        tp = L.tp[r].astype(float)
        ee = (L.ep * L.etp)[r].astype(float)
        counts = S.counts(memo)
        dense = np.zeros(S.total)
        experts = np.zeros(S.total)
        linear = np.zeros(S.total)
        for j, i in enumerate(memo.kinds):
            lp = layer_params(model, i)
            n = counts[:, j]
            sharded = float(lp.attention + lp.dense_mlp + lp.shared_experts)
            dense = dense + n * (sharded / tp + lp.router + lp.norms)
            experts = experts + n * float(lp.experts) / ee
            linear = linear + n * (sharded / tp + lp.experts / ee)
        dense = np.where(k == 0, dense + embedding_params(model) / tp, dense)
        last = k == L.pp[r] - 1
        dense = np.where(last, dense + output_params(model) / tp, dense)
        if model.tied_embeddings:  # Megatron keeps a copy of the word embeddings on the last stage
            dense = np.where(last & (L.pp[r] > 1), dense + model.vocab_size * model.hidden_size / tp, dense)
        hit = S.cache["params"] = np.stack([dense, experts, linear], 1)
    return hit


class Stages:
    """Flat (row, stage) indexing of a Layouts."""

    def __init__(self, L: Layouts):
        self.L = L
        self.n = len(L)
        self.start = np.concatenate([[0], np.cumsum(L.pp)[:-1]]).astype(np.int64)
        self.total = int(L.pp.sum())
        self.row = np.repeat(np.arange(self.n), L.pp)
        self.k = np.arange(self.total) - self.start[self.row]
        self._counts = None
        self.cache: dict = {}

    def counts(self, memo: _Memo) -> np.ndarray:
        if self._counts is None:
            plans = self.L.plans
            self._counts = _gather_blocks([self.L.plan], lambda i: memo.counts(plans[self.L.plan[i]]), self)
        return self._counts

    def max(self, v: np.ndarray) -> np.ndarray:
        return np.maximum.reduceat(v, self.start)

    def sum(self, v: np.ndarray) -> np.ndarray:
        return np.add.reduceat(v, self.start)

    def argmax(self, v: np.ndarray) -> np.ndarray:
        """Each row's first stage with its maximum (as Python's max(key=...) picks it): stage index."""
        top = self.max(v)[self.row]
        hit = np.where(v == top, self.k, np.iinfo(np.int64).max)
        return np.minimum.reduceat(hit, self.start)


def stage_times(model: ModelSpec, cluster: ClusterSpec, L: Layouts, c: Constants, memo: _Memo, S: Stages
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
        u, ut = memo.unit(key)
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
        terms = np.array([memo.loss_terms(float(a), int(b)) for a, b in pairs])[pinv.reshape(-1)]
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
        params = _params(L, memo, S)
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


def dp_terms(model: ModelSpec, cluster: ClusterSpec, L: Layouts, c: Constants, memo: _Memo, S: Stages) -> DPTerms:
    r, k = S.row, S.k
    params = _params(L, memo, S)
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
