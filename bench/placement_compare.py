"""Placed vs identity, measured: did the plan's predicted gain show up on the GPUs?

    python bench/placement_compare.py --identity data/placement/h200x4-run-identity.json \
        --placed data/placement/h200x4-run-placed.json --plan data/placement/h200x4-plan-margin0.json

The two records are `advisor measure` runs of the same layout, one launched plainly and one
through `advisor launch` with the plan (bench/device_session.sh placement). Prints, for both: the
median step time and its p10-p90 spread, the GPU each stage ran on (by UUID, from the record's
rank map), each stage's mean power and max temperature, the hottest GPU; then the measured gain
against the plan's prediction, and whether the gain is larger than the runs' own step-time spread.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _load(path: Path) -> dict:
    try:
        rec = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"error: cannot read {path}: {e}")
    if rec.get("status") != "ok" or not rec.get("steps"):
        raise SystemExit(f"error: {path} is not an ok measurement (status {rec.get('status')!r})")
    return rec


def summary(rec: dict) -> dict:
    st, tel = rec["steps"], rec.get("telemetry") or {}
    per_gpu = tel.get("per_gpu") or {}
    stage_of = {}
    for rm in rec.get("rank_map") or []:
        stage_of.setdefault(rm["stage"], []).append(rm["pci_bus_id"])
    stages = []
    for s in sorted(tel.get("per_stage") or [], key=lambda s: s["stage"]):
        temps = [per_gpu.get(u, {}).get("max_gpu_temp_c") for u in s["gpus"]]
        stages.append({"stage": s["stage"], "pci": stage_of.get(s["stage"], []),
                       "mean_power_w": s.get("mean_power_w"), "max_temp_c": s.get("max_temp_c"),
                       "gpu_temps_c": temps})
    hottest = max((v.get("max_gpu_temp_c") or -1.0 for v in per_gpu.values()), default=None)
    return {"median_s": st["median_s"], "p10_s": st["p10_s"], "p90_s": st["p90_s"],
            "config": rec["config"], "stages": stages, "hottest_c": hottest,
            "min_sm_clock_mhz": tel.get("min_sm_clock_mhz"), "throttle": tel.get("throttle_fraction")}


def compare(identity: dict, placed: dict, plan: dict | None) -> dict:
    a, b = summary(identity), summary(placed)
    keys = ("tp", "pp", "vp", "dp", "mbs", "gbs", "seq", "recompute")
    if any(a["config"].get(k) != b["config"].get(k) for k in keys):
        raise SystemExit("error: the two records are not the same layout")
    gain = (a["median_s"] - b["median_s"]) / a["median_s"] * 100
    noise = max((a["p90_s"] - a["p10_s"]) / a["median_s"], (b["p90_s"] - b["p10_s"]) / b["median_s"]) * 100
    moved = [s["pci"] for s in a["stages"]] != [s["pci"] for s in b["stages"]]
    out = {"identity": a, "placed": b, "measured_gain_pct": gain, "step_spread_pct": noise,
           "stages_moved": moved, "gain_beyond_spread": abs(gain) > noise}
    if plan is not None:
        out["predicted_gain_pct"] = plan.get("predicted_gain_pct")
        out["plan_applied"] = plan.get("applied")
        out["predicted_max_temp_c"] = plan.get("predicted_max_temp_c")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--identity", type=Path, required=True)
    ap.add_argument("--placed", type=Path, required=True)
    ap.add_argument("--plan", type=Path, help="the plan `advisor place --json` made for the placed run")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    plan = json.loads(a.plan.read_text()) if a.plan else None
    c = compare(_load(a.identity), _load(a.placed), plan)
    if a.json:
        json.dump(c, sys.stdout, indent=1)
        print()
        return 0
    for name in ("identity", "placed"):
        s = c[name]
        print(f"{name}: step {s['median_s']:.3f} s (p10-p90 {s['p10_s']:.3f}-{s['p90_s']:.3f}), hottest GPU "
              f"{s['hottest_c']} °C, min SM clock {s['min_sm_clock_mhz']} MHz")
        for st in s["stages"]:
            print(f"  stage {st['stage']} on {','.join(st['pci'])}: {st['mean_power_w']:.0f} W mean, "
                  f"max {st['max_temp_c']} °C")
    print(f"stages moved: {c['stages_moved']}")
    print(f"measured gain {c['measured_gain_pct']:+.2f}% (step-time spread {c['step_spread_pct']:.2f}%: "
          f"{'beyond' if c['gain_beyond_spread'] else 'within'} the runs' own noise)")
    if plan is not None:
        t = c.get("predicted_max_temp_c") or {}
        print(f"predicted gain {c['predicted_gain_pct']:+.2f}% (plan applied: {c['plan_applied']}); predicted "
              f"hottest {t.get('identity')} -> {t.get('planned')} °C, measured "
              f"{c['identity']['hottest_c']} -> {c['placed']['hottest_c']} °C")
    return 0


if __name__ == "__main__":
    sys.exit(main())
