"""The host's issue cost measured from the kernel profiles (issue #22), not from any run's throughput.

    python bench/host_issue.py [data/measurements/h100x4-te.jsonl] [--layers-from llama3-8b]

Eager PyTorch issues a step's kernels from two threads that take turns (the main thread: forward,
optimizer; torch's autograd thread pt_autograd_0: backward), so the host's issue time of a step is
the sum over the two of (profiler-busy - time in blocking synchronisation calls). That is the issue
cost only where the host never waits for the GPU outside a sync: a CUDA context queues at most ~1,000
pending launches, and a host that runs that far ahead blocks inside cudaLaunchKernel at the GPU's
pace. Every GPU-bound run that does not synchronise mid-step ends its step with ~800-1,000 kernels
still queued (`lead`: the main thread's sync time x the device's kernel rate), whatever its length:
its busy - sync is paced by the GPU, an upper bound only (`queue`). Runs whose host never gets that
far ahead: pipeline-parallel ones (megatron-core's p2p calls torch.cuda.synchronize after each
batched send / recv) and host-bound ones (GPT-3 2.7B TP2 SP: no sync at all).

Per run: microbatches m, layer-microbatches N per stage, step (measured / profiled), host issue
`lo` (profiler events only: misses the interpreter between ops) and `hi` (the two threads' OS CPU
time in the profiled steps - sync: the interpreter included), per N, per kernel launch, per CPU-side
profiler event, the lead, and the structural counts the model assumes (TP collectives per N).

Then the host costs measured on the layouts of `--layers-from` (default llama3-8b, NOT host-bound)
whose queue never fills, each as a range (profiled lo .. hi, / the profiler's host slow-down
measured on the same runs), and the check: GPT-3 2.7B's host time, step and GPU idle predicted with
them against its profile.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from advisor.runners.records import read_jsonl  # noqa: E402
RUNS = ROOT / "data/measurements/h100x4-te.jsonl"
# a step that ends with at least this many kernels still queued was issued against a full launch
# queue (the measured leads of GPU-bound runs: 770-1,020; of unblocked ones: <= 570). Pipeline-
# parallel runs synchronise at every p2p (their lead sums several syncs): never full.
QUEUE_FULL = 700
# FP8 GEMMs per layer and microbatch: 4 TE linear layers (QKV, projection, FC1, FC2) x fwd, dgrad, wgrad
FP8_GEMMS = 12


def tp_collectives(c: dict) -> int:
    """TP collectives per layer and microbatch the model prices (step_time.layer_host_s)."""
    return (10 if c.get("sequence_parallel") else 4) if c["tp"] > 1 else 0


def threads(kp: dict) -> tuple[dict, dict]:
    """(main thread, autograd thread) of a kernel profile's two busiest host threads: the main
    thread runs the forward and the optimizer step and synchronises; torch's autograd thread runs
    the backward and never does."""
    main = max(kp["host"][:2], key=lambda h: h["sync_ms"])
    return main, next(h for h in kp["host"][:2] if h is not main)


def host_row(r: dict) -> dict | None:
    """One profiled record's host quantities (None without a usable profile)."""
    kp = r.get("kernel_profile") or {}
    if not kp or "error" in kp or len(kp.get("host", [])) < 2:
        return None
    c = r["config"]
    m = c["gbs"] // (c["dp"] * c["mbs"])
    n = r["layers"] // c["pp"] * m
    main, bwd = threads(kp)
    prof = 1000 * kp["overhead"]["profiled_step_s"]
    ann = kp["categories"].get("nccl other", {}).get("count", 0)  # the profiler's NCCL annotations
    device = kp["kernels"] - ann
    cpu = kp.get("host_cpu") or {}

    def os_ms(when, main_too=True):
        d = cpu.get(when) or {}
        ag = [b["ms"] for b in d.get("busiest", []) if b["name"].startswith("pt_autograd")]
        if not ag or d.get("main_thread_ms") is None:
            return None
        return ag[0] + (d["main_thread_ms"] if main_too else 0.0)

    lo = main["issue_ms"] + bwd["issue_ms"]
    hi = os_ms("profiled")
    lead = main["sync_ms"] / prof * device
    return {"id": r["id"], "model": r["model_name"], "precision": c["precision"], "cfg": c, "m": m, "n": n,
            "step_ms": 1000 * r["steps"]["median_s"], "prof_ms": prof, "lo": lo,
            "hi": None if hi is None else hi - main["sync_ms"],
            "launches": main["launches"] + bwd["launches"], "events": main["events"] + bwd["events"],
            "lead": lead, "queue": c["pp"] == 1 and lead >= QUEUE_FULL,
            "busy": kp["gpu"]["compute_stream_busy"], "kernels_per_n": device / n,
            "coll_per_n": (kp["categories"].get("nccl AllGather", {}).get("count", 0)
                           + kp["categories"].get("nccl ReduceScatter", {}).get("count", 0)) / n,
            "bwd_os": (os_ms("measured", False), os_ms("profiled", False))}


def load(path: Path) -> list[dict]:
    rows = (host_row(r) for r in read_jsonl(path) if r.get("status") == "ok")
    return [row for row in rows if row]


def profiler_slowdown(rows: list[dict]) -> float:
    """The profiler's host slow-down: the autograd thread's OS CPU time (that thread never syncs) in
    the profiled steps over the measured ones, summed over `rows` (unblocked runs)."""
    meas = sum(x["bwd_os"][0] or 0.0 for x in rows if None not in x["bwd_os"])
    prof = sum(x["bwd_os"][1] or 0.0 for x in rows if None not in x["bwd_os"])
    return prof / meas if meas > 0 else float("nan")


def measure(rows: list[dict], layers_from: str) -> dict[str, tuple[float, float]]:
    """{constant: (low, high)} in seconds, unprofiled, from the unblocked runs of `layers_from`:
    host_layer_s = issue / N of the BF16 runs; host_fp8_gemm_s = the FP8 - BF16 issue of the same
    layout / (N x 12 FP8 GEMMs); host_collective_s and host_cp_step_s: the extra launches (low) and
    extra CPU-side events (high) a TP collective / a CP ring step adds per layer-microbatch (counted
    on all of the model's profiled layouts: counts do not depend on the queue) x the unblocked runs'
    issue time per launch / per event."""
    own = [x for x in rows if x["model"] == layers_from]
    free = [x for x in own if not x["queue"]]
    bf = [x for x in free if x["precision"] == "bf16"]
    if not bf:
        raise SystemExit(f"error: no {layers_from} run whose launch queue never fills")
    slow = profiler_slowdown(free)
    per = {k: sum(x[k] for x in bf) / sum(x["n"] for x in bf) / 1000 for k in ("lo", "hi")}
    out = {"host_layer_s": (per["lo"] / slow, per["hi"] / slow)}
    pairs = [(b, f) for b in bf for f in free if f["precision"] != "bf16" and _same(b, f)]
    if pairs:
        d = [((f[k] - b[k]) / (b["n"] * FP8_GEMMS) / 1000 for k in ("lo", "hi")) for b, f in pairs]
        lo, hi = (sum(v) / len(pairs) for v in zip(*d))
        out["host_fp8_gemm_s"] = (lo / slow, hi / slow)
    per_launch = sum(x["lo"] for x in bf) / sum(x["launches"] for x in bf) / 1000
    per_event = sum(x["lo"] for x in bf) / sum(x["events"] for x in bf) / 1000
    base = [x for x in own if x["precision"] == "bf16" and x["cfg"]["tp"] == 1 and x["cfg"]["cp"] == 1 and x["cfg"]["pp"] == 1]
    for name, sel, units in (("host_collective_s", lambda c: c["tp"] > 1 and c["cp"] == 1 and c["pp"] == 1,
                              lambda c: tp_collectives(c)),
                             ("host_cp_step_s", lambda c: c["cp"] > 1 and c["tp"] == 1 and c["pp"] == 1,
                              lambda c: c["cp"])):
        runs = [x for x in own if x["precision"] == "bf16" and sel(x["cfg"])]
        if not runs or not base:
            continue
        extra = {}
        for k in ("launches", "events"):
            ref = _per_n(base, k)
            extra[k] = sum((x[k] - ref(x)) / (x["n"] * units(x["cfg"])) for x in runs) / len(runs)
        out[name] = (extra["launches"] * per_launch / slow, extra["events"] * per_event / slow)
    out["_slowdown"] = (slow, slow)
    out["_per_launch_s"] = (per_launch, per_launch)
    out["_per_event_s"] = (per_event, per_event)
    return out


def _same(a: dict, b: dict) -> bool:
    keys = ("tp", "pp", "vp", "cp", "ep", "dp", "mbs", "gbs", "seq", "sequence_parallel", "recompute")
    return a["model"] == b["model"] and all(a["cfg"].get(k) == b["cfg"].get(k) for k in keys)


def _per_n(base: list[dict], key: str):
    """count(x) of a layout without TP / CP: a per-step part and a per-layer-microbatch part fitted
    on the plain data-parallel runs (least squares over N), evaluated at x's N."""
    ns = [x["n"] for x in base]
    ys = [x[key] for x in base]
    if len(set(ns)) < 2:
        return lambda x: ys[0] / ns[0] * x["n"]
    k = len(ns)
    mn, my = sum(ns) / k, sum(ys) / k
    slope = sum((a - mn) * (b - my) for a, b in zip(ns, ys)) / sum((a - mn) ** 2 for a in ns)
    return lambda x: my + slope * (x["n"] - mn)


def check(rows: list[dict], costs: dict[str, tuple[float, float]], model: str = "gpt3-2.7b") -> list[str]:
    """`model`'s profiled runs: host issue predicted with `costs` (profiled: x the slow-down), the
    step max(host, GPU work) and the compute stream's busy fraction, against the profile."""
    slow = costs["_slowdown"][0]
    out = []
    for x in (x for x in rows if x["model"] == model):
        c = x["cfg"]
        per = {}
        for end, at in (("low", lambda v: v[0]), ("centre", lambda v: (v[0] + v[1]) / 2), ("high", lambda v: v[1])):
            h = at(costs["host_layer_s"]) + tp_collectives(c) * at(costs.get("host_collective_s", (0, 0)))
            h += (c["cp"] * at(costs.get("host_cp_step_s", (0, 0))) if c["cp"] > 1 else 0.0)
            h += (FP8_GEMMS * at(costs.get("host_fp8_gemm_s", (0, 0))) if x["precision"] != "bf16" else 0.0)
            per[end] = x["n"] * h * 1000 * slow  # ms per step, under the profiler
        gpu = x["busy"] * x["prof_ms"]  # the compute stream's busy ms per profiled step
        step = {k: max(v, gpu) for k, v in per.items()}
        out.append(f"  {x['id']:<14} {_layout(c):<22} host issue {x['lo']:4.0f}-{x['hi'] or 0:4.0f} ms, predicted "
                   f"{per['centre']:4.0f} ({per['low']:4.0f}-{per['high']:4.0f}); profiled step {x['prof_ms']:4.0f} ms, "
                   f"predicted {step['centre']:4.0f} ({step['centre'] / x['prof_ms'] - 1:+.1%}); compute stream idle "
                   f"{1 - x['busy']:.2f}, predicted {1 - gpu / step['centre']:.2f} ({1 - gpu / step['low']:.2f}-"
                   f"{1 - gpu / step['high']:.2f}); unprofiled host {per['centre'] / slow:4.0f} ms vs measured step "
                   f"{x['step_ms']:4.0f} ms")
    return out


def moe_launches(path: Path) -> list[str]:
    """Kernel launches per layer-microbatch of the profiled TE MoE runs, by least squares over their
    structure: a MoE layer's fixed count, per local expert (TE's GroupedLinear issues each expert's
    GEMMs and their bookkeeping), per local expert under FP8 (each expert's quantization), FP8's
    and TP's fixed counts, and a per-step count (optimizer, gradient reduction) spread over the
    stage's N layer-microbatches; against the dense runs' launches per layer-microbatch. The MoE
    host issue constants' ranges (models/moe.py MOE_TE_FIT) are these counts x a launch's host time."""
    import numpy as np

    from advisor.models.dataset import load as load_records

    recs = {r.id: r for r in load_records([str(path)]).records}
    X, y, names, dense = [], [], [], []
    for r in read_jsonl(path):
        x = host_row(r) if r.get("status") == "ok" else None
        rec = recs.get(r["id"])
        if x is None or rec is None:
            continue
        if not rec.model.is_moe:
            dense.append(x["launches"] / x["n"])
            continue
        c, m = rec.cfg, rec.model
        e_loc = m.moe.num_experts / c.ep
        moe_share = sum(m.is_moe_layer(i) for i in range(m.num_layers)) / m.num_layers
        fp8 = float(c.precision != "bf16")
        X.append([moe_share, moe_share * e_loc, moe_share * e_loc * fp8, fp8, float(c.tp > 1), 1.0 / x["n"]])
        y.append(x["launches"] / x["n"])
        names.append(x["id"])
    if len(y) <= 6:  # fewer runs than the fit's 6 counts + 1
        return ["  (too few profiled MoE runs)"]
    b, *_ = np.linalg.lstsq(np.array(X), np.array(y), rcond=None)
    res = np.array(X) @ b - np.array(y)
    d = float(np.median(dense)) if dense else float("nan")
    return [f"  {len(y)} profiled MoE runs: launches per layer-microbatch = {b[0]:.0f} per MoE layer + {b[1]:.1f} "
            f"per local expert + {b[2]:.1f} per local expert under FP8 + {b[3]:.0f} under FP8 + {b[4]:.0f} with TP "
            f"+ {b[5]:.0f} per step / N (residuals {np.abs(res).max():.0f} at most)",
            f"  a dense layer: median {d:.0f} launches per layer-microbatch over {len(dense)} profiled dense runs; "
            f"a MoE layer's fixed launches beyond it: {b[0] - d:.0f}"]


def _layout(c: dict) -> str:
    return (" ".join(f"{k}{c[k]}" for k in ("tp", "pp", "cp", "ep", "dp") if c.get(k, 1) > 1 or k == "dp")
            + f" mbs{c['mbs']}" + (" sp" if c.get("sequence_parallel") else "") + f" {c['precision']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="?", default=str(RUNS))
    ap.add_argument("--layers-from", default="llama3-8b", help="model whose unblocked runs measure the costs")
    a = ap.parse_args(argv)
    if not Path(a.runs).is_file():
        print(f"error: no such file: {a.runs}", file=sys.stderr)
        return 2
    rows = load(Path(a.runs))
    if not rows:
        print(f"error: no record with a kernel profile in {a.runs}", file=sys.stderr)
        return 2
    print(f"{'run':<14} {'layout':<26} {'m':>2} {'N':>4} {'step ms':>13} {'issue lo-hi ms':>14} {'/N ms':>11} "
          f"{'us/launch':>9} {'us/event':>8} {'lead':>5} {'queue':>5} {'busy':>5} {'kern/N':>6} {'TPcoll/N':>8}")
    for x in rows:
        hi = x["hi"] if x["hi"] is not None else float("nan")
        print(f"{x['id']:<14} {_layout(x['cfg']):<26} {x['m']:>2} {x['n']:>4} {x['step_ms']:>6.0f}/{x['prof_ms']:<6.0f} "
              f"{x['lo']:>6.0f}-{hi:<7.0f} {x['lo'] / x['n']:>5.2f}-{hi / x['n']:<5.2f} "
              f"{1000 * x['lo'] / x['launches']:>9.0f} {1000 * x['lo'] / x['events']:>8.1f} {x['lead']:>5.0f} "
              f"{'full' if x['queue'] else '-':>5} {x['busy']:>5.2f} {x['kernels_per_n']:>6.1f} {x['coll_per_n']:>8.2f}")
    costs = measure(rows, a.layers_from)
    print(f"\nhost costs measured on {a.layers_from}'s runs whose launch queue never fills (unprofiled: / the "
          f"profiler's host slow-down {costs['_slowdown'][0]:.2f}; per launch {costs['_per_launch_s'][0] * 1e6:.0f} us, "
          f"per CPU event {costs['_per_event_s'][0] * 1e6:.1f} us, profiled):")
    for k, (lo, hi) in costs.items():
        if not k.startswith("_"):
            print(f"  {k:<18} {lo * 1e6:7.0f} .. {hi * 1e6:7.0f} us   centre {(lo + hi) / 2 * 1e6:7.0f} us, "
                  f"sd {(hi - lo) / 2 * 1e6:6.0f} us")
    print("\ncheck on GPT-3 2.7B (not used above), under the profiler:")
    print("\n".join(check(rows, costs)))
    print("\nMoE layers' kernel launches (the structure of moe_layer_host_s / moe_grouped_expert_host_s / "
          "moe_fp8_expert_host_s):")
    print("\n".join(moe_launches(Path(a.runs))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
