"""Which physical GPU runs each (pipeline stage, TP rank): the thermal model and the assignment.

Thermal model of one stage on one slot (``slot_effect``):
- the slot holds temperature T = ambient + c_per_w · P (its profile);
- thermal slowdown: the driver holds the GPU at its target temperature (NVML "max operating",
  87 °C on H100/H200), so a slot can sustain at most P_T = (target - ambient) / c_per_w; the
  effective cap is min(power cap, P_T);
- leakage: hotter silicon needs more power for the same work, so under a cap it runs slower.
  Measured on 4 × H200 at the 700 W cap: the slot 7 °C hotter delivered 2.1% fewer TFLOP/s
  (FACTS.md) ⇒ ``leak_per_c`` = 0.3%/°C, relative to ``ref_temp_c`` (the mean slot temperature
  of that burn);
- a slot's speed under the cap (measured ``speed_at_cap``, leakage taken out, ``slot_speeds``)
  and its leakage at the stage's temperature set a switching-power multiplier: the one under
  which a saturating GEMM at the cap runs that much slower in the DVFS model
  (models.dvfs.power_scales_for_speeds);
- clock, slowdown and power then come from models.power.stage_power on that stage, with the
  effective cap and that multiplier.

Step time under a placement: the models' pipeline formula with each stage's compute stretched
by the worst slowdown among the GPUs that run it (TP, CP and DP peers wait for each other).

Assignment: Megatron's rank order tp-cp-ep-dp-pp fixes which ranks (and so which stages) each
node hosts (stage = rank // (tp·cp·dp); node = rank // gpus_per_node); the planner permutes GPUs
inside each node, so every communication path stays as the launcher set it up (moving stages
across nodes would change PP and DP traffic; node order belongs to the launcher). A TP group
takes tp GPUs of one node; candidate groupings are consecutive chunks of the slots sorted by
temperature (optimal when slots rank the same at every power) and the identity chunks. Given the
groups, the minimum step time is found exactly: bottleneck value by threshold search over the
unit costs, then for each threshold from there up the minimum-sum assignment
(scipy.optimize.linear_sum_assignment per node), scored by the true step formula, stopping when
a threshold cannot beat the best (exact when each stage has one TP group, i.e. dp = cp = 1).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment

from advisor.catalog.specs import ClusterSpec, SpecError, TrainConfig
from advisor.models.constants import DEFAULT, Constants
from advisor.models.dvfs import power_scales_for_speeds
from advisor.placement.profile import NodeProfile, SlotProfile
from advisor.placement.stage_heat import StageHeat, at_slots


@dataclass(frozen=True)
class ThrottleCurve:
    # Fraction of dynamic power per °C above ref_temp_c (FACTS.md burn: -2.1% TFLOP/s at +7 °C
    # under the 700 W cap, hottest vs coolest H200 slot; a least-squares fit over all 4 slots
    # gives 0.14%/°C, see leakage_per_c: silicon spread is as large as the slot effect there).
    leak_per_c: float = 0.003
    # Mean slot temperature of that burn (62-69 °C).
    ref_temp_c: float = 65.5
    # Temperature the driver holds under thermal slowdown; None: the GPU's max_operating_temp_c,
    # else slowdown_temp_c - 2.
    thermal_target_c: float | None = None

    def leakage(self, temp_c: float) -> float:
        """Capped slowdown at temp_c relative to ref_temp_c (floored at 0.5)."""
        return max(0.5, 1.0 + self.leak_per_c * (temp_c - self.ref_temp_c))

    def target_c(self, cluster: ClusterSpec) -> float:
        g = cluster.gpu
        if self.thermal_target_c is not None:
            return self.thermal_target_c
        return g.max_operating_temp_c if g.max_operating_temp_c is not None else g.slowdown_temp_c - 2.0


@dataclass(frozen=True)
class SlotEffect:
    slowdown: float   # >= 1, on the stage's compute
    power_w: float    # mean
    temp_c: float     # steady
    limit: str        # "none", "power cap" or "thermal"


def slot_speeds(slots: list[SlotProfile], cluster: ClusterSpec, curve: ThrottleCurve = ThrottleCurve()) -> list[float]:
    """Each slot's silicon speed under the power cap, relative to the node's mean (for
    `slot_effect`): its measured GEMM speed under the cap (``speed_at_cap`` of `advisor
    thermal-profile`) with the leakage of its temperature during that measurement taken out.
    Silicon differs: on 4 × H200 the fastest slot was 1.1% faster than one only 1 °C warmer,
    which temperature alone cannot explain. All 1.0 unless every slot was measured."""
    speeds = [s.extra.get("speed_at_cap") for s in slots]
    if not slots or any(not isinstance(v, (int, float)) or v <= 0 for v in speeds):
        return [1.0] * len(slots)
    silicon = [v * curve.leakage(s.temp_c(float(s.extra.get("load_power_w") or cluster.power_cap_w)))
               for v, s in zip(speeds, slots)]
    mean = sum(silicon) / len(silicon)
    return [v / mean for v in silicon]


def slot_effect(heat: StageHeat, slot: SlotProfile, cluster: ClusterSpec,
                curve: ThrottleCurve = ThrottleCurve(), c: Constants = DEFAULT,
                speed: float = 1.0) -> SlotEffect:
    """What running stage `heat` on `slot` does: slowdown, mean power, temperature. `speed`: the
    slot's silicon speed under the cap relative to its node (`slot_speeds`). (slot_effects of one.)"""
    return slot_effects([(heat, slot, speed)], cluster, curve, c)[0]


def slot_effects(pairs: Sequence[tuple[StageHeat, SlotProfile, float]], cluster: ClusterSpec,
                 curve: ThrottleCurve = ThrottleCurve(), c: Constants = DEFAULT) -> list[SlotEffect]:
    """slot_effect of every (stage, slot, speed), the stages priced on their slots in one array
    pass (stage_heat.at_slots)."""
    caps, rel, limits = [], [], []
    for heat, slot, speed in pairs:
        p_thermal = slot.power_at_temp_w(curve.target_c(cluster))
        cap = max(min(cluster.power_cap_w, p_thermal), cluster.gpu.idle_w + 1.0)
        t0 = slot.temp_c(min(heat.demand_mean_w, cap))
        caps.append(cap)
        rel.append(speed / curve.leakage(t0))
        limits.append("thermal" if p_thermal < cluster.power_cap_w else "power cap")
    scales = power_scales_for_speeds(rel, cluster.gpu, cluster.power_cap_w, c)
    items = [(heat, cap, scale) for (heat, _, _), cap, scale in zip(pairs, caps, scales)]
    out = []
    for (sp, slowdown), (_, slot, _), limit in zip(at_slots(items, c), pairs, limits):
        out.append(SlotEffect(slowdown, sp.mean_power_w, slot.temp_c(sp.mean_power_w), limit if sp.throttled else "none"))
    return out


# ------------------------------------------------------------------------------- rank geometry
@dataclass(frozen=True)
class Geometry:
    """Megatron's default order tp-cp-ep-dp-pp on num_nodes × gpus_per_node ranks."""

    tp: int
    cp: int
    dp: int
    pp: int
    gpus_per_node: int
    num_nodes: int

    @classmethod
    def of(cls, cfg: TrainConfig, cluster: ClusterSpec) -> "Geometry":
        g = cls(cfg.tp, cfg.cp, cfg.dp, cfg.pp, cluster.gpus_per_node, cluster.num_nodes)
        if cfg.world_size != cluster.world_size:
            raise SpecError(f"tp·cp·dp·pp = {cfg.world_size} ≠ {cluster.world_size} GPUs in the cluster")
        if cluster.gpus_per_node % cfg.tp:
            raise SpecError(f"tp={cfg.tp} does not divide the {cluster.gpus_per_node} GPUs of a node: "
                            f"a TP group must stay inside one NVLink domain")
        return g

    def stage_of(self, rank: int) -> int:
        return rank // (self.tp * self.cp * self.dp)

    def units(self, node: int) -> list[int]:
        """Stage of each TP group on a node; TP group j holds local ranks j·tp .. j·tp+tp-1."""
        base = node * self.gpus_per_node
        return [self.stage_of(base + j * self.tp) for j in range(self.gpus_per_node // self.tp)]


# ------------------------------------------------------------------------------------ placement
@dataclass
class Placement:
    """local rank -> CUDA index (PCI order) per node, with what the model predicts for it."""

    gpus: list[list[int]]                  # gpus[node][local_rank]
    step_s: float
    stage_slowdown: list[float]            # worst slowdown among the GPUs of each stage
    temps: list[list[float]] = field(default_factory=list)   # [node][cuda index]
    powers: list[list[float]] = field(default_factory=list)

    @property
    def max_temp_c(self) -> float:
        return max(max(t) for t in self.temps)


class Assigner:
    """Prices every (stage, slot) pair once, then evaluates and optimises placements."""

    def __init__(self, heats: list[StageHeat], profiles: list[NodeProfile], cfg: TrainConfig,
                 cluster: ClusterSpec, step_fn, curve: ThrottleCurve = ThrottleCurve(), c: Constants = DEFAULT):
        self.geo = Geometry.of(cfg, cluster)
        self.heats, self.cfg, self.step_fn = heats, cfg, step_fn
        self.slots = [p.cuda_order() for p in profiles]  # [node][cuda index]
        for p, s in zip(profiles, self.slots):
            if len(s) != cluster.gpus_per_node:
                raise SpecError(f"profile of node {p.node!r} has {len(s)} GPUs but the cluster has "
                                f"{cluster.gpus_per_node} per node")
        # eff[node][stage][cuda index]: every distinct (stage, slot, speed) priced once, all in one pass
        speeds = [slot_speeds(slots, cluster, curve) for slots in self.slots]
        keys, pairs = {}, []
        for slots, node_speeds in zip(self.slots, speeds):
            for h in heats:
                for s, sp in zip(slots, node_speeds):
                    key = (h.stage, s.ambient_c, s.c_per_w, sp)
                    if key not in keys:
                        keys[key] = len(pairs)
                        pairs.append((h, s, sp))
        effects = slot_effects(pairs, cluster, curve, c)
        self.eff = [[[effects[keys[(h.stage, s.ambient_c, s.c_per_w, sp)]] for s, sp in zip(slots, node_speeds)]
                     for h in heats] for slots, node_speeds in zip(self.slots, speeds)]

    def stage_time(self, node: int, stage: int, gpu: int) -> float:
        h = self.heats[stage]
        return h.compute_s * self.eff[node][stage][gpu].slowdown + h.comm_s

    def evaluate(self, gpus: list[list[int]]) -> Placement:
        geo = self.geo
        worst = [1.0] * geo.pp
        temps, powers = [], []
        for n, row in enumerate(gpus):
            t = [0.0] * geo.gpus_per_node
            p = [0.0] * geo.gpus_per_node
            for r, g in enumerate(row):
                s = geo.stage_of(n * geo.gpus_per_node + r)
                e = self.eff[n][s][g]
                worst[s] = max(worst[s], e.slowdown)
                t[g], p[g] = e.temp_c, e.power_w
            temps.append(t)
            powers.append(p)
        return Placement([list(r) for r in gpus], self.step_fn(worst), worst, temps, powers)

    def identity(self) -> Placement:
        return self.evaluate([list(range(self.geo.gpus_per_node)) for _ in range(self.geo.num_nodes)])

    def _groupings(self, node: int) -> list[list[list[int]]]:
        """Candidate TP groups of a node: identity chunks and chunks of slots sorted by temperature."""
        tp, n = self.geo.tp, self.geo.gpus_per_node
        ident = [list(range(i, i + tp)) for i in range(0, n, tp)]
        if tp == 1:
            return [ident]
        heat = [max(self.eff[node][s][g].temp_c for s in range(self.geo.pp)) for g in range(n)]
        order = sorted(range(n), key=lambda g: (heat[g], g))
        chunks = [sorted(order[i:i + tp]) for i in range(0, n, tp)]
        return [ident] if chunks == ident else [ident, chunks]

    def optimize(self) -> Placement:
        """The placement with the smallest predicted step time (see the module docstring)."""
        geo = self.geo
        units = [geo.units(n) for n in range(geo.num_nodes)]
        ident = [list(range(i, i + geo.tp)) for i in range(0, geo.gpus_per_node, geo.tp)]
        cands = []  # per node, per candidate grouping: (groups, cost[unit][group], cost + tie-break)
        for n in range(geo.num_nodes):
            node = []
            for groups in self._groupings(n):
                c = np.array([[max(self.stage_time(n, s, g) for g in grp) for grp in groups] for s in units[n]])
                moved = np.array([[grp != ident[u] for grp in groups] for u in range(len(units[n]))])
                node.append((groups, c, c + 1e-4 * c.min() * moved))  # near-ties: leave GPUs where they are
            cands.append(node)
        values = np.unique(np.concatenate([c.ravel() for node in cands for _, c, _ in node]))

        def node_ok(c: np.ndarray, theta: float) -> bool:
            r, k = linear_sum_assignment((c > theta).astype(float))
            return not (c[r, k] > theta).any()

        def feasible(theta: float) -> bool:
            return all(any(node_ok(c, theta) for _, c, _ in node) for node in cands)

        lo, hi = 0, len(values) - 1
        while lo < hi:  # smallest threshold with a perfect matching on every node
            mid = (lo + hi) // 2
            if feasible(values[mid]):
                hi = mid
            else:
                lo = mid + 1
        m, vp = self.cfg.num_microbatches, self.cfg.vp
        min_sum = sum(min(self.stage_time(n, s, g) for n in range(geo.num_nodes) for g in range(geo.gpus_per_node))
                      for s in range(geo.pp))
        fixed = self.step_fn([1.0] * geo.pp) - self._pipeline([h.compute_s + h.comm_s for h in self.heats])
        best, big = self.identity(), 1e6 * float(values[-1] + 1.0)
        for theta in values[lo:]:
            if (m - 1.0 / vp) * theta + min_sum / vp + fixed >= best.step_s:
                break  # no placement whose slowest unit costs theta or more can beat the best
            gpus = []
            for n, node in enumerate(cands):
                choice = None
                for groups, c, tie in node:
                    r, k = linear_sum_assignment(np.where(c <= theta, tie, big))
                    total = float(tie[r, k].sum()) if (c[r, k] <= theta).all() else None
                    if total is not None and (choice is None or total < choice[0] - 1e-12):
                        choice = (total, groups, r, k)
                _, groups, r, k = choice
                row = [0] * geo.gpus_per_node
                for unit, grp in zip(r, k):
                    for i, g in enumerate(groups[grp]):
                        row[unit * geo.tp + i] = g
                gpus.append(row)
            cand = self.evaluate(gpus)
            if cand.step_s < best.step_s - 1e-12:
                best = cand
        for n in range(geo.num_nodes):  # a node whose moves buy < 0.001% keeps its GPUs in place
            keep = self.evaluate([list(range(geo.gpus_per_node)) if i == n else row for i, row in enumerate(best.gpus)])
            if keep.step_s <= best.step_s * (1.0 + 1e-5):
                best = keep
        return best

    def _pipeline(self, totals: list[float]) -> float:
        slow = max(totals)
        return self.cfg.num_microbatches * slow + (sum(totals) - slow) / self.cfg.vp

