"""Heat of each pipeline stage: compute time, power and memory per stage, from advisor.models.

Stages differ: the first holds the embedding and the most in-flight activations (1F1B), the
last the output layer, logits and loss; an uneven split moves whole layers. ``stage_times``
only knows the splits Megatron's flags can express (even, or first/last override), so per-stage
times for any split are built from it exactly: ``stage_times`` on the same layout with one layer
per stage gives every layer's cost (the embedding rides on layer 0, the head on the last
layer); a stage is the sum of its layers plus the PP send/recv of its position. Power comes
from the models' power terms on arrays (``models.power_arrays``: the fixed point of the stages'
clocks and the step, each stage's phases and waits under a cap, with the DVFS model's constants);
``at_slots`` prices many (stage, slot) pairs in one array pass.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from advisor.catalog.specs import ClusterSpec, ModelSpec, TrainConfig
from advisor.models import dvfs
from advisor.models.constants import DEFAULT, Constants
from advisor.models.memory import stage_memory
from advisor.models.power import StagePower
from advisor.models.power_arrays import FixedPoint, InStep, busy_phases_of, stage_power_arrays
from advisor.models.stages import Stages
from advisor.models.step_time import (StageTime, StepTime, at_clocks_arrays, stage_arrays, stage_objects,
                                      stage_times, step_time)
from advisor.search_spaces.columns import Layouts
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
        power: its power, clock, and the stretch of its compute_s (>= 1). (at_slots of one.)"""
        return at_slots([(self, cap_w, power_scale)], c)[0]


def at_slots(items: Sequence[tuple[StageHeat, float, float]], c: Constants = DEFAULT) -> list[tuple[StagePower, float]]:
    """StageHeat.at_slot of every (stage, cap, switching-power multiplier), in one array pass
    (models.power_arrays.stage_power_arrays: each stage in its step, the clock its cap holds)."""
    if not items:
        return []
    heats = [h for h, _, _ in items]
    gpu = heats[0].cluster.gpu

    def col(get):
        return np.array([float(get(h)) for h in heats])

    steps = [h.step for h in heats]
    ins = InStep(col(lambda h: h.step.step_time_s), col(lambda h: h.step.pipeline_s),
                 col(lambda h: h.step.dp_exposed_s), col(lambda h: h.step.optimizer_s),
                 col(lambda h: h.step.overhead_s), col(lambda h: h.step.stages[h.stage].total_s),
                 np.array([max(s.total_s for s in st.stages) for st in steps]),
                 col(lambda h: h.step.stages[h.stage].overhead_s), col(lambda h: h.step.num_microbatches))
    busy = busy_phases_of(lambda name: col(lambda h: getattr(h.full, name)), ins.m, c, col(lambda h: h.fp8) != 0)
    cap = np.array([float(v) for _, v, _ in items])
    with np.errstate(divide="ignore", invalid="ignore"):
        d = stage_power_arrays(ins, busy, gpu, cap, c, np.array([float(v) for _, _, v in items]), 0.0)
    cols = {k: v.tolist() for k, v in d.items()}
    out = []
    for i, h in enumerate(heats):
        vals = {k: v[i] for k, v in cols.items()}
        x = vals["clock_ratio"]
        sp = StagePower(stage=h.stage, sm_clock_mhz=gpu.max_sm_clock_mhz * x if gpu.max_sm_clock_mhz else None,
                        **{**vals, "throttled": bool(vals["throttled"]), "spiking": bool(vals["spiking"])})
        st = h.full
        comp, mb = st.gemm_s + st.attention_s + st.recompute_s, st.memory_bound_s
        stretch = ((comp * dvfs.compute_stretch(x, c) + mb * dvfs.memory_stretch(x, 1.0, c))
                   / (comp + mb)) if comp + mb else 1.0
        out.append((sp, stretch))
    return out


class HeatSteps:
    """The step of a split (LayerCosts.step_time) with its stages at clocks x, as the arrays the
    power fixed point (models.power_arrays.FixedPoint) reads; `step`: the last StepTime made."""

    def __init__(self, costs: "LayerCosts", full: dict):
        self.costs, self.full = costs, full
        self.extra = np.zeros(1)
        self.step: StepTime | None = None

    def at(self, x: np.ndarray) -> tuple[dict, dict]:
        at = at_clocks_arrays(self.full, x, self.costs.c)
        step = self.step = self.costs.step_time(stage_objects(at, 0, len(x)))
        totals = np.array([s.total_s for s in step.stages])
        st = {f: np.array([getattr(step, f)]) for f in ("step_time_s", "pipeline_s", "dp_exposed_s", "optimizer_s")}
        st.update(totals=totals, slow=np.array([totals.max()]))
        return at, st


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
        self.S = Stages(Layouts.of(model, [cfg]))  # the layout's stages, as the power arrays index them

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
        return [m.total_gib for m in stage_memory(self.model, self.cfg, self.c, layer_counts=list(counts), gpu=self.cluster.gpu)]

    def heat(self, counts: list[int] | None = None) -> list[StageHeat]:
        counts = list(counts or self.default_counts())
        stages = self.stage_times(counts)
        mem = self.memory_gib(counts)
        fp8 = self.cfg.precision == "fp8"
        m = self.cfg.num_microbatches
        full = stage_arrays(stages)
        busy = busy_phases_of(full.__getitem__, m, self.c, fp8)
        gpu = self.cluster.gpu
        cap = np.full(len(stages), float(self.cluster.power_cap_w))
        steps = HeatSteps(self, full)
        S = self.S
        with np.errstate(divide="ignore", invalid="ignore"):
            fp = FixedPoint(steps, S, full, busy, gpu, cap, self.c)
            x, _, st = fp.solve()  # the clocks the cap holds and the step at them
            power = stage_power_arrays(fp.inputs(st), busy, gpu, cap, self.c, clock=x)
        step = steps.step
        mean, peak, demand = (power[k].tolist() for k in ("mean_power_w", "peak_power_w", "demand_w"))
        out = []
        for k, (st, n, gib) in enumerate(zip(stages, counts, mem)):
            busy_frac = (st.compute_s + st.memory_bound_s) * m / step.step_time_s
            out.append(StageHeat(stage=k, layers=n, busy_fraction=busy_frac, mean_power_w=mean[k],
                                 peak_power_w=peak[k], demand_mean_w=demand[k],
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
