"""Predict every usable row of the published fit set (data/published/published_fit.csv) and print
how far the predictions are: MAPE and median bias per source, model, GPU and precision; Spearman
rank correlation within groups of the same (model, GPUs, sequence, precision); and, with --cv,
leave-one-source-out and leave-one-model-family-out errors of the `te` fit (each held-out group
predicted by constants fitted without it).

    python bench/published_check.py                       # the shipped te profile, every GPU
    python bench/published_check.py --gpu H100 --rows     # one line per row
    python bench/published_check.py --calibration none    # the analytical model, TE settings
    python bench/published_check.py --fit-set --cv        # the te fit's rows: in sample, LOSO, LOFO
    python bench/published_check.py --cv --gpu H100 --gpu A100-80GB --dense
    python bench/published_check.py --json out.json       # the numbers, for tests and docs
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from advisor.models import profile_fit as F  # noqa: E402
from advisor.models import published as P  # noqa: E402
from advisor.models.calibrate import resolve_calibration  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fit_profiles import in_fit  # noqa: E402  (the te profile's fit rows: --fit-set)


def spearman(a: list[float], b: list[float]) -> float:
    if len(a) < 3:
        return math.nan
    from scipy.stats import spearmanr

    r = spearmanr(a, b).statistic
    return float(r) if np.isfinite(r) else math.nan


def evaluate(rows: list[F.Row], calibration, stack: str = "te") -> list[float]:
    """log(predicted / measured) per row."""
    out = []
    for x in rows:
        r = x.run
        if calibration is None:
            p = F.predict_rows([x], F.te_base() if stack == "te" else F.DEFAULT)[0]
        else:
            p = calibration.predict(r.model, r.cluster, x.cfg, check_legal=False)
        out.append(math.log(p.tokens_per_s_per_gpu / x.y))
    return out


def table(title: str, groups: dict[str, list[int]], err: np.ndarray, rows: list[F.Row]) -> list[dict]:
    print(f"\n{title}")
    print(f"  {'group':34} {'n':>4} {'MAPE %':>7} {'bias %':>7}")
    out = []
    for g in sorted(groups, key=str):
        idx = groups[g]
        s = F.summary(err[idx], [rows[i].weight for i in idx])
        out.append({"group": str(g), **s})
        print(f"  {str(g)[:34]:34} {s['n']:>4} {s['mape']:>7.1f} {s['bias']:>+7.1f}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibration", default="default",
                    help="'default' (the stack's profile), a file, or 'none' (analytical)")
    ap.add_argument("--stack", default="te")
    ap.add_argument("--gpu", action="append", help="GPU types to keep (H100, A100-80GB, B200, GB200, ...)")
    ap.add_argument("--dense", action="store_true", help="dense models only")
    ap.add_argument("--moe", action="store_true", help="MoE models only")
    ap.add_argument("--fit-set", action="store_true",
                    help="only the rows the te profile is fitted on (bench/fit_profiles.py: H100, dense, "
                         "without NeMo 24.03's FlashAttention-2-era long-sequence table)")
    ap.add_argument("--rows", action="store_true", help="print every row")
    ap.add_argument("--cv", action="store_true", help="leave-one-source-out and leave-one-family-out refits")
    ap.add_argument("--json", help="write the numbers here")
    a = ap.parse_args(argv)

    def keep(r: P.PublishedRun) -> bool:
        return ((not a.gpu or r.gpu_type in a.gpu) and not (a.dense and r.moe) and not (a.moe and not r.moe)
                and (not a.fit_set or in_fit(r)))

    rows, left = F.fit_rows(P.load(), a.stack, keep)
    cal = resolve_calibration(a.calibration, a.stack)
    print(f"published fit set: {len(rows)} rows predicted with stack {a.stack}, "
          f"{'profile ' + cal.profile + ' (' + Path(cal.source).name + ')' if cal else 'analytical model'}")
    for why, n in left.most_common():
        if why != "not selected":
            print(f"  left out {n:>3}: {why}")
    err = np.array(evaluate(rows, cal, a.stack))
    overall = F.summary(err, [x.weight for x in rows])
    print(f"\nall rows: MAPE {overall['mape']:.1f}%  median bias {overall['bias']:+.1f}%  (n={overall['n']}, "
          f"each distinct configuration weighted once)")
    result = {"stack": a.stack, "profile": cal.profile if cal else None, "overall": overall, "tables": {}}
    keys = {"source": lambda r: r.source_group, "model": lambda r: r.model_key, "gpu": lambda r: r.gpu_type,
            "precision": lambda r: r.cfg.precision + (f"-{r.fp8_recipe}" if r.fp8_recipe else ""),
            "dense / moe": lambda r: "moe" if r.moe else "dense"}
    for name, f in keys.items():
        groups = defaultdict(list)
        for i, x in enumerate(rows):
            groups[f(x.run)].append(i)
        result["tables"][name] = table(f"by {name}", groups, err, rows)
    # rank correlation within groups of the same question (layouts of one model on one cluster)
    groups = defaultdict(list)
    for i, x in enumerate(rows):
        groups[x.run.group].append(i)
    rhos = []
    print("\nSpearman within (model, GPUs, seq, precision) groups with >= 3 distinct layouts")
    for g, idx in groups.items():
        distinct = {rows[i].cfg.key() for i in idx}
        if len(distinct) < 3:
            continue
        meas = [rows[i].y for i in idx]
        pred = [rows[i].y * math.exp(err[i]) for i in idx]
        rho = spearman(meas, pred)
        rhos.append({"group": " ".join(map(str, g)), "n": len(idx), "rho": rho})
        print(f"  {' '.join(map(str, g))[:50]:50} n={len(idx):>3} rho={rho:+.2f}")
    if not rhos:
        print("  (no group has 3 distinct layouts)")
    result["spearman"] = rhos
    if a.rows:
        print(f"\n{'row':>5} {'gpu':9} {'model':16} {'layout':56} {'measured':>9} {'pred':>9} {'err %':>7}")
        for x, e in zip(rows, err):
            r = x.run
            print(f"{r.row_id:>5} {r.gpu_type:9} {r.model_key[:16]:16} {x.cfg.key()[:56]:56} "
                  f"{x.y:9.0f} {x.y * math.exp(e):9.0f} {(math.exp(e) - 1) * 100:+7.1f}")
    if a.cv:
        base = F.te_base()
        result["cv"] = {}
        for name, by in (("leave one source out", lambda x: x.run.source_group),
                         ("leave one model family out", lambda x: x.run.family)):
            oof, per = F.cross_validate(rows, base, by)
            s = F.summary(oof, [x.weight for x in rows])
            print(f"\n{name}: MAPE {s['mape']:.1f}%  median bias {s['bias']:+.1f}%  (n={s['n']})")
            for g, v in per.items():
                print(f"  {g[:34]:34} {v['n']:>4} {v['mape']:>7.1f} {v['bias']:>+7.1f}")
            result["cv"][name] = {"overall": s, "groups": per}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
