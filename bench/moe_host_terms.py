"""Our VM's MoE host issue time, term by term, from the kernel profiles (issue #22 / #24).

    python bench/moe_host_terms.py [data/measurements/h100x4-te.jsonl] [--max-ratio 1.16]

Each kernel-profiled TE MoE run (TP 1, PP 1) records, per step, the host issue time (profiler-busy
less blocking syncs) of its two Python threads: the main thread (forward, optimizer step) and torch's
autograd thread (backward). Per thread a non-negative least squares on the step's structure:
per layer-microbatch (m x L: the layer's own launches, attention and the MoE block's fixed ones), per
local expert and layer-microbatch (m x L_moe x E_loc: TE GroupedLinear's per-expert GEMMs and
main-grad adds), per local expert and layer per step (L_moe x E_loc: per-parameter work once a step,
the optimizer's loops and DDP's last-micro-batch registration; TE GroupedLinear keeps one weight per
expert and linear) and FP8's per local expert and layer-microbatch. Runs whose profiled steps ran
slower than their measured ones by more than --max-ratio are left out (the profiler's own host cost
bound them). Printed: the fitted terms in ms, each run's measured and fitted issue time, and what the
te profile's VM host costs (profile_fit.on_vm, moe.MOE_TE_VM_HOST) put on the same structure.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from host_issue import threads  # noqa: E402  (beside this file)

from advisor.runners.records import read_jsonl  # noqa: E402

DEFAULT = ROOT / "data/measurements/h100x4-te.jsonl"
TERMS = {
    "per layer-microbatch": lambda x: x["m"] * x["L"],
    "per local expert and layer-microbatch": lambda x: x["m"] * x["Lm"] * x["E"],
    "per local expert and layer, per step": lambda x: x["Lm"] * x["E"],
    "FP8, per local expert and layer-microbatch": lambda x: x["m"] * x["Lm"] * x["E"] * x["fp8"],
}


def rows(path: Path) -> list[dict]:
    out = []
    for r in read_jsonl(path):
        kp, c = r.get("kernel_profile") or {}, r.get("config") or {}
        moe = (r.get("model") or {}).get("moe")
        if r.get("status") != "ok" or not moe or len(kp.get("host", [])) < 2 or c.get("tp", 1) > 1 or c.get("pp", 1) > 1:
            continue
        main, bwd = threads(kp)
        out.append({"id": r["id"], "model": r["model_name"], "ep": c["ep"], "mbs": c["mbs"],
                    "m": c["gbs"] // (c["dp"] * c["mbs"]), "L": r["layers"],
                    "Lm": r["layers"] - (moe.get("first_dense_layers") or 0), "E": moe["num_experts"] // c["ep"],
                    "fp8": c["precision"] != "bf16", "forward": main["issue_ms"], "backward": bwd["issue_ms"],
                    "ratio": kp["overhead"]["ratio"]})
    return out


def fit(data: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    A = np.array([[f(x) for f in TERMS.values()] for x in data], float)
    y = np.array([x[key] for x in data])
    sol, _ = nnls(A, y)
    return sol, A @ sol


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", nargs="?", default=str(DEFAULT))
    ap.add_argument("--max-ratio", type=float, default=1.16,
                    help="leave out runs whose profiled steps ran this much slower than the measured ones")
    a = ap.parse_args(argv)
    path = Path(a.path)
    if not path.is_file():
        print(f"error: no such file: {path}", file=sys.stderr)
        return 2
    every = rows(path)
    data = [x for x in every if x["ratio"] <= a.max_ratio]
    if len(data) < len(TERMS) + 1:
        print(f"error: {len(data)} kernel-profiled MoE runs (TP 1, PP 1) within --max-ratio {a.max_ratio}; "
              f"need at least {len(TERMS) + 1}", file=sys.stderr)
        return 2
    print(f"{len(data)} kernel-profiled TE MoE runs (of {len(every)}; profiled / measured step <= {a.max_ratio})")
    fits = {k: fit(data, k) for k in ("forward", "backward")}
    print(f"\n{'term (ms)':44} {'forward':>8} {'backward':>9} {'both':>8}")
    for i, name in enumerate(TERMS):
        f, b = fits["forward"][0][i], fits["backward"][0][i]
        print(f"{name:44} {f:8.3f} {b:9.3f} {f + b:8.3f}")
    for k in ("forward", "backward"):
        y = np.array([x[k] for x in data])
        print(f"{k} thread fit: MAPE {100 * float(np.mean(np.abs(fits[k][1] / y - 1))):.1f}%")
    print(f"\n{'run':16} {'model':26} {'EP':>3} {'mbs':>3} {'m':>2} {'E_loc':>5} {'prec':4}  "
          f"{'forward meas/fit':>17}  {'backward meas/fit':>18}")
    for i, x in enumerate(data):
        print(f"{x['id']:16} {x['model']:26} {x['ep']:3d} {x['mbs']:3d} {x['m']:2d} {x['E']:5d} "
              f"{'fp8' if x['fp8'] else 'bf16':4}  {x['forward']:7.0f} / {fits['forward'][1][i]:6.0f}  "
              f"{x['backward']:8.0f} / {fits['backward'][1][i]:6.0f}")
    from advisor.models.calibrate import resolve_calibration
    from advisor.models.profile_fit import on_vm

    c = on_vm(resolve_calibration("te")).constants
    print(f"\nthe te profile's VM host costs on the same structure (ms): per layer-microbatch "
          f"{1e3 * (c.host_layer_s + c.moe_layer_host_s):.2f} (host_layer_s + moe_layer_host_s), per local expert "
          f"and layer-microbatch {1e3 * c.moe_grouped_expert_host_s:.3f}, per step 0, FP8 per local expert "
          f"{1e3 * c.moe_fp8_expert_host_s:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
