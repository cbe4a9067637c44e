"""How good are `advisor predict`'s numbers? Compare the analytical model (optionally with a
calibration file) against every usable measured trial.

    python bench/compare_measurements.py data/measurements/*.jsonl [--calibration FILE] [--rows]

Prints, per (GPU kind, model shape) group and overall: MAPE of tokens/s/GPU, Spearman rank
correlation of tokens/s/GPU (does the model order layouts right?), memory error against the peak
memory torch reserved (the analytical model's runtime overhead term is left out of that comparison
because torch does not see the CUDA context or NCCL buffers; a calibrated or surrogate memory level
is compared as it is, since it was fitted to the reserved figure), and peak / mean power error.
"""
from __future__ import annotations

import argparse
import math
from collections import defaultdict

import numpy as np
from scipy.stats import spearmanr

from advisor.models import DEFAULT, predict
from advisor.models.dataset import load


def _mape(pred, meas):
    pred, meas = np.asarray(pred, float), np.asarray(meas, float)
    ok = np.isfinite(pred) & np.isfinite(meas) & (meas > 0)
    return float(np.mean(np.abs(pred[ok] - meas[ok]) / meas[ok]) * 100) if ok.any() else math.nan


def _bias(pred, meas):
    pred, meas = np.asarray(pred, float), np.asarray(meas, float)
    ok = np.isfinite(pred) & np.isfinite(meas) & (meas > 0)
    return float(np.mean((pred[ok] - meas[ok]) / meas[ok]) * 100) if ok.any() else math.nan


def _rho(pred, meas):
    if len(pred) < 3:
        return math.nan
    return float(spearmanr(pred, meas).statistic)


def evaluate(paths, calibration=None, constants=DEFAULT, calibration_for=None):
    """(dataset, one row per usable record: predicted vs measured). `calibration_for(record,
    calibration)`: the calibration a record is predicted with (default: `calibration` itself), e.g.
    with the run's measured router skew (bench/te_check.py)."""
    ds = load(paths)
    rows = []
    # the memory figure holds the default runtime overhead unless a fitted memory level replaced it
    fitted_memory = (calibration is not None
                     and calibration.targets["memory_gib_per_gpu"]["mode"] != "analytical")
    for r in ds.records:
        if calibration is not None:
            cal = calibration if calibration_for is None else calibration_for(r, calibration)
            p = cal.predict(r.model, r.cluster, r.cfg)
        else:
            p = predict(r.model, r.cluster, r.cfg, constants, check_legal=False)
        used = calibration.screening_constants if calibration is not None else constants
        overhead = 0.0 if fitted_memory else used.runtime_overhead_gib
        rows.append({
            "group": f"{r.cluster.gpu.name}x{r.cluster.world_size} {r.model.name.split('[')[0]}",
            "id": r.id, "layout": r.cfg.key(),
            "tps_pred": p.tokens_per_s_per_gpu, "tps_meas": r.y["tokens_per_s_per_gpu"],
            "mem_pred": p.memory_gib_per_gpu - overhead, "mem_meas": r.y["memory_gib_per_gpu"],
            "peak_pred": p.peak_power_w, "peak_meas": r.y["peak_power_w"],
            "mean_pred": p.mean_power_w, "mean_meas": r.y["mean_power_w"],
            "throttle_pred": p.throttle_risk, "throttle_meas": r.y["throttle_fraction"],
            "clock_pred": p.sm_clock_mhz,
        })
    return ds, rows


def group_stats(rs) -> dict:
    """MAPE / bias / rank correlation of one group of `evaluate` rows."""
    col = lambda k: [r[k] for r in rs]  # noqa: E731
    return {
        "n": len(rs),
        "tps_mape_pct": _mape(col("tps_pred"), col("tps_meas")),
        "tps_bias_pct": _bias(col("tps_pred"), col("tps_meas")),
        "tps_spearman": _rho(col("tps_pred"), col("tps_meas")),
        "mem_mape_pct": _mape(col("mem_pred"), col("mem_meas")),
        "peak_power_mape_pct": _mape(col("peak_pred"), col("peak_meas")),
        "mean_power_mape_pct": _mape(col("mean_pred"), col("mean_meas")),
    }


def summarize(rows):
    groups = defaultdict(list)
    for r in rows:
        groups[r["group"]].append(r)
    groups["ALL"] = rows
    return {g: group_stats(rs) for g, rs in groups.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--calibration", help="a calibration file from `advisor fit`")
    ap.add_argument("--rows", action="store_true", help="print every trial")
    args = ap.parse_args()
    cal = None
    if args.calibration:
        from advisor.models.calibrate import CalibrationError, resolve_calibration

        try:
            cal = resolve_calibration(args.calibration)
        except CalibrationError as e:
            raise SystemExit(f"error: {e}")
    ds, rows = evaluate(args.paths, cal)
    print(ds.summary())
    for line in ds.rejected:
        print("  " + line)
    label = ("calibrated model (in-sample if the calibration was fitted on these files; "
             "`advisor fit` prints held-out numbers)") if cal else "analytical model"
    print(f"\n{label} vs measurements")
    print(f"{'group':<28} {'n':>3} {'tok/s MAPE':>10} {'bias':>7} {'rank ρ':>7} {'mem MAPE':>9} {'peakW MAPE':>10} {'meanW MAPE':>10}")
    for g, s in summarize(rows).items():
        print(f"{g:<28} {s['n']:>3} {s['tps_mape_pct']:>9.1f}% {s['tps_bias_pct']:>+6.1f}% {s['tps_spearman']:>7.2f} "
              f"{s['mem_mape_pct']:>8.1f}% {s['peak_power_mape_pct']:>9.1f}% {s['mean_power_mape_pct']:>9.1f}%")
    if args.rows:
        print()
        for r in rows:
            print(f"{r['group']:<24} {r['layout']:<58} tok/s {r['tps_pred']:>8.0f} vs {r['tps_meas']:>8.0f}  "
                  f"mem {r['mem_pred']:>6.1f} vs {r['mem_meas']:>6.1f}  peak {r['peak_pred']:>4.0f} vs {r['peak_meas']:>4.0f}")


if __name__ == "__main__":
    main()
