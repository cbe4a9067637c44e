"""Heat of each pipeline stage: compute time, power and memory per stage, from advisor.models.

Stages differ: the first holds the embedding and the most in-flight activations (1F1B), the
last the output layer, logits and loss; an uneven split moves whole layers. ``stage_times``
only knows the splits Megatron's flags can express (even, or first/last override), so per-stage
times for any split are built from it exactly: ``stage_times`` on the same layout with one layer
per stage gives every layer's cost (the embedding rides on layer 0, the head on the last
layer); a stage is the sum of its layers plus the PP send/recv of its position. Power comes
from ``models.power.estimate_power`` applied to one stage at a time (its own busy, memory-bound,
communication and idle fractions of the step), so the coefficients are the model's.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from advisor.catalog.specs import ClusterSpec, ModelSpec, TrainConfig
from advisor.models.constants import DEFAULT, Constants
from advisor.models.memory import stage_memory
from advisor.models.power import PowerEstimate, estimate_power
from advisor.models.step_time import StageTime, StepTime, stage_times, step_time
from advisor.search_spaces.layout import IllegalLayout, layer_counts

_SUMMED = ("gemm_s", "attention_s", "memory_bound_s", "recompute_s", "tp_comm_s", "cp_comm_s",
           "ep_comm_s", "overhead_s", "forward_s", "backward_s")


@dataclass(frozen=True)
class StageHeat:
    stage: int
    layers: int
    busy_fraction: float          # share of the step this stage computes (GEMM, attention, memory-bound)
    mean_power_w: float           # per GPU, under the cluster's cap, on a nominal slot (models.power)
    peak_power_w: float
    demand_mean_w: float          # what it would draw without a cap
    time_per_microbatch_s: float  # forward + backward of one microbatch, unthrottled
    memory_gib: float             # per GPU
    compute_s: float              # per microbatch: the part clocks stretch (compute + memory-bound)
    comm_s: float                 # per microbatch: communication and fixed overheads
    step: StepTime = field(repr=False, compare=False)  # the step seen from this stage (for power)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "step"}
        return d

    def power(self, cluster: ClusterSpec, c: Constants = DEFAULT) -> PowerEstimate:
        """models.power on this stage alone: pass a cluster with another cap, or constants with
        another capped_gemm_speed, to ask what a hotter or capped slot does to it."""
        return estimate_power(self.step, cluster, c)


class LayerCosts:
    """Per-layer stage costs of (model, cluster, cfg), to price any pipeline split."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, c: Constants = DEFAULT):
        self.model, self.cluster, self.cfg, self.c = model, cluster, cfg, c
        n = model.num_layers
        one = cfg.replace(pp=n, vp=1, pp_first_layers=None, pp_last_layers=None, account_for_embedding=False,
                          account_for_loss=False, pipeline_layout=None)
        self.layer = stage_times(model, cluster, one, c)  # index i = layer i (+ embedding / head)
        self.position = stage_times(model, cluster, cfg, c)  # for the PP send/recv of each position
        self.base = step_time(model, cluster, cfg, c)  # DP, optimizer and fixed costs of the step

    def default_counts(self) -> list[int]:
        return layer_counts(self.model, self.cfg)

    def check_counts(self, counts: list[int]) -> None:
        if len(counts) != self.cfg.pp or sum(counts) != self.model.num_layers or min(counts) < 1:
            raise IllegalLayout(f"pipeline split {counts} is not {self.cfg.pp} stages of >= 1 layer adding up "
                                f"to {self.model.num_layers}")
        if self.cfg.vp > 1 and any(k % self.cfg.vp for k in counts) and list(counts) != self.default_counts():
            raise IllegalLayout(f"pipeline split {counts}: vp={self.cfg.vp} must divide every stage's layers")

    def stage_times(self, counts: list[int]) -> list[StageTime]:
        self.check_counts(counts)
        out, start = [], 0
        for k, n in enumerate(counts):
            st = StageTime(stage=k)
            gemm_w = util_w = 0.0
            for lt in self.layer[start:start + n]:
                for name in _SUMMED:
                    setattr(st, name, getattr(st, name) + getattr(lt, name))
                gemm_w += lt.gemm_s
                util_w += lt.gemm_s * lt.gemm_utilization
            st.pp_p2p_s = self.position[k].pp_p2p_s
            st.gemm_utilization = util_w / gemm_w if gemm_w else 0.0
            out.append(st)
            start += n
        return out

    def step(self, stages: list[StageTime], slowdowns: list[float] | None = None) -> float:
        """Step time of the synchronous pipeline (the models' formula) with stage k's compute
        stretched by slowdowns[k]: m · slowest + (sum - slowest) / vp + DP exposed + optimizer."""
        s = slowdowns or [1.0] * len(stages)
        totals = [(st.compute_s + st.memory_bound_s) * f + st.total_s - st.compute_s - st.memory_bound_s
                  for st, f in zip(stages, s)]
        slow = max(totals)
        b = self.base
        return (self.cfg.num_microbatches * slow + (sum(totals) - slow) / self.cfg.vp
                + b.dp_exposed_s + b.optimizer_s * max(s) + b.overhead_s)

    def step_time(self, stages: list[StageTime]) -> StepTime:
        m = self.cfg.num_microbatches
        totals = [st.total_s for st in stages]
        slow = max(totals)
        fill = (sum(totals) - slow) / self.cfg.vp
        b = self.base
        return StepTime(step_time_s=self.step(stages), pipeline_s=m * slow + fill, bubble_s=fill,
                        dp_comm_s=b.dp_comm_s, dp_exposed_s=b.dp_exposed_s, optimizer_s=b.optimizer_s,
                        overhead_s=b.overhead_s, stages=stages, num_microbatches=m)

    def memory_gib(self, counts: list[int]) -> list[float]:
        """Per-GPU memory of each stage for any split."""
        return [m.total_gib for m in stage_memory(self.model, self.cfg, self.c, layer_counts=list(counts))]

    def heat(self, counts: list[int] | None = None) -> list[StageHeat]:
        counts = list(counts or self.default_counts())
        stages = self.stage_times(counts)
        step = self.step_time(stages)
        mem = self.memory_gib(counts)
        out = []
        for st, n, gib in zip(stages, counts, mem):
            own = dataclasses.replace(step, stages=[st])
            p = estimate_power(own, self.cluster, self.c)
            busy = (st.compute_s + st.memory_bound_s) * step.num_microbatches / step.step_time_s
            out.append(StageHeat(stage=st.stage, layers=n, busy_fraction=busy, mean_power_w=p.mean_power_w,
                                 peak_power_w=p.peak_power_w, demand_mean_w=p.demand_mean_w,
                                 time_per_microbatch_s=st.total_s, memory_gib=gib,
                                 compute_s=st.compute_s + st.memory_bound_s,
                                 comm_s=st.total_s - st.compute_s - st.memory_bound_s, step=own))
        return out


def stage_heat(model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, c: Constants = DEFAULT,
               layer_counts: list[int] | None = None) -> list[StageHeat]:
    """Per pipeline stage: busy fraction, mean and peak power, time per microbatch, memory.
    ``layer_counts`` prices another split of the same layout (default: the config's)."""
    return LayerCosts(model, cluster, cfg, c).heat(layer_counts)
