"""Speed of `advisor plan` on this machine (issue #26: the 405B on 16K H100 plan answers in
under 5 s), with the CPU it ran on.

    python bench/plan_speed.py [--cold 5] [--repeat 3]

Columns: cold s = median wall time of --cold fresh `python -m advisor plan ...` processes after
one untimed run (bench/recommend_speed.py's `cold`); in-process s = median of --repeat
`advisor.plan.plan` calls in this process after a first, untimed one; sizes = cluster sizes
swept; candidates = (size, layout, power cap) runs evaluated.

Measured (2026-11-27, `python bench/plan_speed.py`, AMD EPYC, 2 cores of a VM shared with
other jobs, Python 3.11):

| case | target | cold s (median of 5) | in-process s | sizes | candidates |
|---|---|---|---|---|---|
| plan llama3.1-405b 15.6T h100:16384 | ≤ 5 s | 0.64 | 0.13 | 1 | 60 |
| plan llama3-70b 15T h100:<=4096 --deadline 60d | | 2.46 | 1.77 | 16 | 960 |
| plan llama3.1-405b 15.6T h100:<=16384 --deadline 90d | | 3.46 | 4.50 | 15 | 900 |

(The last row's in-process median above its cold one is the VM's neighbours: the same calls vary
by about 2x here.)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from recommend_speed import cold, cpu_model  # noqa: E402

CASES = [  # label, CLI args, PlanOptions keywords, target for the cold process (s)
    ("plan llama3.1-405b 15.6T h100:16384", ["-m", "llama3.1-405b", "--tokens", "15.6T", "--gpus", "h100:16384"],
     dict(tokens=15.6e12, gpu="h100", max_gpus=16384, exact=True), 5.0),
    ("plan llama3-70b 15T h100:<=4096 --deadline 60d",
     ["-m", "llama3-70b", "--tokens", "15T", "--gpus", "h100:<=4096", "--deadline", "60d"],
     dict(tokens=15e12, gpu="h100", max_gpus=4096, deadline_s=60 * 86400.0), None),
    ("plan llama3.1-405b 15.6T h100:<=16384 --deadline 90d",
     ["-m", "llama3.1-405b", "--tokens", "15.6T", "--deadline", "90d"],
     dict(tokens=15.6e12, gpu="h100", deadline_s=90 * 86400.0), None),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cold", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    from advisor.plan import PlanOptions, plan

    print(f"# {cpu_model()}, Python {sys.version.split()[0]}")
    print("| case | target | cold s (median of %d) | in-process s | sizes | candidates |" % a.cold)
    print("|---|---|---|---|---|---|")
    for label, args, kw, target in CASES:
        c = cold(["plan", *args], a.cold)
        res = plan(args[1], PlanOptions(**kw))
        times = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            res = plan(args[1], PlanOptions(**kw))
            times.append(time.perf_counter() - t0)
        t = f"≤ {target:g} s" if target else ""
        print(f"| {label} | {t} | {c:.2f} | {statistics.median(times):.2f} | {len(res.sizes)} | "
              f"{len(res.candidates):,} |", flush=True)


if __name__ == "__main__":
    main()
