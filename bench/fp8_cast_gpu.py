"""FP8 casts alone on one GPU: Transformer Engine's per-tensor quantizer (delayed scaling: the fused
cast + transpose kernel its linear layers run on every GEMM input, weight and output gradient on
Hopper) and a plain BF16 copy, over transformer-shaped tensors, as achieved HBM bandwidth (issue
#22: on 2 x H200 the te profile predicts FP8's speed-up over BF16 5-6% high although the clocks and
the GEMM rates are right; the model prices the casts at Constants.hbm_efficiency x the peak).

    python bench/fp8_cast_gpu.py OUT.jsonl        # on a GPU with TE; ~30 s

One JSON line per (kernel, shape): bytes moved per call (BF16 read, FP8 data + transpose written),
microseconds per call (CUDA events over back-to-back calls), achieved TB/s and its share of the
catalog peak, the GPU and TE versions.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SHAPES = [(4096, 4096), (8192, 4096), (16384, 4096), (8192, 8192), (4096, 14336), (16384, 14336),
          (8192, 28672), (32768, 4096), (2048, 2048), (1024, 4096)]


def main(argv=None) -> int:
    from kernel_rates import te_out_path

    out = te_out_path(__doc__, Path(__file__).name, "casts", argv)
    if out is None:
        return 2
    import torch
    import transformer_engine
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    from kernel_rates import timed_us

    from advisor.catalog import load_gpu

    name = torch.cuda.get_device_name(0)
    gpu = load_gpu(name)
    peak = gpu.hbm_bandwidth_gbs * 1e9
    env = {"gpu": name, "torch": torch.__version__, "transformer_engine": getattr(transformer_engine, "__version__", None)}
    dev = torch.device("cuda:0")
    with out.open("a") as fh:
        for m, n in SHAPES:
            x = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
            rows = []
            y = torch.empty_like(x)
            rows.append(("copy_bf16", 4.0 * m * n, timed_us(torch, lambda: y.copy_(x))))
            for colwise in (False, True):
                q = Float8Quantizer(torch.ones(1, device=dev), torch.zeros(1, device=dev), tex.DType.kFloat8E4M3,
                                    rowwise=True, columnwise=colwise)
                kind = "cast_transpose_fp8" if colwise else "cast_fp8"
                rows.append((kind, (2.0 + 1.0 + (1.0 if colwise else 0.0)) * m * n, timed_us(torch, lambda: q(x))))
            for kind, nbytes, us in rows:
                r = {"kernel": kind, "shape": [m, n], "bytes": nbytes, "us": round(us, 3),
                     "tb_per_s": round(nbytes / us / 1e6, 3), "share_of_peak": round(nbytes / us * 1e6 / peak, 4),
                     "env": env}
                fh.write(json.dumps(r) + "\n")
                print(f"{kind:20} {m:6}x{n:<6} {us:9.2f} us {r['tb_per_s']:6.2f} TB/s {r['share_of_peak']:6.1%}", flush=True)
            del x, y
    return 0


if __name__ == "__main__":
    sys.exit(main())
