"""Power, clocks, throttling and energy of pipeline stages under power caps, written once on
arrays: one value per stage of many layouts (flat, as models/stages.py lays them out); a single
layout is an array of one. models/power.py (the per-layout API: estimate_power, stage_power,
power_at_step, stage_caps) and models/vectorized.py (evaluate: what recommend runs) call these.

How (physics in advisor.models.dvfs): each pipeline stage's GPUs run its phases per step (GEMM,
attention, memory-bound kernels, communication) and wait the rest of the step (pipeline fill and
drain, faster stages waiting for the slowest, launch gaps). The power limiter of each GPU averages
over ~30 ms, so the phases of a microbatch are averaged together, and waits take part in
proportion to how short they are. Each stage's clock is the one at which that average meets its
cap; GEMM / attention time stretches with it (partly: dvfs.compute_stretch), memory-bound kernels
a little, communication not at all. The stages' clocks and the pipeline's waits depend on each
other, so they are iterated to a fixed point (`FixedPoint`, a few rounds).

    inp = PowerInputs.of(model, cluster, L, c)      # stage times at the maximum clocks, DP terms, caps
    pa = evaluate_power(inp)                         # the fixed point, each stage's power, the rows
    pa.row["mean_power_w"], pa.power_estimate(i)     # arrays; the PowerEstimate of row i
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from advisor.catalog.specs import ClusterSpec, ModelSpec
from advisor.models.constants import Constants
from advisor.models.dvfs import Load, Phase, limiter_weight, phase_power, solve_loads, where
from advisor.models.stages import Stages, memo_for
from advisor.models.step_time import (STEP_FIELDS, DPTerms, StepTime, at_clocks_arrays, dp_terms, stage_objects,
                                      stage_time_arrays, step_arrays)
from advisor.search_spaces.columns import Layouts

__all__ = ["FixedPoint", "InStep", "POWER_FIELDS", "PowerArrays", "PowerEstimate", "PowerInputs",
           "STAGE_POWER_FIELDS", "StagePower", "StepModel", "busiest_stretch", "busy_phases_of", "ep_idle_phases_of",
           "evaluate_power", "launch_gaps_of", "peak", "power_at_step_arrays", "sampled_gaps", "sampled_stretch",
           "stage_power_arrays", "step_end_phases", "take_phases", "waits_and_gaps"]


@dataclass(frozen=True)
class StagePower:
    """One pipeline stage's GPUs (each of them; all GPUs of a stage run alike)."""

    stage: int
    power_cap_w: float
    clock_ratio: float            # SM clock held / maximum
    sm_clock_mhz: float | None    # None where the catalog has no maximum clock for the GPU
    demand_w: float               # what the limiter would see at the maximum clock
    busy_power_w: float           # what it sees at the clock held
    mean_power_w: float           # over the whole step, waits included
    peak_power_w: float           # sampled peak (20-50 Hz), see peak()
    throttled: bool               # the cap holds the clock below the maximum
    busy_s: float                 # seconds per step computing or communicating
    energy_j: float               # per GPU per step
    spiking: bool = False         # its busiest stretch draws more than the cap at the maximum clock (brief dips)
    stretch_demand_w: float = 0.0  # that stretch's power at the maximum clock (busiest_stretch)

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in STAGE_POWER_FIELDS}


STAGE_POWER_FIELDS = tuple(f.name for f in dataclasses.fields(StagePower))
# the StagePower fields the arrays hold (stage and the SM clock in MHz are derived per row)
POWER_FIELDS = tuple(f for f in STAGE_POWER_FIELDS if f not in ("stage", "sm_clock_mhz"))


@dataclass
class PowerEstimate:
    mean_power_w: float           # per GPU, over all GPUs and the whole step
    peak_power_w: float           # the highest sampled peak of any GPU
    demand_mean_w: float          # the busiest stage's average at the maximum clock (no cap)
    demand_peak_w: float          # the busiest stretch (busiest_stretch) of any stage at the maximum clock
    power_cap_w: float            # the cluster's cap (stages may have their own: stages[k])
    sm_clock_mhz: float | None    # held by the critical (slowest) stage
    clock_ratio: float
    slowdown: float               # step time at the clocks held / at the maximum clocks (>= 1)
    throttle_fraction: float      # share of GPUs the limiter acts on (held down, or dips in a phase over the cap):
                                  # what NVML's power-cap clock-event reason reports
    energy_j_per_step: float      # all GPUs
    energy_j_per_token: float
    steady_temp_c: float
    throttle_risk: float          # 0..1
    throttle_label: str           # low / medium / high
    throttle_reason: str
    stages: list[StagePower] = field(default_factory=list)
    step: StepTime | None = field(default=None, repr=False)  # the step at the clocks held

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("step", "stages")}
        d["stages"] = [s.to_dict() for s in self.stages]
        return d


# ------------------------------------------------------------------------------------------------
# the terms of a stage (`get(name)`: a StageTime field, per stage)
# ------------------------------------------------------------------------------------------------

def busy_phases_of(get: Callable[[str], object], m, c: Constants, fp8) -> list[Phase]:
    """A stage's work per step at the maximum clocks, as DVFS phases: GEMMs and recompute (at
    their utilisation; quantized GEMMs draw the FP8 power factor), attention, memory-bound kernels
    (at memory_power_bandwidth), communication (TP, CP, EP, PP send/recv); `m` microbatches."""
    comm = get("tp_comm_s") + get("cp_comm_s") + get("ep_comm_s") + get("pp_p2p_s")
    return [Phase("gemm", (get("gemm_s") + get("recompute_s")) * m, utilization=get("gemm_utilization"), fp8=fp8),
            Phase("attention", get("attention_s") * m),
            Phase("memory", get("memory_bound_s") * m, utilization=c.memory_power_bandwidth),
            Phase("comm", comm * m)]


def ep_idle_phases_of(get: Callable[[str], object], m, c: Constants, fp8) -> list[Phase]:
    """The experts' work the busiest EP rank does beyond the mean rank, per step at the maximum
    clocks, as DVFS phases: the mean rank spends that time waiting in the all-to-all."""
    return [Phase("gemm", get("moe_ep_idle_compute_s") * m, utilization=get("gemm_utilization"), fp8=fp8),
            Phase("memory", get("moe_ep_idle_memory_s") * m, utilization=c.memory_power_bandwidth)]


def step_end_phases(dp_exposed_s, optimizer_s, c: Constants) -> list[Phase]:
    """DP communication left exposed and the optimizer: at the end of every stage's step."""
    return [Phase("comm", dp_exposed_s), Phase("memory", optimizer_s, utilization=c.memory_power_bandwidth)]


def take_phases(phases: list[Phase], idx) -> list[Phase]:
    """The stages `idx` of phases of arrays."""
    return [Phase(p.kind, *[v[idx] if isinstance(v, np.ndarray) else v for v in (p.seconds, p.utilization, p.fp8)])
            for p in phases]


@dataclass
class InStep:
    """What a stage sees of the step it runs in (per stage): the step (with any unexplained wait
    in it), its pipeline time, DP communication left exposed, the optimizer, the step's fixed
    overhead, the stage's and the slowest stage's time per microbatch, its launch gaps per
    microbatch, and the microbatches."""

    step_s: object
    pipeline_s: object
    dp_exposed_s: object
    optimizer_s: object
    overhead_s: object
    own_s: object
    slow_s: object
    gaps_s: object
    m: object

    @classmethod
    def of(cls, st: dict, S: Stages, gaps_s: np.ndarray, c: Constants) -> "InStep":
        """From step_arrays' per-row dict (and its per-stage 'totals')."""
        r = S.row
        return cls(st["step_time_s"][r], st["pipeline_s"][r], st["dp_exposed_s"][r], st["optimizer_s"][r],
                   c.step_overhead_s, st["totals"], st["slow"][r], gaps_s, S.L.num_microbatches[r])


def waits_and_gaps(ins: InStep, c: Constants, extra) -> tuple[list, list]:
    """A stage's idle time in its step, as (seconds, limiter weight): waits inside collectives
    (for the slowest stage each microbatch, pipeline fill and drain, the step's end) and gaps with
    no kernel (launch / framework gaps, and `extra`: time the analytical step does not explain;
    negative: host time the step did not take, out of the launch gaps). A wait of length L takes
    part in the limiter's ~30 ms average with weight window / (window + L) (dvfs.limiter_weight)."""
    m = ins.m
    behind = ins.slow_s - ins.own_s
    fill = np.maximum(0.0, ins.pipeline_s - m * ins.slow_s)
    waits = [(m * behind, limiter_weight(behind, c)), (fill, limiter_weight(fill / 2, c)),
             (ins.overhead_s, limiter_weight(ins.overhead_s, c))]
    gaps = [(sampled_gaps(ins, extra), 1.0), (np.maximum(extra, 0.0), limiter_weight(extra / m, c))]
    return waits, gaps


def busiest_stretch(busy: Load, end: list[Phase], x, gpu, c: Constants, power_scale=1.0, busy_w=None):
    """Watts of the busiest stretch that the power limiter's ~30 ms average and a 20-50 Hz sample
    see at clock ratio x: a microbatch's compute (`busy`: its phases' Load, with the gaps between
    its kernels for the sampled peak: sampled_gaps) averaged over its kernels (each of them ms
    long), or a step-end phase. A single kernel over the cap inside a
    microbatch under it trips neither (measured: MoE runs whose attention and GEMM kernels would
    each draw 750-800 W at full clock show no power-cap clock-event reason while their microbatch
    averages 600-650 W). `busy_w`: the microbatches' watts when the caller has them (sampled_stretch)."""
    v = busy.power(x, gpu, c, power_scale) if busy_w is None else busy_w
    for p in end:
        v = where(p.seconds > 0, np.maximum(v, phase_power(p, x, gpu, c, power_scale)), v)
    return v


def sampled_gaps(ins: InStep, extra):
    """Seconds per step of the launch / host gaps inside the microbatches (the stage's own gaps,
    less host time a measured step shorter than the model's did not take): they fall between the
    kernels, microseconds to milliseconds apart, far inside the power sensor's averaging window
    (NVML's instant power field 186 on A100 / H100 averages ~25 ms: Yang et al., "Accurate and
    Convenient Energy Measurements for GPUs", SC'24, arXiv 2312.02741), so every sample of a
    microbatch averages them with its kernels. Time the model's step does not explain (extra > 0)
    is left out: where it falls is not known."""
    return np.maximum(ins.m * ins.gaps_s + np.minimum(0.0, extra), 0.0)


# Share of each phase kind's time per microbatch that falls in the backward pass: a linear layer's
# GEMMs are one forward and two backward (dgrad, wgrad) of equal FLOPs; FlashAttention's backward
# does 2.5x its forward's matmul FLOPs (Dao, "FlashAttention-2", 2023: 5 matmuls vs 2); memory-bound
# kernels and collectives read / write the same tensors backward as forward (the gradient of each).
BACKWARD_SHARE = {"gemm": 2.0 / 3.0, "attention": 2.5 / 3.5, "memory": 0.5, "comm": 0.5}


def sampled_stretch(busy: list[Phase], gaps_s, m, x, gpu, c: Constants, power_scale=1.0):
    """Watts a 20-50 Hz sample of NVML's instant power (averaged over power_sensor_window_s) sees
    at most inside the microbatches of an uncapped GPU at clock ratio x. `busy`: the phases per
    step, `gaps_s`: the launch / host gaps inside the microbatches per step (sampled_gaps), `m`
    microbatches. A microbatch longer than the window is resolved: the busiest window lies in the
    backward pass (BACKWARD_SHARE of each phase, backward_gap_share of the gaps: its kernels are
    issued by the autograd engine's C++ thread), then the forward's mix, then (a microbatch
    shorter than the window) the microbatch's average: what the window cannot resolve."""
    def load(share_of, gap_share):
        return Load.of([Phase(p.kind, p.seconds * share_of(p.kind) / m, p.utilization, p.fp8) for p in busy], (),
                       c, [(gaps_s * gap_share / m, 1.0)])

    g = c.backward_gap_share
    bwd, fwd = load(BACKWARD_SHARE.get, g), load(lambda k: 1.0 - BACKWARD_SHARE[k], 1.0 - g)
    w = c.power_sensor_window_s
    tb, tf = bwd.seconds(x), fwd.seconds(x)
    a = np.minimum(tb, w)
    b = np.minimum(tf, np.maximum(w - tb, 0.0))
    rest = np.maximum(w - tb - tf, 0.0)
    whole = load(lambda k: 1.0, 1.0)
    return (a * bwd.power(x, gpu, c, power_scale) + b * fwd.power(x, gpu, c, power_scale)
            + rest * whole.power(x, gpu, c, power_scale)) / w


def peak(phase_peak_w, throttled, c: Constants):
    """Sampled peak (20-50 Hz NVML instant power) of a GPU whose busiest stretch (a microbatch's
    compute, averaged over its kernels, or a step-end phase) draws phase_peak_w at the clock it
    holds: under a cap the limiter's clock oscillation adds peak_overshoot of it, otherwise the
    ripple (constants)."""
    return phase_peak_w * where(throttled, 1.0 + c.peak_overshoot, c.power_ripple)


def stage_limiter_load(ins: InStep, busy: list[Phase], c: Constants, extra) -> tuple[Load, list[Phase], float]:
    """What the power limiter averages on a stage: its busy phases, the step-end phases (one
    longer than the ~30 ms window, the optimizer, is seen on its own like a wait, with weight
    window / (window + L); it does not dilute the microbatches), waits and gaps. Also the step-end
    phases, the gaps' length and the launch gaps inside the microbatches (sampled_gaps)."""
    end = step_end_phases(ins.dp_exposed_s, ins.optimizer_s, c)
    waits, gaps = waits_and_gaps(ins, c, extra)
    seen = [Phase(p.kind, p.seconds * limiter_weight(p.seconds, c), p.utilization, p.fp8) for p in end]
    return Load.of(busy + seen, waits, c, gaps), end, sum(length for length, _ in gaps), gaps[0][0]


def stage_power_arrays(ins: InStep, busy: list[Phase], gpu, cap, c: Constants, power_scale=1.0, extra=0.0,
                       clock=None, ep_idle: list[Phase] | None = None) -> dict:
    """Each stage's GPUs in its step: the clock its cap holds (or `clock` when given), its power
    and energy (POWER_FIELDS). `busy`: busy_phases_of the stage's busiest EP rank (which sets the
    clock, the step and the peaks); `ep_idle`: ep_idle_phases_of, the part of that work the mean
    EP rank does not do and waits instead (its mean power and energy are the stage's: the mean
    over the stage's GPUs). A stage slowed below the step's pace sets its own step."""
    load, end, gap_s, gaps = stage_limiter_load(ins, busy, c, extra)
    xs, demand, capped = solve_loads(load, gpu, cap, c, power_scale)
    x = xs if clock is None else clock
    work = Load.of(busy + end, (), c)
    busy_s = work.seconds(x)
    step_s = np.maximum(ins.step_s, busy_s + gap_s)
    idle = Load(wait_s=step_s - busy_s - gap_s, gap_s=gap_s)
    e = work.power(x, gpu, c, power_scale) * busy_s + idle.power(x, gpu, c, power_scale) * idle.seconds(x)
    if ep_idle:
        spare = Load.of(ep_idle, (), c)
        spare_s = spare.seconds(x)
        if np.any(spare_s > 0):
            p_wait = Load(wait_s=1.0).power(x, gpu, c, power_scale)
            e = np.where(spare_s > 0, e - spare_s * (spare.power(x, gpu, c, power_scale) - p_wait), e)
    mb = Load.of(busy, (), c)
    # capped: the limiter holds the ~30 ms average and its clock oscillation (peak_overshoot) is
    # over the microbatch's average; uncapped: what the sensor's window resolves (sampled_stretch)
    averaged = Load.of(busy, (), c, [(gaps, 1.0)])
    resolved = sampled_stretch(busy, gaps, ins.m, x, gpu, c, power_scale)
    phase_peak = busiest_stretch(averaged, end, x, gpu, c, power_scale,
                                 np.where(capped, averaged.power(x, gpu, c, power_scale), resolved))
    stretch_demand = busiest_stretch(mb, end, np.ones(np.shape(x)), gpu, c, power_scale)
    return {"power_cap_w": cap, "clock_ratio": x, "demand_w": demand, "busy_power_w": load.power(x, gpu, c, power_scale),
            "mean_power_w": e / step_s, "peak_power_w": peak(phase_peak, capped, c), "throttled": capped,
            "busy_s": busy_s, "energy_j": e, "spiking": stretch_demand > cap, "stretch_demand_w": stretch_demand}


def launch_gaps_of(overhead_s: np.ndarray, S: Stages) -> np.ndarray:
    """Seconds per step of the launch / host gaps of each row's stage with the fewest (no kernel
    runs): a shorter step than the model's can give back at most these."""
    return S.L.num_microbatches * np.minimum.reduceat(overhead_s, S.start)


# ------------------------------------------------------------------------------------------------
# the fixed point of the clocks and the step
# ------------------------------------------------------------------------------------------------

class StepModel:
    """The step of each row at per-stage clocks x (models.step_time: at_clocks_arrays, then
    step_arrays), with the row's unexplained wait `extra` in it."""

    def __init__(self, L: Layouts, S: Stages, c: Constants, full: dict, base: dict, dp: DPTerms, extra: np.ndarray):
        self.L, self.S, self.c, self.full, self.base, self.dp, self.extra = L, S, c, full, base, dp, extra

    def at(self, x: np.ndarray) -> tuple[dict, dict]:
        at = at_clocks_arrays(self.full, x, self.c)
        st = dict(self.base) if at is self.full else step_arrays(self.L, self.c, self.S, self.full, at, self.dp)
        st["step_time_s"] = np.where(self.extra != 0, st["step_time_s"] + self.extra, st["step_time_s"])
        return at, st

    def take(self, rows: np.ndarray, sm: np.ndarray) -> "StepModel":
        """Rows `rows` (their stages: the mask `sm`)."""
        L = self.L.take(rows)
        base = {k: (v[sm] if k == "totals" else v[rows]) for k, v in self.base.items()}
        dp = self.dp.take(sm)
        return StepModel(L, Stages(L), self.c, {k: v[sm] for k, v in self.full.items()}, base, dp, self.extra[rows])


class FixedPoint:
    """The clocks the caps hold and the step at them: each round every stage's clock is solved at
    the step of the round before, the step taken again at those clocks (steps.at), until a row's
    clocks move less than 2e-4 (0.4 MHz on a 1,980 MHz GPU; at most 12 rounds, per row). Once
    fewer than half of the rows still move, the rounds go on with those rows alone (each row's
    rounds depend on its own numbers only). `steps`: a StepModel, or any object with its `at`
    (and `take`, for 64 rows or more)."""

    def __init__(self, steps, S: Stages, full: dict, busy: list[Phase], gpu, cap, c: Constants, power_scale=1.0):
        self.steps, self.S, self.full, self.busy, self.gpu, self.cap, self.c = steps, S, full, busy, gpu, cap, c
        self.ps = power_scale
        self.extra_s = steps.extra[S.row]

    def inputs(self, st: dict) -> InStep:
        return InStep.of(st, self.S, self.full["overhead_s"], self.c)

    def clocks(self, st: dict) -> np.ndarray:
        load, _, _, _ = stage_limiter_load(self.inputs(st), self.busy, self.c, self.extra_s)
        return solve_loads(load, self.gpu, self.cap, self.c, self.ps)[0]

    def sub(self, rows: np.ndarray) -> "FixedPoint":
        mask = np.zeros(self.S.n, bool)
        mask[rows] = True
        sm = mask[self.S.row]
        steps = self.steps.take(rows, sm)
        ps = self.ps[sm] if isinstance(self.ps, np.ndarray) else self.ps
        return FixedPoint(steps, steps.S, steps.full, take_phases(self.busy, sm), self.gpu, self.cap[sm], self.c, ps)

    def solve(self, x: np.ndarray | None = None, rounds: int = 12) -> tuple[np.ndarray, dict, dict]:
        """(clock ratio per stage, stages at those clocks, step at them) after the rounds."""
        S, r = self.S, self.S.row
        x = np.ones(S.total) if x is None else x
        at, st = self.steps.at(x)
        active = np.ones(S.n, bool)
        for i in range(rounds):
            new = self.clocks(st)
            done = S.max(np.abs(new - x)) < 2e-4
            x = np.where(active[r], new, x)
            active &= ~done
            if not active.any():
                return x, *self.steps.at(x)
            if i + 1 < rounds and S.n >= 64 and 2 * active.sum() < S.n:
                rows = np.flatnonzero(active)
                sm = active[r]
                xs, _, _ = self.sub(rows).solve(x[sm], rounds - i - 1)
                x = x.copy()
                x[sm] = xs
                return x, *self.steps.at(x)
            at, st = self.steps.at(x)
        return x, at, st


# ------------------------------------------------------------------------------------------------
# layouts under caps
# ------------------------------------------------------------------------------------------------

@dataclass
class PowerInputs:
    """What the power model takes of the rows of a Layouts on a cluster: stage times at the
    maximum clocks (`full`, per stage), DP terms, the step at the maximum clocks (`base`), each
    stage's cap and switching-power multiplier (placement: hotter or leakier slots)."""

    cluster: ClusterSpec
    L: Layouts
    S: Stages
    c: Constants
    full: dict
    dp: DPTerms
    base: dict
    cap: np.ndarray
    power_scale: float | np.ndarray = 1.0

    @classmethod
    def of(cls, model: ModelSpec, cluster: ClusterSpec, L: Layouts, c: Constants, caps=None, stage_caps=None,
           full: dict | None = None, power_scale: float | np.ndarray = 1.0, S: Stages | None = None,
           dp: DPTerms | None = None) -> "PowerInputs":
        """`caps` per GPU: one number, or one per row; `stage_caps`: one per stage in the flat
        order (default: the cluster's cap); `full`: stage times when the caller has them."""
        S = S or Stages(L)
        memo = memo_for(model, cluster, c)
        if full is None:
            full = stage_time_arrays(model, cluster, L, c, memo, S)
        dp = dp or dp_terms(model, cluster, L, c, memo, S)
        if stage_caps is not None:
            cap = np.asarray(stage_caps, float)
        elif caps is None:
            cap = np.full(S.total, float(cluster.power_cap_w))
        else:
            cap = np.broadcast_to(np.asarray(caps, float), (len(L),))[S.row].copy()
        for v in set(cap.tolist()):  # (np.unique without indices would import numpy.ma: 30 ms cold)
            cluster.gpu.check_power_cap(float(v))
        return cls(cluster, L, S, c, full, dp, step_arrays(L, c, S, full, full, dp), cap, power_scale)

    def take(self, rows: np.ndarray) -> "PowerInputs":
        """Rows `rows` (repeats allowed), with their stage times, DP terms and caps."""
        L = self.L.take(rows)
        S = Stages(L)
        sm = (self.S.start[rows][S.row] + S.k)  # each new stage's index in the flat order
        base = {k: (v[sm] if k == "totals" else v[rows]) for k, v in self.base.items()}
        ps = self.power_scale[sm] if isinstance(self.power_scale, np.ndarray) else self.power_scale
        return PowerInputs(self.cluster, L, S, self.c, {k: v[sm] for k, v in self.full.items()},
                           self.dp.take(sm), base, self.cap[sm], ps)


def evaluate_power(inp: PowerInputs, extra_wait_s: np.ndarray | float = 0.0) -> "PowerArrays":
    """Power, clocks, step time, throttling and energy of every row under its stages' caps: the
    fixed point, then each stage at the clocks held (the mean EP rank's energy), then the rows.
    `extra_wait_s`: seconds per step the analytical step does not explain (a calibration's or a
    measured longer step: launch gaps and framework time), spent at wait power; a shorter step is
    taken out of the launch gaps, at most all of the stage with the fewest (launch_gaps_of).
    Callers run it under np.errstate(divide="ignore", invalid="ignore")."""
    L, S, c, full, gpu = inp.L, inp.S, inp.c, inp.full, inp.cluster.gpu
    r = S.row
    mf = L.num_microbatches[r]
    fp8 = L.fp8[r]  # quantized GEMMs (FP8 / MXFP8 / NVFP4): the FP8 power factor
    busy = busy_phases_of(full.__getitem__, mf, c, fp8)
    extra = np.maximum(-launch_gaps_of(full["overhead_s"], S), np.broadcast_to(np.asarray(extra_wait_s, float), (S.n,)))
    fp = FixedPoint(StepModel(L, S, c, full, inp.base, inp.dp, extra), S, full, busy, gpu, inp.cap, c, inp.power_scale)
    x, at, st = fp.solve()
    power = stage_power_arrays(fp.inputs(st), busy, gpu, inp.cap, c, inp.power_scale, extra[r], clock=x,
                               ep_idle=ep_idle_phases_of(full.__getitem__, mf, c, fp8))
    return PowerArrays(inp, at, st, power, x, extra, rows_of(inp, st, power, x, extra))


RISK_KINDS = ("none", "power cap", "power spikes", "thermal")


def rows_of(inp: PowerInputs, st: dict, power: dict, x: np.ndarray, extra: np.ndarray) -> dict:
    """Per row: energy (all GPUs), mean power, the sampled peak, the critical stage's clock, the
    slowdown from the caps, the share of GPUs the limiter acts on, the hottest stage's steady
    temperature, the throttle risk (a presentation scale, constants.py) and its kind (RISK_KINDS:
    sustained capping, brief spikes over the cap, or temperature near the slowdown point)."""
    S, c, L, gpu = inp.S, inp.c, inp.L, inp.cluster.gpu
    pp = L.pp
    gps = inp.cluster.world_size / pp
    energy = S.sum(power["energy_j"]) * gps
    step = st["step_time_s"]
    crit = S.argmax(st["totals"]) + S.start
    hot = S.argmax(power["mean_power_w"]) + S.start
    busiest = S.argmax(power["demand_w"]) + S.start
    demand_peak = S.max(power["stretch_demand_w"])
    slowdown = (step - extra) / inp.base["step_time_s"]
    temp = c.idle_temp_c + c.c_per_w * (power["mean_power_w"][hot] - gpu.idle_w)
    bcap = inp.cap[busiest]
    sustained = (slowdown > 1.0 + 1e-6) | power["throttled"][busiest]
    spikes = demand_peak > bcap
    r_sus = np.minimum(1.0, c.throttle_risk_sustained_base + (slowdown - 1.0) * c.throttle_risk_per_slowdown)
    r_spike = c.throttle_risk_spike_base + c.throttle_risk_spike_span * np.minimum(
        1.0, (demand_peak - bcap) / (c.throttle_spike_full_excess * bcap))
    r_low = c.throttle_risk_low_span * np.maximum(0.0, (demand_peak - c.throttle_low_start * bcap)
                                                  / (c.throttle_low_range * bcap))
    r_power = np.where(sustained, r_sus, np.where(spikes, r_spike, r_low))
    limit = gpu.slowdown_temp_c
    r_thermal = np.maximum(0.0, np.minimum(1.0, (temp - (limit - c.thermal_margin_c)) / c.thermal_margin_c))
    kind = np.where(r_thermal > r_power, 3, np.where(sustained, 1, np.where(spikes, 2, 0)))
    return {"step_time_s": step, "energy_j_per_step": energy, "energy_j_per_token": energy / (L.gbs * L.seq),
            "mean_power_w": energy / gps / pp / step, "peak_power_w": S.max(power["peak_power_w"]),
            "clock_ratio": x[crit], "sm_clock_mhz": x[crit] * gpu.max_sm_clock_mhz if gpu.max_sm_clock_mhz
            else np.full(S.n, np.nan), "slowdown": slowdown,
            "throttle_fraction": S.sum((power["throttled"] | power["spiking"]).astype(float)) / pp,
            "steady_temp_c": temp, "throttle_risk": np.maximum(r_power, r_thermal), "risk_kind": kind,
            "demand_mean_w": power["demand_w"][busiest], "demand_peak_w": demand_peak, "crit": crit - S.start,
            "busiest": busiest - S.start}


def risk_reason(kind: int, per: list[StagePower], busiest: StagePower, crit: int, slowdown: float,
                demand_peak: float, temp: float, gpu) -> str:
    """The one-line throttle reason of rows_of's risk kind, worded from the numbers the
    prediction prints."""
    cap = busiest.power_cap_w
    if kind == 3:
        return f"thermal: predicted {temp:.0f} °C vs {gpu.slowdown_temp_c:.0f} °C slowdown"
    if kind == 1:
        where_ = f"stage {busiest.stage}" if len(per) > 1 else "the GPUs"
        s = per[crit]
        clk = f"{s.sm_clock_mhz:,.0f} MHz" if s.sm_clock_mhz else f"{s.clock_ratio:.0%} of the maximum clock"
        reason = (f"power cap: {where_} would draw {busiest.demand_w:.0f} W at full clock > {cap:.0f} W; "
                  f"clock held at {clk}, step {(slowdown - 1) * 100:.1f}% slower than at full clock")
        if busiest.busy_power_w > cap * (1.0 + 1e-3):
            # the lowest clock the model knows (min_clock_ratio) still draws more than the cap: the
            # driver would have to go further (clock gating, power brake), which is not modelled
            reason += (f"; even at that clock it draws {busiest.busy_power_w:.0f} W > {cap:.0f} W: a cap this low "
                       f"cannot be held by the clock alone (expect a slower step than predicted)")
        return reason
    if kind == 2:
        return (f"power spikes: the busiest stretch draws {demand_peak:.0f} W at full clock > {cap:.0f} W cap "
                f"(brief clock dips; the ~30 ms average stays under it)")
    return "none"


@dataclass
class PowerArrays:
    """What evaluate_power computed: `at` (StageTime fields at the clocks held, per stage), `step`
    (STEP_FIELDS at the clocks held, with the extra wait, per row), `power` (POWER_FIELDS per
    stage), `x` (clock ratio per stage), `extra` and `row` (rows_of) per row."""

    inp: PowerInputs
    at: dict
    step: dict
    power: dict
    x: np.ndarray
    extra: np.ndarray
    row: dict
    _memo: dict = field(default_factory=dict, repr=False)

    def step_objects(self, i: int) -> tuple[StepTime, StepTime]:
        """(StepTime at the maximum clocks, StepTime at the clocks held) of row i."""
        inp = self.inp
        s0, pp = int(inp.S.start[i]), int(inp.L.pp[i])
        m = int(inp.L.num_microbatches[i])

        def step(d, stages):
            return StepTime(**{f: float(d[f][i]) for f in STEP_FIELDS}, overhead_s=inp.c.step_overhead_s,
                            stages=stages, num_microbatches=m)

        return step(inp.base, stage_objects(inp.full, s0, pp)), step(self.step, stage_objects(self.at, s0, pp))

    def stage_powers(self, i: int) -> list[StagePower]:
        inp = self.inp
        s0, pp = int(inp.S.start[i]), int(inp.L.pp[i])
        mhz = inp.cluster.gpu.max_sm_clock_mhz
        cols = [self.power[f][s0:s0 + pp].tolist() for f in POWER_FIELDS]
        out = []
        for k, vals in enumerate(zip(*cols)):
            d = dict(zip(POWER_FIELDS, vals))
            d["throttled"], d["spiking"] = bool(d["throttled"]), bool(d["spiking"])
            out.append(StagePower(stage=k, sm_clock_mhz=mhz * d["clock_ratio"] if mhz else None, **d))
        return out

    def power_estimate(self, i: int, cluster: ClusterSpec | None = None) -> tuple[PowerEstimate, StepTime]:
        """(the PowerEstimate of row i, its step at the maximum clocks); `cluster`: the cluster
        with the cap row i was evaluated at, when that is not the inputs' cluster."""
        hit = self._memo.get((i, id(cluster)))
        if hit is not None and hit[0] is cluster:
            return hit[1]
        base, st = self.step_objects(i)
        per = self.stage_powers(i)
        row = {k: v[i].item() for k, v in self.row.items()}
        busiest, crit = per[row["busiest"]], row["crit"]
        c = self.inp.c
        risk = row["throttle_risk"]
        label = "high" if risk >= c.throttle_label_high else "medium" if risk >= c.throttle_label_medium else "low"
        cl = cluster or self.inp.cluster
        # the stages' energies summed in stage order, as the per-layout objects always have them
        # (np.add.reduceat of rows_of may pair them: a last-bit difference the JSON outputs show)
        gps = self.inp.cluster.world_size / len(per)
        energy = sum(s.energy_j for s in per) * gps
        row.update(energy_j_per_step=energy, energy_j_per_token=energy / float(self.inp.L.gbs[i] * self.inp.L.seq[i]),
                   mean_power_w=energy / gps / len(per) / st.step_time_s)
        reason = risk_reason(row["risk_kind"], per, busiest, crit, row["slowdown"], row["demand_peak_w"],
                             row["steady_temp_c"], cl.gpu)
        est = PowerEstimate(
            mean_power_w=row["mean_power_w"], peak_power_w=row["peak_power_w"], demand_mean_w=busiest.demand_w,
            demand_peak_w=row["demand_peak_w"], power_cap_w=float(cl.power_cap_w), sm_clock_mhz=per[crit].sm_clock_mhz,
            clock_ratio=per[crit].clock_ratio, slowdown=row["slowdown"], throttle_fraction=row["throttle_fraction"],
            energy_j_per_step=row["energy_j_per_step"], energy_j_per_token=row["energy_j_per_token"],
            steady_temp_c=row["steady_temp_c"], throttle_risk=risk, throttle_label=label, throttle_reason=reason,
            stages=per, step=st)
        self._memo[(i, id(cluster))] = (cluster, (est, base))
        return est, base


def power_at_step_arrays(inp: PowerInputs, first: PowerArrays, step_s: np.ndarray) -> tuple[list, dict]:
    """evaluate_power for steps known to take `step_s` (measured, or a calibration's), per row:
    the time the analytical step does not explain is spent in short waits (extra_wait_s), found
    so that the step at the clocks the cap then holds is `step_s` (3 rounds). A step shorter than
    the model's is taken out of the model's launch gaps (host time: what the model knows least; the
    GPU's work comes from FLOPs and bytes), as far as they go; beyond them the model's step stays.
    `first`: evaluate_power(inp). Returns [(PowerArrays, row) per row] and the per-row arrays
    (mean_power_w, throttle_risk, sm_clock_mhz, clock_ratio) of the evaluation each row ends with."""
    n = len(inp.L)
    where_ = [(first, i) for i in range(n)]
    keys = ("mean_power_w", "throttle_risk", "sm_clock_mhz", "clock_ratio")
    out = {k: first.row[k].copy() for k in keys}
    cur_step = first.row["step_time_s"].copy()
    floor = -launch_gaps_of(inp.full["overhead_s"], inp.S)
    extra = np.zeros(n)
    todo = np.arange(n)
    for _ in range(3):
        gap = step_s[todo] - cur_step[todo]
        stop = (np.abs(gap) < 1e-4 * step_s[todo]) | ((gap < 0) & (extra[todo] <= floor[todo] + 1e-12))
        todo = todo[~stop]
        if not len(todo):
            break
        extra[todo] = np.maximum(floor[todo], extra[todo] + gap[~stop])
        e = evaluate_power(inp.take(todo), extra[todo])
        for j, i in enumerate(todo):
            where_[i] = (e, j)
        for k in keys:
            out[k][todo] = e.row[k]
        cur_step[todo] = e.row["step_time_s"]
    return where_, out
