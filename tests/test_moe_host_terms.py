"""bench/moe_host_terms.py: our VM's MoE host issue time per term, from the kernel profiles of
sessions 24-30 (issue #22): the per-step cost per local expert (x4-te-s30 / -s30b's EP1 vs EP4
pairs) is the largest per-expert term, and the per layer-microbatch total matches the te profile's
VM host costs."""
from __future__ import annotations

import io
from contextlib import redirect_stdout

import pytest

from support import load_bench


def test_host_terms_from_the_profiles():
    bench = load_bench("moe_host_terms")
    data = [x for x in bench.rows(bench.DEFAULT) if x["ratio"] <= 1.16]
    assert len(data) >= 15
    f, _ = bench.fit(data, "forward")
    b, _ = bench.fit(data, "backward")
    per_mb, per_expert_mb, per_expert_step, _ = f + b
    # the step's per-parameter work outweighs the per-micro-batch work of an expert
    assert per_expert_step > 5 * per_expert_mb and 0.6 < per_expert_step < 1.2
    # the per layer-microbatch issue time: what host_layer_s + moe_layer_host_s price (24.8 ms)
    assert per_mb == pytest.approx(24.8, rel=0.15)
    out = io.StringIO()
    with redirect_stdout(out):
        assert bench.main([]) == 0
    assert "per local expert and layer, per step" in out.getvalue()


def test_bad_path_is_one_line():
    assert load_bench("moe_host_terms").main(["/nonexistent.jsonl"]) == 2
