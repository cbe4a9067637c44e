"""Predict, then place only when it pays: the plan for one layout on profiled nodes.

    from advisor.placement import plan, env_for_node
    p = plan("llama3-70b", "h200x16", cfg, ["node0.json", "node1.json"])
    p.to_json()            # the `advisor place --json` object
    env_for_node(p, 0)     # {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "..."}
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from advisor.catalog import ClusterSpec, ModelSpec, TrainConfig, load_cluster, load_model
from advisor.models.constants import DEFAULT, Constants
from advisor.models.power import stage_caps
from advisor.placement.assign import Assigner, Placement, ThrottleCurve
from advisor.placement.profile import NodeProfile, ProfileError, load_profile
from advisor.placement.stage_heat import LayerCosts, StageHeat
from advisor.search_spaces.layout import IllegalLayout, violations

DEFAULT_MARGIN_PCT = 0.5


@dataclass
class Plan:
    applied: bool
    reason: str
    predicted_gain_pct: float          # of the best candidate, whether applied or not
    step_identity_s: float
    step_planned_s: float              # of what will run (identity when not applied)
    max_temp_identity_c: float
    max_temp_planned_c: float
    node_names: list[str]
    gpus: list[list[int]]              # what will run: [node][local rank] -> CUDA index (PCI order)
    cfg: TrainConfig
    layer_counts: list[int]
    uneven_requested: bool = False
    stage_caps: dict = field(default_factory=dict)  # models.power.StageCaps.to_dict() (PP > 1, config's split)
    heats: list[StageHeat] = field(default_factory=list, repr=False)
    candidate: Placement | None = field(default=None, repr=False)
    identity: Placement | None = field(default=None, repr=False)

    def stage_map(self) -> list[dict]:
        tp_cp_dp = self.cfg.tp * self.cfg.cp * self.cfg.dp
        gpn = len(self.gpus[0])
        out = []
        for s in range(self.cfg.pp):
            for n, row in enumerate(self.gpus):
                g = [row[r] for r in range(gpn) if (n * gpn + r) // tp_cp_dp == s]
                if g:
                    out.append({"stage": s, "node": self.node_names[n], "gpus": g})
        return out

    def power_caps_of_node(self, node: int) -> list[tuple[int, float]]:
        """(CUDA index in PCI order, power cap W) of every GPU of one node under stage_caps."""
        caps = self.stage_caps.get("caps_w") if self.stage_caps else None
        if not caps:
            return []
        name = self.node_names[node]
        return [(g, caps[row["stage"]]) for row in self.stage_map() if row["node"] == name for g in row["gpus"]]

    def cuda_visible_devices(self, node: int) -> str:
        return ",".join(str(g) for g in self.gpus[node])

    @property
    def slurm_gpu_bind(self) -> str:
        """srun --gpu-bind value (one map for every node); "" when nodes need different maps."""
        maps = {tuple(row) for row in self.gpus}
        return "map_gpu:" + ",".join(str(g) for g in self.gpus[0]) if len(maps) == 1 else ""

    def to_json(self) -> dict:
        d = {
            "applied": self.applied,
            "reason": self.reason,
            "predicted_gain_pct": round(self.predicted_gain_pct, 3),
            "predicted_max_temp_c": {"identity": round(self.max_temp_identity_c, 1),
                                     "planned": round(self.max_temp_planned_c, 1)},
            "stages": self.stage_map(),
            "nodes": [{"node": name, "cuda_visible_devices": self.cuda_visible_devices(n)}
                      for n, name in enumerate(self.node_names)],
            "slurm_gpu_bind": self.slurm_gpu_bind,
            "stage_caps": self.stage_caps,
        }
        if self.uneven_requested:  # only with uneven=True / --uneven: the layers of each stage
            d["pipeline_layout"] = list(self.layer_counts)
        return d


def node_profiles(profiles: Sequence[NodeProfile | str | Path], num_nodes: int) -> list[NodeProfile]:
    """One profile per node in node-rank order; a single profile stands for every node (same
    chassis; the slots are matched by PCI bus id at launch)."""
    profs = [p if isinstance(p, NodeProfile) else load_profile(p) for p in profiles]
    if not profs:
        raise ProfileError("no slot profile given (--profile FILE; measure one with 'advisor thermal-profile')")
    if len(profs) == 1 and num_nodes > 1:
        return [dataclasses.replace(profs[0], node=f"{profs[0].node}#{i}") for i in range(num_nodes)]
    if len(profs) != num_nodes:
        raise ProfileError(f"{len(profs)} profiles for {num_nodes} nodes: give one per node (in node-rank order) or one for all")
    return profs


class Planner:
    """Prices splits and placements of one layout on profiled nodes."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, profiles: list[NodeProfile],
                 curve: ThrottleCurve = ThrottleCurve(), c: Constants = DEFAULT):
        self.model, self.cluster, self.cfg, self.profiles, self.curve, self.c = model, cluster, cfg, profiles, curve, c
        self.costs = LayerCosts(model, cluster, cfg, c)
        self._cache: dict[tuple[int, ...], Assigner] = {}

    def assigner(self, counts: Sequence[int]) -> Assigner:
        key = tuple(counts)
        if key not in self._cache:
            heats = self.costs.heat(list(counts))
            stages = self.costs.stage_times(list(counts))
            self._cache[key] = Assigner(heats, self.profiles, self.cfg, self.cluster,
                                        lambda s, st=stages: self.costs.step(st, s), self.curve, self.c)
        return self._cache[key]

    def fits(self, counts: Sequence[int]) -> bool:
        return max(self.costs.memory_gib(list(counts))) <= self.cluster.gpu.memory_gib

    def _local_search(self, counts: list[int], best: Placement) -> tuple[list[int], Placement]:
        step = self.cfg.vp
        for _ in range(4 * self.cfg.pp):
            improved = None
            for i in range(self.cfg.pp):
                for j in range(self.cfg.pp):
                    if i == j or counts[i] - step < 1:
                        continue
                    cand = list(counts)
                    cand[i] -= step
                    cand[j] += step
                    if not self.fits(cand):
                        continue
                    p = self.assigner(cand).optimize()
                    if p.step_s < (improved[1].step_s if improved else best.step_s) - 1e-9:
                        improved = (cand, p)
            if improved is None:
                break
            counts, best = improved
        return counts, best

    def _starts(self, even: list[int], placed: Placement) -> list[list[int]]:
        """Start points: the config's split, the paper's alternating +1/-1 splits (both phases),
        and layers in proportion to each stage's speed in the best placement of the even split."""
        L, pp, v = self.model.num_layers, self.cfg.pp, self.cfg.vp
        starts = [list(even)]
        for phase in (0, 1):
            alt = [even[k] + (v if k % 2 == phase else -v) for k in range(pp)]
            alt[-1] += L - sum(alt)
            starts.append(alt)
        speed = [n / (h.compute_s * s + h.comm_s) for n, h, s in
                 zip(even, self.assigner(even).heats, placed.stage_slowdown)]
        prop = [max(v, int(round(L * x / sum(speed) / v)) * v) for x in speed]
        prop[max(range(pp), key=lambda k: prop[k])] += L - sum(prop)
        starts.append(prop)
        ok = []
        for c in starts:
            if min(c) >= 1 and sum(c) == L and all(k % v == 0 for k in c) and self.fits(c) and c not in ok:
                ok.append(c)
        return ok

    def uneven_search(self, start: list[int]) -> tuple[list[int], Placement]:
        """Local search over splits (move vp layers between two stages while the best placement's
        predicted step time improves and every stage fits in memory), from several start points."""
        first = self.assigner(start).optimize()
        best = (list(start), first)
        for s in self._starts(start, first):
            counts, p = self._local_search(s, self.assigner(s).optimize())
            if p.step_s < best[1].step_s - 1e-9:
                best = (counts, p)
        return best


def plan(model: str | ModelSpec, cluster: str | ClusterSpec, cfg: TrainConfig,
         profiles: Sequence[NodeProfile | str | Path], *, margin_pct: float = DEFAULT_MARGIN_PCT,
         uneven: bool = False, curve: ThrottleCurve = ThrottleCurve(), c: Constants = DEFAULT) -> Plan:
    """Place the pipeline stages of `cfg` on the profiled GPUs; keep the identity placement (and
    the config's split) unless the predicted gain is at least margin_pct."""
    m = model if isinstance(model, ModelSpec) else load_model(model)
    cl = cluster if isinstance(cluster, ClusterSpec) else load_cluster(cluster)
    bad = violations(m, cl, cfg)
    if bad:
        raise IllegalLayout(f"illegal layout: {bad[0]}")
    profs = node_profiles(profiles, cl.num_nodes)
    pl = Planner(m, cl, cfg, profs, curve, c)
    counts0 = pl.costs.default_counts()
    a0 = pl.assigner(counts0)
    ident = a0.identity()
    counts, best = counts0, a0.optimize()
    perm_gain = (ident.step_s / best.step_s - 1.0) * 100.0
    if uneven:
        counts, best = pl.uneven_search(counts0)
    gain = (ident.step_s / best.step_s - 1.0) * 100.0
    names = [p.node for p in profs]
    slots = [(s.ambient_c, s.c_per_w) for p in profs for s in p.gpus]
    moved = counts != counts0
    if len(set(slots)) == 1:
        applied, reason = False, "all GPU slots have the same thermal profile: identity placement (nothing to gain)"
    elif gain < margin_pct:
        applied = False
        reason = (f"predicted gain {gain:.2f}% is below the {margin_pct:g}% margin: identity placement kept"
                  + (f" (best uneven split {counts} not worth it)" if moved else ""))
    else:
        applied = True
        heavy = max(range(cfg.pp), key=lambda s: pl.costs.heat(counts)[s].demand_mean_w)
        reason = (f"predicted +{gain:.2f}%: step {ident.step_s:.3f} s -> {best.step_s:.3f} s; hottest slot "
                  f"{ident.max_temp_c:.0f} -> {best.max_temp_c:.0f} °C; heaviest stage {heavy} on cooler GPUs"
                  + (f"; uneven split {counts} (was {counts0}): {perm_gain:+.2f}% of it from placement alone, "
                     f"the rest from the split" if moved else ""))
    run = best if applied else ident
    used = counts if applied else counts0
    sc = stage_caps(m, cl, cfg, c).to_dict() if cfg.pp > 1 and used == counts0 else {}
    return Plan(applied=applied, reason=reason, predicted_gain_pct=gain, step_identity_s=ident.step_s,
                step_planned_s=run.step_s, max_temp_identity_c=ident.max_temp_c, max_temp_planned_c=run.max_temp_c,
                node_names=names, gpus=run.gpus, cfg=cfg, layer_counts=counts if applied else counts0,
                uneven_requested=uneven, stage_caps=sc, heats=pl.costs.heat(counts if applied else counts0),
                candidate=best, identity=ident)
