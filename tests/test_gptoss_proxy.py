"""The gpt-oss proxy on one H200 with Transformer Engine (session 34, issue #24;
data/measurements/h200x1-te.jsonl, `bash bench/te_device.sh run 500 x1-h200-te-s34` and `... s34b`):
gpt-oss-120b at full width with its window, sinks, clamped quick-GeGLU and biases, 16 experts top-4
(1,024 tokens per expert per 4096-token micro-batch, one GPU's share of NVIDIA's EP8 recipe).

What the runs pin down: at micro-batch 4 the GPU binds (86% busy), and there the step's memory-bound
kernels (elementwise, permute / unpermute, norms, RoPE, loss, copies: 271 ms of its 762 ms) are what the te
profile prices as memory_bound_s (273 ms). Pricing the experts at their own GEMM shape alone (branch
moe-per-shape, 108 ms memory-bound) leaves ~160 ms of them out: that model is 37% too fast here, as
it is on NVIDIA's published gpt-oss rows (+50%)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from advisor.catalog import load_cluster
from advisor.catalog.specs import ModelSpec, TrainConfig
from advisor.models.calibrate import resolve_calibration
from advisor.models.dataset import legacy_config, shape_key
from advisor.models.predict import predict
from advisor.models.profile_fit import on_vm

DATA = Path(__file__).resolve().parents[1] / "data" / "measurements" / "h200x1-te.jsonl"


@pytest.fixture(scope="module")
def runs():
    recs = [r for r in (json.loads(x) for x in DATA.read_text().splitlines() if x.strip())
            if r["model"]["name"].startswith("gpt-oss")]
    vm = on_vm(resolve_calibration("te")).constants
    cluster = load_cluster("h200x1")
    out = []
    for r in recs:
        m = ModelSpec.from_dict(r["model"])
        cfg = TrainConfig.from_dict(legacy_config(r["config"], m, "te"))
        out.append((r, m, predict(m, cluster, cfg, vm, check_legal=False)))
    return out


def test_records_name_their_stack_and_features(runs):
    assert len(runs) >= 15 and all(r["status"] == "ok" for r, _, _ in runs)
    for r, m, _ in runs:
        assert r["stack"] == "te" and r["env"]["transformer_engine"] == "2.20.2"
        assert r["env"]["megatron_core"] == "0.19.2" and r["env"]["gpu_name"] == "NVIDIA H200"
    names = {m.name.split("[")[0]: m for _, m, _ in runs}
    full = names["gpt-oss-120b-proxy"]
    assert full.attention_sinks and full.window_size == 128 and full.activation_clamp == 7.0
    plain = names["gpt-oss-120b-proxy-plain"]
    assert not plain.attention_sinks and plain.window_size == 0 and plain.activation_clamp == 0.0
    # the variants are one architecture: leaving it out leaves them all out
    assert len({shape_key(m) for _, m, _ in runs}) == 1


def test_gpu_bound_step_and_its_memory_bound_kernels(runs):
    r, _, p = next(x for x in runs if x[0]["id"] == "h1te-oss-kp-10")
    kp = r["kernel_profile"]
    assert kp["gpu"]["non_nccl_busy"] > 0.8  # the GPU binds: the model's GPU terms are the step
    measured = r["throughput"]["tokens_per_s_per_gpu"]
    assert abs(p.tokens_per_s_per_gpu / measured - 1) < 0.08
    from support import load_bench

    memory_bound = load_bench("moe_kernels").MEMORY_BOUND  # the kernel categories the bench counts
    mem_bound_ms = sum(kp["categories"].get(k, {}).get("ms", 0.0) for k in memory_bound)
    assert 250 < mem_bound_ms < 290
    assert abs(p.breakdown["memory_bound_s"] * 1000 / mem_bound_ms - 1) < 0.15


def test_memory_of_every_run(runs):
    vm = on_vm(resolve_calibration("te")).constants
    for r, _, p in runs:
        # the fullest stage's peak, the analytical runtime overhead left out (as te_check compares),
        # against the measured peak reserved (memory.max_gib); the micro-batch 4 runs' activations are
        # under-predicted (72.3 vs 77.75 GiB here, -7%), the rest sit under the optimizer step's transient
        pred = p.memory_gib_per_gpu - vm.runtime_overhead_gib
        meas = r["memory"]["max_gib"]
        assert abs(pred / meas - 1) < (0.10 if r["config"]["mbs"] >= 4 else 0.02), r["id"]
