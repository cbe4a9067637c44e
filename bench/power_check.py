"""Measured vs predicted power, clock, throttling and energy per token of committed training runs.

    python bench/power_check.py [FILES...] [--calibration FILE|default|none] [--rows]
    python bench/power_check.py --fit data/measurements/h200x4-campaign.jsonl data/measurements/h100x1-campaign.jsonl

For every `status: ok` record with telemetry (default: every data/measurements/*.jsonl):
  measured   mean power (telemetry.mean_power_w: 20 Hz samples over the measured steps), peak power,
             SM clock (median over the GPUs of each GPU's median), throttle fraction (any reason),
             energy per token from the NVML energy counter (telemetry.energy_per_token_j), kept only
             where the counter resolves it: a measured interval of at least MIN_COUNTER_S seconds
             (the sampler reads the counter at 1 Hz; over shorter intervals its deltas disagree with
             the sampled power by up to 67%, see docs/measurement.md)
  predicted  "power model" = models.power.power_at_step with the record's measured step time (the DVFS
             model alone, on the calibration's constants when one is given); "end to end" = the prediction advisor prints (with --calibration: that
             calibration, J/token = its mean power x GPUs / its tokens/s)
  J/token*   the same from the 20 Hz sampled mean power (mean W / measured tokens/s/GPU): every run,
             also the MoE runs, none of which ran long enough for the counter
Groups (counted when run): the held-out dense runs (HELD_OUT: no constant of the power model and no
profile was fitted on them), every MoE run of every file (local and te stacks), the MoE runs no power
constant was fitted on (all but those of FITTED), and the dense runs of FITTED (the campaigns
comm_power, wait_power and peak_overshoot are fitted on); then the MoE runs per file. Their step
constants: MOE_LOCAL_FIT on h100x1-moe*, the te profile's MoE settings on the te MoE runs.
--calibration stack: each run with its own stack's shipped profile (what `advisor predict --stack` uses).
--moe-loso: the MoE runs out of sample in their shape too: for each of the four MoE proxy shapes the
MoE constants (bench/moe_check.py's fit, MOE_LOCAL_FIT) are fitted on the other three and the
held-out shape is predicted with them (power model and end to end).
--fit: fit comm_power, wait_power and peak_overshoot (the constants the load sweep cannot see) on
the given files with the power model given the measured step, and print them.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import statistics
import sys

import numpy as np

from advisor.models.constants import DEFAULT, Constants
from advisor.models.dataset import parse_record
from advisor.models.power import power_at_step

MIN_COUNTER_S = 10.0
HELD_OUT = ("h200x4-full-depth.jsonl", "tune-llama3-8b-h200x4.jsonl", "h200x4-gqa.jsonl", "h200x4-hang-probe.jsonl",
            "h100x1-energy.jsonl")
FITTED = ("h200x4-campaign.jsonl", "h100x1-campaign.jsonl")  # comm_power, wait_power, peak_overshoot fitted on these


def is_moe(row: dict) -> bool:
    return row["rec"].model.moe is not None


# (name, keep(row)); the name's {n} is the number of runs
GROUPS = (("{n} held-out dense runs", lambda r: r["file"] in HELD_OUT and not is_moe(r)),
          ("{n} MoE runs (every file, both stacks)", is_moe),
          ("{n} MoE runs, no power constant fitted", lambda r: is_moe(r) and r["file"] not in FITTED),
          ("{n} fitted dense runs (campaigns)", lambda r: r["file"] in FITTED and not is_moe(r)))
TRAINING_FIT = ("comm_power", "wait_power", "peak_overshoot")
BOUNDS = {"comm_power": (0.02, 0.8), "wait_power": (0.005, 1.0), "peak_overshoot": (0.05, 1.0)}


def load(paths: list[str]) -> list[dict]:
    out = []
    for path in paths:
        for n, line in enumerate(open(path, encoding="utf-8"), 1):
            rec = json.loads(line)
            t = rec.get("telemetry") or {}
            if rec.get("status") != "ok" or not t.get("mean_power_w"):
                continue
            r = parse_record(rec, f"{path}:{n}")
            if isinstance(r, str):
                continue
            per = t.get("per_gpu") or {}
            clk = [g["median_sm_clock_mhz"] for g in per.values() if g.get("median_sm_clock_mhz")]
            interval = t.get("interval_s") or 0.0
            e_tok = t.get("energy_per_token_j") if interval >= MIN_COUNTER_S else None
            out.append({"id": rec["id"], "file": path.rsplit("/", 1)[-1], "rec": r,
                        "step_s": rec["steps"]["median_s"], "mean_w": t["mean_power_w"],
                        "peak_w": t.get("peak_power_w"), "clock_mhz": statistics.median(clk) if clk else None,
                        "throttle": (t.get("throttle_fraction") or {}).get("any_throttle"),
                        "j_per_token": e_tok, "interval_s": interval,
                        "j_tok_sampled": t["mean_power_w"] / rec["throughput"]["tokens_per_s_per_gpu"],
                        "stage_w": [s.get("mean_power_w") for s in sorted(t.get("per_stage") or [], key=lambda s: s["stage"])]})
    return out


def power_model(row: dict, c: Constants) -> dict:
    r = row["rec"]
    e = power_at_step(r.model, r.cluster, r.cfg, row["step_s"], c)
    n = r.cluster.world_size
    j = e.mean_power_w * n * row["step_s"] / r.cfg.tokens_per_step
    return {"mean_w": e.mean_power_w, "peak_w": e.peak_power_w, "clock_mhz": e.sm_clock_mhz,
            "throttle": e.throttle_fraction, "stage_w": [s.mean_power_w for s in e.stages],
            "j_per_token": j, "j_tok_sampled": j}


def stack_calibration(row: dict):
    """The shipped profile of the run's stack (local / te) for its GPU: what `advisor predict
    --stack STACK` uses."""
    from advisor.models.calibrate import resolve_calibration

    r = row["rec"]
    return resolve_calibration("default", stack=r.stack, gpu=r.cluster.gpu)


def end_to_end(row: dict, cal) -> dict:
    from advisor.models import predict

    r = row["rec"]
    p = cal.predict(r.model, r.cluster, r.cfg, check_legal=False) if cal is not None else \
        predict(r.model, r.cluster, r.cfg, DEFAULT, check_legal=False)
    return {"mean_w": p.mean_power_w, "peak_w": p.peak_power_w, "clock_mhz": p.sm_clock_mhz,
            "throttle": p.throttle_fraction, "j_per_token": p.energy_j_per_token, "j_tok_sampled": p.energy_j_per_token,
            "stage_w": [s["mean_power_w"] for s in p.power["stages"]]}


KEYS = (("mean_w", "mean power"), ("peak_w", "peak power"), ("clock_mhz", "SM clock"), ("j_per_token", "J/token"),
        ("j_tok_sampled", "J/token*"))


def errors(rows: list[dict], preds: list[dict]) -> dict:
    out = {}
    for k, _ in KEYS:
        e = [abs(p[k] - r[k]) / r[k] * 100 for r, p in zip(rows, preds) if r.get(k) and p.get(k)]
        out[k] = (float(np.mean(e)) if e else math.nan, len(e))
    t = [abs(p["throttle"] - r["throttle"]) for r, p in zip(rows, preds) if r.get("throttle") is not None]
    out["throttle"] = (float(np.mean(t)) * 100 if t else math.nan, len(t))
    st = [abs(a - b) / b * 100 for r, p in zip(rows, preds) if len(r["stage_w"]) > 1 and len(r["stage_w"]) == len(p["stage_w"])
          for a, b in zip(p["stage_w"], r["stage_w"]) if b]
    out["stage_w"] = (float(np.mean(st)) if st else math.nan, len(st))
    return out


def table(lines: list[tuple[str, list[dict], list[dict]]]) -> None:
    """One line of MAPEs per (name, measured rows, predictions)."""
    print(f"{'':40s} {'mean W':>12s} {'peak W':>12s} {'SM clock':>12s} {'J/token':>12s} {'J/token*':>12s} "
          f"{'throttle pp':>12s} {'stage W':>12s}")
    for name, rows, preds in lines:
        e = errors(rows, preds)
        cells = [f"{e[k][0]:6.2f}% ({e[k][1]:2d})" for k in ("mean_w", "peak_w", "clock_mhz", "j_per_token", "j_tok_sampled")]
        cells.append(f"{e['throttle'][0]:6.1f} ({e['throttle'][1]:2d})")
        cells.append(f"{e['stage_w'][0]:6.2f}% ({e['stage_w'][1]:2d})")
        print(f"{name[:40]:40s} " + " ".join(f"{c:>12s}" for c in cells))


def moe_loso_predictions(rows: list[dict], cal) -> dict[str, tuple[list[dict], list[dict], list[dict]]]:
    """{held-out shape: (its MoE runs, power-model predictions, end-to-end predictions)} with the MoE
    constants (moe.MOE_LOCAL_FIT) fitted by bench/moe_check.py on the other shapes' runs, on the
    local profile; the same constants in the calibrated and the analytical level."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import moe_check as M
    from advisor.models import calibrate, moe

    mrows = M.moe_rows()
    base = M.local_base()
    runs = [r for r in rows if r["file"].startswith("h100x1-moe")]
    keep_default = calibrate.DEFAULT
    out = {}
    try:
        for s in sorted({M.shape_of(r["rec"].model) for r in runs}):
            fitted = M.fit([r for r in mrows if M.shape_of(r["rec"].model) != s], base, M.LOCAL_FIT)
            moe_c = {n: getattr(fitted, n) for n in moe.MOE_LOCAL_FIT}
            fold = dataclasses.replace(cal, constants=cal.constants.replace(**moe_c))
            calibrate.DEFAULT = keep_default.replace(**moe_c)  # the analytical level's constants too
            test = [r for r in runs if M.shape_of(r["rec"].model) == s]
            out[s] = (test, [power_model(r, fold.constants) for r in test], [end_to_end(r, fold) for r in test])
    finally:
        calibrate.DEFAULT = keep_default
    return out


def moe_loso(rows: list[dict], cal) -> None:
    from advisor.models import moe

    print(f"MoE runs, leave one shape out: MoE constants ({', '.join(moe.MOE_LOCAL_FIT)}) fitted by "
          f"bench/moe_check.py on the other shapes' runs")
    lines, all_rows, all_pm, all_ee = [], [], [], []
    for s, (test, pm, ee) in moe_loso_predictions(rows, cal).items():
        lines += [(f"model, held out {s}", test, pm), (f"e2e, held out {s}", test, ee)]
        all_rows += test
        all_pm += pm
        all_ee += ee
    table(lines + [("model, all shapes held out", all_rows, all_pm), ("e2e, all shapes held out", all_rows, all_ee)])


def fit(rows: list[dict], base: Constants = DEFAULT) -> Constants:
    from scipy.optimize import least_squares

    names = TRAINING_FIT
    x0 = np.log([getattr(base, n) for n in names])
    lo = np.log([BOUNDS[n][0] for n in names])
    hi = np.log([BOUNDS[n][1] for n in names])

    def consts(x):
        return base.replace(**{n: float(v) for n, v in zip(names, np.exp(x))})

    def res(x):
        c = consts(x)
        out = []
        for r in rows:
            p = power_model(r, c)
            out.append(math.log(p["mean_w"] / r["mean_w"]))
            out.append(0.5 * math.log(p["peak_w"] / r["peak_w"]))
            if len(r["stage_w"]) > 1 and len(r["stage_w"]) == len(p["stage_w"]):
                out.extend(0.5 * math.log(a / b) / len(r["stage_w"]) ** 0.5 for a, b in zip(p["stage_w"], r["stage_w"]))
        return np.array(out)

    r = least_squares(res, np.clip(x0, lo + 1e-9, hi - 1e-9), bounds=(lo, hi), loss="soft_l1", f_scale=0.05,
                      diff_step=1e-3)
    return consts(r.x)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--calibration", default="none",
                    help="none (the analytical model), default, local, te, a file, or stack: each run with its "
                         "stack's shipped profile (local or te)")
    ap.add_argument("--fit", action="store_true", help="fit the training-run constants on FILES and print them")
    ap.add_argument("--rows", action="store_true")
    ap.add_argument("--moe-loso", action="store_true", help="also the MoE runs with MoE constants fitted on the other shapes")
    a = ap.parse_args(argv)
    files = a.files or sorted(glob.glob("data/measurements/*.jsonl"))
    rows = load(files)
    from advisor.models.calibrate import resolve_calibration

    per_stack = a.calibration == "stack"
    cal = resolve_calibration("local" if per_stack else a.calibration)
    if a.fit:  # on the step-time constants of the calibration, when one is given
        c = fit(rows, cal.constants if cal is not None else DEFAULT)
        print(f"fitted on {len(rows)} runs of {', '.join(sorted({r['file'] for r in rows}))}:")
        for n in TRAINING_FIT:
            print(f"    {n}: float = {getattr(c, n):.4g}")
        return 0
    cals = [stack_calibration(r) if per_stack else cal for r in rows]
    pm = [power_model(r, k.constants if k is not None else DEFAULT) for r, k in zip(rows, cals)]
    ee = [end_to_end(r, k) for r, k in zip(rows, cals)]
    label = ("end to end (each run's stack profile)" if per_stack else
             f"end to end ({'calibration ' + a.calibration if cal is not None else 'analytical'})")
    print(f"{len(rows)} runs with telemetry in {len(files)} file(s); J/token from the energy counter where the "
          f"measured interval is >= {MIN_COUNTER_S:g} s; J/token* from the sampled power (every run)")
    table([("power model (measured step)", rows, pm), (label, rows, ee)])
    print("by group:")
    lines = []
    for g, keep in GROUPS:
        sel = [i for i, r in enumerate(rows) if keep(r)]
        if sel:
            name = g.format(n=len(sel))
            lines += [(f"model {name}", [rows[i] for i in sel], [pm[i] for i in sel]),
                      (f"e2e {name}", [rows[i] for i in sel], [ee[i] for i in sel])]
    table(lines)
    by_file = {}
    for r, p, q in zip(rows, pm, ee):
        by_file.setdefault(r["file"], []).append((r, p, q))
    print("per file (MAPE, power model / end to end): mean W | J/token")
    for f, items in by_file.items():
        rr, pp, qq = zip(*items)
        e1, e2 = errors(list(rr), list(pp)), errors(list(rr), list(qq))
        print(f"  {f:34s} n={len(rr):2d}  {e1['mean_w'][0]:5.2f}% / {e2['mean_w'][0]:5.2f}%  |  "
              f"{e1['j_per_token'][0]:5.2f}% / {e2['j_per_token'][0]:5.2f}% ({e1['j_per_token'][1]} with counter)")
    print("MoE runs per file (MAPE, power model / end to end): mean W | peak W; stack")
    for f, items in by_file.items():
        items = [it for it in items if is_moe(it[0])]
        if not items:
            continue
        rr, pp, qq = zip(*items)
        e1, e2 = errors(list(rr), list(pp)), errors(list(rr), list(qq))
        stacks = ",".join(sorted({r["rec"].stack for r in rr}))
        fitted = "; power constants fitted on them" if f in FITTED else ""
        print(f"  {f:34s} n={len(rr):2d}  {e1['mean_w'][0]:5.2f}% / {e2['mean_w'][0]:5.2f}%  |  "
              f"{e1['peak_w'][0]:5.2f}% / {e2['peak_w'][0]:5.2f}%; {stacks}{fitted}")
    if a.moe_loso:
        moe_loso(rows, cal)
    if a.rows:
        for r, p, q in zip(rows, pm, ee):
            jt = f"{r['j_per_token'] * 1e3:6.2f} {p['j_per_token'] * 1e3:6.2f} {q['j_per_token'] * 1e3:6.2f}" if r["j_per_token"] else " " * 20
            print(f"{r['id'][:20]:20s} W {r['mean_w']:4.0f} {p['mean_w']:4.0f} {q['mean_w']:4.0f}  peak {r['peak_w']:4.0f} "
                  f"{p['peak_w']:4.0f}  MHz {r['clock_mhz'] or 0:5.0f} {p['clock_mhz'] or 0:5.0f}  mJ/tok {jt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
