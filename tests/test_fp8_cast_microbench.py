"""TE's FP8 casts timed alone on one H200 (bench/fp8_cast_gpu.py, data/microbench/h200x1-fp8-casts.jsonl):
the fused cast + transpose that Hopper's FP8 linear layers run on every GEMM input reaches, on tensors
of 32M elements and more, the share of the HBM peak the model prices memory-bound kernels at
(Constants.hbm_efficiency, the te profile's), within 10%."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from advisor.catalog.loaders import load_gpu
from advisor.models.calibrate import resolve_calibration

DATA = Path(__file__).resolve().parent.parent / "data/microbench/h200x1-fp8-casts.jsonl"


def test_large_fp8_casts_run_at_the_modelled_share_of_the_hbm_peak():
    rows = [json.loads(x) for x in DATA.open() if x.strip()]
    big = [r["share_of_peak"] for r in rows
           if r["kernel"] == "cast_transpose_fp8" and r["shape"][0] * r["shape"][1] >= 32 * 2**20]
    assert len(big) >= 6
    c = resolve_calibration("default", "te", gpu=load_gpu("h200")).constants
    assert statistics.mean(big) == pytest.approx(c.hbm_efficiency, rel=0.10)
