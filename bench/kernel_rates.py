"""Kernel rates behind the `te` profile's priors (models/profile_fit.TE_PRIOR), on one GPU at its
default settings: BF16 and FP8 GEMMs and causal attention (forward, and forward + backward), each
timed in short bursts with idle gaps so that the SM clock stays near its maximum (the rate the
model's efficiencies are defined at: DVFS stretches them, models/dvfs.py), with the SM clock read
by NVML during every burst.

    python bench/kernel_rates.py --out DIR     # on a GPU (torch, nvidia-ml-py); ~2 minutes

Writes DIR/kernel_rates.jsonl: one line per kernel shape with TFLOP/s per burst (median), the
median SM clock during the bursts and the rate scaled to the maximum clock by the DVFS model's
clock share (models/dvfs.compute_stretch).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class ClockSampler:
    """SM clock (MHz) sampled every 5 ms while running."""

    def __init__(self):
        import pynvml

        pynvml.nvmlInit()
        self.nv = pynvml
        self.h = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.max_mhz = pynvml.nvmlDeviceGetMaxClockInfo(self.h, pynvml.NVML_CLOCK_SM)
        self.samples: list[float] = []
        self._on = False

    def _loop(self):
        while self._on:
            self.samples.append(self.nv.nvmlDeviceGetClockInfo(self.h, self.nv.NVML_CLOCK_SM))
            time.sleep(0.005)

    def __enter__(self):
        self.samples = []
        self._on = True
        self.t = threading.Thread(target=self._loop, daemon=True)
        self.t.start()
        return self

    def __exit__(self, *a):
        self._on = False
        self.t.join()


def te_out_path(doc: str, script: str, step: str, argv=None) -> Path | None:
    """The OUT argument of a one-GPU Transformer Engine microbenchmark (`--help` prints `doc`), or
    None after a one-line error where torch or TE is missing (the te_device.sh step that runs it)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the JSONL file to write")
    out = ap.parse_args(argv).out
    try:
        import torch  # noqa: F401
        import transformer_engine  # noqa: F401
    except ImportError as e:
        print(f"error: {script} runs on a GPU with torch and Transformer Engine ({e}); on a lent one: "
              f"bash bench/te_device.sh {step}", file=sys.stderr)
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def timed_us(torch, fn, reps: int = 50, warmup: int = 3) -> float:
    """Microseconds per call of `fn`: CUDA events around `reps` back-to-back calls after `warmup`
    (the larger of its GPU time and its host issue time)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps * 1e3


def reps_for(torch, fn, seconds: float, lo: int, hi: int | None = None, warmup: int = 1) -> int:
    """Back-to-back calls of `fn` that fill ~`seconds`, between lo and hi: `warmup` calls, then one
    timed on the host clock (closed by a synchronize)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-5)
    reps = max(lo, int(seconds / one))
    return reps if hi is None else min(hi, reps)


def bursts(torch, fn, flops: float, clock: ClockSampler, n_bursts: int = 6, burst_s: float = 0.25,
           gap_s: float = 0.4) -> dict:
    """Median TFLOP/s of `fn` over bursts of ~burst_s with idle gaps, and the clock during them."""
    reps = reps_for(torch, fn, burst_s, lo=3)
    rates, clocks = [], []
    for _ in range(n_bursts):
        time.sleep(gap_s)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with clock:
            a.record()
            for _ in range(reps):
                fn()
            b.record()
            torch.cuda.synchronize()
        rates.append(flops * reps / (a.elapsed_time(b) / 1e3) / 1e12)
        clocks.extend(clock.samples)
    return {"tflops": statistics.median(rates), "tflops_all": rates, "reps": reps,
            "sm_mhz_median": statistics.median(clocks) if clocks else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    import torch

    from advisor.models.dvfs import compute_stretch

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda:0")
    clock = ClockSampler()
    rows = []

    def record(name, kind, dims, r):
        x = (r["sm_mhz_median"] or clock.max_mhz) / clock.max_mhz
        r.update(name=name, kind=kind, dims=dims, max_sm_mhz=clock.max_mhz,
                 tflops_at_max_clock=r["tflops"] * compute_stretch(x), gpu=torch.cuda.get_device_name(0))
        rows.append(r)
        print(f"{name:34} {r['tflops']:8.1f} TFLOP/s at {r['sm_mhz_median']} MHz -> "
              f"{r['tflops_at_max_clock']:8.1f} at {clock.max_mhz} MHz", flush=True)

    gemms = [(8192, 8192, 8192), (8192, 8192, 10240), (8192, 8192, 57344), (8192, 28672, 8192),
             (8192, 4096, 6144), (4096, 4096, 14336), (16384, 8192, 2048)]
    for m, k, n in gemms:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
        record(f"gemm-bf16-{m}x{k}x{n}", "gemm_bf16", [m, k, n],
               bursts(torch, lambda: x @ w, 2.0 * m * k * n, clock))
        try:
            x8 = x.to(torch.float8_e4m3fn)
            w8 = w.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major second operand
            one = torch.tensor(1.0, device=dev)
            fn = lambda: torch._scaled_mm(x8, w8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
            record(f"gemm-fp8-{m}x{k}x{n}", "gemm_fp8", [m, k, n], bursts(torch, fn, 2.0 * m * k * n, clock))
        except Exception as e:  # noqa: BLE001 - recorded, the rest goes on
            print(f"fp8 {m}x{k}x{n}: {type(e).__name__}: {e}", flush=True)
        del x, w
    F = torch.nn.functional
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for b, h, s, d in [(1, 32, 4096, 128), (1, 32, 8192, 128), (2, 16, 8192, 128), (1, 8, 16384, 128),
                       (1, 8, 32768, 128), (1, 16, 8192, 64)]:
        q, k_, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        fwd_flops = 4.0 * b * h * s * s * d * 0.5  # causal: QK^T and PV over half the score matrix
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            name = backend.name.lower().replace("_attention", "")
            try:
                with sdpa_kernel(backend):
                    record(f"attn-{name}-fwd-{b}x{h}x{s}x{d}", f"attention_fwd_{name}", [b, h, s, d],
                           bursts(torch, lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=True),
                                  fwd_flops, clock))
                    g = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16)

                    def fb():
                        o = F.scaled_dot_product_attention(q, k_, v, is_causal=True)
                        o.backward(g)

                    record(f"attn-{name}-fwdbwd-{b}x{h}x{s}x{d}", f"attention_fwdbwd_{name}", [b, h, s, d],
                           bursts(torch, fb, 3.5 * fwd_flops, clock))
            except Exception as e:  # noqa: BLE001
                print(f"{name} {b}x{h}x{s}x{d}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        del q, k_, v
    with open(out / "kernel_rates.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {len(rows)} rows to {out / 'kernel_rates.jsonl'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
