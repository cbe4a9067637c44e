"""Does `placement.stage_heat` rank pipeline stages by heat the way the GPUs measured them?

    python bench/stage_heat_check.py data/measurements/*.jsonl [--rows] [--calibration default|none|FILE]

For every measured trial with a pipeline (PP > 1) and per-stage telemetry (`telemetry.per_stage`:
the mean power of each stage's GPUs over the measured steps), compares the predicted mean power
per stage (models.power on each stage alone, under the cluster's cap) with the measured one:

* hottest stage: does the model name the stage that drew the most power?
* spread: (hottest - coolest stage) / layout mean, predicted vs measured;
* per-stage error: MAPE of each stage's mean power, and of its offset from the layout's mean
  (what placement acts on: only the differences between stages matter).
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np

from advisor.models.dataset import parse_record
from advisor.placement.stage_heat import stage_heat


def rows_from(paths: list[str], constants=None) -> tuple[list[dict], int]:
    """Rows of the trials with PP > 1; `constants`: the model's (default: the analytical
    defaults; a calibration's constants to check the model as that calibration runs it)."""
    from advisor.models.constants import DEFAULT

    constants = constants or DEFAULT
    rows, skipped = [], 0
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    skipped += 1
                    continue
                stages = ((rec.get("telemetry") or {}).get("per_stage") or [])
                if rec.get("status") != "ok" or len(stages) < 2:
                    continue
                r = parse_record(rec, f"{path}:{n}")
                if isinstance(r, str):
                    skipped += 1
                    continue
                meas = [s.get("mean_power_w") for s in sorted(stages, key=lambda s: s["stage"])]
                if any(not isinstance(m, (int, float)) or m <= 0 for m in meas):
                    skipped += 1
                    continue
                pred = [h.mean_power_w for h in stage_heat(r.model, r.cluster, r.cfg, constants)]
                if len(pred) != len(meas):
                    skipped += 1
                    continue
                rows.append({"id": r.id, "model": r.model.name, "layout": r.cfg.key(),
                             "pred": pred, "meas": [float(m) for m in meas]})
    return rows, skipped


def summarize(rows: list[dict]) -> dict:
    hot = sum(int(np.argmax(r["pred"]) == np.argmax(r["meas"])) for r in rows)
    err, off_err, spread_p, spread_m = [], [], [], []
    for r in rows:
        p, m = np.array(r["pred"]), np.array(r["meas"])
        err += list(np.abs(p - m) / m)
        off_err += list(np.abs((p - p.mean()) - (m - m.mean())) / m.mean())
        spread_p.append((p.max() - p.min()) / p.mean())
        spread_m.append((m.max() - m.min()) / m.mean())
    corr = float(np.corrcoef(spread_p, spread_m)[0, 1]) if len(rows) > 2 and np.std(spread_p) > 0 else math.nan
    return {"trials": len(rows), "hottest_stage_right": hot,
            "stage_power_mape_pct": 100 * float(np.mean(err)) if err else math.nan,
            "stage_offset_error_pct_of_mean": 100 * float(np.mean(off_err)) if off_err else math.nan,
            "spread_pred_pct": 100 * float(np.mean(spread_p)) if rows else math.nan,
            "spread_meas_pct": 100 * float(np.mean(spread_m)) if rows else math.nan,
            "spread_corr": corr}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--rows", action="store_true", help="one line per trial")
    ap.add_argument("--calibration", default="none", help="use this calibration's constants (default|FILE)")
    a = ap.parse_args(argv)
    from advisor.models.calibrate import resolve_calibration

    cal = resolve_calibration(a.calibration)
    rows, skipped = rows_from(a.paths, cal.constants if cal is not None else None)
    if not rows:
        print("no ok trial with PP > 1 and per-stage telemetry in these files", file=sys.stderr)
        return 1
    if a.rows:
        print(f"{'trial':14s} {'model':16s} {'layout':44s} {'predicted W per stage':28s} measured W per stage")
        for r in rows:
            p = " ".join(f"{x:4.0f}" for x in r["pred"])
            m = " ".join(f"{x:4.0f}" for x in r["meas"])
            mark = "" if np.argmax(r["pred"]) == np.argmax(r["meas"]) else "  <- hottest differs"
            print(f"{r['id']:14s} {r['model']:16s} {r['layout']:44s} {p:28s} {m}{mark}")
    s = summarize(rows)
    print(f"{s['trials']} trials with PP > 1 ({skipped} lines skipped)")
    print(f"hottest stage named right: {s['hottest_stage_right']} / {s['trials']}")
    print(f"per-stage mean power MAPE: {s['stage_power_mape_pct']:.1f}%")
    print(f"per-stage offset from the layout mean, error: {s['stage_offset_error_pct_of_mean']:.1f}% of the mean")
    print(f"stage spread (hottest - coolest) / mean: predicted {s['spread_pred_pct']:.1f}%, "
          f"measured {s['spread_meas_pct']:.1f}% (correlation over trials {s['spread_corr']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
