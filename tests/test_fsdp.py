"""Megatron FSDP (TrainConfig.fsdp, optim_grads_params): weights, gradients and optimizer states
sharded over the data-parallel ranks, the units in flight gathered whole; its Megatron-LM arguments;
this project's runner runs it off; the published FSDP recipes read it."""
from __future__ import annotations

import os

import numpy as np
import pytest

from advisor.catalog import SpecError, TrainConfig, load_cluster, load_model
from advisor.models.constants import DEFAULT, GIB
from advisor.models.flops import embedding_params, layer_params, output_params
from advisor.models.memory import stage_memory
from advisor.runners import command as C
from advisor.runners import megatron_args as MA
from advisor.search_spaces.columns import Layouts, enumerate_columns
from advisor.search_spaces.space import SpaceOptions, Workload

# the published FSDP recipe's layout (models/published.py: llama3_8b H100 fsdp rows)
DP8 = TrainConfig(dp=8, mbs=1, gbs=128, seq=8192, precision="fp8", fp8_recipe="tensorwise")


def test_fsdp_needs_the_distributed_optimizer_and_a_bool():
    with pytest.raises(SpecError, match="fsdp .*needs the distributed optimizer"):
        DP8.replace(distributed_optimizer=False, fsdp=True)
    with pytest.raises(SpecError, match="fsdp must be true or false"):
        DP8.replace(fsdp=1)
    assert TrainConfig.from_dict({**DP8.to_dict(), "fsdp": True}).fsdp


def test_weights_and_gradients_are_sharded_and_two_units_gathered():
    m = load_model("llama3-8b")
    off, on = stage_memory(m, DP8)[0], stage_memory(m, DP8.replace(fsdp=True))[0]
    # what does not change: the optimizer's shard (already sharded), the activations, the logits
    assert (on.optimizer_gib, on.activations_gib, on.logits_gib) == (off.optimizer_gib, off.activations_gib,
                                                                      off.logits_gib)
    # a layer of llama3-8b has fewer parameters than its embedding: the stage's largest unit is the
    # output layer (untied: the embedding's size plus the final norm)
    lp = layer_params(m, 0)
    assert lp.attention + lp.dense_mlp + lp.norms < embedding_params(m) < output_params(m)
    units = DEFAULT.fsdp_units_in_flight * output_params(m) / on.params
    assert on.weights_gib == pytest.approx(off.weights_gib * (1 / 8 + units))
    assert on.grads_gib == pytest.approx(off.grads_gib * (1 / 8 + units))
    saved = (off.weights_gib + off.grads_gib) - (on.weights_gib + on.grads_gib)
    assert saved > 20.0  # GiB: 7/8 of the BF16 weights, FP8 copies and fp32 gradients of 8B parameters
    assert off.total_gib - on.total_gib == pytest.approx(saved)
    # DP 1: nothing to shard over, the gathered units come on top
    one = TrainConfig(dp=1, mbs=1, gbs=8, seq=4096)
    assert stage_memory(m, one.replace(fsdp=True))[0].weights_gib > stage_memory(m, one)[0].weights_gib


def test_columns_and_configs_carry_it():
    m, c = load_model("llama3-8b"), load_cluster("h100x8")
    L = enumerate_columns(m, c, Workload(gbs=64, seq=4096, precision="bf16"), SpaceOptions(fsdp=True))
    # FSDP where the space offers it: the distributed optimizer, DP x CP > 1, no pipeline
    assert L.fsdp is not None and (L.fsdp == (L.dist_opt & (L.pp == 1))).all() and L.fsdp.any()
    for i in range(0, len(L), max(1, len(L) // 40)):
        cfg = L.config(i)
        assert cfg.fsdp == bool(L.fsdp[i])
        assert Layouts.of(m, [cfg]).config(0).fsdp == cfg.fsdp
    assert enumerate_columns(m, c, Workload(gbs=64, seq=4096), SpaceOptions()).fsdp is None
    # the arrays and the per-layout call agree (one model: models.memory.memory_arrays)
    rows = [i for i in range(len(L)) if L.fsdp[i]][:20]
    cfgs = [L.config(i) for i in rows]
    from advisor.models.memory import peak_memory_many
    per = [max(s.total_gib for s in stage_memory(m, x)) for x in cfgs]
    assert np.allclose(peak_memory_many(m, Layouts.of(m, cfgs)), per, rtol=1e-12)


def test_megatron_arguments_and_the_runner_runs_it_off(tmp_path):
    on = DP8.replace(fsdp=True)
    for a in (MA.layout_args(on), MA.megatron_lm_args(load_model("llama3-8b"), on)):
        assert "--use-megatron-fsdp" in a and "--use-distributed-optimizer" in a
        assert a[a.index("--data-parallel-sharding-strategy") + 1] == "optim_grads_params"
        assert a[a.index("--ckpt-format") + 1] == "fsdp_dtensor"  # validate_args asserts it with FSDP
    assert "--use-megatron-fsdp" not in MA.layout_args(DP8)
    assert not MA.runner_config(on).fsdp
    # Megatron-LM asserts CUDA_DEVICE_MAX_CONNECTIONS != 1 with Megatron FSDP: a TP layout's command
    # does not get the =1 it gets without FSDP
    tp2 = TrainConfig(tp=2, dp=4, mbs=1, gbs=32, seq=4096)
    spec = C.CommandSpec("pretrain_gpt.py {megatron_args}")
    if "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ:
        m = load_model("llama3-8b")
        _, env = C.build_command(spec, m, tp2, 5, C.NodeInfo(8), "t", tmp_path, tmp_path / "s")
        assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
        _, env = C.build_command(spec, m, tp2.replace(fsdp=True), 5, C.NodeInfo(8), "t", tmp_path, tmp_path / "s")
        assert "CUDA_DEVICE_MAX_CONNECTIONS" not in env


def test_the_published_fsdp_recipes_read_it():
    from advisor.models import published as P

    rows = [r for r in P.load() if r.usable and r.fsdp]
    assert rows
    for r in rows:
        assert r.cfg.fsdp == (r.cfg.dp * r.cfg.cp > 1), r.row_id
        assert not any("Megatron FSDP optim_grads_params" in u for u in r.unmodelled)
