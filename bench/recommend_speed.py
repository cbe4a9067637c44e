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
    from advisor.models.calibrate import resolve_calibration

    t0 = time.perf_counter()
    cal = resolve_calibration("default")
    load_s = time.perf_counter() - t0
    print(f"default calibration: {'none shipped' if cal is None else f'loaded once in {load_s:.2f} s'}")
    print(f"{'model':<16} {'cluster':<12} {'layouts':>8} {'fit':>6} {'analytic s':>10} {'cand/s':>9} "
          f"{'calibrated s':>12} {'target':>7} {'ok':>4}")
    for model, cluster, target in CASES:
        best = {}
        for label, c in (("analytic", None), ("calibrated", cal)):
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                res = recommend(model, cluster, top=5, calibration=c)
                times.append(time.perf_counter() - t0)
            best[label] = min(times)
        ok = "-" if target is None else ("yes" if max(best.values()) < target else "NO")
        tgt = "-" if target is None else f"<{target:g}s"
        print(f"{model:<16} {cluster:<12} {res.candidates_evaluated:>8} {res.feasible:>6} {best['analytic']:>10.3f} "
              f"{res.candidates_evaluated / best['analytic']:>9,.0f} {best['calibrated']:>12.3f} {tgt:>7} {ok:>4}")


if __name__ == "__main__":
    main()
