"""GEMM burn on one GPU, for ``advisor thermal-profile``: ``python -m advisor.placement.burn SECONDS``.

Run with CUDA_VISIBLE_DEVICES set to one GPU. Back-to-back bf16 8192³ matmuls until the deadline;
prints one JSON line {"uuid", "tflops", "iters", "seconds"}. torch is imported here only.
"""
from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> int:
    seconds = float(argv[0]) if argv else 60.0
    n = int(argv[1]) if len(argv) > 1 else 8192
    try:
        import torch
    except ImportError as e:
        print(f"torch is not installed ({e})", file=sys.stderr)
        return 3
    if not torch.cuda.is_available():
        print("CUDA is not available to torch", file=sys.stderr)
        return 3
    dev = torch.device("cuda:0")
    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    iters = 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        iters += 10
    dt = time.perf_counter() - t0
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    print(json.dumps({"uuid": uuid if uuid.startswith("GPU-") else "GPU-" + uuid,
                      "tflops": 2.0 * n**3 * iters / dt / 1e12, "iters": iters, "seconds": dt}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
