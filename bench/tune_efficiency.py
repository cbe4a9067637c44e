"""How many measured trials does a search need to reach a layout within 2% of the best of the
exhaustive grid? `advisor tune`'s study (TPE with the analytical top-K enqueued first), the same
TPE without the seeds, random order and grid (enumeration) order.

The grid: a measured one when data/measurements/*.jsonl holds one (>= --min-grid ok records of one
model x GPUs x workload, the largest such group), else every runnable layout of a small case run
through the simulated runner (labelled "simulated"). Each search only looks values up in the
grid, so all strategies see the same measurements; a layout that failed (OOM, crash) costs a
trial and finds nothing.

    python bench/tune_efficiency.py [--model llama3-8b --cluster h200x4 --seeds 10 --budget 80]
"""
from __future__ import annotations

import argparse
import glob
import json
import random
import statistics
import sys
import time
from collections import defaultdict

import optuna

from advisor.api import default_workload, resolve
from advisor.catalog.specs import ModelSpec, TrainConfig
from advisor.runners.ray_exec import InlineExecutor
from advisor.runners.simulate import run_trial
from advisor.search_spaces.space import layout_key, optuna_space
from advisor.study import Tuner, TuneSettings, make_plan

TOL = 0.02


def measured_grid(min_grid: int):
    groups = defaultdict(dict)
    for path in glob.glob("data/measurements/*.jsonl"):
        for line in open(path, encoding="utf-8"):
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r.get("simulated") or r.get("schema") != "advisor.measurement/1" or not r.get("config"):
                continue
            c = r["config"]
            world = c["tp"] * c["pp"] * c["cp"] * c["dp"]
            g = (r.get("model_name"), r.get("layers"), (r.get("cluster") or {}).get("gpu"), world,
                 c["seq"], c["gbs"], c["precision"])
            groups[g][TrainConfig.from_dict(c).key()] = r
    best = max(groups.items(), key=lambda kv: sum(x["status"] == "ok" for x in kv[1].values()), default=None)
    if best is None or sum(x["status"] == "ok" for x in best[1].values()) < min_grid:
        return None
    return best


class Replay(InlineExecutor):
    """Answers each trial with the grid's record of its layout."""

    def __init__(self, grid):
        super().__init__()
        self.grid = grid

    def submit(self, job):
        job.result = dict(self.grid[job.cfg.key()])
        self._done.append(job)
        return job


def tps(rec) -> float:
    return (rec.get("throughput") or {}).get("tokens_per_s_per_gpu") or 0.0 if rec["status"] == "ok" else 0.0


def first_hit(seq_tps: list[float], target: float) -> int | None:
    for i, v in enumerate(seq_tps, 1):
        if v >= target:
            return i
    return None


def run_tuner(settings, layouts, grid, seed, top_k, budget):
    s = TuneSettings(**{**settings.__dict__, "seed": seed, "top_k": top_k, "trials": budget})
    plan = make_plan(s)
    plan.dataset = None
    keep = {k for k in grid}
    plan.layouts = [c for c in plan.layouts if c.key() in keep]
    plan.space = optuna_space(plan.layouts)
    plan.screened = {k: v for k, v in plan.screened.items() if k in {layout_key(c) for c in plan.layouts}}
    plan.enqueue = [c for c in plan.enqueue if c.key() in keep]
    tu = Tuner(plan, Replay(grid), storage=optuna.storages.InMemoryStorage())
    tu.run()
    trials = [t for t in tu.study.get_trials() if t.user_attrs.get("launched")]
    return [tps(t.user_attrs["record"]) for t in sorted(trials, key=lambda t: t.number)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--cluster", default="h200x4")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--gbs", type=int, default=None)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--budget", type=int, default=80, help="most trials a search may measure")
    ap.add_argument("--min-grid", type=int, default=20)
    ap.add_argument("--simulated", action="store_true", help="ignore measured grids")
    a = ap.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    t0 = time.time()
    found = None if a.simulated else measured_grid(a.min_grid)
    if found:
        (name, layers, gpu, world, seq, gbs, prec), grid = found
        rec0 = next(iter(grid.values()))
        model = ModelSpec.from_dict(rec0["model"])
        cluster_name = f"{gpu}x{world}"
        label = f"measured: {name}" + (f" [{layers}L]" if layers else "") + f" on {cluster_name}, seq {seq}, gbs {gbs}"
        settings = TuneSettings(model=model, cluster=cluster_name, seq=seq, gbs=gbs, precision=prec,
                                runner="megatron", storage=":memory:")
        layouts = [TrainConfig.from_dict(r["config"]) for r in grid.values()]
    else:
        m, c = resolve(a.model, a.cluster)
        wl = default_workload(m, c, a.seq, a.gbs)
        settings = TuneSettings(model=a.model, cluster=a.cluster, seq=wl.seq, gbs=wl.gbs, runner="simulate",
                                storage=":memory:")
        plan = make_plan(settings)
        layouts = [x for x in plan.layouts if layout_key(x) not in plan.screened]
        grid = {x.key(): run_trial(m, c, x) for x in layouts}
        label = f"SIMULATED (analytical model + 3% noise): {m.name} on {c.name}, seq {wl.seq}, gbs {wl.gbs}"
    order = [x.key() for x in layouts]
    best = max(tps(r) for r in grid.values())
    target = (1 - TOL) * best
    ok = sum(r["status"] == "ok" for r in grid.values())
    hits = sum(tps(r) >= target for r in grid.values())
    print(f"grid: {label}")
    print(f"{len(grid)} layouts measured ({ok} ok), best {best:,.0f} tok/s/GPU; {hits} within {TOL:.0%} of it")
    results: dict[str, list] = {}
    results["grid order"] = [first_hit([tps(grid[k]) for k in order], target)]
    rnd = []
    for s in range(max(a.seeds, 100)):
        ks = order[:]
        random.Random(s).shuffle(ks)
        rnd.append(first_hit([tps(grid[k]) for k in ks], target))
    results["random order"] = rnd
    results["TPE, no seeds"] = [first_hit(run_tuner(settings, layouts, grid, s, 0, a.budget), target)
                                for s in range(a.seeds)]
    results["advisor tune (TPE + analytical top-K)"] = [
        first_hit(run_tuner(settings, layouts, grid, s, 4, a.budget), target) for s in range(a.seeds)]
    print(f"\ntrials until one within {TOL:.0%} of the grid's best (budget {a.budget} for the studies)")
    print(f"{'strategy':40s} {'runs':>5s} {'median':>7s} {'mean':>7s} {'worst':>6s} {'not found':>10s}")
    print("(median over all runs, a run that never found one counting as worst; mean and worst over the runs that did)")
    for name, xs in results.items():
        got = [x for x in xs if x is not None]
        m = statistics.median([x if x is not None else float("inf") for x in xs])  # not found counts as worst
        med = f"{m:.0f}" if m != float("inf") else f">{a.budget}"
        mean = f"{statistics.mean(got):.1f}" if got else "-"
        worst = f"{max(got)}" if got else "-"
        print(f"{name:40s} {len(xs):5d} {med:>7s} {mean:>7s} {worst:>6s} {len(xs) - len(got):10d}")
    print(f"\n({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
