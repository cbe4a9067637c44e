"""The te profile (fitted on published Megatron / NeMo runs only) against our own Transformer Engine
runs (issue #22): out of sample, since none of these runs was fitted.

    python bench/te_check.py [data/measurements/h100x4-te.jsonl] [--calibration te] [--rows]

Prints, per model shape and per feature (the job id's feature: dp, sp, tp, cp, spcp, pp, rc, fp8,
ep, moetp, ag): tokens/s/GPU MAPE and bias, Spearman rank correlation, memory MAPE (peak reserved,
the analytical runtime overhead left out as bench/compare_measurements.py does); the FP8 / BF16
speed-up of every layout measured in both, predicted vs measured, with the two runs' machines
(`same GPUs`: both on the same four GPUs by NVML UUID; `other GPUs`: a pair across machines, whose
ratio holds the machines' difference too) and their SM clocks and NVML utilisation (the lowest
GPU's: below ~97% the GPUs idled, as host-bound runs do); the repeats of the same job
(run-to-run spread); and for each model the layout `recommend --stack te` ranks #1 among the
measured ones vs the measured best.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_measurements import evaluate, group_stats  # noqa: E402  (beside this file)
from moe_check import run_router_skews, runner_router_skews, shape_of  # noqa: E402  (beside this file)

from advisor.models.calibrate import resolve_calibration  # noqa: E402
from advisor.models.profile_fit import on_vm  # noqa: E402

REPEAT = re.compile(r"-call\d+$")  # a repeated job's id: <id>-call<N> (its record's repeat_of names <id>)
DEFAULT = Path(__file__).resolve().parent.parent / "data/measurements/h100x4-te.jsonl"


def feature(rid: str) -> str:
    parts = rid.split("-")
    return parts[2] if len(parts) > 2 and parts[0] == "te" else "?"


def _row(name, rs) -> str:
    s = group_stats(rs)
    return (f"{name:<24} {s['n']:>3} {s['tps_mape_pct']:>9.1f}% {s['tps_bias_pct']:>+6.1f}% "
            f"{s['tps_spearman']:>6.2f} {s['mem_mape_pct']:>8.1f}%")


def telemetry(paths) -> dict[str, dict]:
    """Per record id: its GPUs (NVML UUIDs, sorted), their mean SM clock (MHz) and the lowest
    GPU's mean utilisation (%), from the records' telemetry (ids without telemetry left out)."""
    out = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                rec = json.loads(line)
                gpus = (rec.get("telemetry") or {}).get("per_gpu") or {}
                if gpus:
                    out[rec["id"]] = {
                        "gpus": tuple(sorted(gpus)),
                        "clock": float(np.mean([g["mean_sm_clock_mhz"] for g in gpus.values()])),
                        "util": float(min(g["mean_gpu_util_pct"] for g in gpus.values())),
                    }
    return out


def pair_detail(bf, f8, tel: dict) -> str:
    """The machines, measured / predicted SM clocks and lowest utilisation of a BF16 / FP8 pair."""
    a, b = tel.get(bf["id"]), tel.get(f8["id"])
    if a is None or b is None:
        return "telemetry missing"
    where = "same GPUs" if a["gpus"] == b["gpus"] else "other GPUs"
    return (f"{where}; MHz bf16 {a['clock']:.0f} (pred {bf['clock_pred']:.0f}) fp8 {b['clock']:.0f} "
            f"(pred {f8['clock_pred']:.0f}); util {a['util']:.1f} / {b['util']:.1f}%")


def run_skew(paths):
    """`calibration_for` of compare_measurements.evaluate: a MoE record with an aux-loss router is
    predicted with the router skew its shape's runs on the te stack measured at init
    (moe_check.runner_router_skews, from the tokens per expert the runner recorded: the router the
    runner ran, untrained), not the trained router's moe_router_skew the profile ships; every other
    record with the calibration as it is."""
    import dataclasses

    skews, own, memo = runner_router_skews(paths, "te"), run_router_skews(paths, "te"), {}

    def cal_for(rec, cal):
        s = (own.get(rec.id, skews.get(shape_of(rec.model)))
             if rec.model.is_moe and rec.cfg.moe_router == "aux_loss" else None)
        if s is None:
            return cal
        if (id(cal), s) not in memo:
            memo[(id(cal), s)] = (cal, dataclasses.replace(cal, constants=cal.constants.replace(moe_router_skew=s)))
        return memo[(id(cal), s)][1]
    return cal_for, skews


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", default=[str(DEFAULT)])
    ap.add_argument("--calibration", default="te", help="a profile name or calibration file (default te)")
    ap.add_argument("--rows", action="store_true", help="print every run")
    ap.add_argument("--trained-router", action="store_true",
                    help="predict the MoE runs with the profile's trained-router skew (moe_router_skew), "
                         "not the skew the runner's untrained routers measured")
    a = ap.parse_args(argv)
    # with our VM's host issue costs (profile_fit.on_vm): these are our runs
    cal = on_vm(resolve_calibration("default" if a.calibration == "te" else a.calibration, "te"))
    cal_for, skews = (None, {}) if a.trained_router else run_skew(a.paths)
    ds, rows = evaluate(a.paths, cal, calibration_for=cal_for)
    recs = {r.id: r for r in ds.records}
    # a run whose allocator retried ran at the memory edge and measured the retries as well: it
    # stays a memory point (bench/memory_edge.py) but is no check of the step-time model
    edge = [r for r in rows if recs[r["id"]].alloc_retries]
    rows = [r for r in rows if not recs[r["id"]].alloc_retries]
    first, seen = [], set()  # each job's first usable record (a job whose first run crashed: its rerun)
    for r in rows:
        if REPEAT.sub("", r["id"]) not in seen:
            seen.add(REPEAT.sub("", r["id"]))
            first.append(r)
    print(ds.summary())
    for r in edge:
        print(f"left out (allocator retried {recs[r['id']].alloc_retries}x: the memory edge): {r['id']} "
              f"{r['layout']} tok/s {r['tps_pred']:.0f} predicted vs {r['tps_meas']:.0f}")
    if skews:
        print("MoE runs (aux-loss router) predicted with the runner's measured at-init router skew: "
              + ", ".join(f"{k} {v:.2f}" for k, v in sorted(skews.items())))
    print(f"\nprofile {cal.profile} vs {len(first)} distinct runs (repeats left out here)")
    head = f"{'group':<24} {'n':>3} {'tok/s MAPE':>10} {'bias':>7} {'rank ρ':>6} {'mem MAPE':>9}"
    print(head)
    by_model, by_feat = defaultdict(list), defaultdict(list)
    for r in first:
        by_model[r["group"].split(" ", 1)[1]].append(r)
        by_feat[feature(r["id"])].append(r)
    for g, rs in sorted(by_model.items()):
        print(_row(g, rs))
    dense = [r for r in first if not recs[r["id"]].model.is_moe]
    moe = [r for r in first if recs[r["id"]].model.is_moe]
    print(_row("ALL dense", dense))
    print(_row("ALL MoE", moe))
    print(_row("ALL", first))
    print(f"\nby feature\n{head}")
    for f, rs in sorted(by_feat.items()):
        print(_row(f, rs))

    # FP8 / BF16 on the layouts measured in both precisions
    print("\nFP8 / BF16 speed-up, same layout")
    # a pair is the same model (layers included) and layout in both precisions; where a shape was
    # measured on the same four GPUs in both precisions only those pairs count (two machines'
    # clocks differ by a few per cent: a cross-machine pair measures the machines as well)
    # ... with the same allocator and cross entropy (session 27's stack runs: expandable segments,
    # TE's cross entropy); an FP8 run with FP8 primary weights pairs with the BF16 run of its settings
    # and says so ("fpg")
    def key(r):
        cfg = recs[r["id"]].cfg
        return (r["group"], recs[r["id"]].model.num_layers,
                r["layout"].replace("-fp8-", "-X-").replace("-bf16-", "-X-") + ("-es" if cfg.expandable_segments else "")
                + ("" if cfg.cross_entropy_impl == "native" else f"-ce-{cfg.cross_entropy_impl}"))
    pairs = defaultdict(lambda: {"fp8": [], "bf16": []})
    for r in first:
        pairs[key(r)]["fp8" if "-fp8-" in r["layout"] else "bf16"].append(r)
    worst = 0.0
    tel = telemetry(a.paths)
    for (g, n_layers, lay), d in sorted(pairs.items()):
        both = [(b, f) for b in d["bf16"] for f in d["fp8"]]
        same = [(b, f) for b, f in both if tel.get(b["id"], {}).get("gpus") is not None
                and tel.get(b["id"], {}).get("gpus") == tel.get(f["id"], {}).get("gpus")]
        for b, f in same or both:
            m = f["tps_meas"] / b["tps_meas"]
            p = f["tps_pred"] / b["tps_pred"]
            worst = max(worst, abs(p / m - 1))
            lay_f = lay.replace('-X-', '-') + ("-fpg" if recs[f["id"]].cfg.fp8_param_gather else "")
            print(f"  {g:<28} {n_layers:>2}L {lay_f:<62} measured {m:.3f}  predicted {p:.3f}"
                  f"  ({(p / m - 1) * 100:+.1f}%)  {pair_detail(b, f, tel)}")
    print(f"  worst: {worst * 100:.1f}% (target: within 5% on every shape)")

    # run-to-run spread of the repeated jobs
    reps = defaultdict(list)
    for r in rows:
        reps[REPEAT.sub("", r["id"])].append(r["tps_meas"])
    spread = {k: (max(v) - min(v)) / min(v) for k, v in reps.items() if len(v) > 1}
    if spread:
        print(f"\nrepeats: {len(spread)} jobs measured 2-3 times, tokens/s spread "
              + ", ".join(f"{k} {s * 100:.1f}%" for k, s in sorted(spread.items())))

    # recommend's choice among what was measured
    print("\nthe profile's #1 among the measured layouts of each model and workload vs the measured best")
    groups = defaultdict(list)
    for r in first:
        rec = recs[r["id"]]
        groups[(r["group"], rec.cfg.seq, rec.cfg.gbs, rec.cfg.precision)].append(r)
    for (g, seq, gbs, prec), rs in sorted(groups.items()):
        if len(rs) < 3:
            continue
        top_pred = max(rs, key=lambda r: r["tps_pred"])
        best = max(rs, key=lambda r: r["tps_meas"])
        ratio = top_pred["tps_meas"] / best["tps_meas"]
        print(f"  {g:<28} {prec} seq {seq} gbs {gbs} ({len(rs)} layouts): predicted #1 "
              f"{top_pred['layout'][:40]} measures {ratio * 100:.1f}% of the best ({best['layout'][:40]})")
    if a.rows:
        print()
        for r in rows:
            print(f"{r['id']:<22} {r['layout']:<62} tok/s {r['tps_pred']:>8.0f} vs {r['tps_meas']:>8.0f} "
                  f"({(r['tps_pred'] / r['tps_meas'] - 1) * 100:+6.1f}%)  mem {r['mem_pred']:>5.1f} vs "
                  f"{r['mem_meas']:>5.1f}")
    return 0 if not math.isnan(worst) else 1


if __name__ == "__main__":
    raise SystemExit(main())
