"""Run a fixed list of the README's and docs' example commands and write or compare their stdout.

    python bench/cli_golden.py --write     # (re)write tests/data/golden/<name>.txt from this tree
    python bench/cli_golden.py             # compare: exit 1 and a diff summary if any output changed
    python bench/cli_golden.py -k plan     # only the cases whose name contains "plan"

Each case is CPU-only and runs in a fresh `python -m advisor` (a few seconds each). The golden file
holds the exit status on its first line (`# rc=N`), then stdout byte for byte (with this checkout's
path and interpreter as <ROOT> and <PYTHON>); stderr only for a failing command (its `error:` line),
else not compared (warnings may vary); wall times and random ids are masked (MASKS). `COLUMNS=140` fixes the terminal tables' width.
Used to hold a refactor to "behaviour unchanged" (issue #23).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "data" / "golden"
PROFILE = "data/placement/h200x4-profile.json"

# (name, argv after `advisor`): README.md, docs/power.md, docs/plan.md, docs/placement.md,
# docs/report.md, docs/calibration.md, docs/measurement.md, docs/moe.md examples.
CASES: list[tuple[str, list[str]]] = [
    ("catalog_models", ["catalog", "models", "--json"]),
    ("catalog_gpus", ["catalog", "gpus", "--json"]),
    ("catalog_clusters", ["catalog", "clusters"]),
    ("recommend_70b_json", ["recommend", "--model", "llama3-70b", "--cluster", "h100x64", "--json"]),
    ("recommend_70b_table", ["recommend", "--model", "llama3-70b", "--cluster", "h100x64"]),
    ("recommend_70b_fp8", ["recommend", "--model", "llama3-70b", "--cluster", "h100x64",
                           "--seq", "8192", "--gbs", "128", "--precision", "fp8", "--json"]),
    ("recommend_70b_energy", ["recommend", "-m", "llama3-70b", "-c", "h100x64",
                              "--objective", "energy", "--json"]),
    ("recommend_70b_balanced", ["recommend", "-m", "llama3-70b", "-c", "h100x64",
                                "--objective", "balanced"]),
    ("recommend_70b_caps", ["recommend", "-m", "llama3-70b", "-c", "h100x64", "--objective", "energy",
                            "--power-caps", "300:700:25", "--json"]),
    ("recommend_caps_conflict", ["recommend", "-m", "llama3-70b", "-c", "h100x64",
                                 "--power-caps", "300:700:25", "--json"]),
    ("recommend_70b_nocal", ["recommend", "-m", "llama3-70b", "-c", "h100x64",
                             "--calibration", "none", "--json"]),
    ("recommend_dsv3", ["recommend", "--model", "deepseek-v3", "--cluster", "h100x1024",
                        "--seq", "4096", "--gbs", "8192", "--precision", "fp8", "--json"]),
    ("predict_70b_json", ["predict", "--model", "llama3-70b", "--cluster", "h100x64", "--tp", "8",
                          "--pp", "4", "--vp", "5", "--mbs", "1", "--gbs", "128", "--json"]),
    ("predict_70b_table", ["predict", "--model", "llama3-70b", "--cluster", "h100x64", "--tp", "8",
                           "--pp", "4", "--vp", "5", "--mbs", "1", "--gbs", "128"]),
    ("predict_405b", ["predict", "--model", "llama3.1-405b", "--cluster", "h100x1024", "--tp", "8",
                      "--pp", "8", "--cp", "2", "--vp", "8", "--gbs", "1536",
                      "--account-for-embedding", "--account-for-loss", "--json"]),
    ("predict_dsv3", ["predict", "--model", "deepseek-v3", "--cluster", "h100x1024", "--tp", "2",
                      "--pp", "8", "--ep", "64", "--seq", "4096", "--gbs", "8192",
                      "--pipeline-layout", "Et|(tt|)*30L", "--recompute", "full", "--json"]),
    ("predict_8b_caps", ["predict", "-m", "llama3-8b", "-c", "h100x8", "--tp", "2",
                         "--power-caps", "300:700:25", "--json"]),
    ("predict_8b_caps_table", ["predict", "-m", "llama3-8b", "-c", "h100x8", "--tp", "2",
                               "--power-caps", "300:700:25"]),
    ("predict_8b_set", ["predict", "-m", "llama3-8b", "-c", "h200x4", "--tp", "2", "--set", "gpu=h100",
                        "--set", "nodes=2", "--set", "power_cap=500", "--json"]),
    ("predict_8b_badcap", ["predict", "-m", "llama3-8b", "-c", "h100x8", "--power-cap", "81"]),
    ("place_8b_json", ["place", "-m", "llama3-8b", "-c", "h200x4", "--pp", "4", "--gbs", "32",
                       "--seq", "4096", "-p", PROFILE, "--json"]),
    ("place_8b_table", ["place", "-m", "llama3-8b", "-c", "h200x4", "--pp", "4", "--gbs", "32",
                        "--seq", "4096", "-p", PROFILE]),
    ("plan_405b_json", ["plan", "--model", "llama3.1-405b", "--tokens", "15.6T",
                        "--gpus", "h100:16384", "--json"]),
    ("plan_70b_deadline", ["plan", "--model", "llama3-70b", "--tokens", "15T",
                           "--gpus", "h100:<=4096", "--deadline", "60d", "--budget", "2.5GWh",
                           "--gpu-hour-price", "2"]),
    ("measure_dry_run", ["measure", "--model", "llama3-8b", "--layers", "4", "--tp", "2", "--pp", "2",
                         "--gpus", "4", "--dry-run"]),
]


# What varies from run to run, masked before the compare: wall times, a measurement's random id.
MASKS = [(re.compile(rb'"elapsed_s": [0-9.eE+-]+'), b'"elapsed_s": <T>'),
         (re.compile(rb"\bin \d+\.\d+ s\b"), b"in <T> s"),
         (re.compile(rb'"id": "[0-9a-f]{12}"'), b'"id": "<ID>"')]


def run_case(argv: list[str]) -> tuple[int, bytes, float]:
    """Exit status, stdout (stderr too when the status is not 0: the `error:` line is behaviour),
    with this checkout's root and interpreter written as <ROOT> and <PYTHON>; seconds taken."""
    env = dict(os.environ, COLUMNS="140", PYTHONHASHSEED="0")
    env.pop("ADVISOR_DEBUG", None)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "advisor", *argv], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
    out = proc.stdout + (b"# stderr:\n" + proc.stderr if proc.returncode else b"")
    out = out.replace(sys.executable.encode(), b"<PYTHON>").replace(str(ROOT).encode(), b"<ROOT>")
    for pattern, repl in MASKS:
        out = pattern.sub(repl, out)
    return proc.returncode, out, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="write the golden files instead of comparing")
    ap.add_argument("-k", default="", help="only the cases whose name contains this")
    args = ap.parse_args()
    GOLDEN.mkdir(parents=True, exist_ok=True)
    changed = 0
    for name, argv in CASES:
        if args.k not in name:
            continue
        rc, out, secs = run_case(argv)
        got = f"# rc={rc}\n".encode() + out
        path = GOLDEN / f"{name}.txt"
        if args.write:
            path.write_bytes(got)
            print(f"wrote {name:24s} rc={rc} {len(out):7d} B {secs:5.1f} s")
            continue
        want = path.read_bytes() if path.exists() else b""
        if got == want:
            print(f"same  {name:24s} rc={rc} {len(out):7d} B {secs:5.1f} s")
            continue
        changed += 1
        print(f"DIFF  {name:24s} rc={rc} {len(out):7d} B {secs:5.1f} s")
        diff = difflib.unified_diff(want.decode(errors="replace").splitlines(),
                                    got.decode(errors="replace").splitlines(),
                                    "golden", "now", lineterm="", n=1)
        print("\n".join(list(diff)[:40]))
    if not args.write:
        print(f"{changed} of the cases differ" if changed else "all outputs byte-identical")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
