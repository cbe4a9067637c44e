"""torch's caching allocator, reserved but unallocated at a stage's peak (models/allocator_memory.py):
base + block x the largest transient block + moe x sqrt(MoE layers) x one layer's token buffers; with
expandable segments (TrainConfig.expandable_segments: the te stack's default, the runner's off) the
measured residual of te-l8b-alloc-33 instead."""
from __future__ import annotations

import pytest

from advisor.catalog import SpecError, TrainConfig, load_model
from advisor.models.allocator_memory import RANGES, moe_buffer_bytes
from advisor.models.constants import DEFAULT, GIB
from advisor.models.memory import layouts_of, stage_memory
from advisor.models.profiles import apply_layout_defaults
from advisor.models.stages import Stages, memo_for
from advisor.runners import megatron_args as MA
from advisor.search_spaces.columns import Layouts

DENSE = TrainConfig(tp=1, pp=2, dp=2, mbs=8, gbs=64, seq=4096)


def test_the_loss_stage_strands_part_of_its_fp32_logits_block():
    m = load_model("llama3-8b")
    first, last = stage_memory(m, DENSE)
    T = DENSE.seq * DENSE.mbs
    fc1 = T * 2 * m.ffn_hidden_size * 2
    logits = T * m.vocab_size * 4  # the unfused cross entropy's fp32 upcast: 16 GiB at mbs 8
    assert logits / GIB == pytest.approx(15.66, abs=0.01)
    assert first.reserved_free_gib == pytest.approx(DEFAULT.alloc_reserved_base_gib + DEFAULT.alloc_reserved_block * fc1 / GIB)
    assert last.reserved_free_gib == pytest.approx(DEFAULT.alloc_reserved_base_gib
                                                   + DEFAULT.alloc_reserved_block * logits / GIB)
    # TE's cross entropy works in the bf16 logits: half the block
    te = stage_memory(m, DENSE.replace(cross_entropy_impl="te"))[1]
    assert te.reserved_free_gib == pytest.approx(DEFAULT.alloc_reserved_base_gib
                                                 + DEFAULT.alloc_reserved_block * logits / 2 / GIB)
    assert last.total_gib - last.reserved_free_gib == pytest.approx(
        last.weights_gib + last.grads_gib + last.optimizer_gib + last.activations_gib + last.logits_gib
        + last.overhead_gib + last.step_transient_gib)


def test_dropless_moe_layers_strand_token_buffers_as_sqrt_of_the_layers_and_padding_does_not():
    m = load_model("mixtral-8x7b")
    cfg = TrainConfig(tp=1, pp=1, dp=4, ep=4, mbs=1, gbs=16, seq=4096)
    one = moe_buffer_bytes(m, cfg)
    assert one > 0
    sm = stage_memory(m, cfg)[0]
    block = cfg.seq * cfg.mbs * m.vocab_size * 4
    assert sm.reserved_free_gib == pytest.approx(DEFAULT.alloc_reserved_base_gib + (
        DEFAULT.alloc_reserved_block * block + DEFAULT.alloc_reserved_moe * m.num_layers ** 0.5 * one) / GIB)
    # two pipeline stages: the first holds half the MoE layers (and no logits), its MoE part sqrt(2)
    # times smaller than the whole model's, not 2
    first = stage_memory(m, cfg.replace(pp=2))[0]
    whole = sm.reserved_free_gib - DEFAULT.alloc_reserved_base_gib - DEFAULT.alloc_reserved_block * block / GIB
    assert first.reserved_free_gib - DEFAULT.alloc_reserved_base_gib == pytest.approx(whole / 2 ** 0.5)
    padded = cfg.replace(moe_capacity_factor=1.0, moe_pad_to_capacity=True)
    assert moe_buffer_bytes(m, padded) == 0.0


def test_only_routing_sized_moe_buffers_strand():
    """EP = 1, BF16, grouped experts: every token buffer has the same size in every layer (dropless:
    tokens x top-k rows), so none is stranded; EP > 1 (the all-to-all's received tokens), experts one
    at a time (SequentialMLP) or FP8 (TE's per-expert quantized slices): sizes follow the routing.
    The array path (recommend's) keys its table on the grouped-GEMM knob as the per-layout one does."""
    m = load_model("mixtral-8x7b")
    fixed = TrainConfig(tp=2, pp=1, dp=2, ep=1, etp=2, mbs=1, gbs=16, seq=4096, sequence_parallel=True)
    assert moe_buffer_bytes(m, fixed) == 0.0
    for varied in (fixed.replace(tp=1, etp=1, sequence_parallel=False, ep=2, dp=4),
                   fixed.replace(moe_grouped_gemm=False), fixed.replace(precision="fp8")):
        assert moe_buffer_bytes(m, varied) > 0
    seq = fixed.replace(moe_grouped_gemm=False)
    L = Layouts.of(m, [fixed, seq])
    S = Stages(L)
    from advisor.models.memory import memory_arrays
    peak, _ = memory_arrays(m, L, DEFAULT, memo_for(m, None, DEFAULT), S)
    for i, cfg in enumerate((fixed, seq)):
        assert peak[i] == pytest.approx(max(s.total_gib for s in stage_memory(m, cfg)))
    assert peak[1] > peak[0] + 1.0


def test_expandable_segments_leave_the_measured_residual():
    m = load_model("llama3-8b")
    on = DENSE.replace(expandable_segments=True)
    for a, b in zip(stage_memory(m, DENSE), stage_memory(m, on)):
        assert b.reserved_free_gib == pytest.approx(DEFAULT.alloc_reserved_expandable_gib)
        assert a.reserved_free_gib > b.reserved_free_gib + 0.9
    # the array path (recommend's) honours the column as the per-layout one does
    L = Layouts.of(m, [DENSE, on])
    S = Stages(L)
    from advisor.models.memory import memory_arrays
    peak, _ = memory_arrays(m, L, DEFAULT, memo_for(m, None, DEFAULT), S)
    assert peak[0] - peak[1] == pytest.approx(max(s.total_gib for s in stage_memory(m, DENSE))
                                              - max(s.total_gib for s in stage_memory(m, on)))
    assert L.config(1).expandable_segments and not L.config(0).expandable_segments
    assert layouts_of(m, on).xseg is not None


def test_the_expandable_residual_is_the_measured_pair():
    """te-l8b-alloc-32 / -33: the same layout with expandable segments off / on: the same peak
    allocated, and the constant is the on run's peak reserved - peak allocated (max over ranks)."""
    import json
    from pathlib import Path

    recs = {}
    for line in (Path(__file__).resolve().parent.parent / "data/measurements/h100x4-te.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("id") in ("te-l8b-alloc-32", "te-l8b-alloc-33"):
            recs[r["config"]["expandable_segments"]] = r
    on, off = recs[True]["memory"], recs[False]["memory"]
    assert recs[True]["env"]["alloc_conf"] == "expandable_segments:True"
    assert max(on["peak_allocated_gib_per_rank"]) == pytest.approx(max(off["peak_allocated_gib_per_rank"]), abs=0.01)
    free = max(r - a for r, a in zip(on["peak_reserved_gib_per_rank"], on["peak_allocated_gib_per_rank"]))
    assert DEFAULT.alloc_reserved_expandable_gib == pytest.approx(free, abs=0.005)
    assert max(r - a for r, a in zip(off["peak_reserved_gib_per_rank"], off["peak_allocated_gib_per_rank"])) > 3.0


def test_te_default_on_runner_off_and_the_launch_environment_says_it():
    cfg = apply_layout_defaults(DENSE, "te")
    assert cfg.expandable_segments
    assert not apply_layout_defaults(DENSE, "local").expandable_segments
    assert not MA.runner_config(cfg).expandable_segments
    assert MA.launch_env(cfg) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert MA.launch_env(DENSE) == {}
    with pytest.raises(SpecError, match="expandable_segments must be true or false"):
        TrainConfig(expandable_segments="yes")


def test_shipped_coefficients_are_inside_their_physical_ranges():
    for k, (lo, hi) in RANGES.items():
        assert lo <= getattr(DEFAULT, k) <= hi
