"""Compare the advisor's predicted attention time with Transformer Engine's measured one (CPU).

Reads the JSONL of bench/window_attention_gpu.py (TE fused attention, bf16, causal, with and
without a sliding window) and predicts each case as models/step_time.py prices a layer's core
attention: forward FLOPs = 2 x keys_per_query(seq, window) x heads x (qk + v head dims) per
token (models.flops.attention_core_flops_per_token), at the GPU's bf16 peak x
Constants.attention_efficiency, times the kernels' shape factor (models/attention.py: whole
tiles along the band's edges, a fixed cost per thread block, the head-dim efficiency); forward +
backward = that x (1 + attention_backward_factor). A measured case is one isolated call: the GPU
waits for Transformer Engine's Python to launch it (in a training step the CPU runs ahead and this
is hidden), so ISOLATED_CALL_S is added to each prediction here and nowhere in the model.
The constants are the `te` stack's calibrated profile (what `advisor predict` uses by default;
`--calibration none`: the analytical defaults). Prints measured vs predicted per case and the
error; exits 1 if any windowed case is off by more than --tolerance (default 10%)::

    python bench/window_attention_check.py MEASURED.jsonl [--calibration default|none] [--gpu h100]

bench/fit_window_attention.py fits attention_edge_tiles, attention_hdim256_efficiency and
ISOLATED_CALL_S on the measured file (leave-one-shape-out report).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def gpu_name(device: str) -> str:
    """The catalog GPU of a torch device name ('NVIDIA H100 80GB HBM3' -> 'h100')."""
    d = device.lower()
    for name in ("h200", "h100", "a100", "b200", "mi300x"):
        if name in d:
            return name
    raise SystemExit(f"error: no catalog GPU for device {device!r}: give --gpu")


# Host time one isolated fused-attention forward + backward exposes (event recorded, the GPU idle
# until Transformer Engine's DotProductAttention has run its Python and launched its kernels):
# fitted on the measured file by bench/fit_window_attention.py (0.638 ms at the te profile's
# attention_efficiency 0.527, leave-one-shape-out 0.593-0.667 ms; 0.624 at 0.524; 0.471 at 0.492;
# 0.590 at 0.516; 0.410 before). Plausible 0.1-0.7 ms. The same calls back to back
# (bench/kernel_rates.py's bursts) hide it.
ISOLATED_CALL_S = 638e-6


def predict_case(row: dict, gpu, c) -> tuple[float, float]:
    """(forward, forward + backward) GPU seconds the advisor predicts for one measured case (what
    step_time prices for such a layer; without the isolated call's host time)."""
    from advisor.catalog.specs import ModelSpec
    from advisor.models.flops import attention_core_flops_per_token
    from advisor.models.step_time import attention_seconds

    hq, hkv, d, w = row["q_heads"], row["kv_heads"], row["head_dim"], row["window"]
    m = ModelSpec(name="probe", num_layers=1, hidden_size=hq * d, ffn_hidden_size=hq * d, num_attention_heads=hq,
                  vocab_size=1, num_query_groups=hkv if hkv != hq else None, kv_channels=d, window_size=w)
    tokens = row["seq"] * row["batch"]
    fwd = attention_seconds(m, attention_core_flops_per_token(m, row["seq"], layer=0) * tokens, row["seq"], w, gpu, c)
    return fwd, fwd * (1 + c.attention_backward_factor)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("measured", help="JSONL of bench/window_attention_gpu.py")
    ap.add_argument("--calibration", default="default", help="default (the te profile) or none")
    ap.add_argument("--gpu", help="catalog GPU (default: from the rows' device name)")
    ap.add_argument("--tolerance", type=float, default=0.10)
    o = ap.parse_args(argv)
    from advisor.catalog.loaders import load_gpu
    from advisor.models.calibrate import resolve_calibration
    from advisor.models.constants import DEFAULT

    cal = resolve_calibration(o.calibration, stack="te")
    c = cal.constants if cal is not None else DEFAULT
    rows = [json.loads(ln) for ln in Path(o.measured).read_text().splitlines() if ln.strip()]
    bad, worst = [], 0.0
    print(f"{'shape':26s} {'seq':>6s} {'window':>6s} {'meas fwd+bwd ms':>16s} {'pred ms':>9s} {'error':>7s}"
          f" {'meas win/full':>13s} {'pred win/full':>13s}")
    full = {(r["shape"], r["seq"]): r for r in rows if r["window"] == 0 and "error" not in r}
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:26s} {r['seq']:6d} {r['window'] or 'full':>6} measured error: {r['error']}")
            continue
        gpu = load_gpu(o.gpu or gpu_name(r["device"]))
        pred = predict_case(r, gpu, c)[1] + ISOLATED_CALL_S
        err = pred / r["fwd_bwd_s"] - 1.0
        f = full.get((r["shape"], r["seq"]))
        ratio_m = r["fwd_bwd_s"] / f["fwd_bwd_s"] if f else float("nan")
        ratio_p = pred / (predict_case(f, gpu, c)[1] + ISOLATED_CALL_S) if f else float("nan")
        print(f"{r['shape']:26s} {r['seq']:6d} {r['window'] or 'full':>6} {r['fwd_bwd_s'] * 1e3:16.3f} "
              f"{pred * 1e3:9.3f} {err:+7.1%} {ratio_m:13.3f} {ratio_p:13.3f}")
        if r["window"]:
            worst = max(worst, abs(err))
            if abs(err) > o.tolerance:
                bad.append(r)
    print(f"windowed cases off by more than {o.tolerance:.0%}: {len(bad)}; worst {worst:.1%} "
          f"(constants: {'te profile' if cal is not None else 'analytical'}, attention_efficiency "
          f"{c.attention_efficiency:.3f}, backward factor {c.attention_backward_factor:.2f})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
