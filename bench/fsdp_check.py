"""Is Megatron FSDP priced right? The published FSDP rows (models.published: r.fsdp) against the
same GPUs' non-FSDP rows, each GPU predicted by its shipped te profile (H100: te; Blackwell:
te-blackwell, as bench/fit_blackwell.py --rows), and the one constant that prices what overlapped
collectives cost the compute they hide behind (Constants.collective_sm_share: the SMs NCCL takes).

    python bench/fsdp_check.py                 # per GPU: mean signed error, FSDP vs non-FSDP rows
    python bench/fsdp_check.py --rows          # and every FSDP row
    python bench/fsdp_check.py --fit           # fit collective_sm_share on a grid, leave one GPU out
    python bench/fsdp_check.py --recommend     # recommend's top layouts (llama3-70b on h100x64 bf16,
                                               # gb200x64 fp8) at shares 0, 0.0625, 0.25
    python bench/fsdp_check.py --fit --json out.json

The signed error of a row is log(predicted / measured) (printed as %), averaged with the fit set's
weights (each distinct configuration once). The FSDP excess of a GPU is its FSDP rows' mean minus its
non-FSDP rows' mean: what FSDP's pricing adds to the profile's level on that GPU. The fit picks the
share on GRID minimising the weighted squared FSDP excess of every FSDP row (FSDP rows' errors less
their GPU's non-FSDP mean, both at the share: the share moves non-FSDP rows too, by their overlapped
DP traffic); leave one GPU out fits on the other GPUs' FSDP rows and reports the held-out GPU's excess.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from advisor.models import profile_fit as F  # noqa: E402
from advisor.models import published as P  # noqa: E402
from advisor.models.calibrate import resolve_calibration  # noqa: E402

GPUS = ("H100", "B200", "GB200", "B300", "GB300")
# collective_sm_share candidates: 0 .. 0.25 (Constants.collective_sm_share's range) by 0.0125
GRID = tuple(round(0.0125 * i, 4) for i in range(21))


def load_rows() -> list[F.Row]:
    rows, _ = F.fit_rows(P.load(), "te", lambda r: r.gpu_type in GPUS and not r.moe)
    return rows


def profiles() -> dict[str, object]:
    """The shipped constants per GPU: the te profile for H100, te-blackwell for the Blackwell GPUs."""
    h100 = resolve_calibration("default", "te").constants
    bw = resolve_calibration("te", gpu=type("G", (), {"generation": "blackwell"})()).constants
    return {g: h100 if g == "H100" else bw for g in GPUS}


def errors(rows: list[F.Row], share: float | None = None, consts: dict | None = None) -> tuple[np.ndarray, list]:
    """log(predicted / measured) per row and the predictions, at collective_sm_share `share`
    (None: the profiles' own)."""
    consts = consts or profiles()
    preds = []
    for x in rows:
        c = consts[x.run.gpu_type]
        preds.append(F.predict_rows([x], c if share is None else c.replace(collective_sm_share=share))[0])
    return np.array([math.log(p.tokens_per_s_per_gpu / x.y) for x, p in zip(rows, preds)]), preds


def wmean(e: np.ndarray, w: np.ndarray) -> float:
    return float(np.sum(e * w) / np.sum(w)) if len(e) else math.nan


def pct(e: float) -> float:
    return (math.exp(e) - 1.0) * 100.0 if math.isfinite(e) else math.nan


def bias_table(rows: list[F.Row], e: np.ndarray) -> dict[str, dict]:
    """Per GPU: n and weighted mean signed error (%) of the non-FSDP and the FSDP rows, and the FSDP excess (%)."""
    w = np.array([x.weight for x in rows])
    fs = np.array([bool(x.run.fsdp) for x in rows])
    gpu = np.array([x.run.gpu_type for x in rows])
    out = {}
    for g in GPUS:
        a, b = (gpu == g) & ~fs, (gpu == g) & fs
        if not a.any():
            continue
        ma, mb = wmean(e[a], w[a]), wmean(e[b], w[b])
        out[g] = {"n_plain": int(a.sum()), "plain_pct": pct(ma), "n_fsdp": int(b.sum()), "fsdp_pct": pct(mb),
                  "excess_pct": pct(mb - ma) if b.any() else math.nan}
    return out


def matched_table(rows: list[F.Row], e: np.ndarray) -> dict[str, dict]:
    """The same comparison within (GPU, model) groups: those that have FSDP and
    non-FSDP rows (the profile's level on other models and formats taken out)."""
    w = np.array([x.weight for x in rows])
    groups: dict[str, tuple[list[int], list[int]]] = {}
    for i, x in enumerate(rows):
        k = f"{x.run.gpu_type} {x.run.model_key}"
        groups.setdefault(k, ([], []))[bool(x.run.fsdp)].append(i)
    out = {}
    for k, (a, b) in sorted(groups.items()):
        if a and b:
            ma, mb = wmean(e[a], w[a]), wmean(e[b], w[b])
            out[k] = {"n_plain": len(a), "plain_pct": pct(ma), "n_fsdp": len(b), "fsdp_pct": pct(mb),
                      "excess_pct": pct(mb - ma)}
    return out


def print_table(t: dict[str, dict], title: str) -> None:
    print(f"\n{title}")
    print(f"  {'group':34} {'n':>3} {'non-FSDP %':>10} {'n':>3} {'FSDP %':>8} {'FSDP excess %':>14}")
    for g, v in t.items():
        print(f"  {g[:34]:34} {v['n_plain']:>3} {v['plain_pct']:>+10.1f} {v['n_fsdp']:>3} {v['fsdp_pct']:>+8.1f} "
              f"{v['excess_pct']:>+14.1f}")


def excess_residuals(rows: list[F.Row], e: np.ndarray) -> np.ndarray:
    """Each FSDP row's error less its GPU's weighted non-FSDP mean (NaN for non-FSDP rows)."""
    w = np.array([x.weight for x in rows])
    fs = np.array([bool(x.run.fsdp) for x in rows])
    gpu = np.array([x.run.gpu_type for x in rows])
    out = np.full(len(rows), np.nan)
    for g in set(gpu[fs]):
        plain = (gpu == g) & ~fs
        out[(gpu == g) & fs] = e[(gpu == g) & fs] - wmean(e[plain], w[plain])
    return out


def fit(rows: list[F.Row], grid=GRID, say=print) -> dict:
    """The share on `grid` minimising the FSDP rows' weighted squared excess, in sample and leaving
    one GPU out; the per-GPU table at the fitted share."""
    consts = profiles()
    w = np.array([x.weight for x in rows])
    fs = np.array([bool(x.run.fsdp) for x in rows])
    gpu = np.array([x.run.gpu_type for x in rows])
    E = np.stack([errors(rows, s, consts)[0] for s in grid])  # (grid, rows)
    R = np.stack([excess_residuals(rows, e) for e in E])

    def best(mask) -> int:
        return int(np.argmin([np.sum(w[mask] * r[mask] ** 2) for r in R]))

    i = best(fs)
    say(f"\nfitted collective_sm_share = {grid[i]:.4f} (grid {grid[0]}..{grid[-1]} by {grid[1] - grid[0]:.4f}; "
        f"RMS FSDP excess {math.sqrt(wmean(R[0][fs] ** 2, w[fs])) * 100:.1f}% at 0 -> "
        f"{math.sqrt(wmean(R[i][fs] ** 2, w[fs])) * 100:.1f}%)")
    out = {"share": grid[i], "grid": list(grid), "at_zero": bias_table(rows, E[0]), "at_fit": bias_table(rows, E[i]),
           "leave_one_gpu_out": {}}
    say("leave one GPU out: share fitted on the other GPUs' FSDP rows, the held-out GPU's FSDP excess")
    for g in sorted(set(gpu[fs])):
        j = best(fs & (gpu != g))
        held = fs & (gpu == g)
        ex0, ex = pct(wmean(R[0][held], w[held])), pct(wmean(R[j][held], w[held]))
        out["leave_one_gpu_out"][g] = {"share": grid[j], "excess_at_zero_pct": ex0, "excess_pct": ex}
        say(f"  {g:6} share {grid[j]:.4f}: excess {ex0:+.1f}% -> {ex:+.1f}%")
    plain = ~fs
    out["plain_rows_moved"] = [{"row": rows[k].run.row_id, "gpu": rows[k].run.gpu_type,
                                "change_pct": pct(E[i][k] - E[0][k])}
                               for k in np.flatnonzero(plain & (np.abs(E[i] - E[0]) > 1e-4))]
    moved = out["plain_rows_moved"]
    say(f"non-FSDP rows moved by the fitted share: {len(moved)} of {int(plain.sum())}"
        + (f", by {min(m['change_pct'] for m in moved):+.2f}% .. {max(m['change_pct'] for m in moved):+.2f}%"
           if moved else ""))
    return out


# `advisor recommend` questions the FSDP pricing decides (issue #25): (model, cluster, precision)
RECOMMEND = (("llama3-70b", "h100x64", "bf16"), ("llama3-70b", "gb200x64", "fp8"))


def recommend_at(shares=(0.0, 0.0625, 0.25), top: int = 5, say=print) -> dict:
    """The te stack's top `top` layouts for each RECOMMEND question with collective_sm_share at each
    of `shares` (the stack's profile otherwise): layout, FSDP or not, tokens/s per GPU; and the best
    FSDP and best non-FSDP layout's tokens/s among every layout that fits."""
    import dataclasses

    from advisor.api import recommend
    from advisor.catalog.loaders import load_cluster

    out = {}
    for model, cluster, prec in RECOMMEND:
        gpu = load_cluster(cluster).gpu
        cal = resolve_calibration("default", "te", gpu=gpu)
        for s in shares:
            c = dataclasses.replace(cal, constants=cal.constants.replace(collective_sm_share=s))
            r = recommend(model, cluster, precision=prec, top=top, stack="te", calibration=c)
            best = {}
            for cfg, p in r.candidates:
                k = "fsdp" if cfg.fsdp else "plain"
                best[k] = max(best.get(k, 0.0), p.tokens_per_s_per_gpu)
            key = f"{model} {cluster} {prec} share {s}"
            out[key] = {"top": [{"layout": x.config.key(), "fsdp": bool(x.config.fsdp),
                                 "tokens_per_s_per_gpu": x.prediction.tokens_per_s_per_gpu} for x in r.recommendations],
                        "best_fsdp": best.get("fsdp", math.nan), "best_plain": best.get("plain", math.nan)}
            v = out[key]
            say(f"\n{key}: best FSDP {v['best_fsdp']:,.0f} vs best non-FSDP {v['best_plain']:,.0f} tok/s/GPU "
                f"({(v['best_fsdp'] / v['best_plain'] - 1) * 100:+.1f}%)")
            for i, t in enumerate(v["top"], 1):
                say(f"  #{i} {t['layout'][:70]:70} {t['tokens_per_s_per_gpu']:8,.0f}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", action="store_true", help="print every FSDP row")
    ap.add_argument("--fit", action="store_true", help="fit collective_sm_share, leave one GPU out")
    ap.add_argument("--recommend", action="store_true",
                    help="recommend's top layouts for RECOMMEND at collective_sm_share 0, 0.0625, 0.25")
    ap.add_argument("--json", help="write the numbers here")
    a = ap.parse_args(argv)
    rows = load_rows()
    e, preds = errors(rows)
    t = bias_table(rows, e)
    print_table(t, "shipped profiles: weighted mean signed error, log(predicted / measured) as %")
    result = {"table": t, "matched": matched_table(rows, e)}
    print_table(result["matched"], "within (GPU, model) groups with both kinds of rows")
    if a.rows:
        print(f"\n{'row':>5} {'gpu':6} {'model':14} {'format':15} {'layout':28} {'measured':>9} {'pred':>7} "
              f"{'err %':>6} {'DP hidden %':>11}")
        for x, p, err in zip(rows, preds, e):
            if not x.run.fsdp:
                continue
            g, b = x.cfg, p.breakdown
            hidden = (b["dp_comm_total_s"] - b["dp_comm_exposed_s"]) / p.step_time_s * 100
            print(f"{x.run.row_id:>5} {x.run.gpu_type:6} {x.run.model_key[:14]:14} {g.quant:15} "
                  f"{f't{g.tp}p{g.pp}d{g.dp} m{g.mbs} g{g.gbs} s{g.seq}':28} {x.y:9.0f} "
                  f"{p.tokens_per_s_per_gpu:7.0f} {pct(err):+6.1f} {hidden:11.1f}")
    if a.fit:
        result["fit"] = fit(rows)
        print_table(result["fit"]["at_fit"], f"at the fitted share {result['fit']['share']:.4f}")
    if a.recommend:
        result["recommend"] = recommend_at()
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
