"""How many measured trials does a search need to reach a layout within 2% of the best of the
grid? `advisor tune`'s study (TPE with the analytical top-K enqueued first; also with
`--sampler surrogate`, and that sampler without the seeds, where its prior picks the first
layouts), the same TPE without the seeds, random order and grid (enumeration) order.

Two kinds of grid:

* measured (`--measured FILE.jsonl`): a replay of measured trials. Every group of the file (one
  model shape x cluster x seq / gbs / precision) with >= --min-layouts measured layouts is a grid.
  The studies are the real `advisor.study.Tuner` on `make_plan`'s plan with its layouts cut down
  to the measured ones, and each trial is answered with the measured record of its layout
  (`advisor.replay`). Without --measured and --simulated, data/measurements/*.jsonl is
  searched for a group with >= --min-grid measured layouts.
* simulated (`--simulated`, or no measured grid big enough): every runnable layout of a small
  case run through the simulated runner (labelled "simulated").

Each search only looks values up in the grid, so all strategies see the same measurements. A
layout that failed (OOM, crash) costs a trial and finds nothing. A study's trial is a launched
measurement (what `--trials` counts): proposals it screens out or has already measured are free.
With `--batch B` the study also runs as `advisor tune --batch B`: B trials per launch (one
torchrun each), the sampler hearing of them only when the job returns. Its cost is every trial
launched up to the end of the job that found the layout, whole jobs counted (the sampling price
of batching; the start-ups it saves are not in this count).

`--calibration FILE|default|none` (default none: the analytical model, as before) is what the
studies predict with, as `advisor tune --calibration`: the seeds' ranking and the surrogate
sampler's prior. The grid is not affected (a simulated grid stays the analytical model + noise).
The bench says when the calibration was fitted on a file whose records it replays (not held out).

    python bench/tune_efficiency.py --measured data/measurements/h200x4-campaign.jsonl --seeds 50
    python bench/tune_efficiency.py --measured data/measurements/h200x4-campaign.jsonl --calibration default
    python bench/tune_efficiency.py --simulated [--model llama3-8b --cluster h200x4 --seeds 10 --budget 80]
"""
from __future__ import annotations

import argparse
import glob
import math
import random
import statistics
import sys
import time

import optuna

from advisor.api import default_workload, resolve
from advisor.replay import (TOL, MeasuredGroup, Replay, load_groups, tokens_per_gpu,
                                    trials_to_within)
from advisor.runners.simulate import run_trial
from advisor.search_spaces.space import layout_key
from advisor.study import TuneSettings, calibration_label, make_plan

tps = tokens_per_gpu
STUDY = "advisor tune (TPE + analytical top-K)"
SURROGATE = "advisor tune --sampler surrogate"


def study_names(calibrated: bool) -> tuple[str, str]:
    """The rows of the seeded study and of the surrogate sampler."""
    if not calibrated:
        return STUDY, SURROGATE
    return "advisor tune (TPE + calibrated top-K)", "advisor tune --sampler surrogate (calibrated prior)"


def search(rep: Replay, seeds: int, budget: int, random_runs: int, surrogate: bool,
           batches: tuple[int, ...] = ()) -> dict[str, list]:
    """Trials to the first layout within TOL of the grid's best, per strategy and run."""
    grid, best = rep.grid, rep.grid.best
    results: dict[str, list] = {"grid order": [trials_to_within([grid.tps(k) for k in rep.order], best)]}
    rnd = []
    for s in range(max(seeds, random_runs)):
        ks = rep.order[:]
        random.Random(s).shuffle(ks)
        rnd.append(trials_to_within([grid.tps(k) for k in ks], best))
    results["random order"] = rnd
    until = (1 - TOL) * best
    study, surr = study_names(rep.calibration is not None)
    prior_only = f"surrogate, no seeds ({'analytical' if rep.calibration is None else 'calibrated'} prior)"
    studies = ([("TPE, no seeds", 0, "tpe", 1), (study, 4, "tpe", 1)]
               + ([(surr, 4, "surrogate", 1), (prior_only, 0, "surrogate", 1)] if surrogate else [])
               + [(f"{study}, --batch {b} (whole jobs)", 4, "tpe", b) for b in batches])
    for name, top_k, sampler, b in studies:
        results[name] = [jobs_cost(rep.run(top_k, sampler, s, budget, until=until, batch=b).values, best, b)
                         for s in range(seeds)]
    return results


def jobs_cost(values: list[float], best: float, batch: int) -> int | None:
    """Trials run until one within TOL of `best`, counting the whole job (of `batch` trials) it
    came back in; None if none did."""
    hit = trials_to_within(values, best)
    return None if hit is None else min(len(values), math.ceil(hit / batch) * batch)


def print_table(results: dict[str, list], budget: int, worst: str = "worst") -> None:
    w = max(40, *(len(k) for k in results))
    print(f"{'strategy':{w}s} {'runs':>5s} {'median':>7s} {'mean':>7s} {worst:>6s} {'not found':>10s}")
    print(f"(median over all runs, a run that never found one counting as {worst}; mean and {worst} over the runs that did)")
    for name, xs in results.items():
        got = [x for x in xs if x is not None]
        m = statistics.median([x if x is not None else float("inf") for x in xs])  # not found counts as worst
        med = f"{m:.0f}" if m != float("inf") else f">{budget}"
        mean = f"{statistics.mean(got):.1f}" if got else "-"
        mx = f"{max(got)}" if got else "-"
        print(f"{name:{w}s} {len(xs):5d} {med:>7s} {mean:>7s} {mx:>6s} {len(xs) - len(got):10d}")


def describe_group(rep: Replay) -> None:
    """What was measured, and how the study's analytical seeds stand on it."""
    g, best = rep.grid, rep.grid.best
    target = (1 - TOL) * best
    n = len(g.records)
    ok = sum(r.get("status") == "ok" for r in g.records.values())
    hits = [k for k in rep.order if g.tps(k) >= target]
    best_key = max(g.records, key=g.tps)
    print(f"{n} layouts measured in the study's space ({ok} ok), best {best:,.0f} tok/s/GPU ({best_key}); "
          f"{len(hits)} within {TOL:.0%} of it")
    rep_n = sum(1 for k in g.records if g.repeats.get(k, 1) > 1)
    if rep_n:
        print(f"{rep_n} layout(s) measured more than once: the median record is replayed")
    if rep.outside:
        print(f"left out: {len(rep.outside)} measured layout(s) outside the study's space: {', '.join(rep.outside)}")
    print(f"random order needs (n+1)/(hits+1) = {(n + 1) / (len(hits) + 1):.1f} trials on average")
    full = rep.full_plan(4)
    runnable = [layout_key(c) for c in full.layouts if layout_key(c) not in full.screened]
    pos = next((i for i, k in enumerate(runnable, 1) if k in g.records and g.tps(k) >= target), None)
    if pos is not None:
        print(f"the whole space has {len(runnable)} runnable layouts, {n} of them measured; in its enumeration "
              f"order the first measured one within {TOL:.0%} is #{pos}: a grid search of the whole space needs "
              f"<= {pos} trials to get within {TOL:.0%} of the best *measured* layout")
    what = "analytical" if full.calibration is None else "calibrated"
    print(f"the study's seeds (make_plan: {what} top-{full.settings.top_k} by throughput, then "
          f"{full.settings.top_k // 2} {'energy' if full.settings.objective == 'energy' else 'balanced'}), "
          f"in enqueue order:")
    first = None
    for i, cfg in enumerate(full.enqueue, 1):
        k = layout_key(cfg)
        if k in g.records:
            v = g.tps(k)
            within = v >= target
            first = first or (i if within else None)
            what = f"measured {v:,.0f} ({v / best - 1:+.1%} vs best){', within 2%' if within else ''}"
        else:
            what = "not measured: dropped from the replay"
        print(f"  {i}. {k}: {what}")
    if first is not None:
        skipped = sum(1 for c in full.enqueue[:first - 1] if layout_key(c) not in g.records)
        note = ("" if not skipped else
                f"; {skipped} unmeasured seed(s) come before it, which the real study measures first "
                f"(one of them may be within {TOL:.0%} too)")
        print(f"  -> seed #{first} is within {TOL:.0%} of the measured best{note}")
    share = projection_share(rep, target)
    if share is not None:
        print(f"parameter combinations of the study's space that resolve to a layout within {TOL:.0%}: {share:.1%} "
              f"(those layouts are {len(hits) / n:.1%} of the measured ones); a sampler that draws combinations "
              f"(TPE's start-up) sees that share")


def projection_share(rep: Replay, target: float, limit: int = 20000) -> float | None:
    """Share of the plan's parameter combinations that `optuna_suggest` resolves to a layout
    within TOL of the best: unmeasured combinations land on their nearest measured layout, so a
    densely measured region gets less of the parameter space than a sparse one."""
    import itertools

    from advisor.search_spaces.space import resolve_params

    plan = rep.plan(0)
    if not plan.space or math.prod(len(v) for v in plan.space.values()) > limit:
        return None
    combos = list(itertools.product(*plan.space.values()))
    hit = sum(rep.grid.tps(layout_key(resolve_params(dict(zip(plan.space, c)), plan.layouts, plan.space))) >= target
              for c in combos)
    return hit / len(combos)


def held_out_note(cal, sources) -> str | None:
    """Which of the replayed files the calibration was fitted on (by path or file name)."""
    import os

    if cal is None:
        return None
    fitted = (cal.trained_on or {}).get("files") or []
    names = {os.path.basename(f) for f in fitted} | {os.path.realpath(f) for f in fitted}
    used = sorted(s for s in sources if os.path.basename(s) in names or os.path.realpath(s) in names)
    if used:
        return (f"NOT held out: the calibration was fitted on {', '.join(used)}, whose records this grid replays "
                f"(it was fitted on: {', '.join(fitted)})")
    return f"held out by file: the calibration was fitted on {', '.join(fitted) or 'unknown files'}"


def measured_mode(groups: list[MeasuredGroup], a, cal=None) -> None:
    for grp in groups:
        t0 = time.time()
        rep = Replay(grp, calibration=cal)
        print(f"\n=== replay of measured trials: {grp.label} ({', '.join(sorted(grp.sources))})")
        print(f"the studies predict with: {calibration_label(rep.full_plan(4).calibration_info)}")
        note = held_out_note(cal, grp.sources)
        if note:
            print(note)
        if len(rep.grid.records) < 2:
            print("fewer than 2 measured layouts in the study's space: skipped")
            continue
        describe_group(rep)
        budget = min(a.budget, len(rep.grid.records))
        results = search(rep, a.seeds, budget, a.random_runs or 1000, surrogate=True, batches=tuple(a.batch))
        print(f"\nreplay of measured trials: trials until one within {TOL:.0%} of the best measured "
              f"({len(rep.grid.records)} layouts, studies: {a.seeds} seeds, budget {budget})")
        print_table(results, budget, worst="max")
        print(f"({time.time() - t0:.0f} s)")


def simulated_mode(a, cal=None) -> None:
    m, c = resolve(a.model, a.cluster)
    wl = default_workload(m, c, a.seq, a.gbs)
    plan = make_plan(TuneSettings(model=a.model, cluster=a.cluster, seq=wl.seq, gbs=wl.gbs, runner="simulate",
                                  storage=":memory:"))
    layouts = [x for x in plan.layouts if layout_key(x) not in plan.screened]
    grp = MeasuredGroup(m, c.name, wl.seq, wl.gbs, wl.precision,
                        records={layout_key(x): run_trial(m, c, x) for x in layouts})
    rep = Replay(grp, runner="simulate", calibration=cal)
    grid, best = rep.grid.records, rep.grid.best
    ok = sum(r["status"] == "ok" for r in grid.values())
    hits = sum(tps(r) >= (1 - TOL) * best for r in grid.values())
    print(f"grid: SIMULATED (analytical model + 3% noise): {m.name} on {c.name}, seq {wl.seq}, gbs {wl.gbs}")
    print(f"the studies predict with: {calibration_label(rep.full_plan(4).calibration_info)}")
    print(f"{len(grid)} layouts measured ({ok} ok), best {best:,.0f} tok/s/GPU; {hits} within {TOL:.0%} of it")
    results = search(rep, a.seeds, a.budget, a.random_runs or 100, surrogate=False, batches=tuple(a.batch))
    print(f"\ntrials until one within {TOL:.0%} of the grid's best (budget {a.budget} for the studies)")
    print_table(results, a.budget)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", action="append", default=[], metavar="FILE.jsonl",
                    help="replay the measured grids of these records (repeatable, globs)")
    ap.add_argument("--min-layouts", type=int, default=8, help="with --measured: smallest grid replayed")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--cluster", default="h200x4")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--gbs", type=int, default=None)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--budget", type=int, default=80, help="most trials a study may measure")
    ap.add_argument("--random-runs", type=int, default=None, help="random orders drawn (default 1000 measured, 100 simulated)")
    ap.add_argument("--min-grid", type=int, default=20,
                    help="without --measured: smallest group of data/measurements/*.jsonl replayed")
    ap.add_argument("--simulated", action="store_true", help="ignore measured grids")
    ap.add_argument("--batch", type=int, action="append", default=[], metavar="B",
                    help="also run the study with B trials per launch (repeatable)")
    ap.add_argument("--calibration", default="none", metavar="FILE|default|none",
                    help="what the studies predict with (seeds, surrogate prior), as advisor tune --calibration; "
                         "default here: none (the analytical model)")
    a = ap.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    t0 = time.time()
    from advisor.catalog.specs import SpecError
    from advisor.models.calibrate import resolve_calibration

    try:
        cal = resolve_calibration(a.calibration)  # loaded once for every study
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.measured:
        files = sorted({f for pat in a.measured for f in (glob.glob(pat) or [pat])})
        groups = load_groups(files, a.min_layouts)
        if not groups:
            print(f"no group of {', '.join(files)} has >= {a.min_layouts} measured layouts", file=sys.stderr)
            return 1
    else:
        groups = [] if a.simulated else load_groups(sorted(glob.glob("data/measurements/*.jsonl")), a.min_grid)
    if groups:
        measured_mode(groups, a, cal)
    else:
        simulated_mode(a, cal)
    print(f"\n({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
