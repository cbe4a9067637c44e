"""Read the kernel profiles of measured records (job key kernel_profile_steps; runners/kernel_probe.py)
side by side: for each BF16 / FP8 pair (same model, layers, sequence, global batch and layout) GPU ms
per step per kernel category and their counts, the GPU busy fractions, the host's time per step,
the profiler's overhead; then each record's top kernels.

    python bench/kernel_profile.py DATA.jsonl [DATA.jsonl ...] [--top 10]

A record with a profile but no partner in the other precision is printed alone.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from advisor.runners.records import read_jsonl  # noqa: E402

LAYOUT = ("tp", "pp", "vp", "cp", "ep", "etp", "dp", "mbs", "recompute", "sequence_parallel")


def load(paths: list[str]) -> list[dict]:
    """The records of `paths` that carry a kernel profile."""
    return [r for p in paths for r in read_jsonl(p) if r.get("kernel_profile")]


def pair_key(r: dict) -> tuple:
    c = r["config"]
    return (r["model_name"], r.get("layers"), c["seq"], c["gbs"]) + tuple(c.get(k) for k in LAYOUT)


def label(r: dict) -> str:
    c = r["config"]
    lay = " ".join(f"{k.upper()}{c[k]}" for k in ("tp", "pp", "cp", "ep", "dp") if c.get(k, 1) > 1 or k == "dp")
    return f"{r['model_name']}[{r.get('layers')}L] s{c['seq']} gbs{c['gbs']} {lay} mbs{c['mbs']}"


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def columns(rs: list[dict]) -> list[str]:
    """One text block: a row per category (GPU ms / count per step in each record), then summary rows."""
    kps = [r["kernel_profile"] for r in rs]
    heads = [f"{r['config']['precision']} ({r['id']})" for r in rs]
    w = 26
    lines = [f"{'':28}" + "".join(f"{h:>{w}}" for h in heads) + ("   fp8 - bf16 ms" if len(rs) == 2 else "")]
    errors = [(r["id"], kp["error"]) for r, kp in zip(rs, kps) if "error" in kp]
    for i, e in errors:
        lines.append(f"  {i}: kernel profile failed: {e}")
    if errors:
        return lines
    cats = []
    for kp in kps:
        cats += [c for c in kp["categories"] if c not in cats]
    for c in cats:
        vals = [kp["categories"].get(c) for kp in kps]
        cells = "".join(f"{('%.2f ms x%g' % (v['ms'], v['count'])) if v else '-':>{w}}" for v in vals)
        diff = ""
        if len(vals) == 2:
            diff = f"   {(vals[1]['ms'] if vals[1] else 0) - (vals[0]['ms'] if vals[0] else 0):+8.2f}"
        lines.append(f"  {c:<26}{cells}{diff}")

    def row(name, get, fmt="{:.2f}", diff=True):
        vals = [get(r, kp) for r, kp in zip(rs, kps)]
        d = (f"   {vals[1] - vals[0]:+8.2f}" if diff and len(vals) == 2 and None not in vals else "")
        lines.append(f"  {name:<26}" + "".join(f"{_f(v, fmt):>{w}}" for v in vals) + d)

    row("GPU ms / step (all)", lambda r, kp: kp["gpu_ms_total"])
    row("kernels / step", lambda r, kp: kp["kernels"], "{:.0f}")
    row("measured step ms", lambda r, kp: 1000 * r["steps"]["median_s"] if r.get("steps") and r["steps"].get("median_s") else None)
    row("profiled step ms", lambda r, kp: 1000 * kp["overhead"]["profiled_step_s"])
    row("profiler overhead x", lambda r, kp: kp["overhead"]["ratio"], "{:.3f}", False)
    row("compute stream busy", lambda r, kp: kp["gpu"]["compute_stream_busy"], "{:.3f}")
    row("non-NCCL kernels busy", lambda r, kp: kp["gpu"]["non_nccl_busy"], "{:.3f}")
    row("any GPU activity busy", lambda r, kp: kp["gpu"]["any_busy"], "{:.3f}")
    row("host busiest thread ms", lambda r, kp: kp["host"][0]["busy_ms"] if kp["host"] else None)
    row("  of it in syncs ms", lambda r, kp: kp["host"][0]["sync_ms"] if kp["host"] else None)
    row("  launches / step", lambda r, kp: kp["host"][0]["launches"] if kp["host"] else None, "{:.0f}")
    row("host 2nd thread ms", lambda r, kp: kp["host"][1]["busy_ms"] if len(kp["host"]) > 1 else None)
    for when in ("measured", "profiled"):
        row(f"main thread CPU ms ({when[:4]})",
            lambda r, kp: ((kp.get("host_cpu") or {}).get(when) or {}).get("main_thread_ms"), "{:.0f}")
        row(f"all threads CPU ms ({when[:4]})",
            lambda r, kp: ((kp.get("host_cpu") or {}).get(when) or {}).get("all_threads_ms"), "{:.0f}")
    # which of the profiled rank's host and GPU paces it: its non-NCCL GPU work (busy fraction x
    # profiled step, over the profiler's overhead) against its main thread's CPU time, both per
    # measured step; the rest of the step is the exposed collectives and the waits for other ranks
    row("GPU work ms (meas)", gpu_work_ms, "{:.0f}")
    row("step - max(host, GPU) ms", lambda r, kp: beyond_host_and_gpu_ms(r, kp), "{:.0f}")
    return lines


def gpu_work_ms(r: dict, kp: dict) -> float:
    """The profiled rank's non-NCCL GPU work per measured step (ms)."""
    return 1000 * kp["gpu"]["non_nccl_busy"] * kp["overhead"]["profiled_step_s"] / kp["overhead"]["ratio"]


def beyond_host_and_gpu_ms(r: dict, kp: dict):
    """Measured step minus the longer of the rank's main-thread CPU time and its GPU work (ms)."""
    host = ((kp.get("host_cpu") or {}).get("measured") or {}).get("main_thread_ms")
    step = (r.get("steps") or {}).get("median_s")
    if host is None or not step:
        return None
    return 1000 * step - max(host, gpu_work_ms(r, kp))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--top", type=int, default=10, help="top kernels printed per record (0: none)")
    a = ap.parse_args(argv)
    missing = [p for p in a.paths if not Path(p).is_file()]
    if missing:
        print(f"error: no such file: {missing[0]}", file=sys.stderr)
        return 2
    recs = load(a.paths)
    if not recs:
        print(f"error: no record with a kernel_profile in {', '.join(a.paths)}", file=sys.stderr)
        return 2
    groups: dict[tuple, list[dict]] = {}
    for r in recs:
        groups.setdefault(pair_key(r), []).append(r)
    for rs in groups.values():
        rs.sort(key=lambda r: (r["config"]["precision"] != "bf16", r["id"]))
        print(f"\n== {label(rs[0])}   (per step; GPU ms x kernel count)")
        print("\n".join(columns(rs)))
    for r in recs if a.top else []:
        kp = r["kernel_profile"]
        print(f"\n-- {r['id']} ({r['config']['precision']}): top {a.top} kernels, ms / step x count")
        for t in kp.get("top", [])[:a.top]:
            print(f"  {t['ms']:8.2f} x{t['count']:<7g} {t['category']:<20} {t['name'][:90]}")
        if kp.get("other_top"):
            print("  unclassified: " + "; ".join(f"{t['name'][:60]} {t['ms']:.2f}" for t in kp["other_top"][:4]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
