"""A MoE layer re-run by full recompute holds its transient token buffers beside what it saves
(Constants.moe_transient_hidden_per_token; models.memory.moe_transient_bytes), measured on the te
stack by an allocator snapshot at the recompute's peak (x4-te-s30d, te-qw3-snap-32)."""
from __future__ import annotations

from pathlib import Path

import pytest

from advisor.catalog.specs import ModelSpec, TrainConfig
from advisor.models.calibrate import resolve_calibration
from advisor.models.dataset import legacy_config
from advisor.models.memory import moe_transient_bytes, stage_memory
from advisor.models.moe import MOE_TE_SETTINGS, routed_tokens
from advisor.runners.records import read_jsonl

ROOT = Path(__file__).resolve().parents[1]


def record(rid: str) -> dict:
    return next(r for r in read_jsonl(ROOT / "data/measurements/h100x4-te.jsonl") if r.get("id") == rid)


def layout(rid: str):
    r = record(rid)
    model = ModelSpec.from_dict(r["model"])
    return r, model, TrainConfig.from_dict(legacy_config(r["config"], model, "te"))


def test_the_snapshot_holds_about_four_routed_hidden_tensors_beside_the_saved_ones():
    r, model, cfg = layout("te-qw3-snap-32")
    c = resolve_calibration("default", "te").screening_constants
    assert c.moe_transient_hidden_per_token == MOE_TE_SETTINGS["moe_transient_hidden_per_token"] == 4.0
    peak = r["memory_snapshot"]["0"]["at_allocated_peak"]
    sites = {s["site"].split(" ")[0]: s["gib"] for s in peak["sites"]}
    unit = sites["moe_utils.py:608"] / 2  # one routed hidden tensor at the step's load (2 blocks)
    fc1_out = 2 * model.moe.ffn_hidden_size / model.hidden_size * unit  # saved, as fc1's input and SwiGLU's
    # beside them: the permutation's output, the all-to-all's, the second sort_chunks_by_idxs output and
    # the experts' fc2 output
    transient = sites["moe_utils.py:465"] + sites["mappings.py:444"] + unit + (sites["grouped_linear.py:352"] - fc1_out)
    assert transient / unit == pytest.approx(4.0, abs=0.2)
    # the weights, gradients and optimizer states live before the step: what the model predicts for them
    sm = stage_memory(model, cfg, c)[0]
    assert peak["live_before_step_gib"] == pytest.approx(sm.weights_gib + sm.grads_gib + sm.optimizer_gib, rel=0.02)
    assert moe_transient_bytes(model, cfg, c) == pytest.approx(
        4.0 * routed_tokens(model, cfg, c) * model.hidden_size * 2)


def test_full_recompute_working_set_carries_it_and_nothing_else_moves():
    _, model, cfg = layout("te-qw3-rc-29")
    c = resolve_calibration("default", "te").screening_constants
    with_, without = (stage_memory(model, cfg, c.replace(moe_transient_hidden_per_token=t))[0] for t in (4.0, 0.0))
    assert with_.weights_gib == without.weights_gib and with_.logits_gib == without.logits_gib
    assert with_.activations_gib > without.activations_gib  # the working set outgrows the loss's logits
    # measured 41.5 / 41.7 GiB allocated (te-qw3-rc-29 / te-eqw3-rc-00): predicted 37.1 without the
    # buffers, 38.4 with them (the rest: the early steps' untrained-router skew, above the trained
    # router's the profile predicts with)
    alloc = with_.total_gib - with_.reserved_free_gib
    assert 38.0 < alloc < 41.7 and alloc - (without.total_gib - without.reserved_free_gib) > 1.0
    # without recompute the layer's buffers are gone before the next layer runs: no change
    none = cfg.replace(recompute="none")
    a, b = (stage_memory(model, none, c.replace(moe_transient_hidden_per_token=t))[0].total_gib for t in (4.0, 0.0))
    assert a == b
