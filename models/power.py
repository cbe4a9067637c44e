"""Power, clocks, throttling and energy of one layout under per-GPU power caps: the per-layout
API over the one implementation on arrays (models/power_arrays.py), and the choice of caps.

`estimate_power` is the one place where the advisor gets a power, a clock, a throttle fraction or
an energy for a layout: mean and peak power, the SM clock each pipeline stage holds, the step time
at those clocks, throttle risk and energy per token all come out of one evaluation
(power_arrays.evaluate_power on the layout as a Layouts of one), so no two printed numbers can
disagree. `stage_power` is one stage in a given step (placement prices stages on slots with it),
`power_at_step` the same at a measured or calibrated step time.

`cap_sweep` evaluates a layout over a range of caps (with the analytical model, or a calibration's
predictions: the caller's `evaluate`): the cap with the least energy per token, and the least
within 5% of the fastest step. `stage_caps` lowers the caps of stages off the critical
path until they would slow the step (Perseus' "energy bloat", SOSP'24); `stage_caps_many` does it
for several layouts at once on arrays.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

import numpy as np

from advisor.catalog.specs import ClusterSpec, ModelSpec, SpecError, TrainConfig
from advisor.models.constants import DEFAULT, Constants
from advisor.models.dvfs import Phase
from advisor.models.objectives import TIME_SLACK, Energy, MaxSlowdown, Time
from advisor.models.power_arrays import (STAGE_POWER_FIELDS, InStep, PowerEstimate, PowerInputs, StagePower,
                                         busy_phases_of, ep_idle_phases_of, evaluate_power, power_at_step_arrays,
                                         stage_power_arrays)
from advisor.models.step_time import StageTime, StepTime, one_layout, stage_arrays
from advisor.search_spaces.columns import Layouts

__all__ = ["CapPoint", "CapSweep", "PowerEstimate", "STAGE_POWER_FIELDS", "StageCaps", "StagePower",
           "analytical_point", "busy_phases", "cap_grid", "cap_sweep", "ep_idle_phases", "estimate_power",
           "launch_gaps", "point", "power_at_step", "stage_caps", "stage_caps_many", "stage_power", "sweep_of"]


# ------------------------------------------------------------------------------------------------
# one stage
# ------------------------------------------------------------------------------------------------

def busy_phases(full: StageTime, m: int, c: Constants, fp8: bool = False) -> list[Phase]:
    """A stage's work per step at the maximum clocks, as DVFS phases (power_arrays.busy_phases_of;
    the phases with time)."""
    return [p for p in busy_phases_of(partial(getattr, full), m, c, fp8) if p.seconds > 0]


def ep_idle_phases(full: StageTime, m: int, c: Constants, fp8: bool = False) -> list[Phase]:
    """The busiest EP rank's work beyond the mean rank's (power_arrays.ep_idle_phases_of)."""
    return [p for p in ep_idle_phases_of(partial(getattr, full), m, c, fp8) if p.seconds > 0]


def launch_gaps(stages: Sequence[StageTime], m: int) -> float:
    """Seconds per step of the launch / host gaps of the stage with the fewest (no kernel runs;
    power_arrays.launch_gaps_of on arrays)."""
    return m * min(s.overhead_s for s in stages)


def _one(v) -> np.ndarray:
    return np.array([float(v)])


def _phases_of_one(phases: Sequence[Phase]) -> list[Phase]:
    return [Phase(p.kind, _one(p.seconds), p.utilization, p.fp8) for p in phases]


def stage_power(st: StepTime, k: int, busy: list[Phase], gpu, cap_w: float, c: Constants = DEFAULT,
                power_scale: float = 1.0, extra_wait_s: float = 0.0, clock: float | None = None,
                ep_idle: Sequence[Phase] = ()) -> StagePower:
    """Stage k's GPUs in the step `st` (at its clocks): the clock its cap holds (or `clock` when
    given), and its power and energy (power_arrays.stage_power_arrays on a stage of one). `busy`:
    busy_phases() of the stage; `ep_idle`: ep_idle_phases()."""
    own = st.stages[k]
    ins = InStep(*[_one(v) for v in (st.step_time_s, st.pipeline_s, st.dp_exposed_s, st.optimizer_s, st.overhead_s,
                                     own.total_s, max(s.total_s for s in st.stages), own.overhead_s,
                                     st.num_microbatches)])
    with np.errstate(divide="ignore", invalid="ignore"):
        d = stage_power_arrays(ins, _phases_of_one(busy), gpu, _one(cap_w), c, float(power_scale),
                               _one(extra_wait_s), None if clock is None else _one(clock),
                               _phases_of_one(ep_idle))
    vals = {f: d[f][0].item() for f in d}
    x = vals["clock_ratio"]
    return StagePower(stage=k, sm_clock_mhz=gpu.max_sm_clock_mhz * x if gpu.max_sm_clock_mhz else None, **vals)


# ------------------------------------------------------------------------------------------------
# a layout
# ------------------------------------------------------------------------------------------------

def layout_inputs(model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, c: Constants,
                  caps: float | Sequence[float] | None = None, stages: Sequence[StageTime] | None = None,
                  power_scale: float | Sequence[float] = 1.0) -> PowerInputs:
    """power_arrays.PowerInputs of one layout: one cap for every GPU (default: the cluster's) or
    one per pipeline stage; `stages`: its stage_times() when the caller has them."""
    one = one_layout(model, cluster, cfg, c)
    full = stage_arrays(stages) if stages is not None else one.full
    pp = len(full["gemm_s"])
    cap = [float(cluster.power_cap_w)] * pp if caps is None else (
        [float(caps)] * pp if isinstance(caps, (int, float)) else [float(x) for x in caps])
    if len(cap) != pp:
        raise SpecError(f"{len(cap)} power caps for {pp} pipeline stages")
    scale = np.broadcast_to(np.asarray(power_scale, float), (pp,)).copy()
    return PowerInputs.of(model, cluster, one.L, c, stage_caps=np.array(cap), full=full, power_scale=scale,
                          S=one.S, dp=one.dp)


def estimate_power(model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, c: Constants = DEFAULT,
                   caps: float | Sequence[float] | None = None, stages: Sequence[StageTime] | None = None,
                   power_scale: float | Sequence[float] = 1.0, extra_wait_s: float = 0.0) -> PowerEstimate:
    """Power, clocks, step time, throttling and energy of `cfg` under per-GPU power caps: one cap
    for every GPU (default: the cluster's) or one per pipeline stage. `stages`: stage_times() of
    the layout when the caller has them; `power_scale`: switching-power multiplier per stage
    (hotter or leakier slots; placement); `extra_wait_s`: seconds per step the analytical step
    time does not explain (a calibration's longer step: launch gaps and framework time, spread
    over the microbatches), spent at wait power. (power_arrays.evaluate_power of a Layouts of one.)"""
    inp = layout_inputs(model, cluster, cfg, c, caps, stages, power_scale)
    with np.errstate(divide="ignore", invalid="ignore"):
        return evaluate_power(inp, float(extra_wait_s)).power_estimate(0)[0]


def power_at_step(model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, step_s: float,
                  c: Constants = DEFAULT, stages: Sequence[StageTime] | None = None) -> PowerEstimate:
    """estimate_power for a step known to take `step_s` (measured, or a calibration's):
    power_arrays.power_at_step_arrays of a Layouts of one."""
    inp = layout_inputs(model, cluster, cfg, c, stages=stages)
    with np.errstate(divide="ignore", invalid="ignore"):
        where, _ = power_at_step_arrays(inp, evaluate_power(inp), _one(step_s))
        pa, j = where[0]
        return pa.power_estimate(j)[0]


# ------------------------------------------------------------------------------------------------
# caps: sweep, energy-optimal, per stage
# ------------------------------------------------------------------------------------------------

def cap_grid(gpu, spec: str | Sequence[float] | None = None, step_w: float = 25.0) -> list[float]:
    """Caps to try: "LO:HI:STEP" (watts, inclusive), a list, or the GPU's settable range in 25 W
    steps. Every cap must be settable on the GPU (one-line error otherwise)."""
    if spec is None:
        lo, hi = gpu.min_power_limit_w, gpu.max_power_limit_w
    elif isinstance(spec, str):
        try:
            parts = [float(v) for v in spec.split(":")]
        except ValueError:
            raise SpecError(f"--power-caps {spec!r}: expected LO:HI:STEP in watts, e.g. 300:700:25") from None
        if len(parts) != 3 or not all(math.isfinite(v) for v in parts) or parts[2] <= 0 or parts[0] > parts[1]:
            raise SpecError(f"--power-caps {spec!r}: expected LO:HI:STEP with LO <= HI and STEP > 0, e.g. 300:700:25")
        lo, hi, step_w = parts
    else:
        out = sorted({float(v) for v in spec})
        for v in out:
            gpu.check_power_cap(v)
        return out
    n = int(math.floor((hi - lo) / step_w + 1e-9))
    out = [lo + i * step_w for i in range(n + 1)]
    if out[-1] < hi - 1e-9:
        out.append(hi)
    for v in (out[0], out[-1]):
        gpu.check_power_cap(v)
    return out


@dataclass
class CapPoint:
    power_cap_w: float
    step_time_s: float
    energy_j_per_token: float
    mean_power_w: float
    sm_clock_mhz: float | None
    clock_ratio: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class CapSweep:
    points: list[CapPoint]
    fastest: CapPoint                 # the shortest step (ties: the lowest cap)
    min_energy: CapPoint              # the least J/token
    min_energy_within: CapPoint       # the least J/token with a step within TIME_SLACK of the fastest
    at_default: CapPoint              # at the cluster's cap

    def to_dict(self) -> dict:
        def one(p: CapPoint) -> dict:
            d = p.to_dict()
            d["energy_saved_pct"] = (1 - p.energy_j_per_token / self.at_default.energy_j_per_token) * 100
            d["step_time_change_pct"] = (p.step_time_s / self.at_default.step_time_s - 1) * 100
            return d
        return {"time_slack": TIME_SLACK, "at_cluster_cap": one(self.at_default), "fastest": one(self.fastest),
                "min_energy": one(self.min_energy), "min_energy_within_5pct": one(self.min_energy_within),
                "curve": [p.to_dict() for p in self.points]}


def point(cap_w: float, step_time_s: float, energy_j_per_token: float, mean_power_w: float,
          sm_clock_mhz: float | None, clock_ratio: float) -> CapPoint:
    return CapPoint(cap_w, step_time_s, energy_j_per_token, mean_power_w, sm_clock_mhz, clock_ratio)


def analytical_point(model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, c: Constants, cap_w: float,
                     stages: Sequence[StageTime] | None = None) -> CapPoint:
    e = estimate_power(model, cluster, cfg, c, caps=cap_w, stages=stages)
    return CapPoint(cap_w, e.step.step_time_s, e.energy_j_per_token, e.mean_power_w, e.sm_clock_mhz, e.clock_ratio)


def cap_sweep(evaluate: Callable[[float], CapPoint], grid: Sequence[float], cluster_cap_w: float) -> CapSweep:
    """`evaluate(cap)` at every cap of `grid` (cap_grid; one cap for all GPUs): the fastest cap,
    the cap with the least J/token and the least within TIME_SLACK of the fastest step."""
    pts = [evaluate(v) for v in grid]
    default = next((p for p in pts if p.power_cap_w == cluster_cap_w), None) or evaluate(cluster_cap_w)
    return sweep_of(pts, default)


def sweep_of(pts: Sequence[CapPoint], default: CapPoint) -> CapSweep:
    """The CapSweep of evaluated points (`default`: the point at the cluster's cap)."""
    return CapSweep(pts, Time().select(pts), Energy().select(pts), MaxSlowdown(TIME_SLACK).select(pts), default)


@dataclass
class StageCaps:
    caps_w: list[float]               # per pipeline stage
    energy_j_per_token: float
    energy_saved_pct: float           # vs every stage at the cluster's cap
    step_time_change_pct: float
    stages: list[StagePower]

    def to_dict(self) -> dict:
        return {"caps_w": self.caps_w, "energy_j_per_token": self.energy_j_per_token,
                "energy_saved_pct": self.energy_saved_pct, "step_time_change_pct": self.step_time_change_pct,
                "stages": [{"stage": s.stage, "power_cap_w": s.power_cap_w, "sm_clock_mhz": s.sm_clock_mhz,
                            "mean_power_w": s.mean_power_w, "throttled": s.throttled} for s in self.stages]}


def stage_caps(model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, c: Constants = DEFAULT,
               stages: Sequence[StageTime] | None = None, step_w: float = 25.0,
               max_slowdown: float = 0.001) -> StageCaps:
    """Per-stage caps for the stages off the critical path: each one's cap is lowered in `step_w`
    steps (down to the GPU's minimum) while the step stays within `max_slowdown` of the step with
    every GPU at the cluster's cap (Perseus' energy bloat: a faster stage only waits for the
    slowest, so it can run at a lower clock for free). With one stage there is nothing to do.
    (stage_caps_many of one layout.)"""
    return stage_caps_many(model, cluster, [cfg], c, step_w, max_slowdown, stages=stages)[0]


def stage_caps_many(model: ModelSpec, cluster: ClusterSpec, cfgs: Sequence[TrainConfig], c: Constants = DEFAULT,
                    step_w: float = 25.0, max_slowdown: float = 0.001, base: ClusterSpec | None = None,
                    stages: Sequence[StageTime] | None = None) -> list[StageCaps]:
    """stage_caps of each layout: the greedy search (stages off the critical path, the most
    slack first, each cap lowered in `step_w` steps while the step stays within `max_slowdown`
    and the energy falls), with every depth a stage could be lowered to evaluated in one array
    per round, and the layouts' rounds together. `base`: `cluster` but for its cap (the arrays are
    evaluated on it, with the caps per stage, to reuse its memos); `stages`: the stage times of
    the one layout, when the caller has them."""
    gpu = cluster.gpu
    top = float(cluster.power_cap_w)
    cfgs = list(cfgs)
    L0 = Layouts.of(model, cfgs)
    on = base if base is not None else cluster
    with np.errstate(divide="ignore", invalid="ignore"):
        if stages is not None:
            inp0 = layout_inputs(model, on, cfgs[0], c, caps=top, stages=stages)
        else:
            inp0 = PowerInputs.of(model, on, L0, c, caps=top)
        ref = evaluate_power(inp0)
        S0 = inp0.S
        state = []
        for i, cfg in enumerate(cfgs):
            pp = cfg.pp
            s0 = int(S0.start[i])
            totals = ref.step["totals"][s0:s0 + pp].tolist()
            crit = max(range(pp), key=lambda k: totals[k])
            order = sorted((k for k in range(pp) if k != crit), key=lambda k: totals[k]) if pp > 1 else []
            state.append({"caps": [top] * pp, "cur": (ref, i), "E": float(ref.row["energy_j_per_token"][i]),
                          "order": order, "limit": float(ref.row["step_time_s"][i]) * (1 + max_slowdown)})
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
            inp = dataclasses.replace(inp0.take(np.array(rows)), cap=np.array([v for t in trials for v in t], float))
            for v in set(inp.cap.tolist()):
                gpu.check_power_cap(v)
            R = evaluate_power(inp)
            step, energy = R.row["step_time_s"], R.row["energy_j_per_token"]
            at = 0
            for i, k, n in owner:
                s = state[i]
                for j in range(n):
                    r = at + j
                    if step[r] > s["limit"] or energy[r] >= s["E"]:
                        break
                    s["caps"], s["cur"], s["E"] = trials[r], (R, r), float(energy[r])
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
