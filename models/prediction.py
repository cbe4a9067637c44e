"""The prediction of one layout (memory, time, power, throttle risk, energy) and how it is composed
from the stage memory, the step at the maximum clocks and the power evaluation (`assemble`:
models.vectorized.Result.prediction runs it for every row it is asked for). Pure."""
from __future__ import annotations

import copy as _copy
from dataclasses import asdict, dataclass, field, fields, is_dataclass

from advisor.catalog.specs import ClusterSpec, ModelSpec, TrainConfig
from advisor.models.constants import Constants
from advisor.models.flops import training_flops_per_token
from advisor.models.memory import StageMemory
from advisor.models.power_arrays import PowerEstimate
from advisor.models.quant import mfu_peak_tflops
from advisor.models.step_time import StepTime

__all__ = ["Prediction", "assemble", "phase_fractions", "power_fields"]


@dataclass
class Prediction:
    feasible: bool
    reason: str  # why not feasible ("" when feasible)
    tokens_per_s_per_gpu: float
    step_time_s: float
    mfu: float
    tflops_per_gpu: float
    memory_gib_per_gpu: float  # max over stages
    memory_per_stage_gib: list[float]
    peak_power_w: float
    mean_power_w: float
    throttle_risk: float
    throttle_label: str
    throttle_reason: str
    power_slowdown: float  # step time at the clocks the cap holds / at the maximum clocks (>= 1)
    sm_clock_mhz: float | None  # held by the critical (slowest) pipeline stage; None: GPU clock unknown
    clock_ratio: float  # the same as a fraction of the maximum clock
    throttle_fraction: float  # share of the GPUs whose clock the cap holds down
    steady_temp_c: float
    energy_j_per_token: float
    bubble_fraction: float  # share of the pipeline time a stage idles (fill, drain, uneven stages)
    breakdown: dict = field(default_factory=dict)
    memory_breakdown: dict = field(default_factory=dict)  # of the stage with the most memory
    power: dict = field(default_factory=dict)  # per-stage caps, clocks and powers (models.power)
    power_caps: dict = field(default_factory=dict)  # energy-optimal caps, when asked (models.power.cap_sweep)

    def to_dict(self, copy: bool = True) -> dict:
        """dataclasses.asdict of the prediction, without its deep copy of every number (the
        fields hold numbers, strings and dicts / lists of them: copied container by container).
        copy=False: the fields' own dicts and lists (for a caller that only serialises them)."""
        if not copy:
            return {f.name: getattr(self, f.name) for f in fields(self)}
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}


def _plain(o):
    if type(o) is dict:
        return {k: _plain(v) for k, v in o.items()}
    if type(o) is list:
        return [_plain(v) for v in o]
    if type(o) in (float, int, str, bool) or o is None:
        return o
    if type(o) is tuple:
        return tuple(_plain(v) for v in o)
    return asdict(o) if is_dataclass(o) and not isinstance(o, type) else _copy.deepcopy(o)


def assemble(model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, c: Constants, mem: list[StageMemory],
             base: StepTime, power: PowerEstimate) -> Prediction:
    """The Prediction of a layout from its stage memory, its step at the maximum clocks and its
    power estimate (which holds the step at the clocks the caps hold)."""
    worst = max(mem, key=lambda s: s.total_gib)
    capacity = cluster.gpu.memory_gib
    usable = c.usable_memory_gib(capacity)
    feasible = worst.total_gib <= usable
    reason = "" if feasible else (
        f"needs {worst.total_gib:.1f} GiB on pipeline stage {worst.stage} > {usable:.1f} GiB usable "
        f"({capacity:.1f} GiB per GPU less {c.memory_margin_gib:g} GiB)")
    st = power.step
    tokens = cfg.tokens_per_step
    n = cluster.world_size
    tps = tokens / st.step_time_s / n
    flops = training_flops_per_token(model, cfg.seq)
    tflops = tps * flops / 1e12
    mfu = tflops / mfu_peak_tflops(model, cfg.seq, cluster.gpu, cfg.quant_code)
    bd = st.breakdown()
    bd["phase_fractions"] = phase_fractions(base)
    bd["power_demand_mean_w"] = power.demand_mean_w
    bd["power_demand_peak_w"] = power.demand_peak_w
    bd["gemm_utilization"] = max(s.gemm_utilization for s in base.stages)
    return Prediction(
        feasible=feasible,
        reason=reason,
        tokens_per_s_per_gpu=tps,
        step_time_s=st.step_time_s,
        mfu=mfu,
        tflops_per_gpu=tflops,
        memory_gib_per_gpu=worst.total_gib,
        memory_per_stage_gib=[s.total_gib for s in mem],
        bubble_fraction=st.bubble_fraction,
        breakdown=bd,
        memory_breakdown=worst.to_dict(),
        **power_fields(power),
    )


def power_fields(p: PowerEstimate) -> dict:
    """The Prediction fields that come from models.power (one evaluation: they cannot disagree)."""
    return dict(peak_power_w=p.peak_power_w, mean_power_w=p.mean_power_w, throttle_risk=p.throttle_risk,
                throttle_label=p.throttle_label, throttle_reason=p.throttle_reason, power_slowdown=p.slowdown,
                sm_clock_mhz=p.sm_clock_mhz, clock_ratio=p.clock_ratio, throttle_fraction=p.throttle_fraction,
                steady_temp_c=p.steady_temp_c, energy_j_per_token=p.energy_j_per_token,
                power={"power_cap_w": p.power_cap_w, "energy_j_per_step": p.energy_j_per_step,
                       "step_time_s": p.step.step_time_s, "stages": [s.to_dict() for s in p.stages]})


def phase_fractions(st: StepTime) -> dict[str, float]:
    """Time fractions of the step on the slowest stage: gemm, memory-bound, comm, idle (features)."""
    slow = max(st.stages, key=lambda s: s.total_s)
    m = st.num_microbatches
    total = st.step_time_s
    gemm = (slow.gemm_s + slow.attention_s + slow.recompute_s) * m
    mem = slow.memory_bound_s * m + st.optimizer_s
    comm = slow.comm_s * m + st.dp_exposed_s
    idle = max(0.0, total - gemm - mem - comm)
    return {"gemm": gemm / total, "memory_bound": mem / total, "communication": comm / total,
            "idle": idle / total}
