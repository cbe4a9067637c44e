"""The softmax's exponentials on the special function units (models/step_time.softmax_stretch)."""
import dataclasses

import pytest

from advisor.catalog import TrainConfig, load_cluster, load_gpu, load_model
from advisor.models.constants import DEFAULT
from advisor.models.step_time import softmax_stretch, stage_times


def test_reference_gpu_and_head_size_keep_their_attention_time():
    # attention_efficiency is defined on an H100 at head dim 128: the stretch is 1 there
    for m in ("llama3-8b", "llama3-70b", "gpt3-175b"):
        assert load_model(m).head_dim == 128
        assert softmax_stretch(load_model(m), load_gpu("h100"), DEFAULT) == pytest.approx(1.0, abs=1e-12)


def test_blackwell_slower_blackwell_ultra_faster_per_flop():
    m = load_model("llama3-8b")
    s = {g: softmax_stretch(m, load_gpu(g), DEFAULT) for g in ("h100", "b200", "gb200", "b300", "gb300")}
    # B200 / GB200: 2.25-2.5x the H100's tensor rate, about its exponential rate
    assert s["b200"] > 1.1 and s["gb200"] > s["b200"]
    # Blackwell Ultra doubles the SFU rate: below the H100's ratio, well below GB200's
    assert s["gb300"] < 1.0 and s["b300"] < 1.0
    assert s["gb300"] / s["gb200"] < 0.85


def test_smaller_heads_spend_more_of_attention_on_the_softmax():
    base = load_model("llama3-8b")
    g = load_gpu("gb200")
    small = dataclasses.replace(base, kv_channels=64)
    big = dataclasses.replace(base, kv_channels=256)
    assert softmax_stretch(small, g, DEFAULT) > softmax_stretch(base, g, DEFAULT) > softmax_stretch(big, g, DEFAULT)


def test_unknown_sfu_rate_leaves_attention_at_the_tensor_rate():
    g = load_gpu("mi300x")
    assert g.sfu_exp_tera_per_s == 0
    assert softmax_stretch(load_model("llama3-8b"), g, DEFAULT) == 1.0


def test_stage_attention_time_scales_by_the_stretch():
    m = load_model("llama3-8b")
    cfg = TrainConfig(tp=1, pp=1, mbs=1, gbs=8, seq=8192)
    a = {}
    for g in ("gb200", "gb300"):
        a[g] = stage_times(m, load_cluster(f"{g}x8"), cfg, DEFAULT)[0].attention_s
    ratio = softmax_stretch(m, load_gpu("gb300"), DEFAULT) / softmax_stretch(m, load_gpu("gb200"), DEFAULT)
    assert a["gb300"] / a["gb200"] == pytest.approx(ratio, rel=1e-9)  # same BF16 peak, same shapes


def test_every_nvidia_gpu_with_a_rate_has_its_source():
    for name in ("a100-80g", "h100", "h200", "b200", "gb200", "b300", "gb300"):
        g = load_gpu(name)
        assert g.sfu_exp_tera_per_s > 0 and g.sources.get("sfu_exp_tera_per_s", "").strip(), name
