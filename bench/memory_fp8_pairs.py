"""FP8 against BF16 on the same layout (issue #27): for every pair of usable measured runs that
differ only in precision, the measured peak allocated memory of each and their ratio, against the
model's (models.memory with the record's stack profile, its allocator part: less the
runtime-overhead term), and the model's FP8 - BF16 difference split into the linear layers' FP8
weight copies and the stored activations (FP8 copies of the GEMM inputs).

    python bench/memory_fp8_pairs.py [data/measurements/h100x4-te.jsonl ...]

Measured: max over ranks of torch's peak allocated memory (no allocator fragmentation, so the
activations' FP8 saving shows as it is). A pair whose modelled peak is the optimizer step's
transient (not the activations) shows no activation difference in its predicted total.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from advisor.models.calibrate import resolve_calibration  # noqa: E402
from advisor.models.dataset import load  # noqa: E402
from advisor.models.memory import stage_memory  # noqa: E402

DEFAULT_FILES = ["data/measurements/h100x4-te.jsonl", "data/measurements/h100x4-te-edge.jsonl"]


def pairs(paths: list[str]) -> list[dict]:
    """One row per (model, layout) measured under both bf16 and fp8: measured and predicted peaks
    (GiB) and the model's FP8 - BF16 weight and activation terms of the fullest stage."""
    lines = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            lines.update({f"{Path(path).name}:{n}": line for n, line in enumerate(f, 1)})
    groups: dict[tuple, dict] = {}
    consts: dict = {}
    for r in load(paths).records:
        mem = json.loads(lines[r.source]).get("memory") or {}
        if r.cfg.precision not in ("bf16", "fp8") or not mem.get("max_gib") or r.cfg.fp8_param_gather:
            continue  # FP8 primary weights (session 27): no BF16 weights, not the BF16 run's twin
        if r.stack not in consts:
            consts[r.stack] = resolve_calibration("default", r.stack).screening_constants
        c = consts[r.stack]
        stages = stage_memory(r.model, r.cfg, c, gpu=r.cluster.gpu)
        top = max(stages, key=lambda s: s.total_gib)
        key = (r.model.name, r.stack, r.cfg.replace(precision="bf16").key())
        groups.setdefault(key, {})[r.cfg.precision] = {
            # measured: the allocated peak, so the prediction without the reserved-but-unallocated term
            "id": r.id, "measured": float(mem["max_gib"]),
            "predicted": top.total_gib - top.reserved_free_gib - c.runtime_overhead_gib,
            "weights": top.weights_gib, "activations": top.activations_gib, "moe": r.model.is_moe, "cfg": r.cfg}
    out = []
    for (model, stack, _), g in groups.items():
        if set(g) != {"bf16", "fp8"}:
            continue
        b, f = g["bf16"], g["fp8"]
        cfg = b["cfg"]
        out.append({"model": model, "stack": stack, "moe": b["moe"], "ids": (b["id"], f["id"]),
                    "layout": f"tp{cfg.tp} pp{cfg.pp} dp{cfg.dp} cp{cfg.cp} ep{cfg.ep} mbs{cfg.mbs} seq{cfg.seq}"
                              f"{' sp' if cfg.sequence_parallel else ''}",
                    "measured": (b["measured"], f["measured"]), "predicted": (b["predicted"], f["predicted"]),
                    "d_weights": f["weights"] - b["weights"], "d_activations": f["activations"] - b["activations"]})
    return out


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*")
    a = ap.parse_args()
    paths = a.paths or [str(ROOT / p) for p in DEFAULT_FILES]
    for p in paths:
        if not Path(p).is_file():
            fail(f"no file {p}")
    rows = pairs(paths)
    if not rows:
        fail("no layout measured under both bf16 and fp8 in these files")
    print("FP8 vs BF16 on the same layout: peak allocated GiB, measured and predicted (allocator part)")
    print(f"{'model':24} {'layout':34} {'meas bf16':>9} {'fp8':>6} {'ratio':>6} {'d':>5} | {'pred bf16':>9} "
          f"{'fp8':>6} {'ratio':>6} {'d':>5} {'dW':>5} {'dAct':>5}")
    errs = []
    for r in rows:
        (mb, mf), (pb, pf) = r["measured"], r["predicted"]
        errs.append(abs(pf / pb - mf / mb))
        print(f"{r['model'][:24]:24} {r['layout'][:34]:34} {mb:9.2f} {mf:6.2f} {mf / mb:6.3f} {mf - mb:5.2f} | "
              f"{pb:9.2f} {pf:6.2f} {pf / pb:6.3f} {pf - pb:5.2f} {r['d_weights']:5.2f} {r['d_activations']:5.2f}")
    print(f"{len(rows)} pairs; FP8/BF16 ratio, predicted - measured: mean |error| {sum(errs) / len(errs):.3f}, "
          f"worst {max(errs):.3f}")
    print("(d: FP8 - BF16 GiB; dW: the model's FP8 weight copies (rowwise + transpose, 2 B per linear weight); "
          "dAct: its activation change, with fragmentation, at the fullest stage)")


if __name__ == "__main__":
    main()
