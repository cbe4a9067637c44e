"""The analytical model on arrays of layouts: memory, stage times (dense and MoE), the step at the
clocks the caps hold, and the power / DVFS fixed point, one numpy pass per term over every layout
(and every pipeline stage of every layout) at once.

The per-layout functions (models/memory.py, step_time.py, moe.py, power.py, dvfs.py, predict.py)
are the readable reference; this module follows them term by term, in the same order of floating
point operations where it can, and tests/test_vectorized.py holds both to 1e-9 (relative) on
whole layout spaces. What does not depend on the pipeline split (one transformer layer's forward
costs for a given TP / CP / micro-batch / EP shape, a layer's activation bytes, a plan's
parameters per stage, the layers in flight) is computed once per distinct value by the reference
functions themselves and gathered; everything per layout and per stage is arrays.

Layout of the arrays: `Layouts` holds one row per layout; stage arrays are flat, the stages of
row r at `start[r] : start[r] + pp[r]` (ragged; segment reductions with numpy's reduceat).

    res = evaluate(model, cluster, Layouts.of(cfgs), constants)
    res.tokens_per_s_per_gpu, res.energy_j_per_token, res.throttle_risk   # arrays, one per layout
    res.prediction(i)                                                     # the Prediction of row i
"""
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


def _memo(model: ModelSpec, cluster: ClusterSpec, c: Constants) -> _Memo:
    key = (id(model), id(cluster), id(c))
    hit = _MEMOS.get(key)
    if hit is None or hit.model is not model or hit.cluster is not cluster or hit.c is not c:
        if len(_MEMOS) > 64:
            _MEMOS.clear()
        hit = _MEMOS[key] = _Memo(model, cluster, c)
    return hit


def _gather_blocks(cols: Sequence[np.ndarray], block_of, S: "_Stages") -> np.ndarray:
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
    st = _Stages(L)
    memo = _memo(model, cluster, c)
    return _memory(model, L, c, memo, st)[0]


def _memory(model: ModelSpec, L: Layouts, c: Constants, memo: _Memo, S: "_Stages") -> tuple[np.ndarray, np.ndarray]:
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

def _params(L: Layouts, memo: _Memo, S: "_Stages") -> np.ndarray:
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


class _Stages:
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


def stage_times(model: ModelSpec, cluster: ClusterSpec, L: Layouts, c: Constants, memo: _Memo, S: _Stages
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
class _DP:
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


def _dp_terms(model: ModelSpec, cluster: ClusterSpec, L: Layouts, c: Constants, memo: _Memo, S: _Stages) -> _DP:
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
    return _DP(grad, gather, opt_base)


def step_time(L: Layouts, c: Constants, S: _Stages, full: dict, at: dict, dp: _DP) -> dict[str, np.ndarray]:
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


# ------------------------------------------------------------------------------------------------
# power
# ------------------------------------------------------------------------------------------------

def _voltage(x, c: Constants):
    return np.maximum(c.vf_min_voltage, 1.0 - c.vf_slope * (1.0 - x))


class _Load:
    """dvfs.Load on arrays."""

    __slots__ = ("t1", "t0", "switch", "hbm1", "hbm0", "wait_s", "gap_s")

    def __init__(self, t1, t0, switch, hbm1, hbm0, wait_s, gap_s):
        self.t1, self.t0, self.switch, self.hbm1, self.hbm0, self.wait_s, self.gap_s = t1, t0, switch, hbm1, hbm0, wait_s, gap_s

    def seconds(self, x):
        return self.t1 / x + self.t0 + self.wait_s + self.gap_s

    def power(self, x, idle, span, c: Constants, ps):
        """(evaluate runs under np.errstate(divide="ignore", invalid="ignore"): a stage with no
        time at all takes the t <= 0 branch of dvfs.Load.power.)"""
        t = self.seconds(x)
        v2 = _voltage(x, c) ** 2
        e = (c.clock_power * x * t + self.switch + c.wait_power * self.wait_s) * v2 * ps
        e = e + (self.hbm1 / x + self.hbm0)
        busy = idle + span * e / t
        empty = t <= 0
        if np.any(empty):
            return np.where(empty, idle + span * c.clock_power * x * _voltage(x, c) ** 2 * ps, busy)
        return busy


def _phase_sums(phases, c: Constants):
    """dvfs.Load.of's sums over phases given as (kind, seconds, (switch, hbm)) with arrays."""
    t1 = t0 = sw = h1 = h0 = 0.0
    for kind, sec, (w, hbm) in phases:
        share = c.gemm_clock_share if kind in ("gemm", "attention") else (
            c.memory_sm_clock_share if kind == "memory" else 0.0)
        t1 = t1 + sec * share
        t0 = t0 + sec * (1.0 - share)
        sw = sw + sec * w
        h1 = h1 + sec * share * hbm
        h0 = h0 + sec * (1.0 - share) * hbm
    return t1, t0, sw, h1, h0


def _lw(length, c: Constants):
    """dvfs.limiter_weight on arrays."""
    return c.limiter_window_s / (c.limiter_window_s + np.maximum(length, 0.0))


def _solve(load: _Load, cap, idle, span, c: Constants, ps):
    """dvfs.solve_load on arrays: (x, demand, capped). The regula falsi runs on the stages still
    unsolved; each keeps its own iterations and stopping rule."""
    demand = load.power(1.0, idle, span, c, ps)
    capped = demand > cap
    lo_x = c.min_clock_ratio
    p_lo = load.power(np.full_like(demand, lo_x), idle, span, c, ps)
    x = np.where(capped, lo_x, 1.0)
    idx = np.flatnonzero(capped & (p_lo < cap))
    if not len(idx):
        return x, demand, capped
    parts = [v[idx] if isinstance(v, np.ndarray) else v for v in
             (load.t1, load.t0, load.switch, load.hbm1, load.hbm0, load.wait_s, load.gap_s)]
    capv = cap[idx]
    psv = ps[idx] if isinstance(ps, np.ndarray) else ps
    lo = np.full(len(idx), lo_x)
    hi = np.ones(len(idx))
    f_lo = p_lo[idx] - capv
    f_hi = demand[idx] - capv
    side = np.zeros(len(idx), np.int8)
    for _ in range(60):
        mid = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
        f = _Load(*parts).power(mid, idle, span, c, psv) - capv
        up = f > 0
        # f > 0: hi = mid, and f_lo halves when the step before also moved hi (Illinois)
        f_lo = np.where(up, np.where(side == 1, f_lo / 2, f_lo), f)
        f_hi = np.where(up, f, np.where(side == -1, f_hi / 2, f_hi))
        hi = np.where(up, mid, hi)
        lo = np.where(up, lo, mid)
        side = np.where(up, 1, -1).astype(np.int8)
        done = (hi - lo < 1e-7) | (np.abs(f) < 1e-6)
        if done.any():
            x[idx[done]] = lo[done]
            keep = ~done
            if not keep.any():
                break
            idx, lo, hi, f_lo, f_hi, side, capv = idx[keep], lo[keep], hi[keep], f_lo[keep], f_hi[keep], side[keep], capv[keep]
            parts = [v[keep] if isinstance(v, np.ndarray) else v for v in parts]
            psv = psv[keep] if isinstance(psv, np.ndarray) else psv
    else:
        x[idx] = lo
    return x, demand, capped


@dataclass
class Result:
    """What `evaluate` computed, per row (1-d arrays) and per stage (flat arrays, see _Stages)."""

    model: ModelSpec
    cluster: ClusterSpec
    layouts: Layouts
    constants: Constants
    stages: _Stages
    full: dict             # StageTime fields at the maximum clocks, per stage
    base: dict             # STEP_FIELDS at the maximum clocks, per row
    at: dict               # StageTime fields at the clocks held, per stage
    step: dict             # STEP_FIELDS at the clocks held (with extra), per row
    power: dict            # POWER_FIELDS per stage
    x: np.ndarray          # clock ratio per stage
    extra: np.ndarray      # per row
    row: dict              # per-row results (tokens_per_s_per_gpu, energy_j_per_token, throttle_risk, ...)
    peak_gib: np.ndarray   # memory.peak_memory_gib per row

    def __getattr__(self, name):
        row = self.__dict__.get("row")
        if row is not None and name in row:
            return row[name]
        raise AttributeError(name)

    def step_objects(self, i: int):
        """(StepTime at the maximum clocks, StepTime at the clocks held) of row i, as the
        reference builds them."""
        from advisor.models.step_time import StageTime, StepTime

        s0 = int(self.stages.start[i])
        pp = int(self.layouts.pp[i])
        m = int(self.layouts.num_microbatches[i])
        mats = self.__dict__.setdefault("_mats", {})

        def stages(d):
            mat = mats.get(id(d))
            if mat is None:  # StageTime's fields after `stage`, in its order (STAGE_FIELDS)
                mat = mats[id(d)] = np.stack([d[f] for f in STAGE_FIELDS], 1)
            return [StageTime(k, *vals) for k, vals in enumerate(mat[s0:s0 + pp].tolist())]

        def step(d, sts):
            return StepTime(**{f: float(d[f][i]) for f in STEP_FIELDS}, overhead_s=self.constants.step_overhead_s,
                            stages=sts, num_microbatches=m)

        return step(self.base, stages(self.full)), step(self.step, stages(self.at))

    def power_estimate(self, i: int, cluster: ClusterSpec | None = None):
        """The models.power.PowerEstimate of row i (the reference's aggregate of its stages);
        `cluster`: the cluster with the cap row i was evaluated at, when that is not the cluster's."""
        from advisor.models.power import StagePower, aggregate

        memo = self.__dict__.setdefault("_estimates", {})
        hit = memo.get((i, id(cluster)))
        if hit is not None and hit[0] is cluster:
            return hit[1]
        base, st = self.step_objects(i)
        s0 = int(self.stages.start[i])
        pp = int(self.layouts.pp[i])
        gpu = self.cluster.gpu
        mat = self.__dict__.get("_power_mat")
        if mat is None:
            mat = self.__dict__["_power_mat"] = np.stack(
                [self.power[f].astype(float) for f in ("power_cap_w", "demand_w", "busy_power_w", "mean_power_w",
                                                       "peak_power_w", "throttled", "busy_s", "energy_j", "spiking",
                                                       "stretch_demand_w")] + [self.x], 1)
        per = []
        for k, (cap, demand, busy_w, mean, peak, thr, busy_s, e, spk, sd, x) in enumerate(mat[s0:s0 + pp].tolist()):
            per.append(StagePower(
                stage=k, power_cap_w=cap, clock_ratio=x,
                sm_clock_mhz=gpu.max_sm_clock_mhz * x if gpu.max_sm_clock_mhz else None,
                demand_w=demand, busy_power_w=busy_w, mean_power_w=mean, peak_power_w=peak, throttled=thr != 0.0,
                busy_s=busy_s, energy_j=e, spiking=spk != 0.0, stretch_demand_w=sd))
        cfg = self.layouts.config(i)
        cl = cluster or self.cluster
        out = aggregate(cl, cfg, self.constants, per, st, base, [p.clock_ratio for p in per], float(self.extra[i])), base
        memo[(i, id(cluster))] = (cluster, out)
        return out

    def prediction(self, i: int, cluster: ClusterSpec | None = None):
        """The models.predict.Prediction of row i (memory per stage from the reference: cheap);
        `cluster` as for power_estimate."""
        from advisor.models.memory import stage_memory
        from advisor.models.predict import assemble

        cfg = self.layouts.config(i)
        power, base = self.power_estimate(i, cluster)
        return assemble(self.model, cluster or self.cluster, cfg, self.constants, self.stage_memory(i), base, power)

    def stage_memory(self, i: int) -> list:
        """memory.stage_memory of row i (from the arrays when memory was evaluated)."""
        from advisor.models.memory import StageMemory, stage_memory

        got = self.stages.cache.get("memory")
        if got is None:
            return stage_memory(self.model, self.layouts.config(i), self.constants)
        parts, params, layers = got
        mat = self.__dict__.get("_mem_mat")
        if mat is None:
            mat = self.__dict__["_mem_mat"] = np.stack(
                [layers, params] + [parts[k] for k in ("weights_gib", "grads_gib", "optimizer_gib", "activations_gib",
                                                       "logits_gib", "step_transient_gib")], 1)
        s0 = int(self.stages.start[i])
        over = self.constants.runtime_overhead_gib
        return [StageMemory(stage=k, layers=int(n), params=int(p), weights_gib=w, grads_gib=g, optimizer_gib=o,
                            activations_gib=a, logits_gib=lg, overhead_gib=over, step_transient_gib=t)
                for k, (n, p, w, g, o, a, lg, t) in enumerate(mat[s0:s0 + int(self.layouts.pp[i])].tolist())]


class _FixedPoint:
    """The clock fixed point of models.power.estimate_power on arrays: each round every stage's
    clock is solved at the step of the round before (stage_pass), the step taken again at those
    clocks (at_x), until a row's clocks move less than 2e-4 (at most 12 rounds, per row as the
    reference). Once fewer than half of the rows still move, the rounds go on with those rows
    alone (each row's rounds depend on its own numbers only)."""

    def __init__(self, L, S, c, full, base, dp, cap, extra, busy, idle, span, ps):
        self.L, self.S, self.c = L, S, c
        self.full, self.base, self.dp, self.cap, self.extra, self.busy = full, base, dp, cap, extra, busy
        self.idle, self.span, self.ps = idle, span, ps
        self.mf = L.num_microbatches[S.row]
        self.extra_s = extra[S.row]

    def sub(self, rows: np.ndarray) -> "_FixedPoint":
        L = self.L.take(rows)
        S = _Stages(L)
        mask = np.zeros(len(self.L), bool)
        mask[rows] = True
        sm = mask[self.S.row]
        full = {k: v[sm] for k, v in self.full.items()}
        base = {k: (v[sm] if k == "totals" else v[rows]) for k, v in self.base.items()}
        dp = _DP(self.dp.grad[sm], self.dp.gather[sm], self.dp.opt_base[sm])
        busy = [(kd, sec[sm], tuple(w[sm] if isinstance(w, np.ndarray) else w for w in ws))
                for kd, sec, ws in self.busy]
        return _FixedPoint(L, S, self.c, full, base, dp, self.cap[sm], self.extra[rows], busy, self.idle,
                           self.span, self.ps)

    def at_x(self, x):
        at = at_clocks(self.full, x, self.c)
        if at is self.full:
            st = dict(self.base)
        else:
            st = step_time(self.L, self.c, self.S, self.full, at, self.dp)
        st = dict(st)
        st["step_time_s"] = np.where(self.extra != 0, st["step_time_s"] + self.extra, st["step_time_s"])
        return at, st

    def stage_pass(self, at, st, clock=None):
        c, S, r, mf, full, extra_s = self.c, self.S, self.S.row, self.mf, self.full, self.extra_s
        b = c.memory_power_bandwidth
        step_r = st["step_time_s"][r]
        dp_exp = st["dp_exposed_s"][r]
        opt = st["optimizer_s"][r]
        end = [("comm", dp_exp, (c.comm_power, 0.0)), ("memory", opt, (c.memory_sm_power * b, c.memory_hbm_power * b))]
        seen = [(kd, s * _lw(s, c), w) for kd, s, w in end]
        own = st["totals"]
        slow = st["slow"][r]
        fill = np.maximum(0.0, st["pipeline_s"][r] - mf * slow)
        so = np.full(S.total, c.step_overhead_s)
        wait_s = 0.0
        for length, weight in ((mf * (slow - own), _lw(slow - own, c)), (fill, _lw(fill / 2, c)), (so, _lw(so, c))):
            wait_s = wait_s + np.where(length > 0, length * weight, 0.0)
        g1 = mf * full["overhead_s"] + np.minimum(0.0, extra_s)
        gap_s = np.where(g1 > 0, g1 * 1.0, 0.0)
        gap_s = gap_s + np.where(extra_s > 0, extra_s * _lw(extra_s / mf, c), 0.0)
        gap_len = np.where(g1 > 0, g1, 0.0) + np.where(extra_s > 0, extra_s, 0.0)
        t1, t0, sw, h1, h0 = _phase_sums(self.busy + seen, c)
        load = _Load(t1, t0, sw, h1, h0, wait_s, gap_s)
        xs, demand, capped = _solve(load, self.cap, self.idle, self.span, c, self.ps)
        if clock is not None:
            xs = clock
        return load, xs, demand, capped, end, gap_len, step_r

    def solve(self, x=None, rounds: int = 12):
        """(clock ratio per stage, stages at those clocks, step at them) after the rounds."""
        S, r = self.S, self.S.row
        x = np.ones(S.total) if x is None else x
        at, st = self.at_x(x)
        active = np.ones(S.n, bool)
        for i in range(rounds):
            new = self.stage_pass(at, st)[1]
            done = S.max(np.abs(new - x)) < 2e-4
            x = np.where(active[r], new, x)
            active &= ~done
            if not active.any():
                return x, *self.at_x(x)
            if i + 1 < rounds and S.n >= 64 and 2 * active.sum() < S.n:
                rows = np.flatnonzero(active)
                sm = active[r]
                xs, _, _ = self.sub(rows).solve(x[sm], rounds - i - 1)
                x = x.copy()
                x[sm] = xs
                return x, *self.at_x(x)
            at, st = self.at_x(x)
        return x, at, st


def evaluate(model: ModelSpec, cluster: ClusterSpec, L: Layouts, c: Constants = DEFAULT,
             caps: float | np.ndarray | None = None, stage_caps: np.ndarray | None = None,
             extra_wait_s: np.ndarray | float = 0.0, memory: bool = True) -> Result:
    """predict() of every row of `L` on `cluster` as arrays: memory, stage times, the step and the
    power fixed point (models.power.estimate_power) under `caps` (per GPU: one number, one per row,
    or `stage_caps`, one per stage in the flat order; default the cluster's cap). Divisions by
    zero take the reference's branches (np.where), so numpy's warnings about them are off."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return _evaluate(model, cluster, L, c, caps, stage_caps, extra_wait_s, memory)


def _evaluate(model, cluster, L, c, caps, stage_caps, extra_wait_s, memory) -> Result:
    gpu = cluster.gpu
    S = _Stages(L)
    memo = _memo(model, cluster, c)
    r = S.row
    n = len(L)
    if stage_caps is not None:
        cap = np.asarray(stage_caps, float)
    elif caps is None:
        cap = np.full(S.total, float(cluster.power_cap_w))
    else:
        cap = np.broadcast_to(np.asarray(caps, float), (n,))[r].copy()
    for v in set(cap.tolist()):  # (np.unique without indices would import numpy.ma: 30 ms cold)
        gpu.check_power_cap(float(v))
    m = L.num_microbatches
    mf = m[r]
    full = stage_times(model, cluster, L, c, memo, S)
    dp = _dp_terms(model, cluster, L, c, memo, S)
    base = step_time(L, c, S, full, full, dp)
    fp8 = L.fp8[r]
    idle, span = gpu.idle_w, gpu.tdp_w - gpu.idle_w
    ps = 1.0
    # busy phases (power.busy_phases): their Load sums do not depend on the clocks
    u = full["gemm_utilization"]
    wg = c.gemm_power * np.maximum(u, 0.0) ** c.gemm_power_exponent * np.where(fp8 != 0, c.fp8_gemm_power, 1.0)
    b = c.memory_power_bandwidth
    comm = full["tp_comm_s"] + full["cp_comm_s"] + full["ep_comm_s"] + full["pp_p2p_s"]
    busy = [("gemm", (full["gemm_s"] + full["recompute_s"]) * mf, (wg, 0.0)),
            ("attention", full["attention_s"] * mf, (c.attention_power, 0.0)),
            ("memory", full["memory_bound_s"] * mf, (c.memory_sm_power * b, c.memory_hbm_power * b)),
            ("comm", comm * mf, (c.comm_power, 0.0))]
    mb_sums = _phase_sums(busy, c)
    mb_load = _Load(*mb_sums, 0.0, 0.0)
    overhead = full["overhead_s"]
    min_over = np.minimum.reduceat(overhead, S.start)
    extra = np.maximum(-(m * min_over), np.broadcast_to(np.asarray(extra_wait_s, float), (n,)))
    extra_s = extra[r]

    fp = _FixedPoint(L, S, c, full, base, dp, cap, extra, busy, idle, span, ps)
    x, at, st = fp.solve()
    load, x, demand, capped, end, gap_len, step_r = fp.stage_pass(at, st, clock=x)
    work_sums = _phase_sums(busy + end, c)
    work = _Load(*work_sums, 0.0, 0.0)
    busy_s = work.seconds(x)
    step_s = np.maximum(step_r, busy_s + gap_len)
    idle_load = _Load(0.0, 0.0, 0.0, 0.0, 0.0, step_s - busy_s - gap_len, gap_len)
    e = work.power(x, idle, span, c, ps) * busy_s + idle_load.power(x, idle, span, c, ps) * idle_load.seconds(x)
    # the mean EP rank's energy (power.stage_power): the busiest rank's extra expert work at wait power
    spare = [("gemm", full["moe_ep_idle_compute_s"] * mf, (wg, 0.0)),
             ("memory", full["moe_ep_idle_memory_s"] * mf, (c.memory_sm_power * b, c.memory_hbm_power * b))]
    spare_load = _Load(*_phase_sums(spare, c), 0.0, 0.0)
    spare_s = spare_load.seconds(x)
    if np.any(spare_s > 0):
        p_wait = _Load(0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0).power(x, idle, span, c, ps)
        with np.errstate(divide="ignore", invalid="ignore"):
            p_spare = spare_load.power(x, idle, span, c, ps)
        e = np.where(spare_s > 0, e - spare_s * (p_spare - p_wait), e)

    def stretch_power(xx):
        v = mb_load.power(xx, idle, span, c, ps)
        v2 = _voltage(xx, c) ** 2
        for kd, sec, (w, hbm) in end:
            stretch = 1.0 if kd == "comm" else c.memory_sm_clock_share / xx + (1.0 - c.memory_sm_clock_share) / 1.0
            p = idle + span * ((c.clock_power * xx + w / stretch) * v2 * ps + hbm)
            v = np.where(sec > 0, np.maximum(v, p), v)
        return v

    phase_peak = stretch_power(x)
    stretch_demand = stretch_power(np.ones(S.total))
    power = {"power_cap_w": cap, "clock_ratio": x, "demand_w": demand, "busy_power_w": load.power(x, idle, span, c, ps),
             "mean_power_w": e / step_s, "peak_power_w": phase_peak * np.where(capped, 1.0 + c.peak_overshoot, c.power_ripple),
             "throttled": capped, "busy_s": busy_s, "energy_j": e, "spiking": stretch_demand > cap,
             "stretch_demand_w": stretch_demand}
    # aggregate (power.aggregate)
    pp = L.pp
    gps = cluster.world_size / pp
    energy = S.sum(e) * gps
    step = st["step_time_s"]
    mean = energy / gps / pp / step
    crit = S.argmax(st["totals"]) + S.start
    hot = S.argmax(power["mean_power_w"]) + S.start
    busiest = S.argmax(demand) + S.start
    demand_peak = S.max(stretch_demand)
    slowdown = (step - extra) / base["step_time_s"]
    temp = c.idle_temp_c + c.c_per_w * (power["mean_power_w"][hot] - gpu.idle_w)
    bcap = cap[busiest]
    sustained = (slowdown > 1.0 + 1e-6) | capped[busiest]
    r_sus = np.minimum(1.0, c.throttle_risk_sustained_base + (slowdown - 1.0) * c.throttle_risk_per_slowdown)
    r_spike = c.throttle_risk_spike_base + c.throttle_risk_spike_span * np.minimum(
        1.0, (demand_peak - bcap) / (c.throttle_spike_full_excess * bcap))
    r_low = c.throttle_risk_low_span * np.maximum(0.0, (demand_peak - c.throttle_low_start * bcap)
                                                  / (c.throttle_low_range * bcap))
    r_power = np.where(sustained, r_sus, np.where(demand_peak > bcap, r_spike, r_low))
    limit = gpu.slowdown_temp_c
    r_thermal = np.maximum(0.0, np.minimum(1.0, (temp - (limit - c.thermal_margin_c)) / c.thermal_margin_c))
    risk = np.maximum(r_power, r_thermal)
    tokens = L.gbs * L.seq
    world = cluster.world_size
    tps = tokens / step / world
    from advisor.models.flops import training_flops_per_token

    seqs, sinv = np.unique(L.seq, return_inverse=True)
    flops = np.array([training_flops_per_token(model, int(s)) for s in seqs])[sinv.reshape(-1)]
    tflops = tps * flops / 1e12
    rowd = {"tokens_per_s_per_gpu": tps, "step_time_s": step, "energy_j_per_step": energy,
            "energy_j_per_token": energy / tokens, "mean_power_w": mean, "throttle_risk": risk,
            "peak_power_w": S.max(power["peak_power_w"]), "clock_ratio": x[crit],
            "sm_clock_mhz": x[crit] * gpu.max_sm_clock_mhz if gpu.max_sm_clock_mhz else np.full(n, np.nan),
            "slowdown": slowdown, "throttle_fraction": S.sum((capped | power["spiking"]).astype(float)) / pp,
            "steady_temp_c": temp, "tflops_per_gpu": tflops, "mfu": tflops / gpu.bf16_tflops,
            "demand_mean_w": demand[busiest], "demand_peak_w": demand_peak}
    if memory:
        peak, total_gib = _memory(model, L, c, memo, S)
        rowd["memory_gib_per_gpu"] = S.max(total_gib)
    else:
        peak = np.full(n, np.nan)
    rowd["peak_memory_gib"] = peak
    return Result(model=model, cluster=cluster, layouts=L, constants=c, stages=S, full=full, base=base, at=at,
                  step=st, power=power, x=x, extra=extra, row=rowd, peak_gib=peak)


# ------------------------------------------------------------------------------------------------
# calibration (models.calibrate.Calibration.predict_many on arrays)
# ------------------------------------------------------------------------------------------------

def vectorizable(cal) -> bool:
    """A calibration whose levels are all analytical / calibrated (no surrogate in use): its
    predictions are functions of the analytical model's, which `Calibrated` computes on arrays.
    Surrogates need the reference's per-layout features (Calibration.predict_many)."""
    return not any(v["mode"] == "surrogate" and cal.surrogates.get(t) is not None for t, v in cal.targets.items())


class Calibrated:
    """Calibration.predict_many of every row of `res` (evaluated with the calibration's constants),
    as arrays: tokens_per_s_per_gpu, step_time_s, energy_j_per_token, mean_power_w, throttle_risk,
    sm_clock_mhz, clock_ratio, memory_gib_per_gpu, feasible; `prediction(i)` composes the
    CalibratedPrediction of row i as the reference does (Calibration._compose), with the power
    evaluation of power_of done here on arrays."""

    def __init__(self, cal, res: Result, caps: np.ndarray | None = None):
        from advisor.models.calibrate import ADDITIVE, apply_residual

        if res.constants is not cal.constants:
            raise ValueError("Calibrated needs the rows evaluated with the calibration's constants")
        self.cal, self.res = cal, res
        model, cluster, L = res.model, res.cluster, res.layouts
        self.caps = caps
        dft = None
        if any(v["mode"] == "analytical" for v in cal.targets.values()):
            dft = res if cal.constants is DEFAULT else evaluate(model, cluster, L, DEFAULT, caps=caps)
        self.dft = dft
        names = {"tokens_per_s_per_gpu": "tokens_per_s_per_gpu", "memory_gib_per_gpu": "memory_gib_per_gpu",
                 "mean_power_w": "mean_power_w", "peak_power_w": "peak_power_w",
                 "throttle_fraction": "throttle_fraction"}
        est = {}
        for t, spec in cal.targets.items():
            base = (dft if spec["mode"] == "analytical" else res).row[names[t]]
            iv = spec["interval"]
            v = apply_residual(t, base, 0.0) if t in ADDITIVE else base
            lo, hi = apply_residual(t, base, iv["lo"]), apply_residual(t, base, iv["hi"])
            est[t] = (v, np.minimum(lo, hi), np.maximum(lo, hi))
        self.est = est
        n = cluster.world_size
        tokens = L.gbs * L.seq
        tps = est["tokens_per_s_per_gpu"][0]
        step = tokens / (tps * n)
        # the power evaluation behind the printed power numbers (Calibration.power_of)
        if cal.targets["mean_power_w"]["mode"] == "analytical":
            self.pw = (dft, np.arange(len(L)))
            pw_rows = dft.row
            src = {k: pw_rows[k] for k in ("mean_power_w", "throttle_risk", "sm_clock_mhz", "clock_ratio")}
            self.pw_of = [(dft, i) for i in range(len(L))]
        else:
            self.pw_of, src = _power_at_step(res, step, caps)
        mem = est["memory_gib_per_gpu"][0]
        self.row = {"tokens_per_s_per_gpu": tps, "step_time_s": step, "memory_gib_per_gpu": mem,
                    "feasible": mem <= cluster.gpu.memory_gib * cal.constants.memory_usable_fraction,
                    "mean_power_w": src["mean_power_w"], "throttle_risk": src["throttle_risk"],
                    "sm_clock_mhz": src["sm_clock_mhz"], "clock_ratio": src["clock_ratio"],
                    "energy_j_per_token": src["mean_power_w"] * n * step / tokens}

    def __getattr__(self, name):
        row = self.__dict__.get("row")
        if row is not None and name in row:
            return row[name]
        raise AttributeError(name)

    def prediction(self, i: int, cluster: ClusterSpec | None = None):
        res = self.res
        cl = cluster or res.cluster
        p = res.prediction(i, cl)
        pres, j = self.pw_of[i]
        pw = pres.power_estimate(j, cl)[0]
        est = {t: tuple(float(a[i]) for a in e) for t, e in self.est.items()}
        return self.cal._compose(res.model, cl, res.layouts.config(i), p, est, pw=pw)


def _power_at_step(res: Result, step_s: np.ndarray, caps) -> tuple[list, dict]:
    """models.power.power_at_step of every row at `step_s`: [(Result, row) per row], and the
    per-row arrays of the evaluation each row ends with."""
    n = len(res.layouts)
    where = [(res, i) for i in range(n)]
    keys = ("mean_power_w", "throttle_risk", "sm_clock_mhz", "clock_ratio")
    out = {k: res.row[k].copy() for k in keys}
    cur_step = res.row["step_time_s"].copy()
    floor = -(res.layouts.num_microbatches * np.minimum.reduceat(res.full["overhead_s"], res.stages.start))
    extra = np.zeros(n)
    todo = np.arange(n)
    for _ in range(3):
        gap = step_s[todo] - cur_step[todo]
        stop = (np.abs(gap) < 1e-4 * step_s[todo]) | ((gap < 0) & (extra[todo] <= floor[todo] + 1e-12))
        todo = todo[~stop]
        if not len(todo):
            break
        extra[todo] = np.maximum(floor[todo], extra[todo] + gap[~stop])
        sub = res.layouts.take(todo)
        e = evaluate(res.model, res.cluster, sub, res.constants,
                     caps=None if caps is None else np.asarray(caps)[todo], extra_wait_s=extra[todo], memory=False)
        for j, i in enumerate(todo):
            where[i] = (e, j)
        for k in keys:
            out[k][todo] = e.row[k]
        cur_step[todo] = e.row["step_time_s"]
    return where, out


# ------------------------------------------------------------------------------------------------
# per-stage caps (models.power.stage_caps of several layouts at once)
# ------------------------------------------------------------------------------------------------

def stage_caps_many(model: ModelSpec, cluster: ClusterSpec, cfgs: Sequence[TrainConfig], c: Constants = DEFAULT,
                    step_w: float = 25.0, max_slowdown: float = 0.001, base: ClusterSpec | None = None) -> list:
    """models.power.stage_caps of each layout: the same greedy search (stages off the critical
    path, the most slack first, each cap lowered in `step_w` steps while the step stays within
    `max_slowdown` and the energy falls), with every depth a stage could be lowered to evaluated
    in one array per round, and the layouts' rounds together. `base`: `cluster` but for its cap
    (the arrays are evaluated on it, with the caps per stage, to reuse its memos)."""
    from advisor.models.power import StageCaps

    gpu = cluster.gpu
    top = float(cluster.power_cap_w)
    cfgs = list(cfgs)
    L0 = Layouts.of(model, cfgs)
    on = base if base is not None else cluster
    ref = evaluate(model, on, L0, c, caps=top, memory=False)
    S0 = ref.stages
    state = []
    for i, cfg in enumerate(cfgs):
        pp = cfg.pp
        s0 = int(S0.start[i])
        totals = ref.step["totals"][s0:s0 + pp].tolist()
        crit = max(range(pp), key=lambda k: totals[k])
        order = sorted((k for k in range(pp) if k != crit), key=lambda k: totals[k]) if pp > 1 else []
        state.append({"caps": [top] * pp, "cur": (ref, i), "E": float(ref.energy_j_per_token[i]), "order": order,
                      "limit": float(ref.step_time_s[i]) * (1 + max_slowdown)})
    while True:
        rows, trials, owner = [], [], []
        for i, s in enumerate(state):
            if not s["order"]:
                continue
            k = s["order"][0]
            caps = s["caps"]
            v = caps[k]
            depth = []
            while v - step_w >= gpu.min_power_limit_w - 1e-9:
                v = v - step_w
                t = list(caps)
                t[k] = v
                depth.append(t)
            if not depth:
                s["order"].pop(0)
                continue
            rows += [i] * len(depth)
            trials += depth
            owner.append((i, k, len(depth)))
        if not owner:
            break
        L = L0.take(np.array(rows))
        R = evaluate(model, on, L, c, stage_caps=np.array([v for t in trials for v in t], float), memory=False)
        at = 0
        for i, k, n in owner:
            s = state[i]
            for j in range(n):
                r = at + j
                if R.step_time_s[r] > s["limit"] or R.energy_j_per_token[r] >= s["E"]:
                    break
                s["caps"], s["cur"], s["E"] = trials[r], (R, r), float(R.energy_j_per_token[r])
            s["order"].pop(0)
            at += n
    out = []
    for i, s in enumerate(state):
        r0 = ref.power_estimate(i, cluster)[0]
        res, j = s["cur"]
        cur = res.power_estimate(j, cluster)[0]
        saved = (1 - cur.energy_j_per_token / r0.energy_j_per_token) * 100
        out.append(StageCaps(s["caps"], cur.energy_j_per_token, saved,
                             (cur.step.step_time_s / r0.step.step_time_s - 1) * 100, cur.stages))
    return out
