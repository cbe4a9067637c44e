"""Memory at the edge (issue #27): every OOM record of data/measurements/ against the predicted
peak, its upper bound and the usable memory; and on the runs that fit, predicted vs measured peak
memory, leave-one-architecture-out, dense and MoE apart.

    python bench/memory_edge.py [--margin 0.05] [--fit]      # --fit writes models/data/memory_band.json
    python bench/memory_edge.py --recipe 115                  # one published recipe, term by term per stage
    python bench/memory_edge.py --outside                     # memory outside torch's allocator: solve and check
    python bench/memory_edge.py --allocator                   # reserved but unallocated: fit, LOAO, per stage

Measured peak of a run: max over ranks of torch's peak reserved memory less what was already
allocated when the trial started (a trial batched after another in one process starts with the
previous trial's leftovers: 7.5 GiB on the h100x1-moe-a/b batches). Predicted: models.memory's
fullest stage with the stack's profile constants (recommend's memory screen) and the record's own
layout (its cross entropy included: TrainConfig.cross_entropy_impl, models.dataset.legacy_config for
records without it): what torch's allocator holds (StageMemory.total_gib); the memory outside the
allocator (models/outside_memory.py) is a term of its own, added once to the band's interval. A
record's stack is its own `stack` key, else `te` when its env names Transformer Engine, else `local`.

The band (models/memory_band.py): lo / hi = the smallest / largest measured / predicted
ratio of the stack's dense or MoE runs. Leave-one-architecture-out: for each architecture, the band of the
other architectures of its class, and how many of the held-out runs fall under its upper end;
MAPE "LOAO" divides each prediction by the median ratio of the other architectures (a scale fitted
without the run's architecture), "as shipped" is the profile as it is (its memory constants were
fitted on 3 of these architectures: docs/calibration.md).
Memory outside torch's allocator (--outside): the constants of models/outside_memory.py solved from
data/microbench/h100x4-outside-memory-mcore.jsonl (megatron-core's groups, per size class), then the
term against each stage record's memory_phases outside_allocator_gib and each OOM message's "this
process has X GiB memory in use" minus what torch had reserved (allocated + reserved but unallocated).
"""
from __future__ import annotations

import argparse
import glob
import json
import re
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from advisor.catalog.specs import ModelSpec, TrainConfig  # noqa: E402
from advisor.models import memory_band as MB  # noqa: E402
from advisor.models.calibrate import resolve_calibration  # noqa: E402
from advisor.models.dataset import cluster_of, legacy_config, shape_key  # noqa: E402
from advisor.models.memory import peak_memory_gib, stage_memory  # noqa: E402
from advisor.models.outside_memory import megatron_groups, outside_allocator_gib  # noqa: E402

COMMAND = "python bench/memory_edge.py --fit"
GIB_UNITS = {"GiB": 1.0, "MiB": 1.0 / 1024}


def record_stack(rec: dict) -> str:
    env = rec.get("env") or {}
    return rec.get("stack") or ("te" if env.get("transformer_engine") else "local")


def oom_outside_gib(error: str) -> float | None:
    """Process memory in use minus torch's reserved memory, from an OOM message (None: not one)."""
    used = re.search(r"this process has ([\d.]+) (GiB|MiB) memory in use", error or "")
    alloc = re.search(r"([\d.]+) (GiB|MiB) is allocated by PyTorch", error or "")
    free = re.search(r"([\d.]+) (GiB|MiB) is reserved by PyTorch but unallocated", error or "")
    if not (used and alloc and free):
        return None
    g = [float(m.group(1)) * GIB_UNITS[m.group(2)] for m in (used, alloc, free)]
    return g[0] - g[1] - g[2]


def measured_gib(mem: dict) -> float | None:
    peak = mem.get("peak_reserved_gib_per_rank") or mem.get("peak_allocated_gib_per_rank")
    if not peak:
        v = mem.get("max_reserved_gib") or mem.get("max_gib")
        return float(v) if v else None
    start = mem.get("start_allocated_gib_per_rank") or [0.0] * len(peak)
    own = [p - s for p, s in zip(peak, start) if p is not None]
    return max(own) if own else None


def rows(paths: list[str]) -> list[dict]:
    cals: dict = {}
    out = []
    for path in paths:
        for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec.get("status") not in ("ok", "oom"):
                continue
            mem = rec.get("memory") or {}
            meas = measured_gib(mem) if mem else None
            if rec["status"] == "ok" and meas is None:
                continue
            model = ModelSpec.from_dict(rec["model"])
            stack = record_stack(rec)
            cfg = TrainConfig.from_dict(legacy_config(rec["config"], model, stack))
            cluster = cluster_of(rec)
            if stack not in cals:
                cals[stack] = resolve_calibration("default", stack).screening_constants
            c = cals[stack]
            start = max(mem.get("start_allocated_gib_per_rank") or [0.0])
            top = max(stage_memory(model, cfg, c, gpu=cluster.gpu), key=lambda sm: sm.total_gib)  # the fullest stage
            alloc = measured_gib({k: v for k, v in mem.items() if k.startswith(("peak_allocated", "start_"))})
            out.append({"id": rec.get("id", f"{Path(path).name}:{n}"), "status": rec["status"], "stack": stack,
                        "model": model.name, "moe": model.is_moe, "arch": shape_key(model), "gpu": cluster.gpu.name,
                        "gpu_gib": cluster.gpu.memory_gib, "gpu_spec": cluster.gpu, "predicted": top.total_gib,
                        "rf": top.reserved_free_gib, "rf_off": top.reserved_free_off_gib, "x": cfg.expandable_segments, "measured_alloc": alloc,
                        "periodic": MB.periodic_layout(model, cfg),
                        "outside_pred": outside_allocator_gib(model, cfg, None, c),
                        "model_spec": model, "cfg": cfg, "phases": rec.get("memory_phases") or [],
                        "measured": meas, "start": start, "outside": oom_outside_gib(rec.get("error") or ""),
                        "memory": mem})
    return out


def affine(A: np.ndarray, M: np.ndarray) -> tuple[float, float, np.ndarray]:
    """measured = b * A + a by least squares: (b, a, residuals GiB)."""
    b, a = np.polyfit(A, M, 1)
    return float(b), float(a), M - (b * A + a)


def spread(d: np.ndarray) -> dict:
    """The range of measured - predicted reserved-but-unallocated GiB (0, 0 without runs)."""
    return {"rf_lo_gib": float(d.min()) if len(d) else 0.0, "rf_hi_gib": float(d.max()) if len(d) else 0.0}


def envelope(R: np.ndarray, M: np.ndarray, upper: bool) -> tuple[float, float]:
    """The tightest line a + b R over (upper) or under (lower) every point (R, M): measured
    reserved-but-unallocated GiB M against the predicted term R, slope b >= 0 (a layout freeing larger
    blocks strands no less), least total slack (linear program): (b, a). (1, 0) without runs."""
    from scipy.optimize import linprog

    if not len(R):
        return 1.0, 0.0
    s = 1.0 if upper else -1.0
    res = linprog(s * np.array([len(R), R.sum()]), A_ub=-s * np.c_[np.ones_like(R), R], b_ub=-s * M,
                  bounds=[(None, None), (0.0, None)])
    a, b = (float(v) for v in res.x)
    return b, a


RF_FORMS = ("constant", "ratio", "affine")


def reserved_envelope(R: np.ndarray, M: np.ndarray, form: str = "affine") -> dict:
    """The band's reserved-but-unallocated part with expandable segments off (models/memory_band.py):
    lines under and over the measured M against the predicted R that hold every run, of one form:
    "constant" (slope 1: R + the range of M - R, GiB whatever the layout's blocks), "ratio" (no
    intercept: the range of M / R, stranding in proportion to the blocks R is made of) or "affine"
    (the tightest lines of slope >= 0, envelope())."""
    if not len(R):
        return {"rf_lo_scale": 1.0, "rf_lo_gib": 0.0, "rf_hi_scale": 1.0, "rf_hi_gib": 0.0}
    if form == "constant":
        bl = bh = 1.0
    elif form == "ratio":
        bl, bh = float((M / R).min()), float((M / R).max())
    else:
        bl, bh = envelope(R, M, False)[0], envelope(R, M, True)[0]
    # the intercepts that put every run inside (0 for the ratio form, up to rounding)
    al, ah = float((M - bl * R).min()), float((M - bh * R).max())
    if form == "ratio":
        al, ah = min(al, 0.0), max(ah, 0.0)
    return {"rf_lo_scale": bl, "rf_lo_gib": al, "rf_hi_scale": bh, "rf_hi_gib": ah}


def reserved_loao(R: np.ndarray, M: np.ndarray, arch: np.ndarray) -> dict:
    """Per form of reserved_envelope: how many runs fall under the upper line fitted without their
    architecture, and the mean GiB that line is over them (negative: under-predicted)."""
    out = {}
    for form in RF_FORMS:
        cov, slack = 0, []
        for a in sorted(set(arch)):
            held = arch == a
            if held.all():
                continue
            e = reserved_envelope(R[~held], M[~held], form)
            up = e["rf_hi_scale"] * R[held] + e["rf_hi_gib"]
            cov += int((M[held] <= up + 1e-9).sum())
            slack += list(up - M[held])
        out[form] = {"covered": cov, "held": len(slack), "slack_gib": float(np.mean(slack)) if slack else float("nan")}
    return out


def choose_reserved_form(lo: dict) -> str:
    """The form that holds the most held-out runs, then the one with the least mean slack."""
    return min(RF_FORMS, key=lambda f: (-lo[f]["covered"], lo[f]["slack_gib"]))


MIN_ARCHITECTURES = 2  # lines of a subset are used only where a held-out architecture can check them


def reserved_part(R: np.ndarray, M: np.ndarray, arch: np.ndarray) -> dict:
    """The lines of the form choose_reserved_form picks over (R, M), with every form's held-out check
    (rf_loao), how many runs and architectures they stand on, and whether they are used ("used":
    at least MIN_ARCHITECTURES architectures)."""
    lo = reserved_loao(R, M, arch)
    form = choose_reserved_form(lo)
    n_arch = len(set(arch.tolist()))
    return {**reserved_envelope(R, M, form), "rf_form": form, "rf_loao": lo, "n": int(len(R)),
            "architectures": n_arch, "used": n_arch >= MIN_ARCHITECTURES}


def rf_cells(s: dict) -> str:
    """A reserved_part's form, lines and held-out check per form, as table cells."""
    return (f"{s['rf_form']:8} {s['rf_lo_scale']:5.2f} R{s['rf_lo_gib']:+6.2f} {s['rf_hi_scale']:5.2f} R{s['rf_hi_gib']:+6.2f} "
            + " ".join(f"{s['rf_loao'][f]['covered']:3d}/{s['rf_loao'][f]['held']:<3d}{s['rf_loao'][f]['slack_gib']:+5.1f}"
                       for f in RF_FORMS))


def rf_upper(env: dict, R, periodic, pooled: dict, expandable=False, r_off=None, x_periodic_hi=None):
    """The band's upper end of the reserved-but-unallocated memory (models.memory_band.Band.
    reserved_free_interval) with the lines of reserved_part `pooled` and `env` (the periodic-schedule
    runs'); with expandable segments on (`expandable`, `r_off`: the term with them off), a periodic
    layout's R + `x_periodic_hi` (None: not used) and any other layout's `pooled` line at `r_off`."""
    b = MB.Band(lo=1.0, hi=1.0, stack="", kind="", source="", rf_hi_scale=pooled["rf_hi_scale"],
                rf_hi_gib=pooled["rf_hi_gib"], rf_periodic=(1.0, 0.0, env["rf_hi_scale"], env["rf_hi_gib"]),
                rf_expandable_periodic=None if x_periodic_hi is None else (0.0, x_periodic_hi))
    return b.reserved_free_interval(R, expandable, periodic, r_off)[1]


def expandable_spread(ok: list[dict]) -> dict:
    """measured - predicted reserved but unallocated over every run with expandable segments on
    (all stacks and classes pooled: the lower line of a non-periodic layout), and its "periodic"
    block: the same over the runs of a periodic layout alone (models.memory_band.periodic_layout:
    each freed block is asked for again at its size, so the segment holds no hole; "used" where they
    span MIN_ARCHITECTURES architectures), with its leave-one-architecture-out check ("loao": held-out
    runs under the others' largest, and the largest GiB a held-out run is over it)."""
    on = [r for r in ok if r["x"]]
    d = np.array([r["measured"] - r["measured_alloc"] - r["rf"] for r in on])
    per = np.array([bool(r["periodic"]) for r in on], bool)
    arch = np.array([r["arch"] for r in on])
    cov, over = 0, []
    for a in sorted(set(arch[per].tolist())):
        held, rest = per & (arch == a), per & (arch != a)
        if rest.any():
            cov += int((d[held] <= d[rest].max()).sum())
            over.append(float((d[held] - d[rest].max()).max()))
    n_arch = len(set(arch[per].tolist()))
    periodic = {**spread(d[per]), "n": int(per.sum()), "architectures": n_arch, "used": n_arch >= MIN_ARCHITECTURES,
                "runs": sorted(r["id"] for r, p in zip(on, per) if p),
                "loao": {"covered": cov, "held": int(per.sum()), "max_over_gib": max(over) if over else float("nan")}}
    return {**spread(d), "n": int(len(d)), "runs": sorted(r["id"] for r in on), "periodic": periodic}


def expandable_check(ok: list[dict]) -> list[dict]:
    """Every run with expandable segments on: its measured reserved but unallocated, the same
    layout's with them off where it ran ("off": the largest such run's; expandable segments strand a
    subset of what the caching allocator strands), and for the non-periodic ones the band's upper line
    (models.memory_band: the expandable-off line of every run at the layout's R_off) and that line
    fitted without the run's architecture (reserved_part on the other architectures' runs with them
    off) and the ratio measured / R_off (the slope a line in R_off fitted on these runs would need)."""
    out = []
    for r in sorted((r for r in ok if r["x"]), key=lambda r: (r["periodic"], r["id"])):
        meas = r["measured"] - r["measured_alloc"]
        twin = r["cfg"].replace(expandable_segments=False).key()
        offs = [q["measured"] - q["measured_alloc"] for q in ok if not q["x"] and q["model"] == r["model"]
                and q["stack"] == r["stack"] and q["cfg"].key() == twin]
        row = {"id": r["id"], "model": r["model"], "layout": twin, "periodic": bool(r["periodic"]), "measured": meas,
               "off": max(offs) if offs else None, "rf_off": r["rf_off"], "upper": None, "upper_held_out": None}
        if not r["periodic"]:
            b = MB.band(r["stack"], r["moe"])
            row["upper"] = float(b.reserved_free_interval(r["rf"], True, False, r["rf_off"])[1])
            mine = [q for q in ok if q["stack"] == r["stack"] and bool(q["moe"]) == bool(r["moe"]) and not q["x"]]
            R = np.array([q["rf"] for q in mine])
            M = np.array([q["measured"] - q["measured_alloc"] for q in mine])
            arch = np.array([q["arch"] for q in mine])
            e = reserved_envelope(R[arch != r["arch"]], M[arch != r["arch"]], reserved_part(R, M, arch)["rf_form"])
            row["upper_held_out"] = float(max(e["rf_hi_scale"] * r["rf_off"] + e["rf_hi_gib"], r["rf_off"]))
        out.append(row)
    return out


def print_expandable(xs: dict, ok: list[dict]) -> None:
    p = xs["periodic"]
    print(f"expandable segments on: measured - predicted reserved but unallocated {xs['rf_lo_gib']:+.2f} to "
          f"{xs['rf_hi_gib']:+.2f} GiB over {xs['n']} run(s) (R = Constants.alloc_reserved_expandable_gib; the lower "
          f"line of a non-periodic layout); periodic layouts {p['rf_lo_gib']:+.2f} to {p['rf_hi_gib']:+.2f} over "
          f"{p['n']} runs, {p['architectures']} architectures ({'used' if p['used'] else 'not used'}; held out: "
          f"{p['loao']['covered']} of {p['loao']['held']} under the others' largest, at most "
          f"{p['loao']['max_over_gib']:+.2f} GiB over it)")
    print(f"{'id':18} {'model':24} {'layout':44} {'periodic':8} {'on':>5} {'off':>5} {'R_off':>5} {'upper':>6} "
          f"{'held out':>8} {'on/R_off':>8}")
    for r in expandable_check(ok):
        f = (lambda v: f"{v:5.2f}" if v is not None else "    -")
        print(f"{r['id'][:18]:18} {r['model'][:24]:24} {r['layout'][:44]:44} {str(r['periodic']):8} {r['measured']:5.2f} "
              f"{f(r['off'])} {r['rf_off']:5.2f} {f(r['upper']):>6} {f(r['upper_held_out']):>8} "
              f"{r['measured'] / r['rf_off']:8.2f}")
    print("(on / off: measured reserved but unallocated GiB with expandable segments on / the same layout with them "
          "off; R_off: the predicted term with them off; upper: a non-periodic layout's upper line, every run's "
          "expandable-off line at R_off; held out: that line fitted without the run's architecture)")


def loao(ok: list[dict], xs: dict | None = None) -> dict:
    """Per class: the band, its leave-one-architecture-out coverage and MAPE. The band is two parts
    (models/memory_band.py): the predicted allocated peak (A - R) in the ratio form (measured / (A - R)
    between lo and hi) or the affine one (measured = b (A - R) + a, the residuals' range added), and the
    reserved-but-unallocated term R with lines under and over the measured one against R (the runs
    with expandable segments off; reserved_envelope's form that holds the most runs leave-one-
    architecture-out, then the least slack: choose_reserved_form), fitted on every run (for layouts
    whose schedule interleaves allocations: pipeline or CP) and on the runs with a periodic schedule
    alone ("periodic": models.memory_band.periodic_layout; `xs`: the pooled spread of the runs
    with expandable segments on). The allocated part's form kept is the
    one with the smaller LOAO MAPE of the peak reserved (|measured / held-out prediction - 1|, the
    held-out architecture's runs predicted by the allocated form fitted on the others plus R and the
    others' median R residual)."""
    xs = xs if xs is not None else expandable_spread(ok)
    out = {}
    for k, kind in enumerate(MB.CLASSES):
        rs = [r for r in ok if bool(r["moe"]) == bool(k)]
        if not rs:
            continue
        A = np.array([r["predicted"] for r in rs])
        R = np.array([r["rf"] for r in rs])
        R_off = np.array([r["rf_off"] for r in rs])
        Aa = A - R
        Ma = np.array([r["measured_alloc"] for r in rs])
        M = np.array([r["measured"] for r in rs])
        D = M - Ma - R  # measured - predicted reserved but unallocated
        X = np.array([bool(r["x"]) for r in rs])
        ratio = Ma / Aa
        arch = np.array([r["arch"] for r in rs])
        cov = {"ratio": 0, "affine": 0}
        err: dict[str, list] = {"ratio": [], "affine": []}
        P = np.array([bool(r["periodic"]) for r in rs])
        pooled = reserved_part(R[~X], (D + R)[~X], arch[~X])
        periodic = reserved_part(R[~X & P], (D + R)[~X & P], arch[~X & P])
        for a in sorted(set(arch)):
            held, rest = arch == a, arch != a
            if not rest.any():
                continue
            off = rest & ~X
            env = reserved_envelope(R[off], (D + R)[off], pooled["rf_form"])
            # the periodic lines where the shipped band uses them and the others' periodic runs can draw them
            env_p = (reserved_envelope(R[off & P], (D + R)[off & P], periodic["rf_form"])
                     if periodic["used"] and (off & P).any() else env)
            d_mid = np.where(X[held], 0.0, float(np.median(D[off])) if off.any() else 0.0)
            # expandable segments on: a periodic layout R + the periodic runs' largest, any other the
            # expandable-off line at its R_off (models.memory_band.Band.reserved_free_interval)
            xp = xs["periodic"]["rf_hi_gib"] if xs["periodic"]["used"] else None
            rf_hi = rf_upper(env_p, R[held], P[held], env, X[held], R_off[held], xp)
            rf_mid = R[held] + d_mid
            cov["ratio"] += int((M[held] <= ratio[rest].max() * Aa[held] + rf_hi).sum())
            err["ratio"] += list(np.abs(M[held] / (float(np.median(ratio[rest])) * Aa[held] + rf_mid) - 1.0))
            if len(set(Aa[rest])) > 1:
                b, c0, res = affine(Aa[rest], Ma[rest])
                cov["affine"] += int((M[held] <= b * Aa[held] + c0 + res.max() + rf_hi).sum())
                err["affine"] += list(np.abs(M[held] / (b * Aa[held] + c0 + rf_mid) - 1.0))
        mape = {f: float(np.mean(e) * 100) if e else float("nan") for f, e in err.items()}
        b, c0, res = affine(Aa, Ma) if len(set(Aa)) > 1 else (1.0, 0.0, Ma - Aa)
        form = "affine" if len(err["affine"]) == len(err["ratio"]) and mape["affine"] < mape["ratio"] and b > 0 else "ratio"
        band = ({"lo": b, "hi": b, "add_lo_gib": c0 + float(res.min()), "add_hi_gib": c0 + float(res.max())}
                if form == "affine" else {"lo": float(ratio.min()), "hi": float(ratio.max()),
                                          "add_lo_gib": 0.0, "add_hi_gib": 0.0})
        out[kind] = {**band, **{k: v for k, v in pooled.items() if k.startswith("rf_")}, "periodic": periodic,
                     "form": form, "n": len(rs), "architectures": len(set(arch)),
                     "expandable_runs": int(X.sum()), "loao_covered": cov[form],
                     "mape_as_shipped_pct": float(np.mean(np.abs(A / M - 1.0)) * 100),
                     "mape_loao_pct": mape[form], "mape_loao_ratio_pct": mape["ratio"],
                     "mape_loao_affine_pct": mape["affine"]}
    return out


def fit(rs: list[dict]) -> dict:
    stacks = {}
    xs = expandable_spread([r for r in rs if r["status"] == "ok"])
    # what the allocator could not give back when pressed (expandable segments on; bench/allocator_pressure.py)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from allocator_pressure import load, pressure_cap  # beside this file
    pressure = pressure_cap(load(), expandable=True)
    for stack in sorted({r["stack"] for r in rs}):
        mine = [r for r in rs if r["stack"] == stack]
        ok = [r for r in mine if r["status"] == "ok"]
        s = loao(ok, xs)
        if set(s) != set(MB.CLASSES):
            continue
        stacks[stack] = {**s, "expandable": {**xs, "pressure": pressure}, "records": f"{len(ok)} ok runs"}
    if "te" not in stacks:
        stacks["te"] = {**{k: {"lo": 1.0, "hi": 1.0, "n": 0, "form": "ratio"} for k in MB.CLASSES},
                        "unmeasured": "no Transformer Engine run with a memory peak in data/measurements/ yet: "
                                      "no interval (width 0)"}
    return {"format": MB.FORMAT, "command": COMMAND,
            "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "data": sorted(str(Path(p).relative_to(ROOT)) for p in glob.glob(str(ROOT / "data/measurements/*.jsonl"))),
            "measured": "max over ranks of torch's peak reserved (allocated) memory less the allocated memory at the "
                        "trial's start",
            "ratio": "measured allocated / (A - R), A = the predicted allocator peak (StageMemory.total_gib), R its "
                     "reserved-but-unallocated term (StageMemory.reserved_free_gib); the interval is [lo (A - R) + "
                     "add_lo_gib + rf_lo_scale R + rf_lo_gib, hi (A - R) + add_hi_gib + rf_hi_scale R + rf_hi_gib] (form "
                     "ratio: add_* = 0; affine: measured allocated = b (A - R) + a fitted, lo = hi = b, add_* = a + "
                     "the residuals' min / max; rf_*: lines under / over the measured reserved but unallocated against R "
                     "of the runs with expandable segments off, of the form rf_form (constant: slope 1, ratio: no "
                     "intercept, affine: slope >= 0 and least total slack) that holds the most held-out runs "
                     "(rf_loao: per form, runs under the line fitted without their architecture), the stack's "
                     "'expandable' block: R + the range of measured - predicted over every run with them on) plus "
                     "the layout's memory outside the allocator (models/outside_memory.py) once",
            "default_stack": "local", "stacks": stacks}


def recipes(margin: float | None) -> list[dict]:
    """The te fit set's published recipes (bench/fit_profiles.in_fit: NVIDIA's H100 dense runs),
    each with the te stack's layout defaults (TE's cross entropy, as the recipes set it): the
    fullest stage's predicted peak, the band's upper bound and the usable memory."""
    from advisor.models import published as P
    from advisor.models.memory_band import band_upper_gib
    from advisor.models.profiles import apply_layout_defaults

    sys.path.insert(0, str(ROOT / "bench"))
    from fit_profiles import in_fit

    c = resolve_calibration("default", "te").screening_constants
    out = []
    for r in P.load():
        if not (r.usable and in_fit(r)):
            continue
        m = MB.check_margin(margin) if margin is not None else MB.default_margin(c.memory_margin_gib,
                                                                                  r.cluster.gpu.memory_gib)
        cfg = apply_layout_defaults(r.cfg, "te", r.explicit)
        pred = peak_memory_gib(r.model, cfg, c, gpu=r.cluster.gpu)
        outside = outside_allocator_gib(r.model, cfg, None, c)
        b = MB.band("te", r.model.is_moe)
        # each stage's own allocator total with its own outside term: recommend's rule
        # (models.memory_band.band_upper_many); "upper" pairs the fullest stage with the largest outside term
        per_stage = band_upper_gib(r.model, cfg, b, c, under_pressure=True, gpu=r.cluster.gpu)  # the verdict's bound (recommend's)
        unpressed = band_upper_gib(r.model, cfg, b, c, gpu=r.cluster.gpu)
        top = max(stage_memory(r.model, cfg, c, gpu=r.cluster.gpu), key=lambda sm: sm.total_gib)
        notes = [a for a in r.assumptions if a.startswith("recompute not given") or a.startswith("FSDP")]
        if r.explicit:
            notes.append(f"recipe: {len(r.explicit)} settings")
        if r.unmodelled:
            notes.append(f"{len(r.unmodelled)} not modelled")
        out.append({"id": r.row_id, "model": r.model.name, "layout": cfg.key(), "predicted": pred, "outside": outside,
                    "upper": float(b.interval(pred, outside, top.reserved_free_gib, cfg.expandable_segments,
                                              MB.periodic_layout(r.model, cfg), top.reserved_free_off_gib,
                                              under_pressure=True)[1]),
                    "stage_upper": per_stage,
                    "usable": MB.usable_gib(r.cluster.gpu.memory_gib, m),
                    "fits": per_stage <= MB.usable_gib(r.cluster.gpu.memory_gib, m),
                    "unpressed_upper": unpressed,
                    "without_retries": unpressed <= MB.usable_gib(r.cluster.gpu.memory_gib, m),
                    "assumed": "; ".join(notes), "unmodelled": r.unmodelled})
    return out


def recipe_terms(row_id: str) -> tuple[dict, list[dict]]:
    """One usable published row (its row id: any GPU, dense or MoE), with its recipe's settings over
    the te stack's layout defaults and the te profile of its GPU's generation:
    (the recipe: id, model, layout, micro-batches, band, usable GiB; one dict per pipeline stage:
    layers, in-flight micro-batches per virtual chunk (Megatron's warm-up, layout.in_flight_chunks),
    and the memory terms in GiB: bf16 weights, the linear layers' quantized copies, gradients,
    optimizer states, activations, logits, the optimizer step's transient, runtime buffers in the
    allocator, the allocator's total, the memory outside the allocator, and the band's upper bound)."""
    from advisor.models import published as P
    from advisor.models.memory import linear_params, stage_memory
    from advisor.models.profiles import apply_layout_defaults
    from advisor.models.quant import weight_copy_bytes
    from advisor.search_spaces.layout import in_flight_chunks, stage_layers

    runs = [r for r in P.load() if r.usable]
    hit = [r for r in runs if str(r.row_id) == str(row_id)]
    if not hit:
        print(f"error: no usable published row {row_id!r} in data/published/published_fit.csv "
              f"(`python bench/recipes_fit.py --all` lists them)", file=sys.stderr)
        raise SystemExit(2)
    r = hit[0]
    c = resolve_calibration("default", "te", gpu=r.cluster.gpu).screening_constants
    cfg = apply_layout_defaults(r.cfg, "te", r.explicit)
    b = MB.band("te", r.model.is_moe)
    copy = weight_copy_bytes(cfg.quant_code, c, r.cluster.gpu)
    layers = stage_layers(r.model, cfg)
    periodic = bool(MB.periodic_layout(r.model, cfg))
    out = []
    # Megatron FSDP shards the quantized copies with the weights: their share of the stage's weights as
    # without it (the same fraction of each weight byte is sharded and gathered, models.memory.fsdp_terms)
    whole = stage_memory(r.model, cfg.replace(fsdp=False), c, gpu=r.cluster.gpu) if cfg.fsdp else None
    for sm in stage_memory(r.model, cfg, c, gpu=r.cluster.gpu):
        fp8 = linear_params(r.model, cfg, layers[sm.stage]) * copy / 2**30
        if whole is not None:
            fp8 *= sm.weights_gib / whole[sm.stage].weights_gib
        out.append({"stage": sm.stage, "layers": sm.layers, "in_flight": in_flight_chunks(cfg, sm.stage),
                    "weights": sm.weights_gib - fp8, "fp8_copies": fp8, "grads": sm.grads_gib,
                    "optimizer": sm.optimizer_gib, "activations": sm.activations_gib, "logits": sm.logits_gib,
                    "transient": sm.step_transient_gib, "overhead": sm.overhead_gib,
                    "reserved_free": sm.reserved_free_gib, "reserved_free_off": sm.reserved_free_off_gib,
                    "total": sm.total_gib,
                    "outside": sm.outside_gib,
                    "upper": float(b.interval(sm.total_gib, sm.outside_gib, sm.reserved_free_gib,
                                              cfg.expandable_segments, periodic, sm.reserved_free_off_gib,
                                              under_pressure=True)[1]),
                    "upper_unpressed": float(b.interval(sm.total_gib, sm.outside_gib, sm.reserved_free_gib,
                                                        cfg.expandable_segments, periodic, sm.reserved_free_off_gib)[1])})
    m = MB.default_margin(c.memory_margin_gib, r.cluster.gpu.memory_gib)
    head = {"id": r.row_id, "model": r.model.name, "layout": cfg.key(), "microbatches": cfg.num_microbatches,
            "usable": MB.usable_gib(r.cluster.gpu.memory_gib, m), "band": b, "expandable": cfg.expandable_segments,
            "periodic": periodic,
            "assumed": "; ".join(r.assumptions)}
    return head, out


def print_recipe(row_id: str) -> None:
    head, stages = recipe_terms(row_id)
    b = head["band"]
    print(f"recipe {head['id']}: {head['model']} {head['layout']} ({head['microbatches']} micro-batches per step)")
    if head["assumed"]:
        print(f"assumed: {head['assumed']}")
    print("per pipeline stage, GiB (in flight: micro-batches each virtual chunk holds at the stage's peak):")
    cols = ("weights", "fp8_copies", "grads", "optimizer", "activations", "logits", "transient", "overhead", "reserved_free",
            "total", "outside", "upper")
    print(f"{'stage':>5} {'layers':>6}  {'in flight':18} " + " ".join(f"{k[:11]:>11}" for k in cols))
    for s in stages:
        fl = ",".join(str(n) for n in s["in_flight"])
        print(f"{s['stage']:5d} {s['layers']:6d}  {fl[:18]:18} " + " ".join(f"{s[k]:11.2f}" for k in cols))
    top = max(stages, key=lambda s: s["upper"])
    print(f"tightest stage {top['stage']}: {top['total']:.1f} GiB predicted, upper bound {top['upper']:.1f} "
          f"(allocated x {b.hi:.3f} + {b.add_hi_gib:.1f}, reserved free {top['reserved_free']:.2f} "
          f"(expandable segments off {top['reserved_free_off']:.2f}) -> "
          f"{float(b.reserved_free_interval(top['reserved_free'], head['expandable'], head['periodic'], top['reserved_free_off'], True)[1]):.2f}"
          f" (counting all the allocator's cache "
          f"{float(b.reserved_free_interval(top['reserved_free'], head['expandable'], head['periodic'], top['reserved_free_off'])[1]):.2f}: "
          f"upper {top['upper_unpressed']:.1f}), + {top['outside']:.1f} outside the allocator), "
          f"usable {head['usable']:.1f}: {'fits' if top['upper'] <= head['usable'] else 'DOES NOT FIT'}")


MCORE_BENCH = ROOT / "data/microbench/h100x4-outside-memory-mcore.jsonl"


def solve_communicators(path: Path = MCORE_BENCH) -> dict:
    """Least squares of what megatron-core's groups add at creation (step "groups_created" less
    "world", per rank) on the count of its one-rank and larger groups (models.outside_memory.
    megatron_groups): {"single_gib", "comm_gib", "rows": [(layout, rank, n1, n_more, measured, fitted)]}."""
    X, y, rows_ = [], [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        d = json.loads(line)
        pts = {p["step"]: p["outside_gib"] for p in d["points"]}
        if "groups_created" not in pts or "world" not in pts:
            continue
        lay, world = d["layout"], d["world"]
        dp = world // (lay["tp"] * lay["pp"] * lay["cp"])
        stage = d["rank"] // (world // lay["pp"])  # megatron's order tp-cp-ep-dp-pp: PP is the slowest
        etp = lay.get("etp", lay["tp"])  # initialize_model_parallel's default expert TP: the TP size
        sizes = np.array([int(v) for v in megatron_groups(lay["tp"], lay["pp"], lay["cp"], dp, lay["ep"], etp,
                                                          stage).values()])
        n1, more = int((sizes == 1).sum()), int((sizes > 1).sum())
        X.append([n1, more])
        y.append(pts["groups_created"] - pts["world"])
        rows_.append((f"tp{lay['tp']}pp{lay['pp']}cp{lay['cp']}ep{lay['ep']}", d["rank"], n1, more, y[-1]))
    sol = np.linalg.lstsq(np.array(X, float), np.array(y), rcond=None)[0]
    return {"single_gib": float(sol[0]), "comm_gib": float(sol[1]),
            "rows": [(*r, float(np.dot(x, sol))) for r, x in zip(rows_, X)]}


def print_outside(rs: list[dict]) -> None:
    from advisor.models.outside_memory import outside_allocator_arrays

    s = solve_communicators()
    print(f"megatron-core's communicators at creation ({MCORE_BENCH.relative_to(ROOT)}, least squares): "
          f"one-rank {s['single_gib']:.3f} GiB, larger {s['comm_gib']:.3f} GiB")
    print(f"{'layout':14} {'rank':>4} {'1-rank':>6} {'larger':>6} {'measured':>8} {'fitted':>7}")
    for lay, rank, n1, more, meas, fitted in s["rows"]:
        print(f"{lay:14} {rank:4d} {n1:6d} {more:6d} {meas:8.3f} {fitted:7.3f}")
    print()
    print("Stage records (memory_phases): outside the allocator after the step, measured vs models/outside_memory.py")
    print(f"{'id':18} {'stack':5} {'layout':30} {'stage':>5} {'start':>5} {'meas':>6} {'pred':>6} {'diff':>6}")
    diffs = []
    cals: dict = {}
    for r in rs:
        for ph in r["phases"]:
            if ph.get("outside_allocator_gib") is None:
                continue
            if r["stack"] not in cals:
                cals[r["stack"]] = resolve_calibration("default", r["stack"]).screening_constants
            k = r["cfg"]
            pred = float(outside_allocator_arrays(k.tp, k.pp, k.cp, k.dp, k.ep, k.etp, ph["stage"], r["moe"],
                                                  k.precision != "bf16", cals[r["stack"]]))
            d = ph["outside_allocator_gib"] - pred
            diffs.append(d)
            start = ph.get("outside_start_gib")
            lay = f"tp{k.tp}pp{k.pp}cp{k.cp}ep{k.ep}etp{k.etp}dp{k.dp}-{k.precision}"
            print(f"{r['id'][:18]:18} {r['stack']:5} {lay:30} {ph['stage']:5d} "
                  f"{start if start is not None else float('nan'):5.2f} {ph['outside_allocator_gib']:6.2f} "
                  f"{pred:6.2f} {d:+6.2f}")
    if diffs:
        d = np.array(diffs)
        print(f"{len(d)} stage records: measured - predicted {d.min():+.2f} to {d.max():+.2f} GiB, "
              f"mean {d.mean():+.2f}, mean |.| {np.abs(d).mean():.2f}")
    print()
    oom = [r for r in rs if r["status"] == "oom" and r["outside"] is not None]
    print("OOM messages: memory in use less torch's reserved memory vs the layout's term (its largest stage)")
    for r in oom:
        print(f"{r['id']:18} {r['stack']:5} {r['model'][:28]:28} message {r['outside']:5.2f} "
              f"predicted {r['outside_pred']:5.2f} ({r['outside'] - r['outside_pred']:+.2f})")


ALLOC_KEYS = ("alloc_reserved_base_gib", "alloc_reserved_block", "alloc_reserved_moe")


def allocator_stages(rs: list[dict]) -> list[dict]:
    """Every pipeline stage of the ok runs with per-rank peak reserved and allocated: measured
    reserved but unallocated (max over the stage's ranks of reserved - allocated) and the three
    features of models/allocator_memory.py (the term with one coefficient at 1, the others 0,
    through models.memory.stage_memory: the model's own code)."""
    import dataclasses

    from advisor.models.memory import stage_memory

    out = []
    for r in rs:
        mem = r.get("memory") or {}
        res, al = mem.get("peak_reserved_gib_per_rank"), mem.get("peak_allocated_gib_per_rank")
        if r["status"] != "ok" or not res or not al or len(res) != len(al) or r["cfg"].expandable_segments:
            continue  # (expandable segments: the term is the measured residual, not these three features)
        cfg = r["cfg"]
        per = len(res) // cfg.pp
        if per < 1:
            continue
        feats = []
        for k in ALLOC_KEYS:
            basis = dataclasses.replace(resolve_calibration("default", r["stack"]).screening_constants,
                                        **{x: float(x == k) for x in ALLOC_KEYS})
            feats.append([s.reserved_free_gib for s in stage_memory(r["model_spec"], cfg, basis, gpu=r["gpu_spec"])])
        for st in range(cfg.pp):
            meas = max(res[i] - al[i] for i in range(st * per, (st + 1) * per))
            out.append({"id": r["id"], "stack": r["stack"], "arch": r["arch"], "moe": r["moe"], "stage": st,
                        "model": r["model"], "measured": meas, "x": [f[st] for f in feats]})
    return out


def fit_allocator(stages: list[dict]) -> dict:
    """Non-negative least squares of the measured reserved-but-unallocated memory on the term's
    three features; leave-one-architecture-out mean |error| (GiB) per stack and class."""
    from scipy.optimize import nnls

    from advisor.models.allocator_memory import RANGES

    X = np.array([s["x"] for s in stages])
    y = np.array([s["measured"] for s in stages])
    coef = nnls(X, y)[0]
    arch = np.array([s["arch"] for s in stages])
    held = np.zeros(len(y))
    for a in sorted(set(arch)):
        h = arch == a
        held[h] = X[h] @ nnls(X[~h], y[~h])[0]
    fitted = dict(zip(ALLOC_KEYS, (float(v) for v in coef)))
    inside = {k: RANGES[k][0] <= v <= RANGES[k][1] for k, v in fitted.items()}
    return {"coef": fitted, "inside_ranges": inside, "fitted": X @ coef, "held_out": held, "y": y}


def print_allocator(rs: list[dict]) -> None:
    from advisor.models.constants import DEFAULT

    stages = allocator_stages(rs)
    f = fit_allocator(stages)
    print(f"torch's caching allocator, reserved but unallocated per stage: {len(stages)} stages "
          f"(peak reserved - peak allocated, max over the stage's ranks)")
    for k, v in f["coef"].items():
        print(f"  {k:24} fitted {v:6.3f}  shipped {getattr(DEFAULT, k):6.3f}  "
              f"{'inside' if f['inside_ranges'][k] else 'OUTSIDE'} its physical range")
    shipped = np.array([s["x"] for s in stages]) @ np.array([getattr(DEFAULT, k) for k in ALLOC_KEYS])
    print(f"{'stack':5} {'class':5} {'stages':>6} {'measured':>9} {'shipped':>8} {'MAE':>5} {'LOAO MAE':>8} "
          f"{'LOAO max under':>14}  (GiB; mean measured / predicted, mean |error|)")
    for stack in sorted({s["stack"] for s in stages}):
        for kind in (False, True):
            sel = np.array([s["stack"] == stack and bool(s["moe"]) == kind for s in stages])
            if not sel.any():
                continue
            y, p, h = f["y"][sel], shipped[sel], f["held_out"][sel]
            print(f"{stack:5} {'moe' if kind else 'dense':5} {int(sel.sum()):6d} {y.mean():9.2f} {p.mean():8.2f} "
                  f"{np.abs(y - p).mean():5.2f} {np.abs(y - h).mean():8.2f} {(y - h).max():14.2f}")
    worst = np.argsort(f["y"] - shipped)[-5:][::-1]
    print("largest under-predictions (shipped coefficients):")
    for i in worst:
        s = stages[i]
        print(f"  {s['id'][:22]:22} {s['stack']:5} {s['model'][:26]:26} stage {s['stage']}: measured {s['measured']:5.2f}"
              f" predicted {shipped[i]:5.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*")
    ap.add_argument("--margin", type=float, default=None, help="memory margin (default: the profile's)")
    ap.add_argument("--fit", action="store_true", help=f"write {MB.BAND_FILE.relative_to(ROOT)}")
    ap.add_argument("--outside", action="store_true",
                    help="solve and check the memory outside torch's allocator (models/outside_memory.py) and exit")
    ap.add_argument("--recipe", default=None, metavar="ROW",
                    help="print one usable published row's memory terms per pipeline stage (its row id) and exit")
    ap.add_argument("--allocator", action="store_true",
                    help="fit and check torch's reserved-but-unallocated memory (models/allocator_memory.py) and exit")
    a = ap.parse_args()
    if a.allocator:
        print_allocator(rows(a.paths or sorted(glob.glob(str(ROOT / "data/measurements/*.jsonl")))))
        return
    if a.recipe is not None:
        print_recipe(a.recipe)
        return
    if a.outside:
        print_outside(rows(a.paths or sorted(glob.glob(str(ROOT / "data/measurements/*.jsonl")))))
        return
    paths = a.paths or sorted(glob.glob(str(ROOT / "data/measurements/*.jsonl")))
    rs = rows(paths)
    if a.fit:
        MB.BAND_FILE.write_text(json.dumps(fit(rs), indent=1) + "\n", encoding="utf-8")
        MB._load.cache_clear()
        print(f"wrote {MB.BAND_FILE.relative_to(ROOT)}")
    margin_gib = {stack: resolve_calibration("default", stack).screening_constants.memory_margin_gib
                  for stack in {r["stack"] for r in rs}}

    def margin(r):  # --margin (a share of every GPU's memory), else the profile's GiB on the record's GPU
        return MB.check_margin(a.margin) if a.margin is not None else MB.default_margin(margin_gib[r["stack"]],
                                                                                        r["gpu_gib"])
    print("OOM records: predicted peak, the band's upper bound and the usable memory (GiB)")
    print(f"{'id':18} {'stack':5} {'model':28} {'pred':>6} {'out':>5} {'upper':>6} {'usable':>6} {'had':>6}  predicted")
    fit_oom = without = 0
    for r in (r for r in rs if r["status"] == "oom"):
        b = MB.band(r["stack"], r["moe"])
        up = b.interval(r["predicted"], r["outside_pred"], r["rf"], r["x"], r["periodic"], r["rf_off"], under_pressure=True)[1]
        usable = MB.usable_gib(r["gpu_gib"], margin(r))
        ok = bool(up <= usable)  # MB.fits: the verdict's bound
        fit_oom += ok
        without += bool(MB.fits(r["predicted"], r["outside_pred"], r["rf"], r["x"], b, r["gpu_gib"],
                                margin(r), r["periodic"], r["rf_off"], under_pressure=False))
        had = f"{r['gpu_gib'] - r['outside'] - r['start']:6.1f}" if r["outside"] is not None else "     -"
        print(f"{r['id']:18} {r['stack']:5} {r['model'][:28]:28} {r['predicted']:6.1f} {r['outside_pred']:5.1f} "
              f"{up:6.1f} {usable:6.1f} {had}  {'FITS (wrong)' if ok else 'does not fit'}")
    print(f"OOM records predicted to fit: {fit_oom} of {sum(r['status'] == 'oom' for r in rs)} "
          f"('had': the GPU's memory less the memory outside torch's allocator and the trial's start allocation); "
          f"counting all the allocator's cache (no retries): {without}")
    print()
    print("Runs that fit: measured / predicted peak (leave-one-architecture-out)")
    xs = expandable_spread([r for r in rs if r["status"] == "ok"])
    print(f"{'stack':5} {'class':5} {'form':6} {'runs':>4} {'archs':>5} {'lo':>6} {'hi':>6} {'+lo':>5} {'+hi':>5} "
          f"{'rf form':8} {'reserved free lo':>14} {'reserved free hi':>14} "
          + " ".join(f"{'LOAO ' + f[:5]:>13}" for f in RF_FORMS) + " "
          f"{'LOAO under hi':>13} {'MAPE shipped':>12} {'MAPE LOAO':>9} {'ratio':>6} {'affine':>6} {'rejected':>8}")
    for stack in sorted({r["stack"] for r in rs}):
        ok = [r for r in rs if r["stack"] == stack and r["status"] == "ok"]
        for kind, s in loao(ok, xs).items():
            b = MB.band(stack, kind == "moe")
            mine = [r for r in ok if bool(r["moe"]) == (kind == "moe")]
            rejected = sum(not MB.fits(r["predicted"], r["outside_pred"], r["rf"], r["x"], b, r["gpu_gib"],
                                       margin(r), r["periodic"], r["rf_off"]) for r in mine)
            print(f"{stack:5} {kind:5} {s['form']:6} {s['n']:4d} {s['architectures']:5d} {s['lo']:6.3f} {s['hi']:6.3f} "
                  f"{s['add_lo_gib']:5.1f} {s['add_hi_gib']:5.1f} " + rf_cells(s) + " "
                  f"{s['loao_covered']:6d} of {s['n']:<4d} "
                  f"{s['mape_as_shipped_pct']:11.1f}% {s['mape_loao_pct']:8.1f}% {s['mape_loao_ratio_pct']:5.1f}% "
                  f"{s['mape_loao_affine_pct']:5.1f}% {rejected:8d}")
            print(f"{'':5} {'':5} {'':6} {'':4} {'':5} {'':6} {'':6} {'':5} {'':5} " + rf_cells(s["periodic"])
                  + f"   periodic schedule: {s['periodic']['n']} runs, {s['periodic']['architectures']} architectures"
                  + ("" if s["periodic"]["used"] else f" (not used: under {MIN_ARCHITECTURES})"))
    print()
    rec = recipes(a.margin)
    print("Published recipes of the te fit set (NVIDIA, H100, dense): predicted allocator peak, outside it, "
          "upper bound (fullest stage + largest outside term), the largest upper bound of one stage with its own "
          "outside term (the verdict: with expandable segments, the allocator's cache past what it could not give "
          "back when pressed not counted), the same counting all its cache, usable (GiB)")
    for r in rec:
        print(f"{r['id']:>4} {r['model'][:16]:16} {r['layout'][:58]:58} {r['predicted']:6.1f} {r['outside']:5.1f} "
              f"{r['upper']:6.1f} {r['stage_upper']:6.1f} "
              f"{r['unpressed_upper']:6.1f} {r['usable']:6.1f}  "
              f"{('fits' if r['without_retries'] else 'fits (cache given back)') if r['fits'] else 'DOES NOT FIT'}"
              f"  {r['assumed']}")
    print(f"published recipes predicted not to fit: {sum(not r['fits'] for r in rec)} of {len(rec)} "
          f"(each stage with its own outside term, as recommend screens; pairing the fullest stage with "
          f"the largest outside term: {sum(r['upper'] > r['usable'] for r in rec)}); of those that fit, counting on the "
          f"allocator giving back its cache when pressed (expandable segments; bench/allocator_pressure.py): "
          f"{sum(r['fits'] and not r['without_retries'] for r in rec)}")
    unmodelled = sorted({u for r in rec for u in r["unmodelled"]})
    if unmodelled:
        print("recipe settings of these rows the advisor has no field for (models/published.py RECIPES):")
        for u in unmodelled:
            print(f"  - {', '.join(r['id'] for r in rec if u in r['unmodelled'])}: {u}")
    print_expandable(xs, [r for r in rs if r["status"] == "ok"])
    print("(form: the one with the smaller LOAO MAPE of the peak reserved, both shown; lo / hi and +lo / +hi: the "
          "allocated part, the affine form's GiB; reserved free lo / hi: the envelope of the measured reserved but "
          "unallocated GiB against the predicted R, runs with expandable segments off, of the rf form that holds the "
          "most held-out runs (then the least slack); LOAO const / ratio / affine: held-out runs under the upper line "
          "of each form fitted without their architecture, of those, and its mean GiB over them; "
          "runs with expandable segments off; rejected: runs that ran but whose upper bound is over the usable memory)")


if __name__ == "__main__":
    main()
