"""The caching allocator under a dropless MoE (issue #27): measured reserved-but-unallocated memory of
every MoE pipeline stage against what models/allocator_memory.py's MoE term is made of, and how well
one-constant forms of it predict the runs, leave-one-architecture-out.

    python bench/moe_allocator.py [--stack te] [paths ...]

Per stage: the measured term (peak reserved - peak allocated, max and min over the stage's ranks:
records' memory.peak_*_gib_per_rank, expandable segments off), the shipped prediction R, and the
parts of its MoE term: the stage's MoE layers L and one layer's routing-sized token buffers b on the
busiest rank (allocator_memory.moe_buffer_bytes) with the router skew the run's own router measured
(moe_check.run_router_skews: the runner's untrained routers, not the trained-router skew the profile
ships), the busiest rank's load over the mean and its spread (cv: (load - 1) / z_EP, models.moe), the
tokens T entering a MoE layer per micro-batch on one GPU (models.moe.moe_tokens) and the micro-batches
per step n_mb = gbs / (DP mbs). The
residual is the measured term less the shipped base and largest-block parts. Then, for each form
F (L b: the shipped one; b; sqrt(L) b; L b cv; L b / n_mb), the residual = k F fitted by least squares on the
other architecture's stages and its mean |error| on the held-out one (GiB), and the spread of the
measured term over repeats of one layout (same model and TrainConfig): the floor any form meets.

    python bench/moe_allocator.py --pipeline      # the forms through bench/memory_edge.py's band and OOM check

--pipeline: the shipped term, then its MoE part as alloc_reserved_moe x L^p x b for p = 1 (the form
before), 0.5 (the shipped form), 0, with
alloc_reserved_moe refitted per stack (least squares of each stack's MoE stages' measured term less
the shipped base and block parts, the profile's own constants: te_calibration.json / the default
one), the band refitted as `memory_edge.py --fit` does (in memory, the shipped file untouched), and
memory_edge's leave-one-architecture-out MAPE per stack and class and its OOM check. The forms are
put in by replacing models.memory.reserved_free_gib and memory_edge's calibrations for the run.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import glob
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from advisor.models import moe as MOE  # noqa: E402
from advisor.models.allocator_memory import moe_buffer_bytes  # noqa: E402
from advisor.models.calibrate import resolve_calibration  # noqa: E402
from advisor.models.constants import GIB  # noqa: E402
import memory_edge as ME  # noqa: E402  (beside this file)
from memory_edge import allocator_stages, rows  # noqa: E402
from moe_check import run_router_skews  # noqa: E402

FORMS = ("L b", "b", "sqrt(L) b", "L b cv", "L b / n_mb")


def stage_rows(paths: list[str], stack: str = "te") -> list[dict]:
    """Every MoE stage of `stack` with EP > 1 (routing-sized buffers) and its measured and predicted terms."""
    rs = {r["id"]: r for r in rows(paths)}
    skews = run_router_skews(paths, stack)
    c = resolve_calibration("default", stack).screening_constants
    out = []
    for s in allocator_stages(list(rs.values())):
        r = rs[s["id"]]
        cfg, model = r["cfg"], r["model_spec"]
        if s["stack"] != stack or not s["moe"] or cfg.ep <= 1:
            continue
        cr = dataclasses.replace(c, moe_router_skew=skews.get(s["id"], c.moe_router_skew))
        load = MOE.imbalance(model, cfg, cr)
        per = len(r["memory"]["peak_reserved_gib_per_rank"]) // cfg.pp
        res, al = r["memory"]["peak_reserved_gib_per_rank"], r["memory"]["peak_allocated_gib_per_rank"]
        ranks = [res[i] - al[i] for i in range(s["stage"] * per, (s["stage"] + 1) * per)]
        moe_layers = sum(model.is_moe_layer(i) for i in range(model.num_layers)) / cfg.pp
        out.append({"id": s["id"], "arch": s["arch"], "model": model.name, "model_spec": model, "cfg": cfg, "stage": s["stage"],
                    "measured": s["measured"], "rank_min": min(ranks),
                    "R": float(np.dot(s["x"], [c.alloc_reserved_base_gib, c.alloc_reserved_block, c.alloc_reserved_moe])),
                    "other": s["x"][0] * c.alloc_reserved_base_gib + s["x"][1] * c.alloc_reserved_block,
                    "L": moe_layers, "b": moe_buffer_bytes(model, cfg, cr) / GIB, "load": load,
                    "tokens": MOE.moe_tokens(model, cfg), "n_mb": cfg.gbs / (cfg.dp * cfg.mbs),
                    "cv": (load - 1.0) / MOE.expected_max_normal(cfg.ep),
                    "key": json.dumps([model.name, dataclasses.asdict(cfg)], sort_keys=True, default=str)})
    return out


def form_values(st: list[dict], form: str) -> np.ndarray:
    L, b, cv, n = (np.array([s[k] for s in st], float) for k in ("L", "b", "cv", "n_mb"))
    return {"L b": L * b, "b": b, "sqrt(L) b": np.sqrt(L) * b, "L b cv": L * b * cv, "L b / n_mb": L * b / n}[form]


def one_constant_loao(y: np.ndarray, F: np.ndarray, arch: np.ndarray) -> tuple[float, float]:
    """(k, mean |y - k F| over held-out architectures): y = k F by least squares without an intercept,
    k fitted on every stage for the first value and without each architecture for the second."""
    err = []
    for a in sorted(set(arch)):
        h = arch == a
        k = float(F[~h] @ y[~h] / (F[~h] @ F[~h])) if (F[~h] @ F[~h]) > 0 else 0.0
        err.append(np.abs(y[h] - k * F[h]))
    return float(F @ y / (F @ F)), float(np.concatenate(err).mean())


def repeat_spread(st: list[dict]) -> list[tuple[str, int, float, float]]:
    """(first id, repeats, smallest, largest measured term) of every layout run more than once."""
    groups = defaultdict(list)
    for s in st:
        groups[(s["key"], s["stage"])].append(s)
    return [(g[0]["id"], len(g), min(x["measured"] for x in g), max(x["measured"] for x in g))
            for g in groups.values() if len(g) > 1]


@contextlib.contextmanager
def moe_form(p: float | None, k_by_stack: dict[str, float] | None = None):
    """models.memory's reserved-but-unallocated term with the MoE part alloc_reserved_moe x L^p x b (p
    None: the shipped term), and (k_by_stack) memory_edge's calibrations with alloc_reserved_moe per
    stack, for the block's duration."""
    import advisor.models.memory as MM

    shipped_rf, shipped_cal = MM.reserved_free_gib, ME.resolve_calibration

    def rf(block, moe_layers, moe_bytes, c):
        layers = np.asarray(moe_layers, float)
        return (c.alloc_reserved_base_gib + (c.alloc_reserved_block * np.asarray(block, float)
                + c.alloc_reserved_moe * np.where(layers > 0, layers ** p, 0.0) * np.asarray(moe_bytes, float)) / GIB)

    @functools.lru_cache(maxsize=None)
    def cal(name, stack):
        c = shipped_cal(name, stack)
        if not k_by_stack or stack not in k_by_stack:
            return c
        return dataclasses.replace(c, constants=dataclasses.replace(c.constants, alloc_reserved_moe=k_by_stack[stack]))

    if p is not None:
        MM.reserved_free_gib = rf
    ME.resolve_calibration = cal
    try:
        yield
    finally:
        MM.reserved_free_gib, ME.resolve_calibration = shipped_rf, shipped_cal


def fit_moe_constant(paths: list[str], p: float) -> dict[str, float]:
    """alloc_reserved_moe per stack for the form L^p b: least squares of the MoE stages' measured term
    less the profile's base and block parts on the MoE feature (expandable segments off)."""
    with moe_form(p):
        st = allocator_stages(rows(paths))
    out = {}
    for stack in sorted({s["stack"] for s in st}):
        c = resolve_calibration("default", stack).screening_constants
        mine = [s for s in st if s["stack"] == stack and s["moe"] and s["x"][2] > 0]
        y = np.array([s["measured"] - s["x"][0] * c.alloc_reserved_base_gib - s["x"][1] * c.alloc_reserved_block
                      for s in mine])
        F = np.array([s["x"][2] for s in mine])
        out[stack] = float(F @ y / (F @ F))
    return out


def pipeline(paths: list[str], p: float | None, k_by_stack: dict[str, float] | None) -> dict:
    """memory_edge's LOAO MAPE per (stack, class) and its OOM check (records predicted to fit, of all
    OOM records) with the form and constants, the band refitted in memory."""
    from advisor.models import memory_band as MB

    with moe_form(p, k_by_stack):
        rs = rows(paths)
        ok = [r for r in rs if r["status"] == "ok"]
        xs = ME.expandable_spread(ok)
        mape = {(stack, kind): s["mape_loao_pct"] for stack in sorted({r["stack"] for r in ok})
                for kind, s in ME.loao([r for r in ok if r["stack"] == stack], xs).items()}
        with tempfile.TemporaryDirectory() as d:
            band_file = Path(d) / "memory_band.json"
            band_file.write_text(json.dumps(ME.fit(rs)), encoding="utf-8")
            ooms = [r for r in rs if r["status"] == "oom"]
            fit_oom = sum(bool(MB.fits(r["predicted"], r["outside_pred"], r["rf"], r["x"],
                                       MB.band(r["stack"], r["moe"], band_file), r["gpu_gib"],
                                       MB.default_margin(resolve_calibration("default", r["stack"])
                                                         .screening_constants.memory_margin_gib, r["gpu_gib"]),
                                       r["periodic"], r["rf_off"])) for r in ooms)
    return {"mape": mape, "oom_fit": fit_oom, "oom": len(ooms)}


def print_pipeline(paths: list[str]) -> None:
    print("MoE term alloc_reserved_moe x L^p x b through memory_edge's band: LOAO MAPE per stack / class, OOM records "
          "predicted to fit")
    for p in (None, 1.0, 0.5, 0.0):
        k = fit_moe_constant(paths, p) if p is not None else None
        r = pipeline(paths, p, k)
        label = "shipped" if k is None else f"p {p:3.1f} k " + " ".join(f"{s} {v:.3f}" for s, v in k.items())
        print(f"  {label:34} " + " | ".join(f"{s} {c} {v:4.2f}%" for (s, c), v in sorted(r["mape"].items()))
              + f" | OOM predicted to fit {r['oom_fit']} of {r['oom']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*")
    ap.add_argument("--stack", default="te")
    ap.add_argument("--pipeline", action="store_true", help="the forms through memory_edge's band and OOM check")
    a = ap.parse_args()
    paths = a.paths or sorted(glob.glob(str(ROOT / "data/measurements/*.jsonl")))
    if a.pipeline:
        print_pipeline(paths)
        return
    st = stage_rows(paths, a.stack)
    print(f"{a.stack} MoE stages with EP > 1, expandable segments off: {len(st)} "
          "(GiB; measured: max over the stage's ranks, rank min beside it)")
    print(f"{'id':20} {'model':24} {'tp':>2} {'ep':>2} {'mbs':>3} {'prec':4} {'L':>3} {'b':>6} {'load':>5} {'cv':>5} "
          f"{'T':>6} {'n_mb':>4} {'meas':>6} {'min':>5} {'R':>6} {'resid':>6}")
    for s in st:
        c = s["cfg"]
        print(f"{s['id'][:20]:20} {s['model'][:24]:24} {c.tp:2d} {c.ep:2d} {c.mbs:3d} {c.precision[:4]:4} {s['L']:3.0f} "
              f"{s['b']:6.3f} {s['load']:5.2f} {s['cv']:5.2f} {s['tokens']:6.0f} {s['n_mb']:4.0f} {s['measured']:6.2f} {s['rank_min']:5.2f} {s['R']:6.2f} "
              f"{s['measured'] - s['other']:6.2f}")
    y = np.array([s["measured"] - s["other"] for s in st])
    arch = np.array([s["arch"] for s in st])
    print(f"\nresidual (measured - base - block part) = k F, one constant; {len(set(arch))} architectures")
    for f in FORMS:
        k, mae = one_constant_loao(y, form_values(st, f), arch)
        print(f"  {f:10} k {k:6.3f}  LOAO mean |error| {mae:5.2f} GiB")
    print(f"  shipped    mean |measured - R| {np.abs(np.array([s['measured'] - s['R'] for s in st])).mean():5.2f} GiB")
    print("repeats of one layout (the same model and TrainConfig): measured term smallest - largest")
    for rid, n, lo, hi in repeat_spread(st):
        print(f"  {rid:20} x{n}  {lo:5.2f} - {hi:5.2f}  (spread {hi - lo:4.2f})")


if __name__ == "__main__":
    main()
