"""Activation offloading to host memory (TrainConfig.cpu_offload_layers; megatron-core
cpu_offloading_num_layers through Transformer Engine's get_cpu_offload_context): what megatron-core
refuses, the offloaded layers' activations gone from the GPU, the copies' exposed time over the
host link (models/offload.py), the arguments and the runner's TransformerConfig."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from advisor.catalog import load_cluster, load_gpu, load_model
from advisor.catalog.specs import SpecError, TrainConfig
from advisor.models import vectorized as vz
from advisor.models.constants import DEFAULT as c
from advisor.models.memory import layer_activation_bytes, peak_memory_many, stage_memory
from advisor.models.offload import exposed_transfer_s
from advisor.models.predict import predict
from advisor.models.step_time import stage_times
from advisor.runners import megatron_args as MA
from advisor.runners.command import bridge_overrides, nemo_overrides
from advisor.runners.jobs import job_for, make_entry
from advisor.search_spaces.columns import Layouts
from advisor.search_spaces.layout import violations
from advisor.search_spaces.runnable import refusal, refused

M8 = load_model("llama3-8b").with_layers(16)
H100 = load_cluster("h100x4")
BASE = TrainConfig(dp=4, mbs=1, gbs=16, seq=8192)


def test_megatron_cores_refusals():
    with pytest.raises(SpecError, match="non-negative integer"):
        TrainConfig(cpu_offload_layers=-1)
    with pytest.raises(SpecError, match="non-negative integer"):
        TrainConfig(cpu_offload_layers=True)
    with pytest.raises(SpecError, match="Pipeline parallelism with CPU offloading"):
        TrainConfig(pp=2, cpu_offload_layers=1)
    with pytest.raises(SpecError, match="activation recomputation"):
        TrainConfig(recompute="selective", cpu_offload_layers=1)
    assert not violations(M8, H100, BASE.replace(cpu_offload_layers=15))
    assert "below the 16 layers" in violations(M8, H100, BASE.replace(cpu_offload_layers=16))[0]
    mi = load_cluster("mi250xx8")
    assert any("host_link_gbs" in v for v in violations(M8, mi, BASE.replace(dp=8, gbs=32, cpu_offload_layers=2)))
    assert not any("host_link_gbs" in v for v in violations(M8, mi, BASE.replace(dp=8, gbs=32)))


def test_every_nvidia_gpu_has_a_sourced_host_link():
    for name in ("a100-80g", "h100", "h200", "b200", "b300", "gb200", "gb300", "mi300x"):
        g = load_gpu(name)
        assert g.host_link_gbs > 0 and "host_link_gbs" in g.sources, name
    assert load_gpu("mi250x").host_link_gbs == 0  # not known: offloading refused there
    assert load_gpu("b300").host_link_gbs > load_gpu("h100").host_link_gbs > load_gpu("a100-80g").host_link_gbs


def test_the_offloaded_layers_activations_leave_the_gpu():
    f = 1 + c.fragmentation
    per_layer = layer_activation_bytes(M8, 0, BASE, c)
    base = stage_memory(M8, BASE)[0]
    for n in (1, 4, 8, 15):
        off = stage_memory(M8, BASE.replace(cpu_offload_layers=n))[0]
        # L - N layers stay (TE's synchronizer): exactly N layers' activations gone, nothing else moves
        assert base.activations_gib - off.activations_gib == pytest.approx(n * per_layer * f / 2 ** 30, rel=1e-12)
        assert off.activations_gib == pytest.approx((16 - n) / 16 * base.activations_gib, rel=1e-12)
        assert (off.weights_gib, off.grads_gib, off.optimizer_gib, off.logits_gib) == (
            base.weights_gib, base.grads_gib, base.optimizer_gib, base.logits_gib)
    # the arrays, rows with and without offloading at once, give each row's own peak
    cfgs = [BASE, BASE.replace(cpu_offload_layers=8), BASE.replace(mbs=2, cpu_offload_layers=4)]
    peaks = peak_memory_many(M8, Layouts.of(M8, cfgs), c)
    for cfg, p in zip(cfgs, peaks):
        assert p == pytest.approx(max(s.total_gib for s in stage_memory(M8, cfg)), rel=1e-12)


def test_exposed_transfer_form():
    # copies no longer than a layer's compute, with a window: hidden
    assert exposed_transfer_s(8, 16, 0.010, 0.012) == 0.0
    # longer: the queue on the one stream binds at the last copy, L - 2 layers of compute beside it
    assert exposed_transfer_s(8, 16, 0.040, 0.012) == pytest.approx(8 * 0.040 - 14 * 0.012)
    # N = L - 1 (TE warns it prevents overlap): every copy exposed
    assert exposed_transfer_s(15, 16, 0.001, 0.012) == pytest.approx(15 * 0.001)
    assert exposed_transfer_s(0, 16, 1.0, 0.0) == 0.0
    np.testing.assert_allclose(exposed_transfer_s(np.array([0, 8, 15]), 16, 0.040, 0.012),
                               [0.0, 8 * 0.040 - 14 * 0.012, 15 * 0.040])


def _with_link(gbs: float):
    return dataclasses.replace(H100, gpu=dataclasses.replace(H100.gpu, host_link_gbs=gbs))


def test_exposed_time_grows_as_the_host_link_shrinks_and_zero_layers_is_unchanged():
    cfg = BASE.replace(cpu_offload_layers=8)
    base = stage_times(M8, H100, BASE)[0]
    waits = [stage_times(M8, _with_link(bw), cfg)[0].overhead_s - base.overhead_s for bw in (1000.0, 63.0, 8.0, 2.0)]
    assert waits[0] == 0.0  # a fast link hides every copy
    assert all(b >= a for a, b in zip(waits, waits[1:])) and waits[-1] > waits[-2] > 0
    # the wait is the form's: per layer bytes over the link at its efficiency, both passes
    st = stage_times(M8, _with_link(2.0), cfg)[0]
    t_c = layer_activation_bytes(M8, 0, BASE, c) / (2.0e9 * c.host_link_efficiency)
    assert st.overhead_s - base.overhead_s > 2 * (8 * t_c - 14 * st.backward_s / 16)
    # where both passes are bound by the copies, halving the link adds N copies' time to each pass
    slower = stage_times(M8, _with_link(1.0), cfg)[0]
    assert slower.overhead_s - st.overhead_s == pytest.approx(2 * 8 * t_c, rel=1e-9)
    # no layer offloaded: the same prediction, bit for bit, alone or beside offloading rows
    alone = predict(M8, H100, BASE)
    res = vz.evaluate(M8, H100, Layouts.of(M8, [cfg, BASE]), c)
    assert res.prediction(1).to_dict() == alone.to_dict()
    assert res.prediction(0).to_dict() == predict(M8, H100, cfg).to_dict()
    assert predict(M8, H100, BASE.replace(cpu_offload_layers=0)).to_dict() == alone.to_dict()
    # memory falls, time does not fall
    off = predict(M8, _with_link(2.0), cfg)
    assert off.memory_gib_per_gpu < alone.memory_gib_per_gpu and off.step_time_s > alone.step_time_s


def test_arguments_and_the_runner_config():
    cfg = BASE.replace(cpu_offload_layers=4)
    prod = MA.megatron_lm_args(M8, cfg)
    i = prod.index("--cpu-offloading-num-layers")
    assert prod[i - 1] == "--cpu-offloading" and prod[i + 1] == "4"
    assert MA.layout_args(cfg)[-3:] == ["--cpu-offloading", "--cpu-offloading-num-layers", "4"]
    assert "--cpu-offloading" not in MA.megatron_lm_args(M8, BASE) + MA.layout_args(BASE)
    assert bridge_overrides(cfg, 5)[-4:] == ["model.cpu_offloading=true", "model.cpu_offloading_num_layers=4",
                                              "model.cpu_offloading_activations=true",
                                              "model.cpu_offloading_weights=false"]
    assert "model.config.cpu_offloading_num_layers=4" in nemo_overrides(cfg, 5)
    assert not any("cpu_offloading" in x for x in bridge_overrides(BASE, 5) + nemo_overrides(BASE, 5))
    # the runner: te stack runs it with megatron-core's fields, the local stack refuses in one line
    assert MA.runner_config(cfg).cpu_offload_layers == 4
    e = make_entry(M8, 4, stack="te", **cfg.to_dict())
    assert e.refused is None
    tc = job_for(e, 0)["tc"]
    assert (tc["cpu_offloading"], tc["cpu_offloading_num_layers"], tc["cpu_offloading_activations"],
            tc["cpu_offloading_weights"]) == (True, 4, True, False)
    assert "cpu_offloading" not in job_for(make_entry(M8, 4, stack="te", **BASE.to_dict()), 0)["tc"]
    local = make_entry(M8, 4, stack="local", **cfg.to_dict())
    assert "get_cpu_offload_context" in local.refused and "\n" not in local.refused
    assert refusal(M8, cfg, "te") is None
    out, counts = refused(M8, Layouts.of(M8, [BASE, cfg]), "local")
    assert out.tolist() == [False, True] and counts == {"cpu_offload": 1}


@pytest.mark.parametrize("args, says", [
    (["--cpu-offload-layers", "-1"], "--cpu-offload-layers must be >= 0"),
    (["--cpu-offload-layers", "2", "--pp", "2"], "Pipeline parallelism with CPU offloading"),
    (["--cpu-offload-layers", "2", "--recompute", "full"], "activation recomputation"),
    (["--cpu-offload-layers", "32"], "must be below the 32 layers"),
])
def test_bad_offload_input_is_one_error_line(args, says):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "advisor", "predict", "-m", "llama3-8b", "-c", "h100x8", *args],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], p.stderr


def test_predict_shows_it():
    import json
    import subprocess
    import sys

    base = [sys.executable, "-m", "advisor", "predict", "-m", "llama3-8b", "-c", "h100x8", "--stack", "te"]
    p = subprocess.run(base + ["--cpu-offload-layers", "8", "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["config"]["cpu_offload_layers"] == 8
    p = subprocess.run(base + ["--cpu-offload-layers", "8"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "offload 8L" in p.stdout


def test_the_bench_reports_the_gb200_recipe_and_the_campaign():
    from support import load_bench

    b = load_bench("offload_check")
    rows = {(r["recipe"], r["offload"]): r for r in b.recipe_rows("161")}
    for recipe in {k[0] for k in rows}:
        none, half, most = rows[(recipe, 0)], rows[(recipe, 20)], rows[(recipe, 40)]
        assert none["gib"] - half["gib"] == pytest.approx(half["gib"] - most["gib"])  # 20 layers each
        assert most["gib"] < none["gib"] - 100
        assert most["tok_s_gpu"] <= none["tok_s_gpu"]
    jobs = b.campaign_rows([])
    assert len(jobs) == 6 and {j["offload"] for j in jobs} == {0, 4, 8}
    assert all(j["wait_ms"] == 0.0 for j in jobs if j["offload"] == 0)
