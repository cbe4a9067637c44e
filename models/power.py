"""Power, clocks, throttling and energy of one layout under per-GPU power caps. Pure functions.

`estimate_power` is the one place where the advisor gets a power, a clock, a throttle fraction or
an energy: mean and peak power, the SM clock each pipeline stage holds, the step time at those
clocks, throttle risk and energy per token all come out of one evaluation, so no two printed
numbers can disagree.

How (physics in advisor.models.dvfs): each pipeline stage's GPUs run its phases per step (GEMM,
attention, memory-bound kernels, communication) and wait the rest of the step (pipeline fill and
drain, faster stages waiting for the slowest, launch gaps). The power limiter of each GPU averages
over ~30 ms, so the phases of a microbatch are averaged together, and waits take part in
proportion to how short they are. Each stage's clock is the one at which that average meets its
cap; GEMM / attention time stretches with it (partly: dvfs.compute_stretch), memory-bound kernels
a little, communication not at all. The stages' clocks and the pipeline's waits depend on each
other, so they are iterated to a fixed point (a few rounds).

`cap_sweep` evaluates a layout over a range of caps (with the analytical model, or a calibration's
predictions: the caller's `evaluate`): the cap with the least energy per token, and the least
within 5% of the fastest step. `stage_caps` lowers the caps of stages off the critical
path until they would slow the step (Perseus' "energy bloat", SOSP'24).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from advisor.catalog.specs import ClusterSpec, ModelSpec, SpecError, TrainConfig
from advisor.models import dvfs
from advisor.models.constants import DEFAULT, Constants
from advisor.models.dvfs import Phase
from advisor.models.objectives import TIME_SLACK, Energy, MaxSlowdown, Time
from advisor.models.step_time import StageTime, StepTime, stage_times, step_time


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
# one stage
# ------------------------------------------------------------------------------------------------

def busy_phases(full: StageTime, m: int, c: Constants, fp8: bool = False) -> list[Phase]:
    """A stage's work per step at the maximum clocks, as DVFS phases."""
    out = [Phase("gemm", (full.gemm_s + full.recompute_s) * m, utilization=full.gemm_utilization, fp8=fp8),
           Phase("attention", full.attention_s * m),
           Phase("memory", full.memory_bound_s * m, utilization=c.memory_power_bandwidth),
           Phase("comm", full.comm_s * m)]
    return [p for p in out if p.seconds > 0]


def ep_idle_phases(full: StageTime, m: int, c: Constants, fp8: bool = False) -> list[Phase]:
    """The experts' work the busiest EP rank does beyond the mean rank, per step at the maximum
    clocks, as DVFS phases: the mean rank spends that time waiting in the all-to-all."""
    out = [Phase("gemm", full.moe_ep_idle_compute_s * m, utilization=full.gemm_utilization, fp8=fp8),
           Phase("memory", full.moe_ep_idle_memory_s * m, utilization=c.memory_power_bandwidth)]
    return [p for p in out if p.seconds > 0]


def _waits(st: StepTime, k: int, m: int, c: Constants, extra_wait_s: float = 0.0
           ) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Stage k's idle time in the step `st` (at its clocks), as (seconds, limiter weight): waits
    inside collectives (for the slowest stage each microbatch, pipeline fill and drain, the step's
    end) and gaps with no kernel (launch / framework gaps, and `extra_wait_s`: time the analytical
    step does not explain; negative: host time the step did not take, out of the launch gaps)."""
    own = st.stages[k].total_s
    slow = max(s.total_s for s in st.stages)
    fill = max(0.0, st.pipeline_s - m * slow)
    w = dvfs.limiter_weight
    waits = [(m * (slow - own), w(slow - own, c)), (fill, w(fill / 2, c)), (st.overhead_s, w(st.overhead_s, c))]
    gaps = [(m * st.stages[k].overhead_s + min(0.0, extra_wait_s), 1.0)]
    if extra_wait_s > 0:
        gaps.append((extra_wait_s, w(extra_wait_s / m, c)))
    return [x for x in waits if x[0] > 0], [x for x in gaps if x[0] > 0]


def _step_end_phases(st: StepTime, c: Constants) -> list[Phase]:
    """DP communication left exposed and the optimizer: at the end of every stage's step."""
    out = [Phase("comm", st.dp_exposed_s), Phase("memory", st.optimizer_s, utilization=c.memory_power_bandwidth)]
    return [p for p in out if p.seconds > 0]


def busiest_stretch(busy: dvfs.Load, end: list[Phase], x: float, gpu, c: Constants,
                    power_scale: float = 1.0) -> float:
    """Watts of the busiest stretch that the power limiter's ~30 ms average and a 20-50 Hz sample
    see at clock ratio x: a microbatch's compute (`busy`: its phases' Load) averaged over its
    kernels (each of them ms long), or a step-end phase. A single kernel over the cap inside a
    microbatch under it trips neither (measured: MoE runs whose attention and GEMM kernels would
    each draw 750-800 W at full clock show no power-cap clock-event reason while their microbatch
    averages 600-650 W)."""
    return max([busy.power(x, gpu, c, power_scale)] + [dvfs.phase_power(p, x, gpu, c, power_scale) for p in end])


def peak(phase_peak_w: float, throttled: bool, c: Constants) -> float:
    """Sampled peak (20-50 Hz NVML instant power) of a GPU whose busiest stretch (a microbatch's
    compute, averaged over its kernels, or a step-end phase) draws phase_peak_w at the clock it
    holds: under a cap the limiter's clock oscillation adds peak_overshoot of it, otherwise the
    ripple (constants)."""
    return phase_peak_w * ((1.0 + c.peak_overshoot) if throttled else c.power_ripple)


def stage_power(st: StepTime, k: int, busy: list[Phase], gpu, cap_w: float, c: Constants = DEFAULT,
                power_scale: float = 1.0, extra_wait_s: float = 0.0, clock: float | None = None,
                ep_idle: Sequence[Phase] = ()) -> StagePower:
    """Stage k's GPUs in the step `st` (at its clocks): the clock its cap holds (or `clock` when
    given), and its power and energy. `busy`: busy_phases() of the stage, its busiest EP rank's
    (which sets the clock, the step and the peaks); `ep_idle`: ep_idle_phases(), the part of that
    work the mean EP rank does not do and waits instead (its mean power and energy are the
    stage's: the mean over the stage's GPUs)."""
    m = st.num_microbatches
    end = _step_end_phases(st, c)
    waits, gaps = _waits(st, k, m, c, extra_wait_s)
    # the limiter averages ~30 ms: a step-end phase longer than that (the optimizer) is seen on its
    # own, like a wait, with weight window / (window + L); it does not dilute the microbatches
    seen = [dataclasses.replace(p, seconds=p.seconds * dvfs.limiter_weight(p.seconds, c)) for p in end]
    load = dvfs.Load.of(busy + seen, waits, c, gaps)
    sol = dvfs.solve_load(load, gpu, cap_w, c, power_scale)
    x = sol.x if clock is None else clock
    work = dvfs.Load.of(busy + end, (), c)
    busy_s = work.seconds(x)
    gap_s = sum(length for length, _ in gaps)
    step_s = max(st.step_time_s, busy_s + gap_s)  # a stage slowed below the step's pace sets the step
    idle = dvfs.Load(wait_s=step_s - busy_s - gap_s, gap_s=gap_s)
    p_wait = dvfs.Load(wait_s=1.0).power(x, gpu, c, power_scale)
    e = work.power(x, gpu, c, power_scale) * busy_s + idle.power(x, gpu, c, power_scale) * idle.seconds(x)
    if ep_idle:
        spare = dvfs.Load.of(ep_idle, (), c)
        e -= spare.seconds(x) * (spare.power(x, gpu, c, power_scale) - p_wait)
    mb = dvfs.Load.of(busy, (), c)
    phase_peak = busiest_stretch(mb, end, x, gpu, c, power_scale)
    stretch_demand = busiest_stretch(mb, end, 1.0, gpu, c, power_scale)
    return StagePower(
        stage=k, power_cap_w=cap_w, clock_ratio=x, sm_clock_mhz=gpu.max_sm_clock_mhz * x if gpu.max_sm_clock_mhz else None,
        demand_w=sol.demand_w, busy_power_w=load.power(x, gpu, c, power_scale), mean_power_w=e / step_s,
        peak_power_w=peak(phase_peak, sol.capped, c), throttled=sol.capped, busy_s=busy_s, energy_j=e,
        spiking=stretch_demand > cap_w, stretch_demand_w=stretch_demand)


# ------------------------------------------------------------------------------------------------
# the one function
# ------------------------------------------------------------------------------------------------

def estimate_power(model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, c: Constants = DEFAULT,
                   caps: float | Sequence[float] | None = None, stages: Sequence[StageTime] | None = None,
                   power_scale: float | Sequence[float] = 1.0, extra_wait_s: float = 0.0) -> PowerEstimate:
    """Power, clocks, step time, throttling and energy of `cfg` under per-GPU power caps: one cap
    for every GPU (default: the cluster's) or one per pipeline stage. `stages`: stage_times() of
    the layout when the caller has them; `power_scale`: switching-power multiplier per stage
    (hotter or leakier slots; placement); `extra_wait_s`: seconds per step the analytical step
    time does not explain (a calibration's longer step: launch gaps and framework time, spread
    over the microbatches), spent at wait power."""
    gpu = cluster.gpu
    full = list(stages) if stages is not None else stage_times(model, cluster, cfg, c)
    pp = len(full)
    cap = [float(cluster.power_cap_w)] * pp if caps is None else (
        [float(caps)] * pp if isinstance(caps, (int, float)) else [float(x) for x in caps])
    if len(cap) != pp:
        raise SpecError(f"{len(cap)} power caps for {pp} pipeline stages")
    for v in cap:
        gpu.check_power_cap(v)
    scale = [float(power_scale)] * pp if isinstance(power_scale, (int, float)) else list(power_scale)
    m = cfg.num_microbatches
    fp8 = cfg.precision != "bf16"  # quantized GEMMs (FP8 / MXFP8 / NVFP4): the FP8 power factor
    busy = [busy_phases(s, m, c, fp8) for s in full]
    base = step_time(model, cluster, cfg, c, stages=full)
    # launch gaps can give back time (a negative extra), down to the shortest stage's gaps
    extra = max(-launch_gaps(full, m), float(extra_wait_s))

    def at(clocks: list[float]) -> StepTime:
        s = step_time(model, cluster, cfg, c, sm_clock=clocks, stages=full) if any(v < 1.0 for v in clocks) else base
        return dataclasses.replace(s, step_time_s=s.step_time_s + extra) if extra else s

    x = [1.0] * pp
    st = at(x)
    per_stage: list[StagePower] = []
    for _ in range(12):
        per_stage = [stage_power(st, k, busy[k], gpu, cap[k], c, scale[k], extra) for k in range(pp)]
        new = [s.clock_ratio for s in per_stage]
        done = max(abs(a - b) for a, b in zip(new, x)) < 2e-4  # 0.4 MHz on a 1,980 MHz GPU
        x = new
        st = at(x)
        if done:
            break
    idle_ep = [ep_idle_phases(s, m, c, fp8) for s in full]
    per_stage = [stage_power(st, k, busy[k], gpu, cap[k], c, scale[k], extra, clock=x[k], ep_idle=idle_ep[k])
                 for k in range(pp)]
    return aggregate(cluster, cfg, c, per_stage, st, base, x, extra)


def aggregate(cluster: ClusterSpec, cfg: TrainConfig, c: Constants, per_stage: list[StagePower], st: StepTime,
              base: StepTime, x: Sequence[float], extra: float) -> PowerEstimate:
    """The PowerEstimate of a layout from its stages' powers at the clocks `x` they hold, the step
    `st` at those clocks (with `extra` seconds of unexplained wait in it) and the step `base` at
    the maximum clocks (models.vectorized builds the same from arrays and calls this too)."""
    gpu = cluster.gpu
    pp = len(per_stage)
    gpus_per_stage = cluster.world_size / pp
    energy = sum(s.energy_j for s in per_stage) * gpus_per_stage
    mean = energy / gpus_per_stage / pp / st.step_time_s
    crit = max(range(pp), key=lambda k: st.stages[k].total_s)
    hot = max(per_stage, key=lambda s: s.mean_power_w)
    demand_peak = max(s.stretch_demand_w for s in per_stage)
    busiest = max(per_stage, key=lambda s: s.demand_w)
    slowdown = (st.step_time_s - extra) / base.step_time_s
    temp = c.idle_temp_c + c.c_per_w * (hot.mean_power_w - gpu.idle_w)
    risk, label, reason = _risk(per_stage, busiest, crit, slowdown, demand_peak, temp, gpu, c)
    return PowerEstimate(
        mean_power_w=mean, peak_power_w=max(s.peak_power_w for s in per_stage), demand_mean_w=busiest.demand_w,
        demand_peak_w=demand_peak, power_cap_w=float(cluster.power_cap_w), sm_clock_mhz=per_stage[crit].sm_clock_mhz,
        clock_ratio=x[crit], slowdown=slowdown,
        throttle_fraction=sum(s.throttled or s.spiking for s in per_stage) / pp,
        energy_j_per_step=energy, energy_j_per_token=energy / cfg.tokens_per_step, steady_temp_c=temp,
        throttle_risk=risk, throttle_label=label, throttle_reason=reason, stages=per_stage, step=st)


def launch_gaps(stages: Sequence[StageTime], m: int) -> float:
    """Seconds per step of the launch / host gaps of the stage with the fewest (no kernel runs)."""
    return m * min(s.overhead_s for s in stages)


def power_at_step(model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, step_s: float,
                  c: Constants = DEFAULT, stages: Sequence[StageTime] | None = None) -> PowerEstimate:
    """estimate_power for a step known to take `step_s` (measured, or a calibration's): the time
    the analytical step does not explain is spent in short waits (extra_wait_s), found so that the
    step at the clocks the cap then holds is `step_s` (3 rounds). A step shorter than the model's
    is taken out of the model's launch gaps (host time: what the model knows least; the GPU's work
    comes from FLOPs and bytes), as far as they go; beyond them the model's step stays."""
    full = list(stages) if stages is not None else stage_times(model, cluster, cfg, c)
    e = estimate_power(model, cluster, cfg, c, stages=full)
    floor = -launch_gaps(full, cfg.num_microbatches)
    extra = 0.0
    for _ in range(3):
        gap = step_s - e.step.step_time_s
        if abs(gap) < 1e-4 * step_s or (gap < 0 and extra <= floor + 1e-12):
            break
        extra = max(floor, extra + gap)
        e = estimate_power(model, cluster, cfg, c, stages=full, extra_wait_s=extra)
    return e


def _risk(stages: list[StagePower], busiest: StagePower, crit: int, slowdown: float, demand_peak: float,
          temp: float, gpu, c: Constants) -> tuple[float, str, str]:
    """Throttle risk score (a presentation scale, constants.py) and the one-line reason, worded
    from the same numbers the prediction prints."""
    cap = busiest.power_cap_w
    where = f"stage {busiest.stage}" if len(stages) > 1 else "the GPUs"
    if slowdown > 1.0 + 1e-6 or busiest.throttled:
        r_power = min(1.0, c.throttle_risk_sustained_base + (slowdown - 1.0) * c.throttle_risk_per_slowdown)
        s = stages[crit]
        clk = f"{s.sm_clock_mhz:,.0f} MHz" if s.sm_clock_mhz else f"{s.clock_ratio:.0%} of the maximum clock"
        reason = (f"power cap: {where} would draw {busiest.demand_w:.0f} W at full clock > {cap:.0f} W; "
                  f"clock held at {clk}, step {(slowdown - 1) * 100:.1f}% slower than at full clock")
        if busiest.busy_power_w > cap * (1.0 + 1e-3):
            # the lowest clock the model knows (min_clock_ratio) still draws more than the cap: the
            # driver would have to go further (clock gating, power brake), which is not modelled
            reason += (f"; even at that clock it draws {busiest.busy_power_w:.0f} W > {cap:.0f} W: a cap this low "
                       f"cannot be held by the clock alone (expect a slower step than predicted)")
    elif demand_peak > cap:
        r_power = c.throttle_risk_spike_base + c.throttle_risk_spike_span * min(
            1.0, (demand_peak - cap) / (c.throttle_spike_full_excess * cap))
        reason = (f"power spikes: the busiest stretch draws {demand_peak:.0f} W at full clock > {cap:.0f} W cap "
                  f"(brief clock dips; the ~30 ms average stays under it)")
    else:
        r_power = c.throttle_risk_low_span * max(
            0.0, (demand_peak - c.throttle_low_start * cap) / (c.throttle_low_range * cap))
        reason = "none"
    limit = gpu.slowdown_temp_c
    r_thermal = max(0.0, min(1.0, (temp - (limit - c.thermal_margin_c)) / c.thermal_margin_c))
    if r_thermal > r_power:
        reason = f"thermal: predicted {temp:.0f} °C vs {limit:.0f} °C slowdown"
    risk = max(r_power, r_thermal)
    label = "high" if risk >= c.throttle_label_high else "medium" if risk >= c.throttle_label_medium else "low"
    return risk, label, reason


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
    slowest, so it can run at a lower clock for free). With one stage there is nothing to do."""
    gpu = cluster.gpu
    full = list(stages) if stages is not None else stage_times(model, cluster, cfg, c)
    pp = len(full)
    top = float(cluster.power_cap_w)
    ref = estimate_power(model, cluster, cfg, c, caps=top, stages=full)
    limit = ref.step.step_time_s * (1 + max_slowdown)
    caps = [top] * pp
    cur = ref
    if pp > 1:
        crit = max(range(pp), key=lambda k: ref.step.stages[k].total_s)
        order = sorted((k for k in range(pp) if k != crit), key=lambda k: ref.step.stages[k].total_s)
        for k in order:  # the stage with the most slack first
            while caps[k] - step_w >= gpu.min_power_limit_w - 1e-9:
                trial = list(caps)
                trial[k] = caps[k] - step_w
                e = estimate_power(model, cluster, cfg, c, caps=trial, stages=full)
                if e.step.step_time_s > limit or e.energy_j_per_token >= cur.energy_j_per_token:
                    break
                caps, cur = trial, e
    saved = (1 - cur.energy_j_per_token / ref.energy_j_per_token) * 100
    return StageCaps(caps, cur.energy_j_per_token, saved,
                     (cur.step.step_time_s / ref.step.step_time_s - 1) * 100, cur.stages)
