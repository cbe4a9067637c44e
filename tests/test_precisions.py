"""--precision bf16|fp8|mxfp8|nvfp4 and the FP8 recipes: rates, casts, memory, args, errors."""
import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from advisor.catalog import TrainConfig, load_cluster, load_gpu, load_model
from advisor.catalog.specs import QUANTS, SpecError, check_precision, quant_parts
from advisor.models import vectorized as vz
from advisor.search_spaces.columns import Layouts
from advisor.models.constants import DEFAULT
from advisor.models.memory import stage_memory
from advisor.models.predict import predict
from advisor.models.quant import element_bytes, quant
from advisor.runners.megatron_args import layout_args

M = load_model("llama3-70b")
C = load_cluster("gb200x64")
BASE = dict(tp=4, pp=2, dp=8, mbs=1, gbs=64, seq=8192, sequence_parallel=True)


def cfg(**kw):
    return TrainConfig(**{**BASE, **kw})


def test_codes_round_trip():
    for code, name in enumerate(QUANTS):
        p, r = quant_parts(code)
        assert TrainConfig(precision=p, fp8_recipe=r).quant == name
    assert cfg(precision="fp8").key().endswith("-fp8-none")  # delayed fp8 keeps the old key
    assert "-fp8-tensorwise-" in cfg(precision="fp8", fp8_recipe="tensorwise").key()


def test_block_formats_need_blackwell():
    with pytest.raises(SpecError, match="needs Blackwell"):
        check_precision(load_gpu("h100"), "nvfp4")
    check_precision(load_gpu("b200"), "mxfp8")
    g = load_gpu("gb200")  # NVFP4 at the FP4 rate, MXFP8 at the FP8 rate (rates at the maximum clock)
    assert g.peak_tflops("nvfp4") == g.fp4_tflops == pytest.approx(4 * g.peak_tflops("bf16"), abs=3)
    assert g.peak_tflops("mxfp8") == g.fp8_tflops == pytest.approx(2 * g.peak_tflops("bf16"), abs=2)


def test_scale_bytes_per_element():
    assert element_bytes("mxfp8") == pytest.approx(1 + 1 / 32)
    assert element_bytes("nvfp4") == pytest.approx(0.5 + 1 / 16)
    assert element_bytes("fp8") == 1.0
    g = load_gpu("h100")  # two copies of a per-tensor FP8 operand (Blackwell's one: the next test)
    d = quant(g, QUANTS.index("fp8"), DEFAULT)
    t = quant(g, QUANTS.index("fp8-tensorwise"), DEFAULT)
    assert (d.cast_fwd_bytes, d.cast_bwd_bytes) == (DEFAULT.fp8_cast_fwd_bytes, DEFAULT.fp8_cast_bwd_bytes)
    assert t.cast_fwd_bytes == d.cast_fwd_bytes + 2 and t.cast_bwd_bytes == d.cast_bwd_bytes + 2  # amax pass
    assert quant(g, 0, DEFAULT) is None


def test_blackwell_keeps_one_copy_of_a_per_tensor_fp8_operand():
    """TE makes the transpose of a per-tensor FP8 operand only where the FP8 GEMMs are TN-only
    (Hopper); on Blackwell (GPUSpec.fp8_transposed_copy False, a property of the GPU, not of a
    profile) one copy, while the block formats quantize along each axis apart everywhere."""
    from advisor.models.calibrate import resolve_calibration
    from advisor.models.quant import copies, weight_copy_bytes

    bwg, hopg = load_gpu("gb200"), load_gpu("h100")
    assert not bwg.fp8_transposed_copy and hopg.fp8_transposed_copy
    assert load_gpu("h200").fp8_transposed_copy and not load_gpu("b200").fp8_transposed_copy
    assert not load_gpu("a100-80g").fp8_transposed_copy  # no FP8 tensor cores: nothing to copy
    assert copies("fp8", None) == 2.0  # no GPU given: Hopper-like
    bw = resolve_calibration("default", "te", gpu=bwg).screening_constants
    hop = resolve_calibration("default", "te", gpu=hopg).screening_constants
    assert not hasattr(bw, "fp8_tensor_scaled_copies") and not hasattr(hop, "fp8_tensor_scaled_copies")
    fp8, cs, mx = (QUANTS.index(q) for q in ("fp8", "fp8-tensorwise", "mxfp8"))
    for c in (bw, hop, DEFAULT):  # whichever profile: the GPU decides
        assert weight_copy_bytes(fp8, c, hopg) == 2.0 and weight_copy_bytes(cs, c, hopg) == 2.0
        assert weight_copy_bytes(fp8, c, bwg) == 1.0 and weight_copy_bytes(cs, c, bwg) == 1.0
        assert weight_copy_bytes(mx, c, bwg) == weight_copy_bytes(mx, c, hopg) == pytest.approx(2 * (1 + 1 / 32))
    # the casts write one 1-byte copy instead of two: GB200 against a GB200 that were TN-only
    g = bwg
    tn = dataclasses.replace(bwg, generation="hopper")
    assert tn.fp8_transposed_copy
    for code in (fp8, cs):
        assert quant(tn, code, DEFAULT).cast_fwd_bytes - quant(g, code, DEFAULT).cast_fwd_bytes == pytest.approx(1.0)
        assert quant(tn, code, DEFAULT).cast_bwd_bytes - quant(g, code, DEFAULT).cast_bwd_bytes == pytest.approx(1.0)
    assert quant(g, mx, DEFAULT) == quant(tn, mx, DEFAULT)
    # memory: the quantized weight copies halve, nothing else moves
    a, b = (stage_memory(M, cfg(precision="fp8"), DEFAULT, gpu=x)[0] for x in (g, tn))
    assert b.weights_gib - a.weights_gib == pytest.approx(a.params * 1.0 / 2**30, rel=0.1)
    assert (a.grads_gib, a.optimizer_gib, a.activations_gib) == (b.grads_gib, b.optimizer_gib, b.activations_gib)


def test_b200_keeps_one_fp8_weight_copy_under_the_analytical_profile_where_h100_keeps_two():
    """Not only the te-blackwell profile: the analytical constants (DEFAULT, --calibration none) and
    the local profile on a B200 keep one FP8 copy of each linear weight, an H100 two; the memory
    differs by exactly one 1-byte copy of the stage's linear weights. The FP8 primary weights'
    transposes (models/step_time.py dp_terms) follow the same property."""
    from advisor.models.calibrate import resolve_calibration
    from advisor.models.constants import GIB
    from advisor.models.memory import linear_params, peak_memory_gib
    from advisor.models.stages import Stages, memo_for
    from advisor.models.step_time import dp_terms
    from advisor.search_spaces.layout import stage_layers

    m = load_model("llama3-8b")
    x = TrainConfig(tp=1, pp=2, dp=4, mbs=1, gbs=32, seq=4096, precision="fp8")
    b200, h100 = load_gpu("b200"), load_gpu("h100")
    layers = stage_layers(m, x)
    local = resolve_calibration("local")
    for c in (DEFAULT,) + ((local.constants,) if local is not None else ()):
        one = stage_memory(m, x, c, gpu=b200)
        two = stage_memory(m, x, c, gpu=h100)
        assert stage_memory(m, x, c) == two  # no GPU given: Hopper-like
        for a, b in zip(one, two):
            copy = linear_params(m, x, layers[a.stage]) * 1.0 / GIB  # one FP8 copy, 1 byte per weight
            assert copy > 1.0
            assert b.weights_gib - a.weights_gib == pytest.approx(copy, rel=1e-12)
            assert b.total_gib - a.total_gib == pytest.approx(copy, rel=1e-9)
            assert (a.grads_gib, a.optimizer_gib, a.activations_gib) == (b.grads_gib, b.optimizer_gib, b.activations_gib)
        assert peak_memory_gib(m, x, c, gpu=h100) > peak_memory_gib(m, x, c, gpu=b200)
    # the cluster's GPU reaches memory through predict (the array path) the same way
    pb = predict(m, load_cluster("b200x8"), x, DEFAULT)
    assert pb.memory_gib_per_gpu == pytest.approx(max(s.total_gib for s in stage_memory(m, x, DEFAULT, gpu=b200)),
                                                  rel=1e-12)
    # FP8 primary weights: TE builds their transposes each step only where it keeps a transposed copy
    on = x.replace(fp8_param_gather=True)
    L = Layouts.of(m, [on])
    opt = {}
    for name in ("h100x8", "b200x8"):
        cl = load_cluster(name)
        for tn in (False, True):  # the same cluster with the property flipped
            g = dataclasses.replace(cl.gpu, generation="hopper" if tn else "blackwell")
            assert g.fp8_transposed_copy == tn
            c2 = dataclasses.replace(cl, gpu=g)
            opt[name, tn] = dp_terms(m, c2, L, DEFAULT, memo_for(m, c2, DEFAULT), Stages(L)).opt_base
    for name in ("h100x8", "b200x8"):
        assert (opt[name, True] > opt[name, False]).all()
    h, bw = load_cluster("h100x8"), load_cluster("b200x8")
    assert (dp_terms(m, h, L, DEFAULT, memo_for(m, h, DEFAULT), Stages(L)).opt_base == opt["h100x8", True]).all()
    assert (dp_terms(m, bw, L, DEFAULT, memo_for(m, bw, DEFAULT), Stages(L)).opt_base == opt["b200x8", False]).all()


def test_speed_order_and_memory():
    tps = {p: predict(M, C, cfg(precision=p), DEFAULT).tokens_per_s_per_gpu for p in ("bf16", "fp8", "mxfp8", "nvfp4")}
    assert tps["bf16"] < tps["mxfp8"] <= tps["fp8"] < tps["nvfp4"]
    w = {p: stage_memory(M, cfg(precision=p), DEFAULT)[0].weights_gib for p in ("bf16", "fp8", "mxfp8", "nvfp4")}
    assert w["bf16"] < w["nvfp4"] < w["fp8"] < w["mxfp8"]  # quantized weight copies, with their scales


def test_array_path_matches_per_layout():
    cfgs = [cfg(precision=p, fp8_recipe=r) for p, r in map(quant_parts, range(len(QUANTS)))]
    R = vz.evaluate(M, C, vz.Layouts.of(M, cfgs), DEFAULT)
    for i, x in enumerate(cfgs):
        p = predict(M, C, x, DEFAULT, check_legal=False)
        assert R.prediction(i).tokens_per_s_per_gpu == pytest.approx(p.tokens_per_s_per_gpu, rel=1e-9)
        assert R.prediction(i).memory_gib_per_gpu == pytest.approx(p.memory_gib_per_gpu, rel=1e-9)


@pytest.mark.parametrize("p,r,flags", [
    ("fp8", "delayed", ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024"]),
    ("fp8", "tensorwise", ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]),
    ("fp8", "blockwise", ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]),
    ("mxfp8", "delayed", ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"]),
    ("nvfp4", "delayed", ["--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"]),
])
def test_megatron_flags(p, r, flags):
    a = layout_args(cfg(precision=p, fp8_recipe=r))
    i = a.index(flags[0])
    assert a[i:i + len(flags)] == flags


def test_cli_one_line_error_off_blackwell():
    r = subprocess.run([sys.executable, "-m", "advisor", "recommend", "-m", "llama3-8b", "-c", "h100x8",
                        "--precision", "nvfp4"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "needs Blackwell" in r.stderr


def test_nvfp4_gemms_at_the_k64_rate():
    """TE's NVFP4 GEMMs (cuBLASLt, K=64 block-scaled MMA) issue at 4x BF16 on Blackwell and
    Blackwell Ultra alike: GB300's 6x datasheet FP4 rate is not what they run at; MFU keeps it."""
    from advisor.models.quant import mfu_peak_tflops, nvfp4_gemm_tflops

    code = QUANTS.index("nvfp4")
    for name in ("b200", "gb200"):  # Blackwell: the FP4 peak is the K=64 rate
        g = load_gpu(name)
        assert nvfp4_gemm_tflops(g, DEFAULT) == g.fp4_tflops
        assert quant(g, code, DEFAULT).peak_flops == g.fp4_tflops * 1e12
    g = load_gpu("gb300")
    assert g.fp4_tflops == pytest.approx(6 * g.bf16_tflops, abs=3)
    assert quant(g, code, DEFAULT).peak_flops == pytest.approx(4 * g.bf16_tflops * 1e12, rel=1e-3)
    assert nvfp4_gemm_tflops(g, DEFAULT.replace(nvfp4_gemm_rate_bf16=6.0)) == g.fp4_tflops
    fp4_share = mfu_peak_tflops(M, 8192, g, code)  # against the GPU's own FP4 peak
    assert fp4_share > mfu_peak_tflops(M, 8192, g, QUANTS.index("fp8"))


def test_nvfp4_speedup_same_on_gb200_and_gb300():
    """The published llama3.1-405b NVFP4 / FP8 speed-ups are 1.38x on GB200 and 1.35x on GB300:
    at the K=64 rate the model gives the two GPUs the same speed-up within a few %, at GB300's
    datasheet 6x it would give GB300 a much larger one."""
    m = load_model("llama3.1-405b")
    lay = dict(tp=4, pp=8, vp=4, dp=8, mbs=1, gbs=1536, seq=8192, sequence_parallel=True,
               account_for_embedding=True, account_for_loss=True)  # 128 slots over 8 x 4 chunks

    def speedup(cluster, c):
        t = {p: predict(m, load_cluster(cluster), TrainConfig(precision=p, **lay), c).tokens_per_s_per_gpu
             for p in ("fp8", "nvfp4")}
        return t["nvfp4"] / t["fp8"]

    gb200, gb300 = speedup("gb200x256", DEFAULT), speedup("gb300x256", DEFAULT)
    assert gb200 > 1.2 and abs(gb300 / gb200 - 1) < 0.05
    assert speedup("gb300x256", DEFAULT.replace(nvfp4_gemm_rate_bf16=6.0)) > 1.1 * gb300
