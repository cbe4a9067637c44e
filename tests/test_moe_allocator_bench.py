"""bench/moe_allocator.py: the te MoE stages' measured reserved-but-unallocated memory against the
parts of models/allocator_memory.py's MoE term."""
from __future__ import annotations

import glob
from pathlib import Path

import numpy as np
import pytest

from advisor.models.calibrate import resolve_calibration
from advisor.models.memory import stage_memory
from support import load_bench

ROOT = Path(__file__).resolve().parents[1]


def test_one_constant_loao_recovers_a_proportional_term_and_scores_the_held_out_architecture():
    mod = load_bench("moe_allocator")
    F = np.array([1.0, 2.0, 3.0, 4.0])
    arch = np.array(["a", "a", "b", "b"])
    k, mae = mod.one_constant_loao(2.0 * F, F, arch)
    assert k == pytest.approx(2.0) and mae == pytest.approx(0.0, abs=1e-12)
    y = np.array([1.0, 2.0, 6.0, 8.0])  # architecture b twice a's constant
    k, mae = mod.one_constant_loao(y, F, arch)
    held_a = np.abs(y[:2] - 2.0 * F[:2])  # a held out: k fitted on b alone, 2
    held_b = np.abs(y[2:] - 1.0 * F[2:])  # b held out: k fitted on a alone, 1
    assert mae == pytest.approx(np.concatenate([held_a, held_b]).mean())
    assert k == pytest.approx(float(F @ y / (F @ F)))


def test_te_moe_stages_carry_the_shipped_term_and_its_parts():
    mod = load_bench("moe_allocator")
    st = mod.stage_rows(sorted(glob.glob(str(ROOT / "data/measurements/*.jsonl"))), "te")
    assert len(st) >= 29 and all(s["cfg"].ep > 1 for s in st)
    c = resolve_calibration("default", "te").screening_constants
    for s in st:
        assert s["rank_min"] <= s["measured"] and s["load"] >= 1.0 and s["b"] > 0 and s["L"] >= 1
        sm = stage_memory(s["model_spec"], s["cfg"], c)[s["stage"]]
        assert s["R"] == pytest.approx(sm.reserved_free_gib, abs=1e-9)
    # the layout the campaign ran three times (te-mix-ep-00, -call2, -call3): over 1 GiB apart
    rep = {rid: (n, lo, hi) for rid, n, lo, hi in mod.repeat_spread(st)}
    n, lo, hi = rep["te-mix-ep-00"]
    assert n == 3 and hi - lo > 1.0
