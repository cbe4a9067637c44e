"""DVFS physics of one GPU: power and speed of each phase of a step as functions of the SM clock,
and the clock a power cap holds. Pure functions; the constants are in models/constants.py
("DVFS"), fitted on the H100 load sweep of data/dvfs/ (bench/dvfs_fit.py).

Model (CMOS dynamic power, P = C·V²·f per unit of activity), x = f / f_max of the GPU:

  v(x)     = max(v_min, 1 - vf_slope·(1 - x))           voltage / voltage at f_max (linear V-f
                                                          above the floor of the V-f table)
  s_p(x)   = share_p / x + (1 - share_p)                 time of phase p at x over its time at
                                                          f_max: `share_p` of it runs at the SM
                                                          clock, the rest (memory, latency) does not
  P_p(x)   = P_idle + (TDP - P_idle)·[clock·x + W_p / s_p(x)]·v(x)² + (TDP - P_idle)·hbm_p
                                                          idle + clock tree + switching (energy per
                                                          operation ∝ V², operations per second
                                                          ∝ 1 / s_p) + HBM, which runs on its own
                                                          clock and voltage
  W_gemm   = gemm_power · u^gemm_power_exponent          u: GEMM utilisation (achieved / best rate
                                                          at f_max); small GEMMs move more bytes
                                                          per FLOP, so power falls slower than u

The power limiter holds the power it averages over `limiter_window_s` at the cap: phases shorter
than the window (the kernels of a microbatch) are averaged; a wait of length L takes part with
weight window / (window + L). Under a cap the clock is the one at which that average meets the
cap (`solve_clock`); nothing here stretches time by the cap directly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from advisor.catalog.specs import GPUSpec
from advisor.models.constants import DEFAULT, Constants

PHASES = ("gemm", "attention", "memory", "comm", "wait")


def voltage(x: float, c: Constants = DEFAULT) -> float:
    """Supply voltage at clock ratio x, relative to the voltage at the maximum clock."""
    return max(c.vf_min_voltage, 1.0 - c.vf_slope * (1.0 - x))


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
    seconds: float     # at the maximum clock
    utilization: float = 1.0   # GEMM: achieved / best rate at f_max; memory-bound: HBM bandwidth / peak
    fp8: bool = False


def phase_stretch(p: Phase, x: float, c: Constants = DEFAULT) -> float:
    if p.kind in ("gemm", "attention"):
        return compute_stretch(x, c)
    if p.kind == "memory":
        return memory_stretch(x, 1.0, c)
    return 1.0


def phase_dynamic(p: Phase, c: Constants = DEFAULT) -> tuple[float, float]:
    """(switching power at f_max and v = 1, HBM power), as fractions of TDP - idle."""
    if p.kind == "gemm":
        w = c.gemm_power * max(p.utilization, 0.0) ** c.gemm_power_exponent
        return (w * (c.fp8_gemm_power if p.fp8 else 1.0), 0.0)
    if p.kind == "attention":
        return (c.attention_power, 0.0)
    if p.kind == "memory":
        b = max(p.utilization, 0.0)  # bytes per second: both parts scale with them
        return (c.memory_sm_power * b, c.memory_hbm_power * b)
    if p.kind == "comm":
        return (c.comm_power, 0.0)
    return (c.wait_power, 0.0)


def phase_power(p: Phase, x: float, gpu: GPUSpec, c: Constants = DEFAULT, power_scale: float = 1.0) -> float:
    """Watts of phase p at clock ratio x. `power_scale` multiplies the switching power (hotter or
    leakier silicon needs more power for the same work; placement uses it)."""
    span = gpu.tdp_w - gpu.idle_w
    w, hbm = phase_dynamic(p, c)
    v2 = voltage(x, c) ** 2
    return gpu.idle_w + span * ((c.clock_power * x + w / phase_stretch(p, x, c)) * v2 * power_scale + hbm)


@dataclass(frozen=True)
class Load:
    """What one GPU runs in one limiter average, reduced to the sums its power needs (seconds at
    the maximum clock): t1 scales with the SM clock, t0 does not; `switch` is the switching
    energy at v = 1 (seconds x fractions of TDP - idle); waits and gaps in seconds."""

    t1: float = 0.0       # seconds that scale with 1 / x
    t0: float = 0.0       # seconds that do not
    switch: float = 0.0   # sum of seconds x switching power (fractions of TDP - idle), at v = 1
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
            share = c.gemm_clock_share if p.kind in ("gemm", "attention") else (
                c.memory_sm_clock_share if p.kind == "memory" else 0.0)
            w, hbm = phase_dynamic(p, c)
            t1 += p.seconds * share
            t0 += p.seconds * (1.0 - share)
            sw += p.seconds * w  # W_p / s_p(x) x t_p s_p(x) = W_p t_p: switching energy ignores x
            h1 += p.seconds * share * hbm
            h0 += p.seconds * (1.0 - share) * hbm
        return cls(t1, t0, sw, h1, h0, sum(length * weight for length, weight in waits),
                   sum(length * weight for length, weight in gaps))

    def seconds(self, x: float) -> float:
        return self.t1 / x + self.t0 + self.wait_s + self.gap_s

    def power(self, x: float, gpu: GPUSpec, c: Constants = DEFAULT, power_scale: float = 1.0) -> float:
        """Average watts at clock ratio x (the phases' power, time-weighted, in closed form)."""
        t = self.seconds(x)
        if t <= 0:
            return gpu.idle_w + (gpu.tdp_w - gpu.idle_w) * c.clock_power * x * voltage(x, c) ** 2 * power_scale
        v2 = voltage(x, c) ** 2
        e = (c.clock_power * x * t + self.switch + c.wait_power * self.wait_s) * v2 * power_scale
        e += self.hbm1 / x + self.hbm0
        return gpu.idle_w + (gpu.tdp_w - gpu.idle_w) * e / t


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


def limiter_weight(length_s: float, c: Constants = DEFAULT) -> float:
    """How much a wait of this length counts in the limiter's average (1 for short waits)."""
    return c.limiter_window_s / (c.limiter_window_s + max(length_s, 0.0))


def solve_load(load: Load, gpu: GPUSpec, cap_w: float, c: Constants = DEFAULT,
               power_scale: float = 1.0) -> ClockSolution:
    """The clock ratio at which `load`'s average power meets `cap_w` (1 when it stays below the
    cap at the maximum clock; the lowest clock if even that is over). Power rises with x."""
    demand = load.power(1.0, gpu, c, power_scale)
    if demand <= cap_w:
        return ClockSolution(1.0, demand, demand, False)
    lo, hi = min_clock_ratio(c), 1.0
    p_lo = load.power(lo, gpu, c, power_scale)
    if p_lo >= cap_w:
        return ClockSolution(lo, p_lo, demand, True)
    f_lo, f_hi = p_lo - cap_w, demand - cap_w
    side = 0
    for _ in range(60):  # regula falsi, Illinois variant
        mid = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
        f = load.power(mid, gpu, c, power_scale) - cap_w
        if f > 0:
            hi, f_hi = mid, f
            if side == 1:
                f_lo /= 2
            side = 1
        else:
            lo, f_lo = mid, f
            if side == -1:
                f_hi /= 2
            side = -1
        if hi - lo < 1e-7 or abs(f) < 1e-6:
            break
    return ClockSolution(lo, load.power(lo, gpu, c, power_scale), demand, True)


def solve_clock(busy: list[Phase], waits: list[tuple[float, float]], gpu: GPUSpec, cap_w: float,
                c: Constants = DEFAULT, power_scale: float = 1.0) -> ClockSolution:
    """solve_load of busy phases and (length, weight) waits."""
    return solve_load(Load.of(busy, waits, c), gpu, cap_w, c, power_scale)


@lru_cache(maxsize=1024)
def power_scale_for_speed(speed: float, gpu: GPUSpec, cap_w: float, c: Constants = DEFAULT) -> float:
    """The switching-power multiplier under which a saturating GEMM at `cap_w` runs at `speed`
    times the rate it has with multiplier 1 (a slot measured `speed` fast under the cap: its
    silicon needs 1 / that much more power per operation, in this model's terms)."""
    g = [Phase("gemm", 1.0)]
    base = solve_clock(g, [], gpu, cap_w, c)
    if not base.capped or speed <= 0:
        return 1.0
    target = compute_stretch(base.x, c) / speed  # the stretch the slot has
    lo, hi = 0.2, 5.0
    for _ in range(50):
        mid = math.sqrt(lo * hi)
        s = compute_stretch(solve_clock(g, [], gpu, cap_w, c, mid).x, c)
        if s > target:
            hi = mid
        else:
            lo = mid
    return math.sqrt(lo * hi)
