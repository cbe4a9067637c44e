"""What the local stack's layers keep for the backward beyond TE's fused layers
(models/memory.STACK_LAYER_KEEPS): the count per term, the stack columns where they live, and the
local records' measured activations against the model (bench/memory_terms.py)."""
from __future__ import annotations

import glob
import json
from pathlib import Path

import numpy as np
import pytest

from advisor.catalog import TrainConfig, load_model
from advisor.models.calibrate import resolve_calibration
from advisor.models.constants import DEFAULT
from advisor.models.memory import STACK_LAYER_KEEPS, layer_activation_bytes, stack_layer_elements
from advisor.models.profile_fit import TE_SETTINGS, te_base
from support import load_bench

ROOT = Path(__file__).resolve().parents[1]


def test_the_local_column_is_the_default_and_te_gets_its_own():
    for k, v in STACK_LAYER_KEEPS["local"].items():
        assert getattr(DEFAULT, k) == v
    for k, v in STACK_LAYER_KEEPS["te"].items():
        assert TE_SETTINGS[k] == v
        for name in ("te_calibration", "te_blackwell_calibration"):  # shipped te profiles carry it
            d = json.loads((ROOT / "models" / "data" / f"{name}.json").read_text())
            assert d["constants"][k] == v
    assert getattr(resolve_calibration("te").screening_constants, "glu_kept_copies") == 0.0
    assert getattr(resolve_calibration("local").screening_constants, "qkv_output_kept") == 1.0


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_llama3_8b_local_layer_keeps_q_k_again_and_two_ffn_copies(tp):
    m = load_model("llama3-8b")
    cfg = TrainConfig(tp=tp, mbs=2, seq=4096, sequence_parallel=False)
    tokens = 2 * 4096
    # q and k once more (32 + 8 heads of 128), the silu output and x_linear + 0 (2 x 14336)
    want = tokens * ((32 + 8) * 128 + 2 * 14336) / tp
    assert stack_layer_elements(m, 0, cfg) == pytest.approx(want)
    te = te_base()
    assert stack_layer_elements(m, 0, cfg, te) == 0.0
    assert (layer_activation_bytes(m, 0, cfg) - layer_activation_bytes(m, 0, cfg, te)
            == pytest.approx(2 * want))
    # full recompute keeps only the layer input, whatever the stack
    assert layer_activation_bytes(m, 0, cfg, DEFAULT, "full") == layer_activation_bytes(m, 0, cfg, te, "full")


def test_learned_positions_mha_keep_nothing_more_in_attention():
    m = load_model("gpt3-175b")  # MHA, learned positions, GELU: q, k, v stay views of the QKV output
    assert m.position_embedding == "learned" and m.activation != "swiglu"
    assert stack_layer_elements(m, 0, TrainConfig(tp=2, mbs=1, seq=2048)) == 0.0


def test_local_records_activations_match_the_model():
    """Least squares of measured allocated - static over the local dense stages without recompute:
    the TP-sharded term's coefficient was 1.76 without the local column, the norm term's ~1."""
    mt = load_bench("memory_terms")
    rows = mt.stage_rows(sorted(glob.glob(str(ROOT / "data" / "measurements" / "*.jsonl"))), stack="local", moe=False)
    assert len(rows) >= 100
    X = np.array([[1.0, r["norm"], r["sharded"], r["logits"]] for r in rows])
    y = np.array([r["alloc"] for r in rows])
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    assert 0.85 <= coef[1] <= 1.15 and 0.9 <= coef[2] <= 1.2 and 0.85 <= coef[3] <= 1.15
    assert 1.0 <= np.median(y / X[:, 1:].sum(1)) <= 1.1
