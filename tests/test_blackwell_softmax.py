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
    g200, g300 = load_gpu("gb200"), load_gpu("gb300")
    ratio = softmax_stretch(m, g300, DEFAULT) / softmax_stretch(m, g200, DEFAULT)
    # same shapes; the BF16 peaks at the maximum clock differ by SMs x clock (160 x 2070 / 152 x 2062)
    peaks = g200.bf16_tflops / g300.bf16_tflops
    assert a["gb300"] / a["gb200"] == pytest.approx(ratio * peaks, rel=1e-9)


def test_every_nvidia_gpu_with_a_rate_has_its_source():
    for name in ("a100-80g", "h100", "h200", "b200", "gb200", "b300", "gb300"):
        g = load_gpu(name)
        assert g.sfu_exp_tera_per_s > 0 and g.sources.get("sfu_exp_tera_per_s", "").strip(), name


def test_mfu_is_against_the_peak_of_the_formats_the_gemms_run_in():
    from advisor.models.quant import mfu_peak_tflops
    from advisor.catalog.specs import QUANTS
    from advisor.models.predict import predict

    m, g = load_model("llama3.1-405b"), load_gpu("gb300")
    code = {q: i for i, q in enumerate(QUANTS)}
    assert mfu_peak_tflops(m, 8192, g, code["bf16"]) == g.bf16_tflops
    # between the BF16 peak and the format's: core attention and the output layer stay BF16
    assert g.bf16_tflops < mfu_peak_tflops(m, 8192, g, code["fp8"]) < g.fp8_tflops
    assert g.fp8_tflops < mfu_peak_tflops(m, 8192, g, code["nvfp4"]) < g.fp4_tflops
    # the published GB300 NVFP4 405B runs: MFU below 1 (against the BF16 peak it read above 1)
    from advisor.models import published as P
    from advisor.models.calibrate import resolve_calibration

    c = resolve_calibration("default", "te", g).constants
    runs = [r for r in P.load() if r.usable and r.gpu_type == "GB300" and r.cfg.precision == "nvfp4"
            and r.model_key == "llama3.1_405b"]
    assert runs
    for r in runs:
        p = predict(r.model, r.cluster, r.cfg, c, check_legal=False)
        assert 0.2 < p.mfu < 1.0
        assert p.tflops_per_gpu / g.bf16_tflops > 1.0
