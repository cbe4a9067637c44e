"""Hand-computed checks of the analytical model: parameter counts, FLOPs, memory against
Megatron's theoretical formula, pipeline bubble, power behaviour."""
from __future__ import annotations

import dataclasses

import pytest

from advisor.catalog import ModelSpec, TrainConfig, load_cluster, load_model
from advisor.models import DEFAULT, predict
from advisor.models.flops import (
    active_params,
    attention_core_flops_per_token,
    matmul_params_per_token,
    total_params,
    training_flops_per_token,
)
from advisor.models.memory import layer_activation_bytes, stage_memory
from advisor.models.step_time import step_time
from advisor.search_spaces.layout import bubble_fraction, in_flight_microbatches

GIB = 2**30


@pytest.mark.parametrize("name,published", [
    ("llama3-70b", 70.6e9),      # Meta model card: 70.6B
    ("gpt3-175b", 175e9),        # Brown et al. 2020: 175B
    ("mixtral-8x7b", 46.7e9),    # Mistral: 46.7B total
    ("deepseek-v3", 671e9),      # DeepSeek-V3 report: 671B (main model, without the MTP module)
    ("llama3.1-405b", 405.9e9),  # Meta: 405B (HF safetensors: 405.85B)
])
def test_parameter_counts_match_published(name, published):
    n = total_params(load_model(name))
    assert abs(n - published) / published < 0.01, f"{name}: {n / 1e9:.2f}B vs {published / 1e9:.1f}B"


@pytest.mark.parametrize("name,published", [("mixtral-8x7b", 12.9e9), ("deepseek-v3", 37e9)])
def test_active_parameters_match_published(name, published):
    n = active_params(load_model(name))
    assert abs(n - published) / published < 0.02


def test_llama3_70b_param_count_by_hand():
    m = load_model("llama3-70b")
    h, f, L, V, kv, hd = 8192, 28672, 80, 128256, 8, 128
    per_layer = h * h + 2 * h * kv * hd + h * h + 3 * h * f + 2 * h
    expected = L * per_layer + 2 * V * h + h
    assert total_params(m) == expected


def test_training_flops_is_6n_plus_attention():
    m = load_model("llama3-70b")
    seq = 8192
    n = matmul_params_per_token(m)
    # 6N for the weight GEMMs (incl. the logits), + 3 x causal attention (QK^T and AV: 4·s·a·d / 2)
    attn = 3 * m.num_layers * 4 * seq * m.num_attention_heads * m.head_dim / 2
    assert training_flops_per_token(m, seq) == pytest.approx(6 * n + attn, rel=1e-12)
    # and 6N dominates: the classic 6N estimate is within 10% at seq 8192 for a 70B model
    assert 1.0 < training_flops_per_token(m, seq) / (6 * total_params(m)) < 1.10
    assert attention_core_flops_per_token(m, seq, causal=False) == 2 * attention_core_flops_per_token(m, seq)


def megatron_weight_and_optimizer_bytes(m: ModelSpec, cfg: TrainConfig) -> float:
    """Megatron-LM theoretical_memory_usage.compute_weight_and_optimizer_memory for a dense GQA
    model (re-derived: parameters of the most loaded shard = (block / pp + embedding) / tp, bytes
    per parameter 18, or 6 + 12 / dp with the distributed optimizer)."""
    h, L, f, V = m.hidden_size, m.num_layers, m.ffn_hidden_size, m.vocab_size
    a, kv = m.num_attention_heads, m.kv_heads
    gated = 3 / 2 if m.activation == "swiglu" else 1
    block = 2 * L * h * h * ((1 + kv / a) + (f / h) * gated + 1 / h)
    params = (block / cfg.pp + V * h) / cfg.tp
    per_param = 6 + 12 / cfg.dp if cfg.distributed_optimizer else 18
    return params * per_param


@pytest.mark.parametrize("tp,pp,dp,dist", [(8, 4, 2, True), (4, 2, 8, True), (2, 8, 4, False)])
def test_weight_memory_matches_megatron_formula(tp, pp, dp, dist):
    m = load_model("llama3-70b")
    cfg = TrainConfig(tp=tp, pp=pp, dp=dp, mbs=1, gbs=128, seq=8192, distributed_optimizer=dist,
                      overlap_param_gather=dist, sequence_parallel=tp > 1)
    s0 = stage_memory(m, cfg)[0]
    ours = (s0.weights_gib + s0.grads_gib + s0.optimizer_gib) * GIB
    theirs = megatron_weight_and_optimizer_bytes(m, cfg)
    # Megatron also divides the (tiny) norm weights by TP; we keep them replicated
    assert ours == pytest.approx(theirs, rel=0.01)


def test_activation_memory_against_megatron_formula():
    """Megatron (Korthikanti Table 2) with SP and selective recompute: s·b·h·(18 + 4·ffn/h)/t bytes
    per layer for a GELU MHA model. That count includes 2 one-byte dropout masks (2·s·b·h); we
    model dropout-free training, so ours must be exactly 2·s·b·h/t smaller."""
    g = load_model("gpt3-175b")
    s, b, t = 2048, 1, 8
    cfg = TrainConfig(tp=t, pp=1, dp=1, mbs=b, gbs=1, seq=s, sequence_parallel=True, recompute="selective",
                      distributed_optimizer=False, overlap_grad_reduce=False, overlap_param_gather=False)
    h, f = g.hidden_size, g.ffn_hidden_size
    megatron = s * b * h * (18 + 4 * f / h) / t
    ours = layer_activation_bytes(g, 0, cfg)
    assert ours == pytest.approx(megatron - 2 * s * b * h / t, rel=1e-9)


def test_full_recompute_keeps_only_layer_inputs():
    m = load_model("llama3-8b")
    cfg = TrainConfig(tp=2, mbs=2, gbs=2, seq=4096, sequence_parallel=True, recompute="full",
                      distributed_optimizer=False, overlap_grad_reduce=False, overlap_param_gather=False)
    assert layer_activation_bytes(m, 0, cfg) == 2 * 4096 * 2 * m.hidden_size / 2


def test_in_flight_microbatches_1f1b_and_interleaved():
    cfg = TrainConfig(pp=4, dp=1, mbs=1, gbs=16)
    assert [in_flight_microbatches(cfg, s) for s in range(4)] == [4, 3, 2, 1]
    few = cfg.replace(gbs=2)
    assert in_flight_microbatches(few, 0) == 2
    # interleaved: Megatron's theoretical formula multiplies stage 0 by 1 + (p-1)/(p·v)
    inter = cfg.replace(vp=2)
    p, v = 4, 2
    assert in_flight_microbatches(inter, 0) == pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_bubble_fraction_formula_and_step_time():
    assert bubble_fraction(TrainConfig(pp=4, dp=1, gbs=32, mbs=1, vp=1)) == pytest.approx(3 / 32)
    assert bubble_fraction(TrainConfig(pp=8, dp=1, gbs=64, mbs=2, vp=4)) == pytest.approx(7 / (4 * 32))
    # with (almost) equal stages the pipeline's idle time is (p-1)/(v·m) of the busy time
    m = ModelSpec("uniform", num_layers=16, hidden_size=4096, ffn_hidden_size=16384, num_attention_heads=32,
                  vocab_size=128, tied_embeddings=True)
    cluster = load_cluster("h100x8")
    for vp in (1, 2):
        cfg = TrainConfig(tp=2, pp=4, dp=1, vp=vp, mbs=1, gbs=16, seq=2048, sequence_parallel=True,
                          distributed_optimizer=False, overlap_grad_reduce=False, overlap_param_gather=False)
        st = step_time(m, cluster, cfg)
        busy = st.num_microbatches * max(s.total_s for s in st.stages)
        assert st.bubble_s / busy == pytest.approx(bubble_fraction(cfg), rel=0.02)


def test_first_stage_holds_most_activations_last_stage_holds_logits():
    m = load_model("llama3-8b")
    cfg = TrainConfig(pp=4, dp=2, mbs=1, gbs=64, seq=8192, distributed_optimizer=True)
    mem = stage_memory(m, cfg)
    assert mem[0].activations_gib > mem[1].activations_gib > mem[3].activations_gib
    assert mem[3].logits_gib > 0 and mem[0].logits_gib == 0


def test_distributed_optimizer_shards_optimizer_state():
    m = load_model("llama3-8b")
    base = TrainConfig(tp=1, pp=1, dp=8, mbs=1, gbs=64, seq=4096, distributed_optimizer=False,
                       overlap_param_gather=False)
    no = stage_memory(m, base)[0]
    yes = stage_memory(m, base.replace(distributed_optimizer=True))[0]
    assert yes.optimizer_gib == pytest.approx(no.optimizer_gib / 8)


def test_moe_experts_are_divided_by_ep():
    m = load_model("mixtral-8x7b")
    a = TrainConfig(tp=1, pp=1, dp=8, ep=1, mbs=1, gbs=64, seq=4096)
    b = a.replace(ep=8)
    wa, wb = stage_memory(m, a)[0].weights_gib, stage_memory(m, b)[0].weights_gib
    assert wb < wa / 3  # experts are ~96% of Mixtral's weights


def _h100():
    return load_cluster("h100x8")


def test_power_rises_with_microbatch_and_cap_slows():
    m = load_model("llama3-8b")
    cl = _h100()
    peaks = []
    for mbs in (1, 2, 4):
        cfg = TrainConfig(tp=1, pp=1, dp=8, mbs=mbs, gbs=64, seq=4096, recompute="full")
        peaks.append(predict(m, cl, cfg).breakdown["power_demand_peak_w"])
    assert peaks[0] < peaks[1] < peaks[2]
    cfg = TrainConfig(tp=1, pp=1, dp=8, mbs=2, gbs=64, seq=4096, recompute="full")
    capped = load_cluster("h100x8", power_cap_w=450)
    p_full, p_cap = predict(m, cl, cfg), predict(m, capped, cfg)
    assert p_cap.power_slowdown > 1.0 and p_cap.sm_clock_mhz < p_full.sm_clock_mhz
    assert p_cap.tokens_per_s_per_gpu < p_full.tokens_per_s_per_gpu
    assert p_cap.mean_power_w == pytest.approx(450, rel=0.02)  # the step's end waits average lower
    assert p_cap.throttle_label == "high"


def test_saturating_gemm_holds_the_measured_clock_at_the_cap():
    """The DVFS calibration point: a saturating bf16 GEMM at the H100's 700 W cap holds 1,380-
    1,425 MHz (measured for 4096^3-16384^3, data/dvfs/h100x1-sweep.jsonl) and runs at 686 / 803 of
    its rate near the maximum clock (8192^3 at 1,410 vs 1,950 MHz)."""
    from advisor.models.dvfs import Phase, compute_stretch, solve_clock

    h100 = _h100().gpu
    x = solve_clock([Phase("gemm", 1.0, utilization=1.0)], [], h100, 700.0).x
    assert 1380 / 1980 - 0.02 < x < 1425 / 1980 + 0.02
    assert compute_stretch(1950 / 1980) / compute_stretch(1410 / 1980) == pytest.approx(686 / 803, rel=0.02)


def test_prediction_fields_and_energy():
    m = load_model("llama3-70b")
    cl = load_cluster("h100x64")
    cfg = TrainConfig(tp=8, pp=4, dp=2, mbs=1, gbs=128, seq=8192, sequence_parallel=True)
    p = predict(m, cl, cfg)
    assert p.feasible and 0 < p.mfu < 1
    assert p.tokens_per_s_per_gpu == pytest.approx(128 * 8192 / p.step_time_s / 64)
    assert p.energy_j_per_token == pytest.approx(p.mean_power_w * 64 * p.step_time_s / (128 * 8192))
    assert p.memory_gib_per_gpu == max(p.memory_per_stage_gib)
    assert p.peak_power_w >= p.mean_power_w


def test_constants_replace_changes_prediction():
    m = load_model("llama3-8b")
    cl = _h100()
    cfg = TrainConfig(tp=1, pp=1, dp=8, mbs=1, gbs=64, seq=4096)
    slow = DEFAULT.replace(gemm_efficiency_max=0.4)
    assert predict(m, cl, cfg, slow).step_time_s > predict(m, cl, cfg).step_time_s
    assert dataclasses.asdict(DEFAULT)["gemm_efficiency_max"] == 0.80


def test_logits_fp32_bytes_is_a_named_constant():
    from advisor.models.memory import stage_memory

    m = load_model("llama3-8b")
    cfg = TrainConfig(tp=1, pp=2, dp=4, mbs=1, gbs=64, seq=4096)
    base = stage_memory(m, cfg)[-1].logits_gib
    assert DEFAULT.bytes_logits_fp32 == 4.0
    # bf16 logits (2 B) + the fp32 copy (4 B): dropping the copy leaves a third of the logits' bytes
    # (the final norm's two saved s x b x h tensors beside them stay)
    final_norm = 2 * 4096 * m.hidden_size * 2 * (1 + DEFAULT.fragmentation) / 2**30
    no_copy = stage_memory(m, cfg, DEFAULT.replace(bytes_logits_fp32=0.0))[-1].logits_gib
    assert no_copy - final_norm == pytest.approx((base - final_norm) / 3)


def _power(model, cluster, cfg, c=DEFAULT):
    from advisor.models.power import estimate_power

    return estimate_power(model, cluster, cfg, c)


def test_throttle_risk_mapping_reads_the_named_constants():
    """Each band of the risk score is computed from the named constants (no literals left in
    models/power.py): moving a constant moves the score exactly as the formula says."""
    c = DEFAULT
    m70 = load_model("llama3-70b")
    cfg = TrainConfig(tp=8, pp=4, dp=2, mbs=1, gbs=128, seq=8192, sequence_parallel=True)
    # sustained throttling under a 450 W cap (high band)
    capped = load_cluster("h100x64", power_cap_w=450)
    e = _power(m70, capped, cfg)
    assert e.slowdown > 1.0 and e.throttle_label == "high"
    c2 = c.replace(throttle_risk_sustained_base=0.2, throttle_risk_per_slowdown=0.1)
    e2 = _power(m70, capped, cfg, c2)
    assert e2.throttle_risk == pytest.approx(0.2 + (e2.slowdown - 1.0) * 0.1)
    assert e2.throttle_label == "low"
    # spikes over the 700 W cap (medium band): a microbatch's compute over the cap, the limiter's
    # average under it (2 microbatches on PP4: the fill and drain waits pull the average down)
    full = load_cluster("h100x64")
    cfg = cfg.replace(gbs=4)
    e = _power(m70, full, cfg, c)
    excess = (e.demand_peak_w - 700) / (c.throttle_spike_full_excess * 700)
    assert 0 < excess < 1 and e.throttle_label == "medium" and e.slowdown == 1.0
    assert e.throttle_risk == c.throttle_risk_spike_base + c.throttle_risk_spike_span * excess
    e2 = _power(m70, full, cfg, c.replace(throttle_risk_spike_base=0.5, throttle_spike_full_excess=0.1))
    assert e2.throttle_risk == pytest.approx(0.5 + c.throttle_risk_spike_span * min(1.0, 2 * excess))
    # below the cap (low band): a tiny model's GEMMs never saturate
    tiny = ModelSpec("tiny", num_layers=2, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4,
                     vocab_size=1000, source="test")
    small = TrainConfig(tp=1, pp=1, dp=8, mbs=1, gbs=8, seq=1024)
    h8 = load_cluster("h100x8")
    c = c.replace(attention_power=0.8)  # its flash attention at full activity would draw 803 W
    e = _power(tiny, h8, small, c)
    assert e.demand_peak_w < 700 and e.throttle_reason == "none"
    e2 = _power(tiny, h8, small, c.replace(throttle_low_start=0.5, throttle_low_range=0.5))
    assert e2.throttle_risk == pytest.approx(c.throttle_risk_low_span * (e.demand_peak_w - 350) / 350)
    assert _power(tiny, h8, small, c.replace(throttle_label_medium=0.0)).throttle_label == "medium"
