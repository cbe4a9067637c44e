"""The experts phase's kernels alone, on one GPU: Transformer Engine's GroupedLinear (what
megatron-core's TEGroupedMLP runs) as fc1 -> SwiGLU -> fc2, forward + backward, over the expert
shapes of the MoE models the advisor plans (h x f), the tokens per expert n and the local experts
E_loc, in BF16 and FP8 (delayed scaling, HYBRID, amax history 1024, as the runner's te stack).

    python bench/grouped_gemm_rates.py --out DIR [--quick]     # on a GPU with TE; ~5 minutes
    python bench/grouped_gemm_rates.py --list                   # the grid, no GPU
    python bench/grouped_gemm_rates.py --check [FILE.jsonl]     # the model against them, CPU

--check (default file data/microbench/h200x1-grouped-gemm.jsonl) prices each point two ways at the
te profile's constants for the GPU it ran on, at the clock the point held (dvfs.compute_stretch),
both with the phase's memory-bound passes as models/moe.py prices them (the activation's
moe_expert_elementwise_passes and the weight gradients' accumulation, grad_accum_bytes_per_param):

  shipped    models/moe.py's rate model: the dense GEMM rate at moe_gemm_reference_tokens rows x
             grouped_gemm_fraction(n) x expert_width_fraction(f) (moe_gemm_half_tokens /
             moe_gemm_half_ffn, fitted end to end on published rows and our runs);
  per-shape  each expert's six GEMMs (fc1, fc2, their dgrads and wgrads) at their own shape through
             the dense GEMM model (step_time.gemm_time: shape factors, HBM-bound weight reads),
             plus a fixed GPU time per GEMM call, fitted here on the BF16 points (2-15 us) and
             reported leaving each expert shape out.

against gpu_ms (BF16) and, for FP8, the GEMM kernels alone against the GEMM part (the model prices
FP8's casts with the other linear layers').

Writes DIR/grouped_gemm_rates.jsonl, one line per point with the environment (GPU, TE, torch).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# (label, h, f): the expert shapes (per ETP rank) of the catalog's MoE models and the runner's proxies
SHAPES = [
    ("qwen3-30b-a3b", 2048, 768),
    ("olmoe-1b-7b", 2048, 1024),
    ("deepseek-v2-lite", 2048, 1408),
    ("qwen3-235b-a22b", 4096, 1536),
    ("gpt-oss-120b", 2880, 2880),
    ("deepseek-v3", 7168, 2048),
    ("mixtral-8x7b-etp4", 4096, 3584),
    ("mixtral-8x7b", 4096, 14336),
    ("mixtral-8x22b", 6144, 16384),
]
TOKENS = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
LOCAL_EXPERTS = [4, 32]
FP8_TOKENS = {512, 2048, 8192}
MAX_GFLOP = 40_000.0        # per iteration: keeps a point under ~0.1 s
MAX_ACT_GIB = 40.0          # activations + weights + grads, a rough bound


def flops(e_loc: int, n: int, h: int, f: int) -> float:
    return 3 * 2.0 * e_loc * n * (h * 2 * f + f * h)


def grid(quick: bool = False) -> list[dict]:
    pts = []
    for label, h, f in SHAPES:
        for e in LOCAL_EXPERTS:
            for n in TOKENS:
                if quick and n not in (512, 4096):
                    continue
                t = e * n
                gib = (2.0 * t * (2 * h + 3 * f) * 2 + 4.0 * e * 3 * h * f * 2) / 2**30
                if flops(e, n, h, f) / 1e9 > MAX_GFLOP or gib > MAX_ACT_GIB:
                    continue
                for prec in ("bf16", "fp8"):
                    if prec == "fp8" and n not in FP8_TOKENS:
                        continue
                    pts.append({"shape": label, "h": h, "f": f, "e_loc": e, "n": n, "precision": prec})
    return pts


def expert_gemms_s(n: float, h: float, f: float, mats: int, gemm) -> float:
    """Seconds of one expert's six GEMMs for n tokens, forward and backward, each at its own shape
    through `gemm(m, k, n) -> (seconds, fraction)`: fc1 (n x h x mats·f), fc2 (n x f x h), their
    dgrads (n x mats·f x h, n x h x f) and wgrads (h x n x mats·f, f x n x h)."""
    return sum(gemm(*d)[0] for d in ((n, h, mats * f), (n, f, h), (n, mats * f, h), (n, h, f),
                                     (h, n, mats * f), (f, n, h)))


def _gemm(r: dict, c):
    from advisor.catalog.loaders import load_gpu
    from advisor.catalog.specs import QUANTS
    from advisor.models.quant import quant
    from advisor.models.step_time import gemm_time

    gpu = load_gpu(r["gpu_key"])
    hbm = gpu.hbm_bandwidth_gbs * 1e9
    q = quant(gpu, QUANTS.index(r["precision"]), c) if r["precision"] != "bf16" else None

    def gemm(m, k, n):
        if q is not None:
            return gemm_time(m, k, n, q.peak_flops, hbm, c, q.efficiency, in_bytes=q.in_bytes, half_dim=q.half_dim)
        return gemm_time(m, k, n, gpu.bf16_tflops * 1e12, hbm, c, c.gemm_efficiency_max)
    return gemm, hbm


def phase_mem_s(r: dict, c) -> float:
    """The experts phase's memory-bound seconds as models/moe.py prices them: the activation's HBM
    passes over the routed n x f elements and each expert weight's gradient accumulation."""
    _, hbm = _gemm(r, c)
    h, f, n, e = r["h"], r["f"], r["n"], r["e_loc"]
    return (c.moe_expert_elementwise_passes * e * n * f * c.bytes_activation
            + e * 3 * h * f * c.grad_accum_bytes_per_param) / (hbm * c.hbm_efficiency)


def per_shape_s(r: dict, c, call_s: float) -> float:
    """The GEMM part at the maximum clock, per-shape form: E_loc x (six GEMMs + 6 calls' fixed time)."""
    gemm, _ = _gemm(r, c)
    return r["e_loc"] * (expert_gemms_s(r["n"], r["h"], r["f"], 2, gemm) + 6 * call_s)


def shipped_s(r: dict, c) -> float:
    """The GEMM part at the maximum clock as models/moe.py's rate model prices it (imbalance 1)."""
    from advisor.models import moe as MOE

    gemm, _ = _gemm(r, c)
    ref = c.moe_gemm_reference_tokens
    h, f, n = r["h"], r["f"], r["n"]
    per_token = (gemm(ref, h, 2 * f)[0] + gemm(ref, f, h)[0]) / ref
    frac = MOE.grouped_gemm_fraction(n, c) * MOE.expert_width_fraction(f, c)
    return 3 * per_token * n * r["e_loc"] / (frac * c.moe_gemm_efficiency)


def load_points(path: Path) -> tuple[list[dict], dict]:
    """The measured points (errors left out), each with its GPU's catalog key and the DVFS stretch of
    the clock it held, and the te profile's constants per GPU (the MoE settings of the TE stack)."""
    from advisor.catalog.loaders import load_gpu
    from advisor.models import moe as MOE
    from advisor.models.calibrate import resolve_calibration
    from advisor.models.dvfs import compute_stretch

    rows = [json.loads(x) for x in path.open() if x.strip()]
    rows = [r for r in rows if "error" not in r]
    consts = {}
    for r in rows:
        r["gpu_key"] = load_gpu(r["env"]["gpu"]).name
        if r["gpu_key"] not in consts:
            consts[r["gpu_key"]] = MOE.te_moe_constants(
                resolve_calibration("default", "te", gpu=load_gpu(r["gpu_key"])).constants)
        r["stretch"] = compute_stretch(min(1.0, (r["sm_mhz"] or r["max_sm_mhz"]) / r["max_sm_mhz"]),
                                       consts[r["gpu_key"]])
    return rows, consts


def predicted_ms(r: dict, c, call_s: float | None) -> float:
    """The model's ms for point r, comparable to measured_ms(r): per-shape form with call_s, or the
    shipped rate model where call_s is None."""
    g = shipped_s(r, c) if call_s is None else per_shape_s(r, c, call_s)
    return (g * r["stretch"] + (phase_mem_s(r, c) if r["precision"] == "bf16" else 0.0)) * 1e3


def measured_ms(r: dict) -> float:
    return r["gpu_ms"] if r["precision"] == "bf16" else r["gemm_ms"]


def fit_call_s(rows: list[dict], consts: dict) -> float:
    """The per-call fixed time (s) of the per-shape form by least squares on log time (2-15 us)."""
    import math

    from scipy.optimize import minimize_scalar

    res = minimize_scalar(lambda t: sum(math.log(predicted_ms(r, consts[r["gpu_key"]], t * 1e-6) / measured_ms(r)) ** 2
                                        for r in rows), bounds=(2.0, 15.0), method="bounded")
    return float(res.x) * 1e-6


def check(path: Path) -> int:
    import numpy as np

    rows, consts = load_points(path)
    bf = [r for r in rows if r["precision"] == "bf16"]
    fp = [r for r in rows if r["precision"] != "bf16"]

    def err(r, call_s):
        return predicted_ms(r, consts[r["gpu_key"]], call_s) / measured_ms(r) - 1

    def mape(rs, call_s):
        return 100 * float(np.mean([abs(err(r, call_s)) for r in rs])) if rs else float("nan")

    t_all = fit_call_s(bf, consts)
    print(f"{len(rows)} points ({len(bf)} BF16, {len(fp)} FP8); per-call time fitted on the BF16 ones: {t_all * 1e6:.2f} us")
    print(f"{'shape':18} {'h':>5} {'f':>6} {'E':>3} {'n':>6} prec  measured ms  per-shape error  shipped ms error")
    for r in rows:
        c = consts[r["gpu_key"]]
        p, o, y = predicted_ms(r, c, t_all), predicted_ms(r, c, None), measured_ms(r)
        print(f"{r['shape']:18} {r['h']:>5} {r['f']:>6} {r['e_loc']:>3} {r['n']:>6} {r['precision']:4} "
              f"{y:10.3f} {p:9.3f} {p / y - 1:+6.0%} {o:9.3f} {o / y - 1:+6.0%}")
    print(f"\nMAPE          per-shape   shipped rate model (median error)")
    for name, rs in (("BF16 phase", bf), ("BF16 n<1024", [r for r in bf if r["n"] < 1024]),
                     ("BF16 n>=1024", [r for r in bf if r["n"] >= 1024]),
                     ("BF16 f<=1536", [r for r in bf if r["f"] <= 1536]), ("FP8 GEMMs", fp)):
        med = float(np.median([err(r, None) for r in rs])) if rs else float("nan")
        print(f"  {name:13} {mape(rs, t_all):7.1f}%   {mape(rs, None):7.1f}% ({med:+.0%})")
    print("per-shape form, each expert shape left out of the per-call fit (BF16):")
    held_errs = []
    for shape in dict.fromkeys(r["shape"] for r in bf):
        held = [r for r in bf if r["shape"] == shape]
        t = fit_call_s([r for r in bf if r["shape"] != shape], consts)
        held_errs += [abs(err(r, t)) for r in held]
        print(f"  {shape:18} {len(held):3} points  call {t * 1e6:5.2f} us  MAPE {mape(held, t):5.1f}%")
    print(f"  all held out: MAPE {100 * float(np.mean(held_errs)):.1f}% over {len(held_errs)} points")
    return 0


def grid_bias() -> list[dict]:
    """gpt-oss's experts carry biases (GroupedLinear bias=True: a bias add forward and a bias-gradient
    reduction per expert backward): its shape with and without them, BF16, 4 / 32 local experts."""
    pts = []
    for e in LOCAL_EXPERTS:
        for n in (512, 2048, 8192):
            for bias in (False, True):
                pts.append({"shape": "gpt-oss-120b", "h": 2880, "f": 2880, "e_loc": e, "n": n,
                            "precision": "bf16", "bias": bias})
    return pts


def measure(torch, te, pt: dict, clock, recipe) -> dict:
    from kernel_rates import reps_for, timed_us

    from advisor.runners.kernel_probe import run_profiled, summarize

    dev = torch.device("cuda:0")
    e, n, h, f = pt["e_loc"], pt["n"], pt["h"], pt["f"]
    bias = bool(pt.get("bias", False))
    fc1 = te.GroupedLinear(e, h, 2 * f, bias=bias, params_dtype=torch.bfloat16, device=dev)
    fc2 = te.GroupedLinear(e, f, h, bias=bias, params_dtype=torch.bfloat16, device=dev)
    x = torch.randn(e * n, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(e * n, h, device=dev, dtype=torch.bfloat16)
    splits = [n] * e
    fp8 = pt["precision"] == "fp8"

    def it():
        with te.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
            y = fc1(x, splits)
            a, b = y.chunk(2, dim=-1)
            z = fc2(torch.nn.functional.silu(a) * b, splits)
        z.backward(g)

    reps = reps_for(torch, it, 0.25, lo=4, hi=200, warmup=3)
    time.sleep(0.15)
    with clock:
        wall_ms = timed_us(torch, it, reps=reps, warmup=0) / 1e3
    events, walls, _ = run_profiled(it, 3, torch.cuda.synchronize)
    s = summarize(events, 3, walls)
    gemm_ms = sum(v["ms"] for k, v in s["categories"].items() if k.startswith("gemm"))
    main = s["host"][0] if s["host"] else {}
    out = dict(pt)
    out.update(
        flops=flops(e, n, h, f), reps=reps, wall_ms=round(wall_ms, 4),
        gpu_ms=round((s["gpu"]["any_busy"] or 0.0) * sum(walls) * 1000 / 3, 4),
        gemm_ms=round(gemm_ms, 4), host_ms=main.get("issue_ms"), launches=main.get("launches"),
        categories=s["categories"], sm_mhz=statistics.median(clock.samples) if clock.samples else None,
        max_sm_mhz=clock.max_mhz,
    )
    out["tflops_wall"] = round(out["flops"] / wall_ms / 1e9, 2)
    out["tflops_gemm"] = round(out["flops"] / gemm_ms / 1e9, 2) if gemm_ms > 0 else None
    del fc1, fc2, x, g
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="two token counts per shape")
    ap.add_argument("--list", action="store_true", help="print the grid and exit")
    ap.add_argument("--bias", action="store_true", help="the gpt-oss shape with and without expert biases "
                    "(grid_bias), into grouped_gemm_rates_bias.jsonl")
    ap.add_argument("--check", nargs="?", const=str(ROOT / "data/microbench/h200x1-grouped-gemm.jsonl"),
                    help="the model against the measured points (CPU)")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds; the points left are skipped")
    a = ap.parse_args(argv)
    if a.check:
        return check(Path(a.check))
    pts = grid_bias() if a.bias else grid(a.quick)
    if a.list or not a.out:
        for p in pts:
            print(p)
        print(f"{len(pts)} points")
        return 0 if a.list else 2
    import torch
    import transformer_engine
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    from kernel_rates import ClockSampler

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "transformer_engine": getattr(transformer_engine, "__version__", None)}
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=1024, amax_compute_algo="max")
    clock = ClockSampler()
    start = time.time()
    path = out / ("grouped_gemm_rates_bias.jsonl" if a.bias else "grouped_gemm_rates.jsonl")
    done = 0
    with path.open("a") as fh:
        for p in pts:
            if time.time() - start > a.budget:
                print(f"budget: {len(pts) - done} points left", flush=True)
                break
            try:
                r = measure(torch, te, p, clock, recipe)
            except Exception as ex:  # noqa: BLE001 - recorded, the grid goes on
                r = dict(p, error=f"{type(ex).__name__}: {str(ex)[:300]}")
            r["env"] = env
            fh.write(json.dumps(r) + "\n")
            fh.flush()
            done += 1
            torch.cuda.empty_cache()
            if "error" in r:
                print(f"{p} ERROR {r['error']}", flush=True)
            else:
                print(f"{p['shape']:18} E{p['e_loc']:<3} n{p['n']:<6} {p['precision']:4}{' bias' if p.get('bias') else ''} wall {r['wall_ms']:8.3f} "
                      f"gpu {r['gpu_ms']:8.3f} gemm {r['gemm_ms']:8.3f} host {r['host_ms']} ms "
                      f"{r['tflops_wall']:7.1f}/{r['tflops_gemm']} TF/s {r['sm_mhz']} MHz", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
