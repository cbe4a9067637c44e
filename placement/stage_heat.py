"""Heat of each pipeline stage: compute time, power and memory per stage, from advisor.models.

Stages differ: the first holds the embedding and the most in-flight activations (1F1B), the
last the output layer, logits and loss; an uneven split moves whole layers. ``stage_times``
only knows the splits Megatron's flags can express (even, or first/last override), so per-stage
times for any split are built from it exactly: ``stage_times`` on the same layout with one layer
per stage gives every layer's cost (the embedding rides on layer 0, the head on the last
layer); a stage is the sum of its layers plus the PP send/recv of its position. Power comes
from ``models.power.stage_power``: the stage's own phases and waits in the step, under a cap, with
the DVFS model's constants (the clock its limiter holds, and what that does to its time).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from advisor.catalog.specs import ClusterSpec, ModelSpec, TrainConfig
from advisor.models.constants import DEFAULT, Constants
from advisor.models.memory import stage_memory
from advisor.models import dvfs
from advisor.models.power import StagePower, busy_phases, stage_power
from advisor.models.step_time import StageTime, StepTime, at_clocks, stage_times, step_time
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
    step: StepTime = field(repr=False, compare=False)  # the step (every stage) at the clocks the cap holds
    full: StageTime | None = field(default=None, repr=False, compare=False)  # this stage at full clocks
    cluster: ClusterSpec | None = field(default=None, repr=False, compare=False)
    fp8: bool = False

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("step", "full", "cluster", "fp8")}

    def at_slot(self, cap_w: float, c: Constants = DEFAULT, power_scale: float = 1.0) -> tuple[StagePower, float]:
        """This stage on a GPU limited to cap_w whose silicon needs power_scale times the switching
        power: its power, clock, and the stretch of its compute_s (>= 1)."""
        st = self.full
        busy = busy_phases(st, self.step.num_microbatches, c, self.fp8)
        sp = stage_power(self.step, self.stage, busy, self.cluster.gpu, cap_w, c, power_scale)
        comp, mb = st.gemm_s + st.attention_s + st.recompute_s, st.memory_bound_s
        stretch = ((comp * dvfs.compute_stretch(sp.clock_ratio, c) + mb * dvfs.memory_stretch(sp.clock_ratio, 1.0, c))
                   / (comp + mb)) if comp + mb else 1.0
        return sp, stretch


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
        mem = self.memory_gib(counts)
        fp8 = self.cfg.precision == "fp8"
        m = self.cfg.num_microbatches
        busy_of = [busy_phases(st, m, self.c, fp8) for st in stages]
        gpu, cap = self.cluster.gpu, self.cluster.power_cap_w
        x = [1.0] * len(stages)
        step = self.step_time(stages)
        for _ in range(12):  # the clocks the cap holds and the step at them, to a fixed point
            new = [stage_power(step, k, b, gpu, cap, self.c).clock_ratio for k, b in enumerate(busy_of)]
            done = max(abs(a - b) for a, b in zip(new, x)) < 2e-4
            x = new
            step = self.step_time(at_clocks(stages, x, 1.0, self.c))
            if done:
                break
        out = []
        for k, (st, n, gib) in enumerate(zip(stages, counts, mem)):
            p = stage_power(step, k, busy_of[k], gpu, cap, self.c, clock=x[k])
            busy = (st.compute_s + st.memory_bound_s) * m / step.step_time_s
            out.append(StageHeat(stage=k, layers=n, busy_fraction=busy, mean_power_w=p.mean_power_w,
                                 peak_power_w=p.peak_power_w, demand_mean_w=p.demand_w,
                                 time_per_microbatch_s=st.total_s, memory_gib=gib,
                                 compute_s=st.compute_s + st.memory_bound_s,
                                 comm_s=st.total_s - st.compute_s - st.memory_bound_s, step=step,
                                 full=st, cluster=self.cluster, fp8=fp8))
        return out


def stage_heat(model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, c: Constants = DEFAULT,
               layer_counts: list[int] | None = None) -> list[StageHeat]:
    """Per pipeline stage: busy fraction, mean and peak power, time per microbatch, memory.
    ``layer_counts`` prices another split of the same layout (default: the config's)."""
    return LayerCosts(model, cluster, cfg, c).heat(layer_counts)
