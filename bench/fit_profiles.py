"""Fit the shipped `te` stack profile on the published runs and our own Transformer Engine runs, and
write it to models/data/te_calibration.joblib (+ .json beside it, readable).

    python bench/fit_profiles.py            # fit, cross-validate, write the profile
    python bench/fit_profiles.py --dry-run  # fit and print, write nothing

Rows: the usable pretraining rows of data/published/published_fit.csv on H100 (Megatron-Core /
NeMo / Megatron-Bridge with Transformer Engine). Left out of the fit and reported as out-of-sample
checks: Blackwell rows (other chips, same physics), the A100 rows (Megatron-LM of 2021, FP16, no
Transformer Engine: not this stack) and NeMo 24.03's long-sequence table (its attention ran at
FlashAttention-2 rates: with the te constants its error grows with the sequence, +3% at 4K, +7% at
8K, +18% at 16K without CP, +41% at 1M, as the attention share grows; today's TE attention is
cuDNN's, measured on our H100 at 0.49-0.51 of peak at 8K against 0.28-0.29 for FlashAttention-2). Each distinct configuration weighs the same.

Plus our own dense runs of the TE stack (TE_RUNS: 4 x H100, TE 2.20.2, megatron-core 0.19.2; issue
#22), predicted with the settings they ran with (no TP-comm overlap, gradient_accumulation_fusion off,
recorded in their config), each distinct configuration weighing 1 at the spread of our repeats
(profile_fit.MEASURED_SPREAD) where a published row weighs 1 at PUBLISHED_SPREAD. Reported out of
sample three ways: leave one source out (our runs are one source: the fit without any of them), one
model family out, and one architecture out (llama3-8b, llama3-70b, gpt3, nemotron; the published rows
and our runs of it together), with the MAPE on our runs of the architecture left out. The tokens/s interval is the
80% quantile of |leave-one-source-out residual| (split conformal, as `advisor fit` builds its
calibrated level's); memory and power have no published measurements, so their intervals are the
`local` profile's (measured on this project's GPUs), and say so.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from advisor.models import profile_fit as F  # noqa: E402
from advisor.models import published as P  # noqa: E402
from advisor.models.calibrate import LEVEL, Calibration, resolve_calibration  # noqa: E402
from advisor.models.profiles import STACKS  # noqa: E402

FIT_GPUS = ("H100",)
CHECK_GPUS = ("A100-80GB", "B200", "GB200", "B300", "GB300")


OLD_ATTENTION = ("nemo_long_sequence_cp",)  # sources whose attention kernels predate TE's cuDNN ones


def in_fit(r: P.PublishedRun) -> bool:
    return r.gpu_type in FIT_GPUS and not r.moe and r.source_group not in OLD_ATTENTION


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def borrowed_interval(spec: dict) -> dict:
    """A local-profile interval as a quantile interval of the calibrated level."""
    iv = dict(spec["interval"])
    if iv.get("type") == "gp_sd":  # +- k sd_floor: the surrogate's band away from its training rows
        half = iv["k"] * iv.get("sd_floor", 0.0)
        iv = {"type": "quantiles", "lo": -half, "hi": half}
    iv["note"] = "from the local profile (this project's measured GPUs): no published measurements of it"
    return iv


TE_RUNS = (P.ROOT / "data/measurements/h100x4-te.jsonl", P.ROOT / "data/measurements/tune-llama3-8b-h100x4-te.jsonl")
TE_SOURCE = "our TE runs (4 x H100)"
ARCHITECTURES = ("llama3-8b", "llama3-70b", "gpt3", "nemotron")  # left out in turn


def te_run_rows() -> list[F.Row]:
    """Our dense TE-stack runs as fit rows (MoE runs: the MoE terms' own fit, bench/moe_check.py)."""
    from advisor.models.dataset import load

    ds = load([str(f) for f in TE_RUNS])
    # a run whose allocator retried (memory edge) measured the retries too: not a speed row
    return F.measured_rows([r for r in ds.records if r.stack == "te" and not r.model.is_moe and not r.alloc_retries],
                           TE_SOURCE)


def te_fit_set(runs) -> tuple[list, list, dict, np.ndarray, np.ndarray]:
    """The te fit's rows (the published rows in_fit keeps, then ours: te_run_rows), the published
    ones, what fit_rows left out, which rows are ours, and their weights."""
    pub, left = F.fit_rows(runs, "te", in_fit)
    rows = pub + te_run_rows()
    mine = np.array([x.run.source_group == TE_SOURCE for x in rows])
    return rows, pub, left, mine, np.array([x.weight for x in rows])


def te_runs_by_group(rows, oof, mine, w, by, groups) -> dict:
    """Out-of-fold summary of our TE runs per group (`by(row)` in `groups`)."""
    return {g: F.summary(oof[mine & np.array([by(x) == g for x in rows])], w[mine & np.array([by(x) == g for x in rows])])
            for g in groups}


def build(say=print) -> Calibration:
    runs = P.load()
    rows, pub, left, mine, w = te_fit_set(runs)
    ours = rows[len(pub):]
    base = F.te_base()
    t0 = time.time()
    say(f"fitting te on {len(pub)} published rows ({', '.join(FIT_GPUS)}, dense) and {len(ours)} of our TE runs "
        f"({round(sum(x.weight for x in ours))} distinct)")
    c, info = F.fit(rows, base)
    say(f"  fitted in {time.time() - t0:.0f} s: " + ", ".join(f"{k}={v:.4g}" for k, v in info["fitted"].items())
        + (f"; at a bound: {', '.join(info['at_bound'])}" if info["at_bound"] else ""))
    e = F.log_errors(rows, c)
    in_sample = F.summary(e[~mine], w[~mine])
    say(f"  in sample: published MAPE {in_sample['mape']:.1f}%, bias {in_sample['bias']:+.1f}%; our TE runs "
        f"{F.summary(e[mine], w[mine])['mape']:.1f}%")
    cv = {"scheme": "leave one source out / model family out / architecture out", "level": LEVEL,
          "in_sample": in_sample, "in_sample_te_runs": F.summary(e[mine], w[mine])}
    oof_source = None
    for name, by, only in (("leave_one_source_out", lambda x: x.run.source_group, None),
                           ("leave_one_family_out", lambda x: x.run.family, None),
                           ("leave_one_architecture_out", F.architecture, ARCHITECTURES)):
        oof, per = F.cross_validate(rows, base, by, only=only)
        s = F.summary(oof[~mine], w[~mine])
        s_te = F.summary(oof[mine], w[mine])
        cv[name] = {"overall": s, "groups": per, "te_runs": s_te}
        if only is not None:
            cv[name]["te_runs_by_group"] = te_runs_by_group(rows, oof, mine, w, by, only)
        say(f"  {name.replace('_', ' ')}: published MAPE {s['mape']:.1f}%, bias {s['bias']:+.1f}%; our TE runs "
            f"MAPE {s_te['mape']:.1f}%, bias {s_te['bias']:+.1f}% (n={s_te['n']})")
        for g, v in cv[name].get("te_runs_by_group", {}).items():
            say(f"    {g:<12} our runs left out: MAPE {v['mape']:.1f}%, bias {v['bias']:+.1f}% (n={v['n']}); "
                f"rows left out in all: {per.get(g, {}).get('n', 0)}")
        if oof_source is None:
            oof_source = oof
    check = {}
    for g in CHECK_GPUS:
        rr, _ = F.fit_rows(runs, "te", lambda r, g=g: r.gpu_type == g and not r.moe)
        if rr:
            check[g] = F.summary(F.log_errors(rr, c), [x.weight for x in rr])
            say(f"  out of sample on {g} (not fitted): MAPE {check[g]['mape']:.1f}% over {check[g]['n']} rows")
    rr, _ = F.fit_rows(runs, "te", lambda r: r.gpu_type in FIT_GPUS and not r.moe and r.source_group in OLD_ATTENTION)
    if rr:
        check["H100 NeMo 24.03 long-sequence (FlashAttention-2 era)"] = s = F.summary(
            F.log_errors(rr, c), [x.weight for x in rr])
        say(f"  out of sample, NeMo 24.03 long-sequence CP table (not fitted): MAPE {s['mape']:.1f}%, "
            f"bias {s['bias']:+.1f}% over {s['n']} rows")
    cv["blackwell_out_of_sample"] = check  # and the other out-of-sample checks
    r = oof_source[np.isfinite(oof_source)]
    q = float(np.quantile(np.abs(r), LEVEL))
    local = resolve_calibration("local")
    targets = {"tokens_per_s_per_gpu": {
        "mode": "calibrated", "kind": "log_ratio",
        "interval": {"type": "quantiles", "lo": -q, "hi": q, "n_cv": int(r.size),
                     "construction": "symmetric: +-80% quantile of |leave-one-source-out residual|",
                     "coverage_cv": float(np.mean(np.abs(r) <= q))}}}
    for t, spec in local.targets.items():
        if t != "tokens_per_s_per_gpu":
            targets[t] = {"mode": "calibrated", "kind": spec["kind"], "interval": borrowed_interval(spec)}
    files = [P.FIT_FILE, P.ARCH_FILE, *TE_RUNS]
    trained_on = {"n_rows": len(rows), "n_te_runs": len(ours), "left_out": dict(left),
                  "files": [str(f.relative_to(P.ROOT)) for f in files],
                  "sha256": {str(f.relative_to(P.ROOT)): _sha(f) for f in files},
                  "gpus": list(FIT_GPUS), "sources": sorted({x.run.source_group for x in rows}),
                  "models": sorted({x.run.model_key for x in rows})}
    # the shipped constants price no host floor (the published runs' hosts); our VM's fitted host
    # issue costs, and the MoE ones, stay in fit_info (profile_fit.vm_host / on_vm apply them to our runs)
    return Calibration(constants=F.without_host(c), targets=targets, surrogates={}, trained_on=trained_on, cv=cv,
                       fit_info=F.with_vm_host(info), profile="te", fitted_bounds=dict(F.TE_FIT),
                       base_constants=base)


def main(argv=None, build=build, out=STACKS["te"].file, doc=__doc__) -> int:
    """The command line of a profile fit (this one, bench/fit_blackwell.py's)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("-o", "--out", default=str(out))
    a = ap.parse_args(argv)
    cal = build()
    if not a.dry_run:
        cal.save(a.out)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
