"""The pipeline's stage outputs (TrainConfig.deallocate_pipeline_outputs, megatron-core
ModelParallelConfig.deallocate_pipeline_outputs): off, each pipeline stage keeps the output tensor
of every chunk-microbatch in flight until its backward; on (Megatron-LM's training and
Megatron-Bridge set it; the te stack's default), the pipeline frees it once sent. This project's
runner runs megatron-core's default (off), and its records say so."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from advisor.catalog import SpecError, TrainConfig, load_cluster, load_model
from advisor.catalog.specs import ModelSpec
from advisor.models.constants import DEFAULT, GIB
from advisor.models.memory import layouts_of, memory_arrays, stage_memory
from advisor.models.calibrate import resolve_calibration
from advisor.models.profiles import apply_layout_defaults
from advisor.models.stages import Stages, memo_for
from advisor.runners import megatron_args as MA
from advisor.search_spaces.columns import Layouts, enumerate_columns
from advisor.search_spaces.layout import in_flight_chunks
from advisor.search_spaces.space import SpaceOptions, Workload

ROOT = Path(__file__).resolve().parent.parent
PP = TrainConfig(tp=2, pp=4, vp=2, dp=1, mbs=2, gbs=32, seq=4096, sequence_parallel=True)


def test_te_default_on_local_and_runner_off():
    assert apply_layout_defaults(PP, "te").deallocate_pipeline_outputs
    assert not apply_layout_defaults(PP, "local").deallocate_pipeline_outputs
    assert not MA.runner_config(apply_layout_defaults(PP, "te")).deallocate_pipeline_outputs
    with pytest.raises(SpecError, match="deallocate_pipeline_outputs must be true or false"):
        TrainConfig(deallocate_pipeline_outputs=1)


def test_kept_outputs_are_the_in_flight_chunks_but_the_loss():
    m = load_model("llama3-8b")
    on = PP.replace(deallocate_pipeline_outputs=True)
    one = PP.seq * PP.mbs * m.hidden_size / PP.tp * DEFAULT.bytes_activation / GIB  # SP: sharded over TP
    for a, b in zip(stage_memory(m, PP), stage_memory(m, on)):
        chunks = in_flight_chunks(PP, a.stage)
        kept = sum(chunks[:-1]) if a.stage == PP.pp - 1 else sum(chunks)
        assert kept > 0
        assert a.activations_gib - b.activations_gib == pytest.approx(kept * one * (1 + DEFAULT.fragmentation))
        assert (a.weights_gib, a.logits_gib, a.reserved_free_gib) == (b.weights_gib, b.logits_gib, b.reserved_free_gib)
    # no pipeline, nothing kept
    flat = PP.replace(pp=1, vp=1)
    assert [s.total_gib for s in stage_memory(m, flat)] == \
        [s.total_gib for s in stage_memory(m, flat.replace(deallocate_pipeline_outputs=True))]


def test_columns_and_configs_carry_it():
    m, c = load_model("llama3-8b"), load_cluster("h100x8")
    wl = Workload(gbs=64, seq=4096)
    L = enumerate_columns(m, c, wl, SpaceOptions(deallocate_pipeline_outputs=True))
    assert L.dpo is not None and L.dpo.all()
    assert enumerate_columns(m, c, wl, SpaceOptions()).dpo is None
    cfgs = [PP, PP.replace(deallocate_pipeline_outputs=True)]
    L = Layouts.of(m, cfgs)
    assert [L.config(i).deallocate_pipeline_outputs for i in range(2)] == [False, True]
    peak, _ = memory_arrays(m, L, DEFAULT, memo_for(m, None, DEFAULT), Stages(L))
    for i, cfg in enumerate(cfgs):
        assert peak[i] == pytest.approx(max(s.total_gib for s in stage_memory(m, cfg)))
    assert peak[0] > peak[1]
    assert layouts_of(m, cfgs[1]).dpo is not None


def test_the_runner_records_say_off_and_fit_better_so():
    """te-gpt3-top-01 (GPT-3 2.7B PP2 VP16 mbs8, the runner: off): each stage's measured peak
    allocated memory is closer to the prediction with the outputs kept than freed."""
    rec = next(json.loads(line) for line in (ROOT / "data/measurements/h100x4-te.jsonl").read_text().splitlines()
               if '"te-gpt3-top-01"' in line)
    cfg = TrainConfig.from_dict(rec["config"])
    assert not cfg.deallocate_pipeline_outputs
    m = ModelSpec.from_dict(rec["model"])
    c = resolve_calibration("default", "te").screening_constants
    mem = rec["memory"]
    per = len(mem["peak_allocated_gib_per_rank"]) // cfg.pp
    for dpo in (False, True):
        for sm in stage_memory(m, cfg.replace(deallocate_pipeline_outputs=dpo), c):
            meas = max(mem["peak_allocated_gib_per_rank"][sm.stage * per:(sm.stage + 1) * per])
            err = meas - (sm.total_gib - sm.reserved_free_gib)
            assert (abs(err) < 2.0) if not dpo else (err > 2.5)
