"""Speed of `advisor recommend` on this machine. Targets: llama3-70b on h100x64 under 1 s;
llama3.1-405b on h100x16384 under 10 s.

Two measurements:
1. In process, per case: `advisor.api.recommend` with the analytical model and with the default
   calibration, the calibration loaded once beforehand (its load time is printed apart): wall time
   and candidates per second. This is the cost of ranking alone.
2. End to end: a cold `python -m advisor recommend --model M --cluster C` process, as a user runs
   it (interpreter start-up, imports, loading the default calibration, ranking, printing), with the
   default calibration and with `--calibration none`; min and median of --cold runs.

    python bench/recommend_speed.py [--repeat 3] [--cold 5]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's code, not whichever copy is installed

CASES = [
    ("llama3-70b", "h100x64", 1.0),
    ("llama3.1-405b", "h100x16384", 10.0),
    ("mixtral-8x22b", "h100x256", None),
    ("deepseek-v3", "h100x1024", None),
    ("qwen3-235b-a22b", "h200x512", None),
]


def cold_runs(args: list[str], n: int) -> list[float]:
    """Wall time of `n` fresh `python -m advisor ...` processes (stdout discarded)."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "advisor", *args], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, cwd=ROOT)
        out.append(time.perf_counter() - t0)
        if r.returncode:
            raise SystemExit(f"advisor {' '.join(args)} failed: {r.stderr.strip()}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3, help="in-process runs per case (best is shown)")
    ap.add_argument("--cold", type=int, default=5, help="cold processes per end-to-end command (0: skip)")
    args = ap.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}")

    t0 = time.perf_counter()
    from advisor.api import recommend
    from advisor.models.calibrate import resolve_calibration

    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    cal = resolve_calibration("default")
    load_s = time.perf_counter() - t0
    print(f"import advisor.api: {import_s:.2f} s; default calibration: "
          + ("none shipped" if cal is None else f"loaded once in {load_s:.2f} s "
             f"(scikit-learn imported: {'yes' if 'sklearn' in sys.modules else 'no'})"))

    print("\n## 1. in process (calibration already loaded; best of --repeat)\n")
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

    if args.cold <= 0:
        return
    model, cluster, target = CASES[0]
    print(f"\n## 2. end to end: a cold `python -m advisor recommend --model {model} --cluster {cluster}` "
          f"process ({args.cold} runs)\n")
    print(f"{'command':<44} {'min s':>7} {'median s':>9} {'target':>7} {'ok':>4}")
    base = cold_runs(["--help"], args.cold)
    print(f"{'python -m advisor --help (start-up only)':<44} {min(base):>7.2f} {statistics.median(base):>9.2f}")
    for label, extra in (("default calibration", []), ("--calibration none", ["--calibration", "none"])):
        t = cold_runs(["recommend", "--model", model, "--cluster", cluster, *extra], args.cold)
        ok = "yes" if statistics.median(t) < target else "NO"
        print(f"{'recommend, ' + label:<44} {min(t):>7.2f} {statistics.median(t):>9.2f} {f'<{target:g}s':>7} {ok:>4}")


if __name__ == "__main__":
    main()
