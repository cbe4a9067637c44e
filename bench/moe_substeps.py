"""The MoE layer's sub-steps as our runner timed them beside the model's terms, per layer-microbatch,
and where the rest of each step's error sits (issue #24: what DeepSeek-V2-Lite's dispatch spends).

    python bench/moe_substeps.py [--shape deepseek-v2-lite] [--all] [--fit-without SHAPE]

For each `local` MoE record of data/measurements/ with a moe_probe (runners/moe_probe.py: CUDA events
around megatron-core's MoELayer sub-steps on rank 0, forward + backward, summed over the step's
layer-microbatches) and more than one GPU (--all: every one):

  measured   router, permute (preprocess + postprocess + the routed phase beyond the experts: the
             local chunk sort), dispatch (dispatch + combine, both directions), experts, shared
             experts, the whole layer, per layer-microbatch (ms);
  model      the same terms of models/moe.py (moe_layer_time) for the run's layout, with the shipped
             `local` profile (what section 1b of bench/moe_check.py predicts with) or, with
             --fit-without SHAPE, the MoE constants fitted on the other shapes (section 1's
             leave-one-shape-out fit, max_nfev 40), each with the run's measured router skew;
  d+x        dispatch + experts, measured on rank 0 and modelled for the busiest rank: with EP > 1
             rank 0's experts carry its own tokens while its all-to-all waits for the busiest rank's,
             so the two terms are comparable only together;
  outside    the step's error (model - measured, ms) left after the MoE layers' own error (n x the
             layer's): attention, dense layers, the optimizer, gradient reduction, host gaps between
             layers;
  util       NVML GPU utilization (mean over the GPUs), whose complement is time with no kernel
             running: the GPU waiting for its host.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import moe_check as MC  # noqa: E402  (a sibling bench module)
from host_bound import measured_util  # noqa: E402  (a sibling bench module)

from advisor.models import step_time as ST  # noqa: E402
from advisor.models.predict import predict  # noqa: E402


def probe_terms(probe: dict) -> dict[str, float]:
    """Seconds per layer-microbatch of each sub-step the probe timed on rank 0 (forward + backward),
    grouped as the model's terms; `preprocess_fwd` apart (the permutation before the dispatch, and
    with EP > 1 the token-count all-gather and the host's wait for the split sizes)."""
    ph = probe["phases"]
    n = max(1, ph["experts"]["calls"])

    def tot(p: str) -> float:
        return (ph[p]["fwd_s"] + ph[p]["bwd_s"]) / n

    return {"router": tot("router"),
            "permute": tot("preprocess") + tot("postprocess") + max(0.0, tot("routed") - tot("experts")),
            "preprocess_fwd": ph["preprocess"]["fwd_s"] / n,
            "dispatch": tot("dispatch") + tot("combine"), "expert": tot("experts"), "shared": tot("shared"),
            "layer": tot("layer"), "calls": float(n)}


def model_layer(row: dict, c) -> tuple:
    """(prediction, MoELayerTime of the run's MoE layer) with the run's router skew."""
    captured = []
    inner = ST.moe_layer_time

    def spy(*a, **k):
        out = inner(*a, **k)
        captured.append(out)
        return out

    ST.moe_layer_time = spy
    try:
        r = row["rec"]
        p = predict(r.model, r.cluster, r.cfg, MC.run_constants(row, c), check_legal=False)
    finally:
        ST.moe_layer_time = inner
    return p, captured[0]


def compare(rows: list[dict], c, util: dict[str, float]) -> list[dict]:
    out = []
    for row in rows:
        r = row["rec"]
        probe = row.get("probe")
        if not probe:
            continue
        m = probe_terms(probe)
        p, mt = model_layer(row, c)
        model = {"router": mt.router, "permute": mt.permute, "dispatch": mt.dispatch, "expert": mt.expert,
                 "shared": mt.shared}
        model["layer"] = sum(model.values())
        step = p.step_time_s * p.tokens_per_s_per_gpu / r.y["tokens_per_s_per_gpu"]  # the measured step
        out.append({"id": r.id, "shape": MC.shape_of(r.model), "cfg": r.cfg, "m": m, "model": model,
                    "step": step, "pred_step": p.step_time_s,
                    "outside": (p.step_time_s - step) - m["calls"] * (model["layer"] - m["layer"]),
                    "util": util.get(r.id), "err": p.tokens_per_s_per_gpu / r.y["tokens_per_s_per_gpu"] - 1})
    return out


def layout(cfg) -> str:
    return (f"EP{cfg.ep} {cfg.moe_dispatcher[:5]}{'' if cfg.moe_grouped_gemm else ' seqMLP'} "
            f"mbs{cfg.mbs} seq{cfg.seq} x{cfg.world_size}")


def table(res: list[dict]) -> None:
    ms = 1e3
    print("| run | shape | layout | util | permute m/model | pre fwd | dispatch m/model | experts m/model | "
          "d+x m/model | layer m/model | step m/model | outside | tok/s err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for x in res:
        m, d = x["m"], x["model"]
        util = f"{100 * x['util']:.0f}%" if x["util"] is not None else "-"
        print(f"| {x['id']} | {x['shape']} | {layout(x['cfg'])} | {util} | "
              f"{ms * m['permute']:.2f}/{ms * d['permute']:.2f} | {ms * m['preprocess_fwd']:.2f} | "
              f"{ms * m['dispatch']:.2f}/{ms * d['dispatch']:.2f} | {ms * m['expert']:.2f}/{ms * d['expert']:.2f} | "
              f"{ms * (m['dispatch'] + m['expert']):.2f}/{ms * (d['dispatch'] + d['expert']):.2f} | "
              f"{ms * m['layer']:.2f}/{ms * d['layer']:.2f} | {ms * x['step']:.0f}/{ms * x['pred_step']:.0f} | "
              f"{ms * x['outside']:+.0f} | {100 * x['err']:+.1f}% |")


def summary(res: list[dict]) -> None:
    """Per shape and dispatcher (EP > 1): the mean measured - model of dispatch, d+x, the layer (ms per
    layer-microbatch) and outside the MoE layers (ms per step); per shape and micro-batch tokens, the
    mean NVML utilization and tokens/s error."""
    ms = 1e3
    groups = defaultdict(list)
    for x in res:
        if x["cfg"].ep > 1:
            groups[(x["shape"], x["cfg"].moe_dispatcher)].append(x)
    print("\n| shape | dispatcher (EP > 1) | runs | dispatch m - model | d+x m - model | layer m - model | outside (model - m, ms/step) |")
    print("|---|---|---|---|---|---|---|")
    for (s, disp), xs in sorted(groups.items()):
        def mean(f):
            return statistics.fmean(f(x) for x in xs)
        print(f"| {s} | {disp} | {len(xs)} | {ms * mean(lambda x: x['m']['dispatch'] - x['model']['dispatch']):+.2f} | "
              f"{ms * mean(lambda x: x['m']['dispatch'] + x['m']['expert'] - x['model']['dispatch'] - x['model']['expert']):+.2f} | "
              f"{ms * mean(lambda x: x['m']['layer'] - x['model']['layer']):+.2f} | {ms * mean(lambda x: x['outside']):+.0f} |")
    by_tokens = defaultdict(list)
    for x in res:
        if x["util"] is not None and x["cfg"].moe_grouped_gemm:
            by_tokens[(x["shape"], x["cfg"].mbs * x["cfg"].seq)].append(x)
    print("\n| shape | tokens per microbatch | runs (grouped GEMM) | NVML util | tokens/s error |")
    print("|---|---|---|---|---|")
    for (s, t), xs in sorted(by_tokens.items()):
        print(f"| {s} | {t} | {len(xs)} | {100 * statistics.fmean(x['util'] for x in xs):.0f}% | "
              f"{100 * statistics.fmean(x['err'] for x in xs):+.1f}% |")
    print("\n| shape | runs (grouped GEMM) | GPU idle (1 - util) | corr(idle, tokens/s error) | slope of unexplained step share on idle |")
    print("|---|---|---|---|---|")
    shapes = sorted({s for s, _ in by_tokens})
    for s in shapes + ["all"]:
        xs = [x for (sh, _), v in by_tokens.items() if s in ("all", sh) for x in v]
        idle = np.array([1.0 - x["util"] for x in xs])
        err = np.array([x["err"] for x in xs])
        gap = np.array([1.0 - x["pred_step"] / x["step"] for x in xs])
        if len(xs) > 2 and idle.std() > 0:
            print(f"| {s} | {len(xs)} | {100 * idle.mean():.1f}% | {np.corrcoef(idle, err)[0, 1]:+.2f} | "
                  f"{np.polyfit(idle, gap, 1)[0]:+.2f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", help="only this shape (e.g. deepseek-v2-lite)")
    ap.add_argument("--all", action="store_true", help="one-GPU runs too")
    ap.add_argument("--fit-without", metavar="SHAPE",
                    help="MoE constants fitted on the other shapes (bench/moe_check.py section 1's fit)")
    a = ap.parse_args(argv)
    rows = MC.moe_rows()
    shapes = {MC.shape_of(r["rec"].model) for r in rows}
    for name in (a.shape, a.fit_without):
        if name is not None and name not in shapes:
            print(f"error: unknown shape {name!r} (have: {', '.join(sorted(shapes))})")
            return 2
    probes, files = {}, sorted(MC.MEASUREMENTS.glob("*.jsonl"))
    util = {}
    for f in files:
        util.update(measured_util(f))
        for line in open(f):
            rec = json.loads(line)
            if rec.get("moe_probe"):
                probes[rec["id"]] = rec["moe_probe"]
    c = MC.local_base()
    if a.fit_without:
        c = MC.fit([r for r in rows if MC.shape_of(r["rec"].model) != a.fit_without], c, MC.LOCAL_FIT, 40)
        print(f"MoE constants fitted without {a.fit_without}: "
              + ", ".join(f"{n}={getattr(c, n):.4g}" for n in MC.MOE.MOE_LOCAL_FIT))
    keep = [dict(r, probe=probes.get(r["rec"].id)) for r in rows
            if (a.all or r["rec"].cfg.world_size > 1) and (a.shape is None or MC.shape_of(r["rec"].model) == a.shape)]
    res = compare(keep, c, util)
    table(res)
    summary(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
