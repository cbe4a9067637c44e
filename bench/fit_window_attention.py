"""Fit the fused-attention shape constants on Transformer Engine's measured window / full attention (CPU).

Fits, on the JSONL of bench/window_attention_gpu.py (forward + backward medians), by maximum a
posteriori on log errors (each constant with a physical prior: centre, spread):
- Constants.attention_edge_tiles: a thread block's fixed cost besides its tiles, in tile-times;
- Constants.attention_hdim256_efficiency: head dim 256 relative to 128;
- window_attention_check.ISOLATED_CALL_S: the host time an isolated call exposes;
with Constants.attention_efficiency and the backward factor kept at the `te` profile's (fitted on
the published runs; the shape factor is 1 at its reference shape). Prints the fit in sample and
leave-one-shape-out (each head shape predicted by the constants fitted on the other two; the
head-dim-256 efficiency then falls back to its prior when the one head-dim-256 shape is left out).
The printed values are the ones models/constants.py and bench/window_attention_check.py carry::

    python bench/fit_window_attention.py data/microbench/h100x1-window-attention.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from window_attention_check import gpu_name, predict_case  # noqa: E402  (beside this file)

NAMES = ("attention_edge_tiles", "attention_hdim256_efficiency", "isolated_call_s")
# (centre, spread, lower, upper): the edge from the per-row passes' bytes (~3 tile-times) plus a
# pipeline fill / drain (~1); head dim 256 as efficient as 128 until measured; TE's Python
# dispatch of one DotProductAttention forward + backward, 0.1-0.6 ms
PRIORS = {"attention_edge_tiles": (4.0, 3.0, 0.0, 20.0),
          "attention_hdim256_efficiency": (1.0, 0.15, 0.3, 1.5),
          "isolated_call_s": (3e-4, 3e-4, 0.0, 2e-3)}
DATA_SPREAD = 0.05  # the medians' run-to-run spread at 8K (median vs min differ by up to 15%)


def predict(rows, gpu, c, p) -> np.ndarray:
    cc = c.replace(attention_edge_tiles=p[0], attention_hdim256_efficiency=p[1])
    return np.array([predict_case(r, gpu, cc)[1] + p[2] for r in rows])


def fit(rows, gpu, c) -> np.ndarray:
    from scipy.optimize import least_squares

    meas = np.array([r["fwd_bwd_s"] for r in rows])
    pri = [PRIORS[n] for n in NAMES]

    def resid(p):
        data = np.log(predict(rows, gpu, c, p) / meas) / DATA_SPREAD
        return np.concatenate([data, [(v - m) / s for v, (m, s, _, _) in zip(p, pri)]])

    x0 = [m for m, _, _, _ in pri]
    return least_squares(resid, x0, bounds=([lo for *_, lo, _ in pri], [hi for *_, hi in pri])).x


def describe(p) -> str:
    return f"edge tiles {p[0]:.2f}, head-dim-256 efficiency {p[1]:.3f}, isolated call {p[2] * 1e3:.3f} ms"


def errors(rows, gpu, c, p) -> np.ndarray:
    return predict(rows, gpu, c, p) / np.array([r["fwd_bwd_s"] for r in rows]) - 1.0


def report(label, rows, err) -> str:
    win = np.array([bool(r["window"]) for r in rows])
    return (f"{label}: windowed max {np.max(np.abs(err[win])):.1%} mean {np.mean(np.abs(err[win])):.1%}"
            f" ({int(np.sum(np.abs(err[win]) > 0.10))} > 10%); full causal max {np.max(np.abs(err[~win])):.1%}"
            f" mean {np.mean(np.abs(err[~win])):.1%}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("measured", help="JSONL of bench/window_attention_gpu.py")
    o = ap.parse_args(argv)
    from advisor.catalog.loaders import load_gpu
    from advisor.models.calibrate import resolve_calibration

    c = resolve_calibration("default", stack="te").constants
    rows = [json.loads(ln) for ln in Path(o.measured).read_text().splitlines() if ln.strip()]
    rows = [r for r in rows if "error" not in r]
    gpu = load_gpu(gpu_name(rows[0]["device"]))
    print(f"{len(rows)} cases; te profile attention_efficiency {c.attention_efficiency:.3f}, "
          f"backward factor {c.attention_backward_factor:.2f}; priors " +
          ", ".join(f"{n} {m:g} +- {s:g}" for n, (m, s, _, _) in PRIORS.items()))
    p = fit(rows, gpu, c)
    print(f"in sample: {describe(p)}")
    print("  " + report("in sample", rows, errors(rows, gpu, c, p)))
    out_err = np.zeros(len(rows))
    for shape in sorted({r["shape"] for r in rows}):
        train = [r for r in rows if r["shape"] != shape]
        test = [i for i, r in enumerate(rows) if r["shape"] == shape]
        q = fit(train, gpu, c)
        e = errors([rows[i] for i in test], gpu, c, q)
        out_err[test] = e
        print(f"leave out {shape}: {describe(q)}")
        print("  " + report(shape, [rows[i] for i in test], e))
    print(report("leave-one-shape-out, all", rows, out_err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
