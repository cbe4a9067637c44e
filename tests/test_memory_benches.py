"""bench/memory_terms.py and the memory column of bench/compare_measurements.py, on the committed
full-depth measurements."""
from __future__ import annotations

from pathlib import Path

import json

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
    assert len(rows) == 16 and len({r["id"] for r in rows}) == 8  # 1 + 1 + 2 + 2 + 4 + 4 + 1 + 1 stages
    k = 1.0 + DEFAULT.fragmentation
    for r in rows:
        sm = stage_memory(recs[r["id"]].model, recs[r["id"]].cfg)[r["stage"]]
        assert (r["norm"] + r["sharded"] + r["outputs"]) * k == pytest.approx(sm.activations_gib)
        assert r["logits"] * k == pytest.approx(sm.logits_gib)
        assert r["norm"] > 0 and r["sharded"] > 0 and r["stack"] == "local"


def test_memory_terms_predict_te_runs_with_the_te_runners_physics():
    """te records: the te profile's bf16 gradient buffers in the static part, and the cross entropy
    each record ran: native fused for records without the key (models.dataset.legacy_config: the
    session-22 runner), the record's own setting otherwise (the session-23 campaign ran unfused):
    bf16 logits + 2 fp32 tensors = 10 B per logit (native), + 1 = 6 B (unfused), in the logits term."""
    te_file = str(ROOT / "data" / "measurements" / "h100x4-te.jsonl")
    rows = load_bench("memory_terms").stage_rows([te_file], stack="te")
    recs = {r.id: r for r in load([te_file]).records}
    raw = {json.loads(x)["id"]: json.loads(x) for x in open(te_file, encoding="utf-8") if x.strip()}
    assert len(rows) >= 60 and {r["stack"] for r in rows} == {"te"}
    for r in rows:
        said = raw[r["id"]]["config"].get("cross_entropy_impl")
        assert recs[r["id"]].cfg.cross_entropy_impl == (said or "native")
    with_logits = [r for r in rows if r["logits"] > 0]
    # session 27's stack runs ran TE's cross entropy (bf16 logits + its saved bf16 copy = 4 B)
    assert {recs[r["id"]].cfg.cross_entropy_impl for r in with_logits} == {"native", "unfused", "te"}
    for r in with_logits:
        cfg, m = recs[r["id"]].cfg, recs[r["id"]].model
        logits = cfg.seq / cfg.cp * cfg.mbs * m.vocab_size / cfg.tp
        per_logit = {"native": 2 + 2 * 4, "unfused": 2 + 4, "te": 2 + 2}[cfg.cross_entropy_impl]
        # ... and the final norm's input and output (2 x s x b x h BF16, / TP with sequence parallelism)
        final_norm = 2 * cfg.seq / cfg.cp * cfg.mbs * m.hidden_size * 2 / (cfg.tp if cfg.sequence_parallel else 1)
        assert r["logits"] * 2**30 == pytest.approx(logits * per_logit + final_norm)
    assert {r["moe"] for r in rows} == {True, False}


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
