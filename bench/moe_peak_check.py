"""The sampled peak power of the uncapped MoE runs, with backward_gap_share fitted leave one file out
(issue #24).

    python bench/moe_peak_check.py [FILES...]

An uncapped GPU's sampled peak is what NVML's ~25 ms power window sees at most inside a microbatch
(models/power_arrays.sampled_stretch): the backward pass, with backward_gap_share of the
microbatch's launch / host gaps. For each file with MoE runs, backward_gap_share is fitted (grid
0-0.6, least mean absolute relative error of the peak) on the other files' MoE runs and that file's
runs are predicted with it (the power model given each run's measured step, bench/power_check.py);
printed: the fitted share and the peak MAPE per file, then all MoE runs and the held-out dense runs
(bench/power_check.HELD_OUT) at the shipped constant. Capped stages do not depend on the share.
"""
from __future__ import annotations

import glob
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import power_check as P  # noqa: E402

from advisor.models.constants import DEFAULT  # noqa: E402

GRID = np.round(np.linspace(0.0, 0.6, 31), 3)


def peaks(rows: list[dict], share: float) -> np.ndarray:
    c = DEFAULT.replace(backward_gap_share=float(share))
    return np.array([P.power_model(r, c)["peak_w"] for r in rows])


def mape(rows: list[dict], pred: np.ndarray) -> float:
    meas = np.array([r["peak_w"] for r in rows])
    return float(np.mean(np.abs(pred / meas - 1.0)) * 100)


def main(argv: list[str] | None = None) -> int:
    files = (argv if argv is not None else sys.argv[1:]) or sorted(glob.glob("data/measurements/*.jsonl"))
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        print(f"error: no such file: {missing[0]}")
        return 2
    rows = P.load(files)
    moe = [r for r in rows if P.is_moe(r)]
    if not moe:
        print("error: no MoE runs with telemetry in the given files")
        return 2
    by_file: dict[str, list[dict]] = {}
    for r in moe:
        by_file.setdefault(r["file"], []).append(r)
    table = {g: peaks(moe, g) for g in GRID}  # every MoE run at every share: folds pick their columns
    index = {id(r): i for i, r in enumerate(moe)}
    print(f"{'file (MoE runs)':36s} {'n':>3s} {'share fitted on the others':>27s} {'peak MAPE held out':>19s} "
          f"{'at shipped':>11s}")
    held, meas_all = [], []
    for f, test in by_file.items():
        train = [index[id(r)] for r in moe if r["file"] != f]
        if not train:
            continue
        best = min(GRID, key=lambda g: mape([moe[i] for i in train], table[g][train]))
        idx = [index[id(r)] for r in test]
        held += list(table[best][idx])
        meas_all += test
        print(f"{f:36s} {len(test):3d} {best:27.3f} {mape(test, table[best][idx]):18.2f}% "
              f"{mape(test, peaks(test, DEFAULT.backward_gap_share)):10.2f}%")
    print(f"{'all MoE runs, each file held out':36s} {len(meas_all):3d} {'':27s} {mape(meas_all, np.array(held)):18.2f}%")
    print(f"{'all MoE runs at the shipped share':36s} {len(moe):3d} {DEFAULT.backward_gap_share:27.3f} "
          f"{mape(moe, peaks(moe, DEFAULT.backward_gap_share)):18.2f}%")
    dense = [r for r in rows if r["file"] in P.HELD_OUT and not P.is_moe(r)]
    if dense:
        print(f"{'held-out dense runs (shipped share)':36s} {len(dense):3d} {'':27s} "
              f"{mape(dense, peaks(dense, DEFAULT.backward_gap_share)):18.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
