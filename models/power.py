"""Power per GPU (mean and instantaneous peak), power-cap slowdown, steady temperature and
throttle risk, from the duty cycle of a step. Pure functions.

Model. A GPU draws idle power plus dynamic power proportional to how hard its busiest units
work. A saturating GEMM demands D watts of dynamic power, where D is set so that at the GPU's TDP
cap a sustained GEMM runs at `capped_gemm_speed` of its uncapped rate (measured on H200). A GEMM
phase running at utilisation u (achieved / best GEMM rate, which grows with the micro-batch: this
is the paper's "larger microbatches -> power spikes") demands u·D; memory-bound kernels,
communication and bubbles demand fixed fractions of D. The power limiter acts on the average over
a window much longer than a microbatch, so the *mean* demand decides sustained throttling
(clocks drop until the mean meets the cap), while the *phase* demand decides instantaneous peaks.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from advisor.catalog.specs import ClusterSpec
from advisor.models.constants import DEFAULT, Constants
from advisor.models.step_time import StepTime


@dataclass(frozen=True)
class PowerEstimate:
    mean_power_w: float
    peak_power_w: float
    demand_mean_w: float  # what the step would draw without a cap
    demand_peak_w: float
    power_cap_w: float
    compute_slowdown: float  # >= 1: how much the cap stretches compute (1 = no throttling)
    steady_temp_c: float
    throttle_risk: float  # 0..1
    throttle_label: str  # low / medium / high
    throttle_reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def gemm_dynamic_power_w(cluster: ClusterSpec, c: Constants = DEFAULT) -> float:
    """Dynamic power a saturating GEMM demands on this GPU (watts above idle)."""
    gpu = cluster.gpu
    return (gpu.tdp_w - gpu.idle_w) / c.capped_gemm_speed


def phase_fractions(st: StepTime) -> dict[str, float]:
    """Time fractions of the step on the slowest stage: gemm, memory-bound, comm, idle."""
    slow = max(st.stages, key=lambda s: s.total_s)
    m = st.num_microbatches
    total = st.step_time_s
    gemm = (slow.gemm_s + slow.attention_s + slow.recompute_s) * m
    mem = slow.memory_bound_s * m + st.optimizer_s
    comm = (slow.comm_s) * m + st.dp_exposed_s
    idle = max(0.0, total - gemm - mem - comm)
    return {"gemm": gemm / total, "memory_bound": mem / total, "communication": comm / total,
            "idle": idle / total}


def estimate_power(st: StepTime, cluster: ClusterSpec, c: Constants = DEFAULT) -> PowerEstimate:
    """Power of the unthrottled step `st` (compute_slowdown=1) and the slowdown the cap imposes."""
    gpu = cluster.gpu
    cap = cluster.power_cap_w
    idle = gpu.idle_w
    D = gemm_dynamic_power_w(cluster, c)
    u = max((s.gemm_utilization for s in st.stages), default=0.0)
    f = phase_fractions(st)
    dyn_mean = D * (f["gemm"] * u + f["memory_bound"] * c.power_memory_bound
                    + f["communication"] * c.power_communication + f["idle"] * c.power_bubble)
    demand_mean = idle + dyn_mean
    demand_peak = idle + D * max(u, c.power_memory_bound)
    budget = cap - idle
    if dyn_mean > budget:
        # Clocks drop until the mean meets the cap. Busy phases (GEMM, memory-bound) stretch by s
        # at constant dynamic energy per unit of work; communication and bubbles keep their time
        # and power: D·(e_busy + e_rest) / (t_busy·s + t_rest) = cap - idle.
        t_busy = f["gemm"] + f["memory_bound"]
        e_busy = f["gemm"] * u + f["memory_bound"] * c.power_memory_bound
        t_rest = f["communication"] + f["idle"]
        e_rest = f["communication"] * c.power_communication + f["idle"] * c.power_bubble
        slowdown = ((e_busy + e_rest) * D / budget - t_rest) / t_busy if t_busy > 0 else 1.0
        slowdown = max(1.0, min(slowdown, c.max_power_slowdown))
        mean = cap
        peak = min(cap * c.power_overshoot, demand_peak)
    else:
        slowdown = 1.0
        mean = demand_mean
        peak = min(demand_peak * c.power_ripple, max(cap * c.power_overshoot, demand_mean))
    temp = c.idle_temp_c + c.c_per_w * (mean - idle)
    # risk: sustained power throttling > transient spikes over the cap > thermal headroom
    r_power = 0.0
    reason = "none"
    if slowdown > 1.0:
        r_power = min(1.0, c.throttle_risk_sustained_base + (slowdown - 1.0) * c.throttle_risk_per_slowdown)
        reason = f"power cap: sustained demand {demand_mean:.0f} W > {cap:.0f} W, ~{(1 - 1 / slowdown) * 100:.0f}% slower compute"
    elif demand_peak > cap:
        r_power = c.throttle_risk_spike_base + c.throttle_risk_spike_span * min(
            1.0, (demand_peak - cap) / (c.throttle_spike_full_excess * cap))
        reason = f"power spikes: GEMM phases demand {demand_peak:.0f} W > {cap:.0f} W cap (brief clock dips)"
    else:
        r_power = c.throttle_risk_low_span * max(
            0.0, (demand_peak - c.throttle_low_start * cap) / (c.throttle_low_range * cap))
    limit = gpu.slowdown_temp_c
    r_thermal = max(0.0, min(1.0, (temp - (limit - c.thermal_margin_c)) / c.thermal_margin_c))
    if r_thermal > r_power:
        reason = f"thermal: predicted {temp:.0f} °C vs {limit:.0f} °C slowdown"
    risk = max(r_power, r_thermal)
    label = "high" if risk >= c.throttle_label_high else "medium" if risk >= c.throttle_label_medium else "low"
    return PowerEstimate(mean_power_w=mean, peak_power_w=peak, demand_mean_w=demand_mean,
                         demand_peak_w=demand_peak, power_cap_w=cap, compute_slowdown=slowdown,
                         steady_temp_c=temp, throttle_risk=risk, throttle_label=label,
                         throttle_reason=reason)
