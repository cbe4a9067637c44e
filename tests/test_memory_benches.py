"""bench/memory_terms.py and the memory column of bench/compare_measurements.py, on the committed
full-depth measurements."""
from __future__ import annotations

from pathlib import Path

import pytest

from advisor.models.calibrate import resolve_calibration
from advisor.models.constants import DEFAULT
from advisor.models.dataset import load
from advisor.models.memory import stage_memory
from support import load_bench

ROOT = Path(__file__).resolve().parents[1]
FULL = str(ROOT / "data" / "measurements" / "h200x4-full-depth.jsonl")


def test_memory_terms_split_the_models_activations_and_logits():
    rows = load_bench("memory_terms").stage_rows([FULL])
    recs = {r.id: r for r in load([FULL]).records}
    assert len(rows) == 16 and len({r[0] for r in rows}) == 8  # 1 + 1 + 2 + 2 + 4 + 4 + 1 + 1 stages
    k = 1.0 + DEFAULT.fragmentation
    for rid, st, _, norm, sharded, logits in rows:
        sm = stage_memory(recs[rid].model, recs[rid].cfg)[st]
        assert (norm + sharded) * k == pytest.approx(sm.activations_gib)
        assert logits * k == pytest.approx(sm.logits_gib)
        assert norm > 0 and sharded > 0


def test_compare_leaves_the_runtime_overhead_out_of_analytical_memory_only():
    cmp = load_bench("compare_measurements")
    _, plain = cmp.evaluate([FULL])
    cal = resolve_calibration("local")
    _, calibrated = cmp.evaluate([FULL], cal)
    if cal.targets["memory_gib_per_gpu"]["mode"] == "analytical":
        # the calibration's memory is the analytical model's: same figure, same overhead left out
        assert [r["mem_pred"] for r in calibrated] == pytest.approx([r["mem_pred"] for r in plain])
    else:  # a fitted memory level is compared as it is
        cfgs = {r.id: r for r in load([FULL]).records}
        for row in calibrated:
            rec = cfgs[row["id"]]
            assert row["mem_pred"] == pytest.approx(cal.predict(rec.model, rec.cluster, rec.cfg).memory_gib_per_gpu)
