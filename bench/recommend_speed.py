"""Speed of `advisor recommend` and `advisor predict --batch` on this machine: the table of issue
#15 ("Answers in a blink"), with the CPU it ran on.

    python bench/recommend_speed.py [--cold 5] [--repeat 5] [--lines 10000]

Columns:
  cold s        median wall time of --cold fresh `python -m advisor ...` processes, as a user runs
                them (interpreter start-up, imports, the default calibration, ranking, printing the
                table). One untimed run first writes the bytecode caches an installed package has
                (PYTHONDONTWRITEBYTECODE is dropped for the child processes: otherwise every
                process compiles every module again, which no installed advisor does).
  in-process s  median of --repeat `advisor.api.recommend` calls in this process (catalog and
                calibration loaded by a first, untimed call).
  layouts       legal layouts of the case's space (recommend's: SpaceOptions.wide); layouts/s =
                layouts / in-process s (the whole command: enumeration, memory screen of every
                layout, ranking of those that fit, head, caps, explanations).
The last rows: `predict --batch` of a --lines JSONL file of layouts drawn from four models' spaces
(cold process, median of --cold), and the array model alone (models.vectorized.evaluate: memory,
stage times, step time, power fixed point) on a whole space, in layouts per second.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's code, not whichever copy is installed

CASES = [  # model, cluster, target for the cold process (s)
    ("llama3-70b", "h100x64", 0.5),
    ("deepseek-v3", "h100x1024", 1.0),
    ("llama3.1-405b", "h100x16384", 1.0),
    ("qwen3-235b-a22b", "h100x256", 2.0),
]
BATCH_TARGET_S = 5.0
RATE_TARGET = 100_000
BATCH_SPACES = [("llama3-70b", "h100x64"), ("llama3-8b", "h200x4"), ("mixtral-8x22b", "h100x256"),
                ("deepseek-v3", "h100x1024")]


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or platform.machine()


def child_env() -> dict:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def cold(args: list[str], n: int) -> float:
    """Median wall time of n fresh `python -m advisor ...` processes (after one untimed run)."""
    env = child_env()
    times = []
    for i in range(n + 1):
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "advisor", *args], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        if r.returncode:
            raise SystemExit(f"advisor {' '.join(args)} failed: {r.stderr.strip()}")
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def batch_file(path: Path, lines: int) -> None:
    """`lines` JSONL layouts drawn (seeded) from the spaces of BATCH_SPACES."""
    from advisor.api import default_workload, resolve
    from advisor.search_spaces.space import SpaceOptions, enumerate_layouts

    rng = random.Random(15)
    pool = []
    for model, cluster in BATCH_SPACES:
        m, c = resolve(model, cluster)
        for cfg in enumerate_layouts(m, c, default_workload(m, c), SpaceOptions()):
            d = {"model": model, "cluster": cluster, "tp": cfg.tp, "pp": cfg.pp, "cp": cfg.cp, "ep": cfg.ep,
                 "etp": cfg.etp, "vp": cfg.vp, "mbs": cfg.mbs, "recompute": cfg.recompute}
            for k in ("pp_first_layers", "pp_last_layers", "pipeline_layout"):
                if getattr(cfg, k) is not None:
                    d[k] = getattr(cfg, k)
            for k in ("account_for_embedding", "account_for_loss"):
                if getattr(cfg, k):
                    d[k] = True
            pool.append(d)
    with path.open("w") as f:
        for i in range(lines):
            f.write(json.dumps({**rng.choice(pool), "id": i}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cold", type=int, default=5, help="timed cold processes per command (median)")
    ap.add_argument("--repeat", type=int, default=5, help="timed in-process calls per case (median)")
    ap.add_argument("--lines", type=int, default=10_000, help="lines of the predict --batch file")
    args = ap.parse_args()

    from advisor.api import default_workload, recommend, resolve
    from advisor.models import vectorized as vz
    from advisor.models.calibrate import resolve_calibration
    from advisor.search_spaces.columns import enumerate_columns
    from advisor.search_spaces.space import SpaceOptions

    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores), Python {platform.python_version()}")
    cal = resolve_calibration("default")
    print(f"default calibration: {'none' if cal is None else cal.profile} profile\n")
    print(f"| case | target | cold s (median of {args.cold}) | in-process s | layouts | layouts/s |")
    print("|---|---|---|---|---|---|")
    for model, cluster, target in CASES:
        recommend(model, cluster)  # catalog, calibration and memos loaded
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            res = recommend(model, cluster)
            times.append(time.perf_counter() - t0)
        inproc = statistics.median(times)
        wall = cold(["recommend", "--model", model, "--cluster", cluster], args.cold)
        ok = "" if wall <= target else " (over)"
        print(f"| recommend {model} {cluster} | ≤ {target:g} s | {wall:.2f}{ok} | {inproc:.3f} | "
              f"{res.candidates_evaluated:,} | {res.candidates_evaluated / inproc:,.0f} |", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "batch.jsonl"
        batch_file(path, args.lines)
        wall = cold(["predict", "--batch", str(path)], args.cold)
        ok = "" if wall <= BATCH_TARGET_S else " (over)"
        print(f"| predict --batch, {args.lines:,} lines | ≤ {BATCH_TARGET_S:g} s | {wall:.2f}{ok} | | | "
              f"{args.lines / wall:,.0f} lines/s |", flush=True)
    # the array model alone on a whole space
    model, cluster = "deepseek-v3", "h100x1024"
    m, c = resolve(model, cluster)
    st = "te"
    L = enumerate_columns(m, c, default_workload(m, c), SpaceOptions.wide(tp_comm_overlap=True))  # recommend's
    consts = cal.constants if cal is not None else vz.DEFAULT
    vz.evaluate(m, c, L, consts)
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        vz.evaluate(m, c, L, consts)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    rate = len(L) / t
    ok = "" if rate >= RATE_TARGET else " (under)"
    print(f"| layouts evaluated per second (models.vectorized.evaluate, {model} {cluster}, {st}) | "
          f"≥ {RATE_TARGET:,} | | {t:.3f} | {len(L):,} | {rate:,.0f}{ok} |")


if __name__ == "__main__":
    main()
