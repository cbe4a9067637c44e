"""Fit the DVFS constants (models/dvfs.py) on the H100 load sweep, report in and out of sample.

    python bench/dvfs_fit.py [--sweep data/dvfs/h100x1-sweep] [--json OUT.json] [--write-constants]
    python bench/dvfs_fit.py --sweep data/dvfs/h200x1-sweep --gpu h200    # another GPU's sweep
    python bench/dvfs_fit.py --sweep data/dvfs/h200x1-sweep --gpu h200 --shipped   # the shipped
                                                  # constants on it, nothing fitted (out of sample)

Observations, from the sweep's windows (bench/dvfs_sweep.py; mean power = energy counter / window):
  idle                        awake power at the maximum clock
  loads below the cap         mean power at the maximum clock (small GEMMs, memory-bound kernels)
  loads at the cap            the median SM clock the limiter held (the model solves the clock at
                              which the load's power meets the window's mean power)
  gemm-8192 rate vs clock     TFLOP/s of the steady load and of every duty-cycle setting against
                              the clock its bursts ran at (what gemm_clock_share describes)
  duty cycles                 burst power (window energy minus the gaps at idle power, over the
                              bursts' GPU time) against the bursts' clock, and the clock the limiter
                              held given the gaps (what limiter_window_s describes)
  mixes                       mean power of alternating GEMM / copy at the clock held
Held out (never in the fit): the transformer-shaped GEMMs (shape-ffn-up, -ffn-down, -qkv, -wide-k,
-skinny) and mem-chain. Not fitted: memory_sm_power (every memory-bound load ran at the maximum
clock but the copies of the mixes, so the SM-side share of their power cannot be told from the HBM
share; fitted, it went to its bound 0). `--write-constants` prints the lines for
models/constants.py.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from pathlib import Path

import numpy as np

from advisor.catalog import load_gpu
from advisor.models import dvfs
from advisor.models.constants import DEFAULT

FIT = {  # name: (lo, hi)
    "vf_slope": (0.05, 1.5),
    "gemm_clock_share": (0.1, 1.0),
    "memory_sm_clock_share": (0.0, 1.0),
    "clock_power": (0.0, 0.3),
    "gemm_power": (0.3, 4.0),
    "gemm_power_exponent": (0.3, 1.0),
    "fp8_gemm_power": (0.3, 3.0),
    "attention_power": (0.2, 4.0),
    "memory_hbm_power": (0.0, 1.0),
    "limiter_window_s": (0.005, 1.0),
}
HELD_OUT = ("shape-ffn-up", "shape-ffn-down", "shape-qkv", "shape-wide-k", "shape-skinny", "mem-chain")
BEST_BF16 = DEFAULT.gemm_efficiency_max  # u = rate at f_max / (this x peak), as the step model does
BEST_FP8 = DEFAULT.gemm_efficiency_max_fp8


def load(sweep: Path):
    rows = {json.loads(line)["name"]: json.loads(line) for line in open(f"{sweep}.jsonl")}
    tr = json.load(gzip.open(f"{sweep}.trace.json.gz"))
    uuid = next(iter(tr["columns"]))
    col = {k: np.array([np.nan if v is None else v for v in vals], float) for k, vals in tr["columns"][uuid].items()}
    windows = {w[0]: (w[1], w[2]) for w in tr["windows"]}
    return rows, col, windows, tr["meta"].get("loads", {})


def observations(rows, col, windows, loads, gpu):
    """List of dicts: {name, kind, ...} (see the module docstring)."""
    fmax = gpu.max_sm_clock_mhz
    obs = []
    p_idle = rows["idle"]["telemetry"]["energy_j"] / (rows["idle"]["t1"] - rows["idle"]["t0"])
    obs.append({"name": "idle", "what": "power", "phases": [("wait0", 1.0, 1.0)], "x": 1.0, "y": p_idle})
    for name, r in rows.items():
        if "error" in r or r["kind"] not in ("gemm", "fp8", "attention", "memory"):
            continue
        t = r["telemetry"]
        mean = t["energy_j"] / (r["t1"] - r["t0"])
        x_obs = t["median_sm_clock_mhz"] / fmax
        capped = (t["throttle_fractions"] or {}).get("sw_power_cap", 0.0) > 0.5
        if r["kind"] in ("gemm", "fp8"):
            best = (BEST_FP8 * gpu.fp8_tflops) if r["kind"] == "fp8" else BEST_BF16 * gpu.bf16_tflops
            phase = ("gemm", r["tflops"] / best, x_obs, r["kind"] == "fp8")  # rate at x_obs / best at f_max
        elif r["kind"] == "attention":
            phase = ("attention", 1.0, x_obs, False)
        else:  # bandwidth / peak; the first sweep logged the chain with 12 passes of its buffer, it makes 10
            nbytes = r["bytes"] * (10 / 12 if r.get("op") == "chain" and "chain_passes" not in r else 1.0)
            phase = ("memory", nbytes / r["gpu_s"] / 1e9 / gpu.hbm_bandwidth_gbs, x_obs, False)
        obs.append({"name": name, "what": "clock" if capped else "power", "phase": phase, "x": x_obs,
                    "y": x_obs if capped else mean, "cap": mean})
    # gemm-8192: rate against clock (steady and duty bursts); duty bursts' power and held clock
    ref = rows["gemm-8192"]
    rate_pts = [(ref["telemetry"]["median_sm_clock_mhz"] / fmax, ref["tflops"])]
    for name, v in loads.items():
        r = rows[name]
        t0, t1 = windows[name]
        if "bursts" in v:
            b = np.array(v["bursts"])
            inb = np.zeros(len(col["t"]), bool)
            for bb in b:
                inb |= (col["t"] >= bb[0]) & (col["t"] <= bb[1])
            x_on = float(np.nanmedian(col["sm_clock_mhz"][inb & (col["t"] >= t0) & (col["t"] <= t1)])) / fmax
            gpu_on = float(b[:, 3].sum())
            tfl = v["flops_per_replay"] * b[:, 2].sum() / gpu_on / 1e12
            rate_pts.append((x_on, tfl))
            T = t1 - t0
            p_on = (r["telemetry"]["energy_j"] - p_idle * (T - gpu_on)) / gpu_on
            period, duty = r["period"], r["duty"]
            obs.append({"name": name, "what": "burst_power", "x": x_on, "y": p_on, "rate": tfl})
            obs.append({"name": name, "what": "burst_clock", "x": x_on, "y": x_on, "rate": tfl,
                        "on": duty * period, "off": (1 - duty) * period})
        elif "groups" in v:
            g = np.array(v["groups"])
            x = r["telemetry"]["median_sm_clock_mhz"] / fmax
            tg, tc = float(g[:, 1].sum()), float(g[:, 2].sum())
            tfl = v["flops_per_gemm_group"] * len(g) / tg / 1e12
            mean = r["telemetry"]["energy_j"] / (t1 - t0)
            bw = v["bytes_per_copy_group"] * len(g) / tc / 1e9 / gpu.hbm_bandwidth_gbs
            obs.append({"name": name, "what": "mix", "x": x, "y": mean, "rate": tfl, "tg": tg, "tc": tc, "bw": bw})
            copy = rows["mem-copy"]
            obs.append({"name": f"copy-rate@{x * fmax:.0f}", "what": "copy_rate", "x": x, "y": bw,
                        "y_ref": copy["bytes"] / copy["gpu_s"] / 1e9 / gpu.hbm_bandwidth_gbs})
    for x, tfl in rate_pts:
        obs.append({"name": f"rate@{x * fmax:.0f}", "what": "rate", "x": x, "y": tfl, "x_ref": rate_pts[0][0],
                    "y_ref": rate_pts[0][1]})
    return obs


def predict(o, c, gpu):
    """The model's value for observation o under constants c."""
    what = o["what"]
    if what == "power" and o["name"] == "idle":
        return dvfs.phase_power(dvfs.Phase("wait", 1.0), 1.0, gpu, c.replace(wait_power=0.0))
    if what in ("power", "clock"):
        kind, rate_rel, x_obs, fp8 = o["phase"]
        u = rate_rel * (dvfs.compute_stretch(x_obs, c) if kind == "gemm" else dvfs.memory_stretch(x_obs, 1.0, c))
        p = dvfs.Phase(kind, 1.0, utilization=u, fp8=fp8)
        if what == "power":
            return dvfs.phase_power(p, 1.0, gpu, c)
        return dvfs.solve_clock([p], [], gpu, o["cap"], c).x
    if what == "copy_rate":
        return o["y_ref"] / dvfs.memory_stretch(o["x"], 1.0, c)
    if what == "rate":
        return o["y_ref"] * dvfs.compute_stretch(o["x_ref"], c) / dvfs.compute_stretch(o["x"], c)
    u8 = o["rate"] / (BEST_BF16 * gpu.bf16_tflops) * dvfs.compute_stretch(o["x"], c)
    g = dvfs.Phase("gemm", 1.0, utilization=u8)
    if what == "burst_power":
        return dvfs.phase_power(g, o["x"], gpu, c)
    if what == "burst_clock":  # bursts of `on` s with gaps of `off` s, under the 700 W cap
        busy = [dvfs.Phase("gemm", o["on"], utilization=u8)]
        waits = [(o["off"], dvfs.limiter_weight(o["off"], c))]
        return dvfs.solve_clock(busy, waits, gpu, gpu.max_power_limit_w, c.replace(wait_power=0.0)).x
    if what == "mix":
        tg, tc = o["tg"], o["tc"]
        pg = dvfs.phase_power(g, o["x"], gpu, c)
        bw1 = o["bw"] * dvfs.memory_stretch(o["x"], 1.0, c)  # bandwidth it would reach at f_max
        pm = dvfs.phase_power(dvfs.Phase("memory", 1.0, utilization=bw1), o["x"], gpu, c)
        return (pg * tg + pm * tc) / (tg + tc)
    raise ValueError(what)


def residual(o, v):
    if o["what"] in ("clock", "burst_clock"):
        return (v - o["y"]) / 0.02  # a clock within 2% weighs like a power within 2%
    return math.log(v / o["y"]) / 0.02


def fit(obs, gpu, names=tuple(FIT)):
    from scipy.optimize import least_squares

    x0 = np.array([getattr(DEFAULT, n) for n in names])
    lo = np.array([FIT[n][0] for n in names])
    hi = np.array([FIT[n][1] for n in names])
    x0 = np.clip(x0, lo + 1e-9, hi - 1e-9)

    def consts(x):
        return DEFAULT.replace(**{n: float(v) for n, v in zip(names, x)})

    def res(x):
        c = consts(x)
        return np.array([residual(o, predict(o, c, gpu)) for o in obs])

    r = least_squares(res, x0, bounds=(lo, hi), loss="soft_l1", f_scale=1.0, diff_step=1e-4, max_nfev=400)
    return consts(r.x), r


def table(obs, c, gpu, held=()):
    out = []
    for o in obs:
        v = predict(o, c, gpu)
        unit = {"clock": "ratio", "burst_clock": "ratio", "rate": "TFLOP/s", "copy_rate": "of peak BW"}.get(o["what"], "W")
        err = (v - o["y"]) / o["y"] * 100
        out.append({"name": o["name"], "what": o["what"], "measured": o["y"], "predicted": v, "unit": unit,
                    "error_pct": err, "held_out": o["name"] in held})
    return out


def print_rows(rows) -> None:
    """The observation table of `table`'s rows, held-out ones tagged."""
    print(f"{'observation':22s} {'what':12s} {'measured':>10s} {'predicted':>10s} {'err %':>7s}")
    for t in rows:
        tag = " (held out)" if t["held_out"] else ""
        print(f"{t['name']:22s} {t['what']:12s} {t['measured']:10.3f} {t['predicted']:10.3f} {t['error_pct']:+7.2f}{tag}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", default="data/dvfs/h100x1-sweep")
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--json", default=None)
    ap.add_argument("--write-constants", action="store_true")
    ap.add_argument("--shipped", action="store_true",
                    help="no fit: the shipped constants (models/constants.py) and the catalog GPU on the sweep")
    a = ap.parse_args(argv)
    gpu = load_gpu(a.gpu)
    obs = observations(*load(Path(a.sweep)), gpu)
    if a.shipped:
        rows = table(obs, DEFAULT, gpu, ())
        print(f"shipped constants, {gpu.name} (hbm_power_scale {gpu.hbm_power_scale:g}), nothing fitted:")
        print_rows(rows)
        for what in sorted({t["what"] for t in rows}):
            e = [t["error_pct"] for t in rows if t["what"] == what]
            print(f"  {what:12s} n={len(e):2d} MAPE {np.mean(np.abs(e)):5.2f}%  bias {np.mean(e):+5.2f}%")
        return 0
    train = [o for o in obs if o["name"] not in HELD_OUT]
    c, r = fit(train, gpu)
    rows = table(obs, c, gpu, HELD_OUT)
    print(f"{len(train)} observations fitted, {len(obs) - len(train)} held out; cost {r.cost:.2f}, "
          f"status {r.status}")
    print_rows(rows)
    for held in (False, True):
        sel = [t for t in rows if t["held_out"] == held]
        for what in sorted({t["what"] for t in sel}):
            e = [abs(t["error_pct"]) for t in sel if t["what"] == what]
            print(f"  {'held out' if held else 'fitted':8s} {what:12s} n={len(e):2d} MAPE {np.mean(e):5.2f}%")
    fitted = {n: getattr(c, n) for n in FIT}
    at = [n for n in FIT if min(abs(fitted[n] - FIT[n][0]), abs(fitted[n] - FIT[n][1])) < 1e-6]
    print("fitted:", ", ".join(f"{n}={v:.4g}" for n, v in fitted.items()), "| at a bound:", at or "none")
    # the memory system's power of this GPU over the H100's, which the shipped constants were fitted
    # on: GPUSpec.hbm_power_scale (the fit above already multiplies by the catalog's value)
    print(f"{gpu.name}: memory power over the shipped constants' (GPUSpec.hbm_power_scale) "
          f"{fitted['memory_hbm_power'] * gpu.hbm_power_scale / DEFAULT.memory_hbm_power:.3f} "
          f"(catalog: {gpu.hbm_power_scale:g})")
    if a.write_constants:
        for n, v in fitted.items():
            print(f"    {n}: float = {v:.4g}")
    if a.json:
        Path(a.json).write_text(json.dumps({"constants": fitted, "at_bound": at, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
