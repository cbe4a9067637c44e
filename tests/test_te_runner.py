"""The runner's te stack (Transformer Engine layer spec) on CPU: what it refuses, the jobs the
worker gets, the records it writes, TE missing said in one line, and `tune --stack te`'s plan.
The GPU side runs in tests/gpu/test_gpu_runner.py::test_te_stack_on_local_gpus."""
from __future__ import annotations

import pytest

from advisor.catalog import load_model
from advisor.catalog.specs import SpecError, TrainConfig
from advisor.runners import measure as M
from advisor.runners import megatron_args as MA

LLAMA = load_model("llama3-8b").with_layers(2)
MIX = load_model("mixtral-8x7b").with_layers(2)


@pytest.mark.parametrize("kw", [dict(precision="fp8"), dict(tp=2, sequence_parallel=True), dict(cp=2)])
def test_te_runs_what_local_refuses(kw):
    cfg = TrainConfig(gbs=8, **kw)
    assert MA.refusal_reason(LLAMA, cfg, stack="local")
    assert MA.refusal_reason(LLAMA, cfg, stack="te") is None


def test_te_refusals():
    assert "userbuffers" in MA.refusal_reason(LLAMA, TrainConfig(tp=2, sequence_parallel=True,
                                                                  tp_comm_overlap=True), stack="te")
    assert "sequence parallelism" in MA.refusal_reason(MIX, TrainConfig(tp=2, ep=1), stack="te")
    assert MA.refusal_reason(MIX, TrainConfig(tp=2, sequence_parallel=True), stack="te") is None
    assert "unknown runner stack" in MA.refusal_reason(LLAMA, TrainConfig(), stack="nemo")


def test_te_job_is_what_the_recipes_run():
    e = M.make_entry(LLAMA, 4, stack="te", tp=2, sequence_parallel=True, precision="fp8", fp8_recipe="tensorwise")
    assert e.refused is None
    job = M.job_for(e, 0)
    tc = job["tc"]
    assert job["stack"] == "te" and tc["transformer_impl"] == "transformer_engine"
    assert tc["bf16"] is True and tc["fp8"] == "hybrid" and tc["fp8_recipe"] == "tensorwise"
    assert tc["sequence_parallel"] is True and tc["gradient_accumulation_fusion"] is False
    assert job["ddp"]["grad_reduce_in_fp32"] is False and job["opt"]["bf16"] is True
    local = M.job_for(M.make_entry(LLAMA, 4), 0)
    assert local["tc"]["transformer_impl"] == "local" and local["ddp"]["grad_reduce_in_fp32"] is True
    moe = M.job_for(M.make_entry(MIX, 4, stack="te", ep=4, precision="fp8"), 0)
    assert moe["moe_experts"] == "te_grouped" and moe["tc"]["moe_grouped_gemm"] is True
    assert moe["tc"]["moe_router_padding_for_quantization"] is True


def test_bad_stack_or_recipe_is_one_line():
    with pytest.raises(SpecError, match="stack must be one of"):
        M.make_entry(LLAMA, 4, stack="nemo")
    with pytest.raises(SpecError, match="fp8_recipe must be one of"):
        M.make_entry(LLAMA, 4, stack="te", fp8_recipe="mxfp8")


def test_te_missing_is_a_refusal_and_the_record_names_the_stack(tmp_path, monkeypatch):
    monkeypatch.setattr(M, "te_available", lambda: False)
    entries = [M.make_entry(LLAMA, 1, stack="te"), M.make_entry(LLAMA, 1, stack="te", precision="fp8")]
    recs = M.run_batch(entries, tmp_path / "d.jsonl", 1, run_dir=tmp_path / "run")
    assert [r["status"] for r in recs] == ["refused", "refused"]
    assert all(r["error"] == M.TE_MISSING and r["stack"] == "te" for r in recs)
    assert recs[1]["fp8_recipe"] == "delayed" and "fp8_recipe" not in recs[0]
    assert len(M.read_jsonl(tmp_path / "d.jsonl")) == 2


def test_te_entry_survives_the_pending_file():
    e = M.make_entry(LLAMA, 4, stack="te", precision="fp8", fp8_recipe="tensorwise")
    back = M.entry_from_dict(M.entry_to_dict(e))
    assert (back.stack, back.fp8_recipe) == ("te", "tensorwise")


def test_tune_plan_with_the_te_stack_keeps_sp_and_cp():
    from advisor.study import TuneSettings, make_plan

    te = make_plan(TuneSettings(model="llama3-8b", cluster="h100x4", runner="megatron", layers=4, stack="te"))
    local = make_plan(TuneSettings(model="llama3-8b", cluster="h100x4", runner="megatron", layers=4))
    assert any(c.cp > 1 for c in te.layouts) and not any(c.cp > 1 for c in local.layouts)
    assert any(c.sequence_parallel for c in te.layouts) and not any(c.sequence_parallel for c in local.layouts)
    assert not any(c.tp_comm_overlap for c in te.layouts)
    assert te.study_name.endswith("-megatron-te") and local.study_name.endswith("-megatron")
    assert te.calibration.profile == "te" and local.calibration.profile == "local"
    with pytest.raises(SpecError, match="--stack must be one of"):
        make_plan(TuneSettings(model="llama3-8b", cluster="h100x4", runner="megatron", stack="nemo"))


def test_fit_refuses_mixed_stacks_and_filters_with_stack(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    te = root / "data" / "measurements" / "h100x4-te.jsonl"
    local = root / "data" / "measurements" / "h100x4-dense.jsonl"
    p = subprocess.run([sys.executable, "-m", "advisor", "fit", "-d", str(te), "-d", str(local),
                        "-o", str(tmp_path / "c.joblib")], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 2 and "several runner stacks" in p.stderr and "Traceback" not in p.stderr
    assert "--stack local or --stack te" in p.stderr.strip().splitlines()[-1]
    from advisor.models.dataset import load

    ds = load([te, local])
    assert {r.stack for r in ds.records} == {"te", "local"}
    assert sum(r.stack == "te" for r in ds.records) == sum(
        1 for line in te.read_text().splitlines() if json.loads(line)["status"] == "ok")
