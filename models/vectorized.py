"""The analytical model on arrays of layouts, the power / DVFS part and the whole prediction:
memory (models/memory.py), stage times and the step (models/step_time.py) are written once on
arrays there; this module adds the power / DVFS fixed point, `evaluate`, the calibration on
arrays and per-stage caps, one numpy pass per term over every layout (and every pipeline stage of
every layout) at once.

The per-layout power functions (models/power.py, dvfs.py, predict.py) are still a second,
readable copy of the power composition; tests/test_vectorized.py holds both to 1e-9 (relative)
on whole layout spaces, and tests/test_frozen_predictions.py both to the frozen numbers.

Layout of the arrays: `Layouts` holds one row per layout; stage arrays are flat, the stages of
row r at `start[r] : start[r] + pp[r]` (ragged; segment reductions with numpy's reduceat).

    res = evaluate(model, cluster, Layouts.of(cfgs), constants)
    res.tokens_per_s_per_gpu, res.energy_j_per_token, res.throttle_risk   # arrays, one per layout
    res.prediction(i)                                                     # the Prediction of row i
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from advisor.catalog.specs import ClusterSpec, ModelSpec, TrainConfig
from advisor.models.constants import DEFAULT, Constants
from advisor.models.memory import memory_arrays, peak_memory_many, stage_memory_of
from advisor.models.stages import Stages, memo_for
from advisor.models.power import STAGE_POWER_FIELDS
from advisor.models.quant import mfu_peak_tflops
from advisor.models.step_time import (STAGE_FIELDS, STEP_FIELDS, DPTerms, at_clocks_arrays, dp_terms,
                                      stage_time_arrays, step_arrays)
from advisor.search_spaces.columns import Layouts  # noqa: F401 (Layouts: API)

# the StagePower fields the arrays hold (stage and the SM clock in MHz are derived when a row
# becomes a StagePower)
POWER_FIELDS = tuple(f for f in STAGE_POWER_FIELDS if f not in ("stage", "sm_clock_mhz"))


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
    """What `evaluate` computed, per row (1-d arrays) and per stage (flat arrays, see Stages)."""

    model: ModelSpec
    cluster: ClusterSpec
    layouts: Layouts
    constants: Constants
    stages: Stages
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
        from advisor.models.predict import assemble

        cfg = self.layouts.config(i)
        power, base = self.power_estimate(i, cluster)
        return assemble(self.model, cluster or self.cluster, cfg, self.constants, self.stage_memory(i), base, power)

    def stage_memory(self, i: int) -> list:
        """memory.stage_memory of row i (from the arrays when memory was evaluated)."""
        from advisor.models.memory import stage_memory

        if self.stages.cache.get("memory") is None:
            return stage_memory(self.model, self.layouts.config(i), self.constants)
        return stage_memory_of(self.stages, i, self.constants)


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
        S = Stages(L)
        mask = np.zeros(len(self.L), bool)
        mask[rows] = True
        sm = mask[self.S.row]
        full = {k: v[sm] for k, v in self.full.items()}
        base = {k: (v[sm] if k == "totals" else v[rows]) for k, v in self.base.items()}
        dp = DPTerms(self.dp.grad[sm], self.dp.gather[sm], self.dp.opt_base[sm])
        busy = [(kd, sec[sm], tuple(w[sm] if isinstance(w, np.ndarray) else w for w in ws))
                for kd, sec, ws in self.busy]
        return _FixedPoint(L, S, self.c, full, base, dp, self.cap[sm], self.extra[rows], busy, self.idle,
                           self.span, self.ps)

    def at_x(self, x):
        at = at_clocks_arrays(self.full, x, self.c)
        if at is self.full:
            st = dict(self.base)
        else:
            st = step_arrays(self.L, self.c, self.S, self.full, at, self.dp)
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


def peak_memory_gib(model: ModelSpec, L: Layouts, c: Constants = DEFAULT, cluster: ClusterSpec | None = None
                    ) -> np.ndarray:
    """memory.peak_memory_gib of every row: the fullest stage's memory per GPU (`cluster`: unused,
    memory does not depend on it)."""
    return peak_memory_many(model, L, c)


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
    S = Stages(L)
    memo = memo_for(model, cluster, c)
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
    full = stage_time_arrays(model, cluster, L, c, memo, S)
    dp = dp_terms(model, cluster, L, c, memo, S)
    base = step_arrays(L, c, S, full, full, dp)
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
    sq, qinv = np.unique(np.stack([L.seq, L.fp8]), axis=1, return_inverse=True)
    mfu_peak = np.array([mfu_peak_tflops(model, int(a), gpu, int(b)) for a, b in sq.T])[qinv.reshape(-1)]
    rowd = {"tokens_per_s_per_gpu": tps, "step_time_s": step, "energy_j_per_step": energy,
            "energy_j_per_token": energy / tokens, "mean_power_w": mean, "throttle_risk": risk,
            "peak_power_w": S.max(power["peak_power_w"]), "clock_ratio": x[crit],
            "sm_clock_mhz": x[crit] * gpu.max_sm_clock_mhz if gpu.max_sm_clock_mhz else np.full(n, np.nan),
            "slowdown": slowdown, "throttle_fraction": S.sum((capped | power["spiking"]).astype(float)) / pp,
            "steady_temp_c": temp, "tflops_per_gpu": tflops, "mfu": tflops / mfu_peak,
            "demand_mean_w": demand[busiest], "demand_peak_w": demand_peak}
    if memory:
        peak, total_gib = memory_arrays(model, L, c, memo, S)
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
        from advisor.models.dataset import ADDITIVE, apply_residual

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
            self.pw_of, src = power_at_step(res, step, caps)
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


def power_at_step(res: Result, step_s: np.ndarray, caps) -> tuple[list, dict]:
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
