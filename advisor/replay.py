"""Replaying measured trials: a study whose every measurement is a look-up in records measured
before (``advisor.measurement/1`` JSONL, e.g. a campaign's). Used by ``bench/tune_efficiency.py``
to ask how many trials ``advisor tune`` needs on a grid that was really measured.

A *group* is one model shape (proxy depth included) x cluster x workload (seq, gbs, precision);
its grid is the set of layouts measured for it. A layout measured more than once is replayed from
its median record (the upper median of tokens/s/GPU, as ``bench/fit_accuracy.py`` does); a
"refused" record is no measurement (the runner never ran it) and simulated records are ignored.

The study is the real one: ``advisor.study.make_plan`` (its space, its memory / runner screen,
its analytical top-K seeds) and ``advisor.study.Tuner`` (its sampler, constraints, duplicate
handling and stopping rules), with two changes made from the outside:

* ``restrict_plan``: the plan's layouts are cut down to the measured ones, so every proposal
  resolves to a measured layout (``optuna_suggest`` projects any combination of the plan's
  parameters onto the nearest of the plan's layouts). Seeds that were never measured are
  dropped; the rest keep their order. The study therefore searches the measured layouts only:
  a proposal that the real study would have spent on an unmeasured layout lands on the nearest
  measured one instead, so the sampler's numbers say how it ranks *these* layouts, not how it
  would fare on the whole space.
* ``ReplayExecutor``: an executor (the same interface as ``InlineExecutor``) whose trials return
  the measured record of their layout, ``status`` (ok / oom / crash ...) as measured. Asked for a
  layout that was not measured, it raises ``ReplayMiss`` (strict) instead of inventing a value.

Adding a runner name would mean editing ``advisor.runners.ray_exec``; an injected executor does
not, and the runner the study believes in stays ``megatron``, so the plan screens layouts as the
measuring runner did (sequence parallelism off, CP > 1 refused, one node only).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from advisor.catalog.specs import ModelSpec, TrainConfig
from advisor.runners.ray_exec import InlineExecutor

TOL = 0.02
NOT_MEASURED = ("refused",)  # statuses that are not a measurement of the layout


class ReplayMiss(RuntimeError):
    """The study asked for a layout that the replayed grid does not hold."""


def tokens_per_gpu(rec: dict | None) -> float:
    """Measured tokens/s/GPU of a record; 0 for anything but an ok record."""
    if not rec or rec.get("status") != "ok":
        return 0.0
    return float((rec.get("throughput") or {}).get("tokens_per_s_per_gpu") or 0.0)


def trials_to_within(values: Iterable[float], best: float, tol: float = TOL) -> int | None:
    """1-based index of the first value >= (1 - tol) * best; None if there is none."""
    target = (1.0 - tol) * best
    for i, v in enumerate(values, 1):
        if v >= target:
            return i
    return None


def cluster_name(rec: dict) -> str | None:
    c = rec.get("cluster") or {}
    gpu, nodes, per = c.get("gpu"), c.get("num_nodes") or 1, c.get("gpus_per_node")
    if not gpu or not per:
        return None
    return f"{gpu}x{per}" if nodes == 1 else f"{gpu}x{per}x{nodes}"


@dataclass
class MeasuredGroup:
    """The measured grid of one model shape x cluster x workload."""

    model: ModelSpec  # as measured (a proxy keeps its depth, e.g. "llama3-8b[8L]")
    cluster: str
    seq: int
    gbs: int
    precision: str
    records: dict[str, dict] = field(default_factory=dict)  # layout key -> the record replayed
    repeats: dict[str, int] = field(default_factory=dict)  # layout key -> records measured
    sources: set[str] = field(default_factory=set)

    @property
    def label(self) -> str:
        return f"{self.model.name} on {self.cluster}, seq {self.seq}, gbs {self.gbs}, {self.precision}"

    @property
    def best(self) -> float:
        return max((tokens_per_gpu(r) for r in self.records.values()), default=0.0)

    def tps(self, key: str) -> float:
        return tokens_per_gpu(self.records[key])

    def subset(self, keys: Iterable[str]) -> "MeasuredGroup":
        keys = set(keys)
        return dataclasses.replace(self, records={k: r for k, r in self.records.items() if k in keys},
                                   repeats={k: n for k, n in self.repeats.items() if k in keys})


def _pick(recs: list[dict]) -> dict:
    """The record a repeated layout is replayed from: the median ok one, else the last one."""
    ok = sorted((r for r in recs if r.get("status") == "ok"), key=tokens_per_gpu)
    return ok[len(ok) // 2] if ok else recs[-1]


def load_groups(paths: Iterable[str | Path], min_layouts: int = 1) -> list[MeasuredGroup]:
    """Measured groups of the JSONL files with at least `min_layouts` measured layouts, the
    largest first. Lines that are not measurement records are skipped."""
    from advisor.models.dataset import SCHEMA, shape_key
    from advisor.search_spaces.space import layout_key

    by: dict[tuple, tuple[MeasuredGroup, dict[str, list[dict]]]] = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if (not isinstance(r, dict) or r.get("schema") != SCHEMA or r.get("simulated")
                        or r.get("status") in NOT_MEASURED or not r.get("config") or not r.get("model")):
                    continue
                cl = cluster_name(r)
                if cl is None:
                    continue
                try:
                    model, cfg = ModelSpec.from_dict(r["model"]), TrainConfig.from_dict(r["config"])
                except Exception:  # noqa: BLE001 - not a usable record
                    continue
                g = (shape_key(model, True), model.name, cl, cfg.seq, cfg.gbs, cfg.precision)
                if g not in by:
                    by[g] = (MeasuredGroup(model, cl, cfg.seq, cfg.gbs, cfg.precision), {})
                grp, recs = by[g]
                grp.sources.add(str(path))
                recs.setdefault(layout_key(cfg), []).append(r)
    out = []
    for grp, recs in by.values():
        grp.records = {k: _pick(v) for k, v in recs.items()}
        grp.repeats = {k: len(v) for k, v in recs.items()}
        if len(grp.records) >= min_layouts:
            out.append(grp)
    return sorted(out, key=lambda g: (-len(g.records), g.label))


class ReplayExecutor(InlineExecutor):
    """Answers each trial with the measured record of its layout (no GPU, no Ray)."""

    name = "replay"

    def __init__(self, records: dict[str, dict], strict: bool = True) -> None:
        super().__init__()
        self.records = records
        self.strict = strict
        self.asked: list[str] = []  # layout keys, in the order the study launched them
        self.misses: list[str] = []

    def submit(self, job):
        from advisor.runners.simulate import new_record
        from advisor.search_spaces.space import layout_key

        job.results = []
        for cfg in job.cfgs:
            key = layout_key(cfg)
            self.asked.append(key)
            if key in self.records:
                job.results.append(json.loads(json.dumps(self.records[key])))  # a copy the study may annotate
            else:
                self.misses.append(key)
                if self.strict:
                    raise ReplayMiss(f"the study asked for {key}, which was not measured")
                job.results.append(new_record(job.model, job.cluster, cfg, "crash", "not measured (replay)",
                                              job.runner))
        self._done.append(job)
        return job


def replay_settings(group: MeasuredGroup, runner: str = "megatron", **kw: Any):
    """TuneSettings of a study on `group`. The runner is the one that measured it (megatron for
    real records), so the plan screens layouts as that runner did."""
    from advisor.study import TuneSettings

    return TuneSettings(model=group.model, cluster=group.cluster, seq=group.seq, gbs=group.gbs,
                        precision=group.precision, runner=runner, storage=":memory:", **kw)


def restrict_plan(plan, keys: Iterable[str]):
    """`plan` with its layouts cut down to `keys` (enumeration order kept; a kept layout the plan
    screens out stays screened: proposed, it is told infeasible and never launched), the seeds not
    in `keys` dropped and no dataset. The Optuna space (the parameters and their choices) stays
    the whole plan's, as the real study declares it: `optuna_suggest` projects every combination
    onto the nearest kept layout. (A space recomputed from a sparse subset could have no free knob
    left, and every proposal would be the same layout.)"""
    from advisor.catalog.specs import SpecError
    from advisor.search_spaces.space import layout_key

    keys = set(keys)
    layouts = [c for c in plan.layouts if layout_key(c) in keys]
    if not layouts:
        raise SpecError("none of the measured layouts is in the study's space")
    return dataclasses.replace(
        plan, layouts=layouts, dataset=None,
        screened={k: v for k, v in plan.screened.items() if k in keys},
        enqueue=[c for c in plan.enqueue if layout_key(c) in keys])


@dataclass
class ReplayRun:
    launched: list[str]  # layout keys measured, in order
    values: list[float]  # their measured tokens/s/GPU (0 for a failed trial)
    proposed: list[str]  # the layout key of every trial (launched or not)
    stopped: str
    seeds: list[str]  # the seeds enqueued (measured ones only)


class _Found(Exception):
    """Raised from the progress callback to end a study at its first hit."""


class Replay:
    """Studies on one measured group; the full plan is made once per top-K."""

    def __init__(self, group: MeasuredGroup, runner: str = "megatron", calibration: Any = None):
        """`calibration`: what the studies predict with (TuneSettings.calibration: None for the
        analytical model, "default", a file or a loaded Calibration, best loaded once)."""
        from advisor.search_spaces.space import layout_key

        self.group = group
        self.runner = runner
        self.calibration = calibration
        self._plans: dict[int, Any] = {}  # top-K -> make_plan's Plan
        full = self.full_plan(0)
        in_space = {layout_key(c) for c in full.layouts}
        self.outside = sorted(k for k in group.records if k not in in_space)  # not in the study's space
        self.grid = group.subset(in_space)  # what every strategy is compared on
        self.order = [layout_key(c) for c in full.layouts if layout_key(c) in self.grid.records]  # enumeration order

    def full_plan(self, top_k: int):
        """`make_plan`'s plan of the whole space (its seeds included), unrestricted."""
        from advisor.study import make_plan

        if top_k not in self._plans:
            self._plans[top_k] = make_plan(replay_settings(self.group, self.runner, top_k=top_k,
                                                           calibration=self.calibration))
        return self._plans[top_k]

    def plan(self, top_k: int = 4, sampler: str = "tpe", seed: int | None = 0, budget: int | None = None,
             batch: int = 1):
        full = self.full_plan(top_k)
        # without a budget the study stops by itself once every layout of the grid is measured
        s = dataclasses.replace(full.settings, sampler=sampler, seed=seed, batch=batch,
                                trials=budget or len(self.grid.records))
        return restrict_plan(dataclasses.replace(full, settings=s), self.grid.records)

    def run(self, top_k: int = 4, sampler: str = "tpe", seed: int | None = 0, budget: int | None = None,
            until: float | None = None, batch: int = 1) -> ReplayRun:
        """One study (InMemoryStorage, one job of `batch` trials at a time). `until`: end it once
        a measured trial reaches this many tokens/s/GPU (nothing before that point changes; the
        rest of that trial's job was launched with it and is in `launched`)."""
        import optuna

        from advisor.search_spaces.space import layout_key
        from advisor.study import Tuner

        plan = self.plan(top_k, sampler, seed, budget, batch)
        ex = ReplayExecutor(self.grid.records)

        def progress(_event: dict) -> None:
            if until is not None and ex.asked and self.grid.tps(ex.asked[-1]) >= until:
                raise _Found

        tu = Tuner(plan, ex, progress=progress, storage=optuna.storages.InMemoryStorage())
        try:
            stopped = tu.run().stopped
        except _Found:
            stopped = "found"
        trials = sorted(tu.study.get_trials(deepcopy=False), key=lambda t: t.number)
        launched = [t.user_attrs["layout_key"] for t in trials if t.user_attrs.get("launched")]
        assert launched == ex.asked  # one slot: trials are launched in trial order (a job's in its order)
        return ReplayRun(launched, [self.grid.tps(k) for k in launched],
                         [t.user_attrs.get("layout_key") for t in trials], stopped,
                         [layout_key(c) for c in plan.enqueue])
