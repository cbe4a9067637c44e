"""Load sweep for the DVFS model (models/dvfs.py): many clock / power points on one GPU at its
default power limit, without changing any GPU setting.

    python bench/dvfs_sweep.py --out DIR            # on a GPU (torch + NVML), ~4 minutes
    python bench/dvfs_sweep.py --out DIR --fake     # CPU rehearsal: numpy loads, FakeBackend

Loads, each in its own telemetry window (NVML at 50 Hz, the energy counter read at every window
boundary), with a 1.5 s idle gap after each:
  idle                      the GPU awake with a CUDA context and nothing to do
  gemm-N                    square bf16 GEMMs N = 256 ... 16384 (CUDA graphs, back to back)
  shape-*                   non-square transformer GEMM shapes, fp8 8192^3, flash attention
  mem-*                     memory-bound kernels: copy, add, a chain of elementwise ops
  duty-P-D                  gemm-8192 bursts of period P s at duty D, idle between bursts: the
                            clock each burst runs at (its own TFLOP/s) and the power limiter's
                            reaction time
  mix-F                     gemm-8192 and copy alternating (GEMM share of time F): each group
                            timed with CUDA events, so the memory-bound kernel's time at the
                            clock the cap holds is measured
Besides: `nvidia-smi -q -d POWER,CLOCK,PERFORMANCE` before and after (min / max power limit,
read only), and `nvidia-smi -q -d VOLTAGE,CLOCK -lms 250` in the background (the graphics
voltage where the driver reports one).

Writes DIR/dvfs_sweep.jsonl (one line per load: what ran, FLOPs, bytes, GPU seconds, and the
window's telemetry summary), DIR/dvfs_sweep.trace.json.gz (every sample, with the windows and
the burst / group timings), DIR/nvidia-smi-*.txt and DIR/log.txt.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path


# ------------------------------------------------------------------------------------- devices
class TorchDev:
    """Loads on CUDA, captured in CUDA graphs so that launch overhead does not limit small kernels."""

    name = "cuda"

    def __init__(self):
        import torch

        self.torch = torch
        self.dev = torch.device("cuda:0")
        torch.backends.cuda.matmul.allow_tf32 = False

    def sync(self):
        self.torch.cuda.synchronize()

    def event(self):
        e = self.torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    @staticmethod
    def elapsed(a, b) -> float:
        return a.elapsed_time(b) / 1e3

    def graph(self, fn, reps: int):
        torch = self.torch
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        return g.replay

    def gemm(self, m: int, k: int, n: int):
        t = self.torch
        a = t.randn(m, k, dtype=t.bfloat16, device=self.dev)
        b = t.randn(k, n, dtype=t.bfloat16, device=self.dev)
        c = t.empty(m, n, dtype=t.bfloat16, device=self.dev)
        return (lambda: t.matmul(a, b, out=c)), 2.0 * m * k * n, 2.0 * (m * k + k * n + m * n)

    def gemm_fp8(self, n: int):
        t = self.torch
        a = t.randn(n, n, device=self.dev).to(t.float8_e4m3fn)
        b = t.randn(n, n, device=self.dev).to(t.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
        one = t.ones((), device=self.dev)
        fn = lambda: t._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=t.bfloat16)  # noqa: E731
        fn()
        return fn, 2.0 * n**3, 4.0 * n * n

    def attention(self, batch: int, heads: int, seq: int, dim: int):
        t = self.torch
        q, k, v = (t.randn(batch, heads, seq, dim, dtype=t.bfloat16, device=self.dev) for _ in range(3))
        fn = lambda: t.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        return fn, 2.0 * batch * heads * seq * seq * dim, 4.0 * 2 * batch * heads * seq * dim  # causal: half of 4·B·H·S²·D

    def memory(self, kind: str, nbytes: int):
        t = self.torch
        n = nbytes // 2
        x = t.randn(n, dtype=t.bfloat16, device=self.dev)
        y = t.randn(n, dtype=t.bfloat16, device=self.dev)
        z = t.empty_like(x)
        if kind == "copy":
            return (lambda: y.copy_(x)), 0.0, 2.0 * nbytes
        if kind == "add":
            return (lambda: t.add(x, y, out=z)), float(n), 3.0 * nbytes
        # an elementwise chain: four passes (read + write each), a few FLOPs per element
        def chain():
            t.mul(x, 1.0001, out=z)
            t.add(z, y, out=z)
            t.sigmoid(z, out=z)
            t.mul(z, y, out=z)
        return chain, 8.0 * n, 10.0 * nbytes  # passes: 2 + 3 + 2 + 3


class FakeDev:
    """numpy stand-ins with the same interface (CPU rehearsal of the script only)."""

    name = "fake"

    def __init__(self):
        import numpy as np

        self.np = np

    def sync(self):
        pass

    def event(self):
        return time.perf_counter()

    @staticmethod
    def elapsed(a, b) -> float:
        return b - a

    def graph(self, fn, reps: int):
        def run():
            for _ in range(reps):
                fn()
        return run

    def gemm(self, m: int, k: int, n: int):
        np = self.np
        s = 1 / 64  # tiny shapes: only the code path is rehearsed
        m, k, n = (max(2, int(v * s)) for v in (m, k, n))
        a, b = np.ones((m, k), np.float32), np.ones((k, n), np.float32)
        return (lambda: a @ b), 2.0 * m * k * n, 2.0 * (m * k + k * n + m * n)

    def gemm_fp8(self, n: int):
        raise RuntimeError("fp8 needs a GPU")

    def attention(self, batch, heads, seq, dim):
        return self.gemm(seq, dim, seq)

    def memory(self, kind: str, nbytes: int):
        np = self.np
        x = np.ones(max(1024, nbytes // 4096), np.float32)
        y = x.copy()
        return (lambda: np.copyto(y, x)), 0.0, 2.0 * x.nbytes


# --------------------------------------------------------------------------------------- loads
def calibrate(dev, fn, target_s: float) -> tuple[int, float]:
    """Kernel repetitions per graph replay so that one replay takes ~target_s; kernel seconds."""
    for _ in range(3):
        fn()
    dev.sync()
    a = dev.event()
    for _ in range(5):
        fn()
    b = dev.event()
    dev.sync()
    t = max(dev.elapsed(a, b) / 5, 1e-7)
    return max(1, min(4096, round(target_s / t))), t


def run_steady(dev, replay, seconds: float, sync_every_s: float = 0.05, per_replay_s: float = 0.01):
    """Replays back to back for `seconds` of wall time; (replays, GPU seconds)."""
    every = max(1, round(sync_every_s / max(per_replay_s, 1e-6)))
    a = dev.event()
    n = 0
    t_end = time.time() + seconds
    while time.time() < t_end:
        for _ in range(every):
            replay()
        n += every
        dev.sync()
    b = dev.event()
    dev.sync()
    return n, dev.elapsed(a, b)


def run_duty(dev, replay, per_replay_s: float, seconds: float, period: float, duty: float):
    """Bursts of `duty`·`period` of replays, then idle; per burst (t_on, t_off, replays, GPU s)."""
    bursts = []
    t_end = time.time() + seconds
    on = duty * period
    k = max(1, round(on / max(per_replay_s, 1e-6)))
    while time.time() < t_end:
        t0 = time.time()
        a = dev.event()
        for _ in range(k):
            replay()
        b = dev.event()
        dev.sync()
        t1 = time.time()
        bursts.append([t0, t1, k, dev.elapsed(a, b)])
        rest = period - (t1 - t0)
        if rest > 0:
            time.sleep(rest)
    return bursts


def run_mix(dev, g_replay, m_replay, seconds: float, kg: int, km: int):
    """Alternating groups: kg GEMM replays then km memory replays, each timed by events."""
    groups = []
    t_end = time.time() + seconds
    while time.time() < t_end:
        pending = []
        for _ in range(8):
            e0 = dev.event()
            for _ in range(kg):
                g_replay()
            e1 = dev.event()
            for _ in range(km):
                m_replay()
            e2 = dev.event()
            pending.append((time.time(), e0, e1, e2))
        dev.sync()
        for t, e0, e1, e2 in pending:
            groups.append([t, dev.elapsed(e0, e1), dev.elapsed(e1, e2)])
    return groups


# ------------------------------------------------------------------------------------ the sweep
def plan(scale: float) -> list[dict]:
    s = lambda x: x * scale  # noqa: E731
    loads = [{"name": "idle", "kind": "idle", "seconds": s(6)}]
    for n in (256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384):
        loads.append({"name": f"gemm-{n}", "kind": "gemm", "shape": [n, n, n], "seconds": s(5)})
    for name, shape in (("shape-ffn-up", [8192, 4096, 28672]), ("shape-ffn-down", [8192, 14336, 4096]),
                        ("shape-qkv", [8192, 4096, 6144]), ("shape-wide-k", [2048, 16384, 2048]),
                        ("shape-skinny", [32768, 1024, 4096])):
        loads.append({"name": name, "kind": "gemm", "shape": shape, "seconds": s(5)})
    loads.append({"name": "shape-fp8-8192", "kind": "fp8", "n": 8192, "seconds": s(5)})
    loads.append({"name": "shape-attention", "kind": "attention", "dims": [2, 32, 4096, 128], "seconds": s(5)})
    for kind in ("copy", "add", "chain"):
        loads.append({"name": f"mem-{kind}", "kind": "memory", "op": kind, "nbytes": 2**30, "seconds": s(5)})
    for period, duty in ((0.02, 0.5), (0.1, 0.5), (0.5, 0.5), (2.0, 0.5), (0.1, 0.25), (0.1, 0.75)):
        loads.append({"name": f"duty-{period:g}-{duty:g}", "kind": "duty", "period": period, "duty": duty,
                      "seconds": s(6)})
    for frac in (0.8, 0.5, 0.2):
        loads.append({"name": f"mix-{frac:g}", "kind": "mix", "gemm_share": frac, "seconds": s(6)})
    loads.append({"name": "idle-end", "kind": "idle", "seconds": s(5)})
    return loads


def _clean(o):
    """JSON-safe: NaN / inf -> None, tuples -> lists."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def nvsmi(args: list[str], out: Path) -> None:
    try:
        r = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30)
        out.write_text(r.stdout + r.stderr)
    except (OSError, subprocess.SubprocessError) as e:
        out.write_text(f"nvidia-smi {' '.join(args)}: {type(e).__name__}: {e}\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--fake", action="store_true", help="CPU rehearsal: numpy loads, FakeBackend")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every load's duration")
    ap.add_argument("--rate", type=float, default=50.0, help="telemetry samples per second")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "log.txt", "w")

    def log(msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    from advisor.runners.telemetry import FakeBackend, Sampler, open_backend

    backend = FakeBackend(1) if a.fake else open_backend("nvml")
    dev = FakeDev() if a.fake else TorchDev()
    vproc = None
    if not a.fake:
        nvsmi(["-q", "-d", "POWER,CLOCK,PERFORMANCE,TEMPERATURE"], out / "nvidia-smi-before.txt")
        nvsmi(["--query-gpu=name,uuid,pci.bus_id,power.limit,power.default_limit,power.min_limit,"
               "power.max_limit,clocks.max.sm,clocks.max.mem,temperature.gpu", "--format=csv"],
              out / "nvidia-smi-query.txt")
        vproc = subprocess.Popen(["nvidia-smi", "-q", "-d", "VOLTAGE,CLOCK", "-lms", "250"],
                                 stdout=open(out / "nvidia-smi-voltage.txt", "w"), stderr=subprocess.STDOUT)
    sampler = Sampler(backend, rate_hz=a.rate, counter_rate_hz=5.0).start()
    rows, extra = [], {}
    t_begin = time.time()
    try:
        g8 = dev.gemm(8192, 8192, 8192)
        g8_reps, g8_t = calibrate(dev, g8[0], 0.003)
        g8_replay = dev.graph(g8[0], g8_reps)
        cp = dev.memory("copy", 2**30)
        cp_reps, cp_t = calibrate(dev, cp[0], 0.003)
        cp_replay = dev.graph(cp[0], cp_reps)
        for load in plan(a.scale):
            name, kind, secs = load["name"], load["kind"], load["seconds"]
            row = dict(load)
            try:
                if kind == "idle":
                    sampler.begin_window(name)
                    time.sleep(secs)
                    summ = sampler.end_window(name)
                elif kind in ("gemm", "fp8", "attention", "memory"):
                    if kind == "gemm":
                        fn, flops, nbytes = dev.gemm(*load["shape"])
                    elif kind == "fp8":
                        fn, flops, nbytes = dev.gemm_fp8(load["n"])
                    elif kind == "attention":
                        fn, flops, nbytes = dev.attention(*load["dims"])
                    else:
                        fn, flops, nbytes = dev.memory(load["op"], load["nbytes"])
                    reps, t_kernel = calibrate(dev, fn, 0.02)
                    replay = dev.graph(fn, reps)
                    sampler.begin_window(name)
                    n, gpu_s = run_steady(dev, replay, secs, per_replay_s=reps * t_kernel)
                    summ = sampler.end_window(name)
                    row.update(kernels=n * reps, flops=flops * n * reps, bytes=nbytes * n * reps, gpu_s=gpu_s,
                               kernel_s_first=t_kernel)
                    if load.get("op") == "chain":
                        row["chain_passes"] = 10
                elif kind == "duty":
                    sampler.begin_window(name)
                    bursts = run_duty(dev, g8_replay, g8_reps * g8_t, secs, load["period"], load["duty"])
                    summ = sampler.end_window(name)
                    row.update(kernels=sum(b[2] for b in bursts) * g8_reps, flops=g8[1] * g8_reps * sum(b[2] for b in bursts),
                               gpu_s=sum(b[3] for b in bursts), bursts=len(bursts))
                    extra[name] = {"bursts": bursts, "flops_per_replay": g8[1] * g8_reps}
                elif kind == "mix":
                    f = load["gemm_share"]
                    group_s = 0.03
                    kg = max(1, round(f * group_s / (g8_reps * g8_t)))
                    km = max(1, round((1 - f) * group_s / (cp_reps * cp_t)))
                    sampler.begin_window(name)
                    groups = run_mix(dev, g8_replay, cp_replay, secs, kg, km)
                    summ = sampler.end_window(name)
                    row.update(gemm_replays=kg, copy_replays=km, groups=len(groups),
                               flops=g8[1] * g8_reps * kg * len(groups), bytes=cp[2] * cp_reps * km * len(groups),
                               gemm_gpu_s=sum(g[1] for g in groups), copy_gpu_s=sum(g[2] for g in groups))
                    extra[name] = {"groups": groups, "flops_per_gemm_group": g8[1] * g8_reps * kg,
                                   "bytes_per_copy_group": cp[2] * cp_reps * km}
                else:
                    raise ValueError(kind)
                d = next(iter(summ.devices.values()))
                row.update(t0=summ.t0, t1=summ.t1, telemetry={k: d.get(k) for k in (
                    "n_samples", "mean_power_w", "peak_power_w", "p99_power_w", "energy_j", "energy_source",
                    "max_gpu_temp_c", "mean_sm_clock_mhz", "median_sm_clock_mhz", "min_sm_clock_mhz",
                    "mean_gpu_util_pct", "throttle_fractions")})
                if row.get("gpu_s") and row.get("flops"):
                    row["tflops"] = row["flops"] / row["gpu_s"] / 1e12
                tel = row["telemetry"]
                log(f"{name:18s} P {tel['mean_power_w'] or 0:6.1f} W (E {tel['energy_j'] or 0:8.1f} J) "
                    f"peak {tel['peak_power_w'] or 0:6.1f} clk {tel['median_sm_clock_mhz'] or 0:6.0f} "
                    f"T {tel['max_gpu_temp_c'] or 0:4.0f} "
                    + (f"{row['tflops']:7.1f} TFLOP/s" if "tflops" in row else ""))
            except Exception as e:  # noqa: BLE001 - one failed load must not lose the others
                row["error"] = f"{type(e).__name__}: {e}"
                log(f"{name}: FAILED {row['error']}")
                for w in list(sampler._open):
                    sampler.end_window(w)
            rows.append(row)
            time.sleep(1.5 * a.scale)
    finally:
        trace = sampler.stop()
        if vproc is not None:
            vproc.terminate()
        trace.meta["loads"] = _clean(extra)
        trace.save(out / "dvfs_sweep.trace.json.gz")
        with open(out / "dvfs_sweep.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(_clean(r), allow_nan=False) + "\n")
        if not a.fake:
            nvsmi(["-q", "-d", "POWER,CLOCK,PERFORMANCE,TEMPERATURE"], out / "nvidia-smi-after.txt")
        log(f"done in {time.time() - t_begin:.0f} s, {len(rows)} loads, "
            f"{sum('error' in r for r in rows)} failed; files in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
