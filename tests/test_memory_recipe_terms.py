"""Issue #27: `python bench/memory_edge.py --recipe ROW`, a published recipe's memory terms per
pipeline stage, adds up to what the advisor predicts for it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support import load_bench

ROOT = Path(__file__).resolve().parents[1]


def test_recipe_terms_add_up_and_hold_megatrons_interleaved_warmup():
    edge = load_bench("memory_edge")
    head, stages = edge.recipe_terms("115")  # llama3-70b TP4 PP8 VP5 mbs1 seq8192 FP8, 128 micro-batches
    assert head["model"] == "llama3-70b" and head["microbatches"] == 128 and len(stages) == 8
    pred = {r["id"]: r["predicted"] for r in edge.recipes(None)}
    assert max(s["total"] for s in stages) == pytest.approx(pred["115"])
    parts = ("weights", "fp8_copies", "grads", "optimizer", "activations", "logits", "transient", "overhead",
             "reserved_free")
    for s in stages:
        assert sum(s[k] for k in parts) == pytest.approx(s["total"])
        # megatron-core's warm-up: (pp - rank - 1) * 2 + (vp - 1) * pp forwards, plus the first steady one,
        # in groups of pp micro-batches per virtual chunk
        assert sum(s["in_flight"]) == min(128 * 5, (8 - s["stage"] - 1) * 2 + 4 * 8 + 1)
        # FP8 primary weights (the te stack's fp8_param_gather, as the recipe): BF16 weights are only
        # the embedding / output layer's (and the norms'); the linear layers' are FP8 data + transpose
        assert s["weights"] == pytest.approx(0.49 if s["stage"] in (0, 7) else 0.0, abs=0.01)
        assert s["fp8_copies"] == pytest.approx(3.98, abs=0.01)
    assert stages[0]["in_flight"] == [15, 8, 8, 8, 8] and stages[7]["in_flight"] == [8, 8, 8, 8, 1]
    assert stages[7]["logits"] > 0 == stages[0]["logits"]
    # the te stack launches with expandable segments (as the recipes): the measured residual only
    assert all(s["reserved_free"] == pytest.approx(0.44) for s in stages)


def test_recipe_flag_prints_the_table_and_refuses_an_unknown_row():
    ok = subprocess.run([sys.executable, str(ROOT / "bench/memory_edge.py"), "--recipe", "115"],
                        capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0 and "tightest stage 0" in ok.stdout and "fp8_copies" in ok.stdout and "outside" in ok.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "bench/memory_edge.py"), "--recipe", "nope"],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error:") and "Traceback" not in bad.stderr
