"""One prediction for one layout: memory, time, power, throttle risk, energy. Pure."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from advisor.catalog.specs import ClusterSpec, ModelSpec, TrainConfig
from advisor.models.constants import DEFAULT, Constants
from advisor.models.flops import training_flops_per_token
from advisor.models.memory import StageMemory, stage_memory
from advisor.models.power import estimate_power, phase_fractions
from advisor.models.step_time import step_time
from advisor.search_spaces.layout import violations


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
    compute_slowdown: float
    steady_temp_c: float
    energy_j_per_token: float
    bubble_fraction: float  # share of the pipeline time a stage idles (fill, drain, uneven stages)
    breakdown: dict = field(default_factory=dict)
    memory_breakdown: dict = field(default_factory=dict)  # of the stage with the most memory

    def to_dict(self) -> dict:
        return asdict(self)


def memory_only(model: ModelSpec, cfg: TrainConfig, c: Constants = DEFAULT) -> list[StageMemory]:
    return stage_memory(model, cfg, c)


def predict(model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, c: Constants = DEFAULT,
            check_legal: bool = True) -> Prediction:
    """Predict one layout on one cluster. Illegal layouts raise IllegalLayout (via check);
    layouts that do not fit in memory come back with feasible=False and the reason."""
    if check_legal:
        v = violations(model, cluster, cfg)
        if v:
            from advisor.search_spaces.layout import IllegalLayout

            raise IllegalLayout(f"illegal layout: {v[0]}")
    mem = stage_memory(model, cfg, c)
    worst = max(mem, key=lambda s: s.total_gib)
    capacity = cluster.gpu.memory_gib
    usable = capacity * c.memory_usable_fraction
    feasible = worst.total_gib <= usable
    reason = "" if feasible else (
        f"needs {worst.total_gib:.1f} GiB on pipeline stage {worst.stage} > {usable:.1f} GiB usable "
        f"({c.memory_usable_fraction:.0%} of {capacity:.1f} GiB per GPU)")
    base = step_time(model, cluster, cfg, c)
    power = estimate_power(base, cluster, c)
    st = step_time(model, cluster, cfg, c, compute_slowdown=power.compute_slowdown) if power.compute_slowdown > 1 else base
    tokens = cfg.tokens_per_step
    n = cluster.world_size
    tps = tokens / st.step_time_s / n
    flops = training_flops_per_token(model, cfg.seq)
    tflops = tps * flops / 1e12
    mfu = tflops / cluster.gpu.bf16_tflops
    energy = power.mean_power_w * n * st.step_time_s / tokens
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
        peak_power_w=power.peak_power_w,
        mean_power_w=power.mean_power_w,
        throttle_risk=power.throttle_risk,
        throttle_label=power.throttle_label,
        throttle_reason=power.throttle_reason,
        compute_slowdown=power.compute_slowdown,
        steady_temp_c=power.steady_temp_c,
        energy_j_per_token=energy,
        bubble_fraction=st.bubble_fraction,
        breakdown=bd,
        memory_breakdown=worst.to_dict(),
    )
