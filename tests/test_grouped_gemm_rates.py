"""TE's GroupedLinear experts phase measured alone (bench/grouped_gemm_rates.py, one H200, TE 2.20.2:
data/microbench/h200x1-grouped-gemm.jsonl): each expert's six GEMMs at their own shape through the
dense GEMM model plus a fixed GPU time per call explain the phase's GPU time across 9 expert shapes,
128-16,384 tokens per expert and 4 / 32 local experts, with the per-call time fitted on the other
shapes (issue #24: the physics the experts term of models/moe.py is to be rebuilt on)."""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import grouped_gemm_rates as G  # noqa: E402

DATA = ROOT / "data/microbench/h200x1-grouped-gemm.jsonl"


@pytest.fixture(scope="module")
def points():
    return G.load_points(DATA)


def test_the_grid_ran_whole_on_the_te_stack(points):
    rows, _ = points
    assert len(rows) == len(G.grid()) == 164
    assert {r["env"]["transformer_engine"] for r in rows} == {"2.20.2"}
    assert {r["precision"] for r in rows} == {"bf16", "fp8"}
    # every point timed three ways, the GPU side never longer than the wall
    for r in rows:
        assert 0 < r["gpu_ms"] <= r["wall_ms"] * 1.05 and r["gemm_ms"] > 0 and r["host_ms"] > 0


def test_per_shape_gemms_plus_a_call_time_hold_out_of_shape(points):
    """Per-call time fitted on all BF16 points 3-6 us; each expert shape predicted by the fit on the
    other eight within 8% MAPE (6.4% over all held-out points when measured)."""
    rows, consts = points
    bf = [r for r in rows if r["precision"] == "bf16"]
    t = G.fit_call_s(bf, consts)
    assert 3e-6 < t < 6e-6
    held = []
    for shape in {r["shape"] for r in bf}:
        ts = G.fit_call_s([r for r in bf if r["shape"] != shape], consts)
        errs = [abs(G.predicted_ms(r, consts[r["gpu_key"]], ts) / G.measured_ms(r) - 1)
                for r in bf if r["shape"] == shape]
        assert statistics.mean(errs) < 0.10, shape
        held += errs
    assert statistics.mean(held) < 0.08
    # FP8: the GEMM kernels alone (casts are priced with the other linear layers) within 15%
    fp = [abs(G.predicted_ms(r, consts[r["gpu_key"]], t) / G.measured_ms(r) - 1) for r in rows if r["precision"] == "fp8"]
    assert statistics.mean(fp) < 0.15


def test_few_tokens_are_bound_by_the_weights_and_the_calls():
    """128 tokens of a 14336-wide expert: the six GEMMs take at least the time to read the weights
    twice and write their gradient once; 4 experts of Qwen3's 768-wide shape at 128 tokens cost >2x
    their FLOPs at the dense rate by their shapes and weights alone (no call time), and each of their
    24 GEMM calls adds its fixed time on top."""
    from advisor.catalog.loaders import load_gpu
    from advisor.models import moe as MOE
    from advisor.models.calibrate import resolve_calibration

    c = MOE.te_moe_constants(resolve_calibration("default", "te", gpu=load_gpu("h200")).constants)
    r = {"gpu_key": "h200", "precision": "bf16", "h": 4096, "f": 14336, "n": 128, "e_loc": 1}
    gemm, hbm = G._gemm(r, c)
    weights_s = 3 * 4096 * 14336 * 2 * 3 / (hbm * c.hbm_efficiency)
    assert G.expert_gemms_s(128, 4096, 14336, 2, gemm) >= 0.9 * weights_s
    q = dict(r, h=2048, f=768, e_loc=4)
    flops_s = 3 * 2.0 * 4 * 128 * 3 * 2048 * 768 / (load_gpu("h200").bf16_tflops * 1e12 * c.gemm_efficiency_max)
    alone = G.per_shape_s(q, c, 0.0)
    assert alone > 2 * flops_s
    assert alone >= 0.9 * 3 * 4 * 2048 * 768 * 2 * 3 / (hbm * c.hbm_efficiency)  # 4 experts' weights
    assert G.per_shape_s(q, c, 4e-6) == pytest.approx(alone + 6 * 4 * 4e-6)
