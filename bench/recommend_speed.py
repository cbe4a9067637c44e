"""Speed of `advisor recommend` (analytical model) on this machine: wall time and candidates per
second. Targets: llama3-70b on h100x64 under 1 s; llama3.1-405b on h100x16384 under 10 s.

    python bench/recommend_speed.py [--repeat 3]
"""
from __future__ import annotations

import argparse
import os
import platform
import time

from advisor.api import recommend

CASES = [
    ("llama3-70b", "h100x64", 1.0),
    ("llama3.1-405b", "h100x16384", 10.0),
    ("mixtral-8x22b", "h100x256", None),
    ("deepseek-v3", "h100x1024", None),
    ("qwen3-235b-a22b", "h200x512", None),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"{'model':<16} {'cluster':<12} {'layouts':>8} {'fit':>6} {'best s':>8} {'cand/s':>9} {'target':>7} {'ok':>4}")
    for model, cluster, target in CASES:
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            res = recommend(model, cluster, top=5)
            times.append(time.perf_counter() - t0)
        best = min(times)
        ok = "-" if target is None else ("yes" if best < target else "NO")
        tgt = "-" if target is None else f"<{target:g}s"
        print(f"{model:<16} {cluster:<12} {res.candidates_evaluated:>8} {res.feasible:>6} {best:>8.3f} "
              f"{res.candidates_evaluated / best:>9,.0f} {tgt:>7} {ok:>4}")


if __name__ == "__main__":
    main()
