"""DVFS physics of one GPU: power and speed of each phase of a step as functions of the SM clock,
and the clock a power cap holds. Pure functions; the constants are in models/constants.py
("DVFS"), fitted on the H100 load sweep of data/dvfs/ (bench/dvfs_fit.py).

Model (CMOS dynamic power, P = C·V²·f per unit of activity), x = f / f_max of the GPU:

  v(x)     = max(v_min, 1 - vf_slope·(1 - x))           voltage / voltage at f_max (linear V-f
                                                          above the floor of the V-f table)
  s_p(x)   = share_p / x + (1 - share_p)                 time of phase p at x over its time at
                                                          f_max: `share_p` of it runs at the SM
                                                          clock, the rest (memory, latency) does not
  P_p(x)   = P_idle + D·[clock·x + W_p / s_p(x)]·v(x)² + D·hbm_p·k_hbm
                                                          idle + clock tree + switching (energy per
                                                          operation ∝ V², operations per second
                                                          ∝ 1 / s_p) + HBM, which runs on its own
                                                          clock and voltage; k_hbm the GPU's memory
                                                          power over the H100's (GPUSpec.
                                                          hbm_power_scale: H200's HBM3e 1.32)
  D        = the GPU's dynamic power span (GPUSpec.power_span_w): TDP - P_idle of the board the
             fractions are sized on; a board that runs the same chip at the same clocks under a
             higher limit (GB300: GB200's span, B300: B200's) keeps the chip's span, and its extra
             limit raises the clock the cap holds
  W_gemm   = gemm_power · u^gemm_power_exponent          u: GEMM utilisation (achieved / best rate
                                                          at f_max); small GEMMs move more bytes
                                                          per FLOP, so power falls slower than u

The power limiter holds the power it averages over `limiter_window_s` at the cap: phases shorter
than the window (the kernels of a microbatch) are averaged; a wait of length L takes part with
weight window / (window + L). Under a cap the clock is the one at which that average meets the
cap (`solve_clock`); nothing here stretches time by the cap directly.

Every function takes floats or numpy arrays (one value per pipeline stage of many layouts:
models/power_arrays.py runs them on arrays; a single stage is a float or an array of one).
Array callers run them under np.errstate(divide="ignore", invalid="ignore"): a stage with no time
at all takes the t <= 0 branch of Load.power through np.where.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from advisor.catalog.specs import GPUSpec
from advisor.models.constants import DEFAULT, Constants

PHASES = ("gemm", "attention", "memory", "comm", "wait")


def where(cond, a, b):
    """`a` where `cond` holds, else `b`: np.where on arrays, a branch on a float."""
    if isinstance(cond, np.ndarray):
        return np.where(cond, a, b)
    return a if cond else b


def positive(v):
    """max(v, 0) of a float or an array."""
    return np.maximum(v, 0.0) if isinstance(v, np.ndarray) else max(v, 0.0)


def voltage(x, c: Constants = DEFAULT):
    """Supply voltage at clock ratio x, relative to the voltage at the maximum clock."""
    v = 1.0 - c.vf_slope * (1.0 - x)
    return np.maximum(c.vf_min_voltage, v) if isinstance(v, np.ndarray) else max(c.vf_min_voltage, v)


def stretch(x: float, share: float) -> float:
    """Time of a phase at clock ratio x over its time at the maximum clock, when `share` of it
    scales with the clock (1: all of it, 0: none)."""
    return share / x + (1.0 - share)


def compute_stretch(x: float, c: Constants = DEFAULT) -> float:
    """GEMM, attention and recompute phases (measured on H100: GEMM throughput ∝ x^~0.5 between
    1,380 and 1,950 MHz, data/dvfs/)."""
    return stretch(x, c.gemm_clock_share)


def memory_stretch(x_sm: float, x_mem: float = 1.0, c: Constants = DEFAULT) -> float:
    """Memory-bound kernels: the HBM clock sets most of their time, the SM clock the rest."""
    s = c.memory_sm_clock_share
    return s / x_sm + (1.0 - s) / x_mem


@dataclass(frozen=True)
class Phase:
    """One kind of work on one GPU: seconds per step at the maximum clock, and its activity."""

    kind: str          # one of PHASES
    seconds: float     # at the maximum clock (or an array: one per stage)
    utilization: float = 1.0   # GEMM: achieved / best rate at f_max; memory-bound: HBM bandwidth / peak
    fp8: bool = False  # quantized GEMMs (or an array of flags)


def clock_share(kind: str, c: Constants = DEFAULT) -> float:
    """Share of a phase's time that runs at the SM clock (the rest does not stretch)."""
    if kind in ("gemm", "attention"):
        return c.gemm_clock_share
    return c.memory_sm_clock_share if kind == "memory" else 0.0


def phase_stretch(p: Phase, x, c: Constants = DEFAULT):
    if p.kind in ("gemm", "attention"):
        return compute_stretch(x, c)
    if p.kind == "memory":
        return memory_stretch(x, 1.0, c)
    return 1.0


def phase_dynamic(p: Phase, c: Constants = DEFAULT) -> tuple:
    """(switching power at f_max and v = 1, HBM power), as fractions of the power span (GPUSpec.power_span_w)."""
    if p.kind == "gemm":
        w = c.gemm_power * positive(p.utilization) ** c.gemm_power_exponent
        return (w * where(p.fp8 != 0, c.fp8_gemm_power, 1.0), 0.0)
    if p.kind == "attention":
        return (c.attention_power, 0.0)
    if p.kind == "memory":
        b = positive(p.utilization)  # bytes per second: both parts scale with them
        return (c.memory_sm_power * b, c.memory_hbm_power * b)
    if p.kind == "comm":
        return (c.comm_power, 0.0)
    return (c.wait_power, 0.0)


def phase_power(p: Phase, x, gpu: GPUSpec, c: Constants = DEFAULT, power_scale=1.0):
    """Watts of phase p at clock ratio x. `power_scale` multiplies the switching power (hotter or
    leakier silicon needs more power for the same work; placement uses it)."""
    span = gpu.power_span_w
    w, hbm = phase_dynamic(p, c)
    v2 = voltage(x, c) ** 2
    return gpu.idle_w + span * ((c.clock_power * x + w / phase_stretch(p, x, c)) * v2 * power_scale
                                + hbm * gpu.hbm_power_scale)


@dataclass(frozen=True)
class Load:
    """What one GPU runs in one limiter average, reduced to the sums its power needs (seconds at
    the maximum clock): t1 scales with the SM clock, t0 does not; `switch` is the switching
    energy at v = 1 (seconds x fractions of the power span); waits and gaps in seconds."""

    t1: float = 0.0       # seconds that scale with 1 / x
    t0: float = 0.0       # seconds that do not
    switch: float = 0.0   # sum of seconds x switching power (fractions of the power span), at v = 1
    hbm1: float = 0.0     # sum of seconds x HBM power, the part that scales with 1 / x
    hbm0: float = 0.0
    wait_s: float = 0.0   # waiting on a peer inside a collective kernel (NCCL polls: wait_power)
    gap_s: float = 0.0    # no kernel at all (launch gaps, host time): the awake GPU's clock tree only

    @classmethod
    def of(cls, phases: Sequence[Phase], waits: Sequence[tuple[float, float]] = (), c: Constants = DEFAULT,
           gaps: Sequence[tuple[float, float]] = ()) -> "Load":
        """Busy phases plus waits and gaps given as (length, weight): w·L seconds of each."""
        t1 = t0 = sw = h1 = h0 = 0.0
        for p in phases:
            share = clock_share(p.kind, c)
            w, hbm = phase_dynamic(p, c)
            t1 += p.seconds * share
            t0 += p.seconds * (1.0 - share)
            sw += p.seconds * w  # W_p / s_p(x) x t_p s_p(x) = W_p t_p: switching energy ignores x
            h1 += p.seconds * share * hbm
            h0 += p.seconds * (1.0 - share) * hbm
        return cls(t1, t0, sw, h1, h0, sum(length * weight for length, weight in waits),
                   sum(length * weight for length, weight in gaps))

    def seconds(self, x):
        return self.t1 / x + self.t0 + self.wait_s + self.gap_s

    def power(self, x, gpu: GPUSpec, c: Constants = DEFAULT, power_scale=1.0):
        """Average watts at clock ratio x (the phases' power, time-weighted, in closed form); with
        no time at all, the clock tree's."""
        t = self.seconds(x)
        span = gpu.power_span_w
        v2 = voltage(x, c) ** 2
        if not isinstance(t, np.ndarray) and t <= 0:
            return gpu.idle_w + span * c.clock_power * x * v2 * power_scale
        e = (c.clock_power * x * t + self.switch + c.wait_power * self.wait_s) * v2 * power_scale
        e = e + (self.hbm1 / x + self.hbm0) * gpu.hbm_power_scale
        busy = gpu.idle_w + span * e / t
        if isinstance(t, np.ndarray):
            empty = t <= 0
            if empty.any():
                return np.where(empty, gpu.idle_w + span * c.clock_power * x * v2 * power_scale, busy)
        return busy

    def take(self, idx) -> "Load":
        """The stages `idx` of a Load of arrays (float fields stay)."""
        return Load(*[v[idx] if isinstance(v, np.ndarray) else v for v in self.parts()])

    def parts(self) -> tuple:
        return (self.t1, self.t0, self.switch, self.hbm1, self.hbm0, self.wait_s, self.gap_s)


def min_clock_ratio(c: Constants = DEFAULT) -> float:
    return c.min_clock_ratio


@dataclass(frozen=True)
class ClockSolution:
    x: float               # clock ratio held
    busy_power_w: float    # what the limiter averages, at x
    demand_w: float        # the same at the maximum clock
    capped: bool


def averaged_power(busy: list[Phase], waits: list[tuple[float, float]], x: float, gpu: GPUSpec,
                   c: Constants, power_scale: float) -> float:
    """Power the limiter sees at clock ratio x: the busy phases (stretched by x) plus each wait
    (length L, weight w) as w·L seconds of the wait phase."""
    return Load.of(busy, waits, c).power(x, gpu, c, power_scale)


def limiter_weight(length_s, c: Constants = DEFAULT):
    """How much a wait of this length counts in the limiter's average (1 for short waits)."""
    return c.limiter_window_s / (c.limiter_window_s + positive(length_s))


def solve_load(load: Load, gpu: GPUSpec, cap_w: float, c: Constants = DEFAULT,
               power_scale: float = 1.0) -> ClockSolution:
    """The clock ratio at which `load`'s average power meets `cap_w` (1 when it stays below the
    cap at the maximum clock; the lowest clock if even that is over). Power rises with x.
    (solve_loads on a Load of one.)"""
    one = Load(*[np.atleast_1d(np.asarray(v, float)) for v in load.parts()])
    with np.errstate(divide="ignore", invalid="ignore"):
        x, demand, capped = solve_loads(one, gpu, np.array([float(cap_w)]), c, power_scale)
        busy = one.power(x, gpu, c, power_scale)
    return ClockSolution(float(x[0]), float(busy[0]), float(demand[0]), bool(capped[0]))


def solve_loads(load: Load, gpu: GPUSpec, cap, c: Constants = DEFAULT, power_scale=1.0):
    """solve_load of every stage of a Load of arrays (`cap`, `power_scale`: arrays or floats):
    (clock ratio, power at the maximum clock, capped), arrays. Regula falsi (Illinois variant) on
    the stages still unsolved, each with its own iterations and stopping rule (|hi - lo| < 1e-7
    or within 1e-6 W of the cap, at most 60 steps; the clock held is the bracket's low end)."""
    demand = load.power(1.0, gpu, c, power_scale)
    cap = np.broadcast_to(np.asarray(cap, float), np.shape(demand))
    capped = demand > cap
    lo_x = min_clock_ratio(c)
    p_lo = load.power(np.full_like(demand, lo_x), gpu, c, power_scale)
    x = np.where(capped, lo_x, 1.0)
    idx = np.flatnonzero(capped & (p_lo < cap))
    if not len(idx):
        return x, demand, capped
    part = load.take(idx)
    capv = cap[idx]
    psv = power_scale[idx] if isinstance(power_scale, np.ndarray) else power_scale
    lo = np.full(len(idx), lo_x)
    hi = np.ones(len(idx))
    f_lo = p_lo[idx] - capv
    f_hi = demand[idx] - capv
    side = np.zeros(len(idx), np.int8)
    for _ in range(60):
        mid = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
        f = part.power(mid, gpu, c, psv) - capv
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
            part = part.take(keep)
            psv = psv[keep] if isinstance(psv, np.ndarray) else psv
    else:
        x[idx] = lo
    return x, demand, capped


def solve_clock(busy: list[Phase], waits: list[tuple[float, float]], gpu: GPUSpec, cap_w: float,
                c: Constants = DEFAULT, power_scale: float = 1.0) -> ClockSolution:
    """solve_load of busy phases and (length, weight) waits."""
    return solve_load(Load.of(busy, waits, c), gpu, cap_w, c, power_scale)


_SCALES: dict = {}


def power_scale_for_speed(speed: float, gpu: GPUSpec, cap_w: float, c: Constants = DEFAULT) -> float:
    """The switching-power multiplier under which a saturating GEMM at `cap_w` runs at `speed`
    times the rate it has with multiplier 1 (a slot measured `speed` fast under the cap: its
    silicon needs 1 / that much more power per operation, in this model's terms).
    (power_scales_for_speeds of one.)"""
    return power_scales_for_speeds([speed], gpu, cap_w, c)[0]


def power_scales_for_speeds(speeds: Sequence[float], gpu: GPUSpec, cap_w: float, c: Constants = DEFAULT
                            ) -> list[float]:
    """power_scale_for_speed of each speed: the multipliers not found before are bisected
    together (geometric bisection in [0.2, 5], 50 steps, each step one solve_loads of all of them;
    the time of a saturating GEMM scales with compute_stretch of the clock the cap holds)."""
    key = (gpu, float(cap_w), c)
    miss = sorted({float(v) for v in speeds if (float(v), key) not in _SCALES})
    if miss:
        if len(_SCALES) > 4096:
            _SCALES.clear()
        g = [Phase("gemm", 1.0)]
        base = solve_clock(g, [], gpu, cap_w, c)
        got = np.ones(len(miss))
        speed = np.array(miss)
        ok = speed > 0
        if base.capped and ok.any():
            target = compute_stretch(base.x, c) / speed[ok]
            load = Load(*[np.full(int(ok.sum()), v) for v in Load.of(g, (), c).parts()])
            lo, hi = np.full(len(target), 0.2), np.full(len(target), 5.0)
            with np.errstate(divide="ignore", invalid="ignore"):
                for _ in range(50):
                    mid = np.sqrt(lo * hi)
                    slower = compute_stretch(solve_loads(load, gpu, cap_w, c, mid)[0], c) > target
                    hi = np.where(slower, mid, hi)
                    lo = np.where(slower, lo, mid)
            got[ok] = np.sqrt(lo * hi)
        _SCALES.update(((v, key), x) for v, x in zip(miss, got.tolist()))
    return [_SCALES[(float(v), key)] for v in speeds]
