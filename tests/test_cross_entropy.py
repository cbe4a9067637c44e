"""The loss's cross entropy as a layout field (issue #27): TrainConfig.cross_entropy_impl, its
Megatron arguments, the runner's TransformerConfig, the te stack's default, the records' legacy
value, and what the loss stage holds per logit."""
from __future__ import annotations

import pytest

from advisor.api import recommend
from advisor.catalog import SpecError, load_model
from advisor.catalog.specs import CROSS_ENTROPY_IMPLS, TrainConfig
from advisor.models.dataset import legacy_config
from advisor.models.memory import CROSS_ENTROPY_BF16_COPIES, CROSS_ENTROPY_FP32_COPIES, peak_memory_many, stage_memory
from advisor.models.profiles import apply_layout_defaults, stack_cross_entropy
from advisor.runners.megatron_args import (cross_entropy_args, layout_args, megatron_lm_args, refusal_reason,
                                           transformer_config_kwargs)
from advisor.search_spaces.columns import Layouts

LLAMA = load_model("llama3-8b").with_layers(4)
CFG = TrainConfig(dp=4, mbs=2, gbs=32, seq=4096)


def test_the_field_is_checked_and_round_trips():
    assert TrainConfig().cross_entropy_impl == "unfused"  # Megatron-LM's default: no loss fusion
    with pytest.raises(SpecError, match="cross_entropy_impl must be one of unfused, native, te"):
        TrainConfig(cross_entropy_impl="fast")
    for impl in CROSS_ENTROPY_IMPLS:
        cfg = CFG.replace(cross_entropy_impl=impl)
        assert TrainConfig.from_dict(cfg.to_dict()) == cfg
        assert Layouts.of(LLAMA, [cfg]).config(0).cross_entropy_impl == impl


def test_megatron_flags_and_the_runners_transformer_config():
    assert cross_entropy_args(CFG) == []
    te = CFG.replace(cross_entropy_impl="te")
    flags = ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"]
    for args in (megatron_lm_args(LLAMA, te), megatron_lm_args(LLAMA, te, runner=True), layout_args(te)):
        i = args.index("--cross-entropy-loss-fusion")
        assert args[i:i + 3] == flags
    assert "--cross-entropy-loss-fusion" not in megatron_lm_args(LLAMA, CFG)
    for impl, fused, name in (("unfused", False, "native"), ("native", True, "native"), ("te", True, "te")):
        for stack in ("local", "te"):
            kw = transformer_config_kwargs(LLAMA, CFG.replace(cross_entropy_impl=impl), stack)
            assert (kw["cross_entropy_loss_fusion"], kw["cross_entropy_fusion_impl"]) == (fused, name)
    assert "Transformer Engine" in refusal_reason(LLAMA, te, 4, "local")
    assert refusal_reason(LLAMA, te, 4, "te") is None
    assert refusal_reason(LLAMA, CFG.replace(cross_entropy_impl="native"), 4, "local") is None


def test_stacks_and_records():
    assert stack_cross_entropy("te") == "te" and stack_cross_entropy("local") == "unfused"
    assert apply_layout_defaults(CFG, "te").cross_entropy_impl == "te"
    assert apply_layout_defaults(CFG, "te", explicit={"cross_entropy_impl"}).cross_entropy_impl == "unfused"
    # the te runner ran megatron-core's native fused cross entropy before the layout carried it
    assert legacy_config(CFG.to_dict() | {"cross_entropy_impl": "te"}, LLAMA, "te")["cross_entropy_impl"] == "te"
    old = {k: v for k, v in CFG.to_dict().items() if k != "cross_entropy_impl"}
    assert legacy_config(old, LLAMA, "te")["cross_entropy_impl"] == "native"
    assert "cross_entropy_impl" not in legacy_config(old, LLAMA, "local")


def test_loss_stage_bytes_per_logit_by_implementation():
    """bf16 logits (2 B) + 4 B per fp32 tensor + 2 B per bf16 copy: unfused 6, native 10, te 4 (TE 2.20's
    cross entropy saves a copy of its input), and the final norm's input and output (2 x s x b x h
    BF16); only the loss stage."""
    logits = CFG.seq * CFG.mbs * LLAMA.vocab_size
    final_norm = 2 * CFG.seq * CFG.mbs * LLAMA.hidden_size * 2 / CFG.tp
    got = {impl: stage_memory(LLAMA, CFG.replace(cross_entropy_impl=impl))[0].logits_gib for impl in CROSS_ENTROPY_IMPLS}
    f = 1.0 + 0.08  # the default fragmentation multiplies the logits
    assert CROSS_ENTROPY_BF16_COPIES == {"unfused": 0, "native": 0, "te": 1}
    for impl, copies in CROSS_ENTROPY_FP32_COPIES.items():
        per_logit = 2 + 4 * copies + 2 * CROSS_ENTROPY_BF16_COPIES[impl]
        assert got[impl] == pytest.approx((logits * per_logit + final_norm) * f / 2**30)
    assert got["te"] < got["unfused"] < got["native"]
    # sequence parallelism shards the final norm's tensors over TP (not the logits' vocabulary split)
    tp2 = CFG.replace(tp=2, dp=2)
    no_sp, sp = (stage_memory(LLAMA, tp2.replace(sequence_parallel=v))[0].logits_gib for v in (False, True))
    assert no_sp - sp == pytest.approx(final_norm / 2 * f / 2**30)
    pp = CFG.replace(pp=2, dp=2)
    for impl in CROSS_ENTROPY_IMPLS:
        st = stage_memory(LLAMA, pp.replace(cross_entropy_impl=impl))
        assert st[0].logits_gib == 0 and st[1].logits_gib == pytest.approx(got[impl])  # the same micro-batch on the last stage
    # the arrays hold each row's own implementation
    cfgs = [CFG.replace(cross_entropy_impl=i) for i in CROSS_ENTROPY_IMPLS]
    many = peak_memory_many(LLAMA, Layouts.of(LLAMA, cfgs))
    assert many.tolist() == pytest.approx([max(s.total_gib for s in stage_memory(LLAMA, c)) for c in cfgs])


def test_recommend_takes_the_stacks_cross_entropy():
    te = recommend("llama3-8b", "h100x8", top=3, stack="te")
    local = recommend("llama3-8b", "h100x8", top=3, stack="local")
    assert {r.config.cross_entropy_impl for r in te.recommendations} == {"te"}
    assert {r.config.cross_entropy_impl for r in local.recommendations} == {"unfused"}


# the same layout (llama3-8b[8L] DP4 mbs4 BF16, expandable segments) with each cross entropy
PAIR_IDS = {"unfused": "te-l8b-stack-62", "native": "te-l8b-ce-83", "te": "te-l8b-stack-72"}


def _te_records(ids) -> dict:
    import json
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "data" / "measurements" / "h100x4-te.jsonl"
    recs = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {r["id"]: r for r in recs if r["id"] in set(ids)}


def test_loss_time_by_implementation_against_the_measured_pairs():
    """The loss's memory-bound kernels per implementation (step_time.LOSS_BYTES_PER_LOGIT): TE's
    Triton cross entropy lightest, megatron-core's jit-fused "native" about as heavy as the unfused
    one; the predicted step-time gaps of llama3-8b[8L] DP4 mbs4 BF16 on 4 x H100 (te profile) against
    the measured ones (x4-te-s27c / x4-te-s28a, the same layout and allocator setting)."""
    from advisor.catalog import load_cluster
    from advisor.models.calibrate import resolve_calibration
    from advisor.models.predict import predict
    from advisor.models.step_time import LOSS_BYTES_PER_LOGIT, loss_bytes_per_logit

    assert LOSS_BYTES_PER_LOGIT["te"] < LOSS_BYTES_PER_LOGIT["native"] <= LOSS_BYTES_PER_LOGIT["unfused"]
    gemma_like = LLAMA.__class__.from_dict({**LLAMA.to_dict(), "final_logit_softcap": 30.0})
    c = resolve_calibration("te").constants
    assert loss_bytes_per_logit(gemma_like, c, "te") > loss_bytes_per_logit(LLAMA, c, "te")
    recs = _te_records(PAIR_IDS.values())
    cfgs = {impl: TrainConfig.from_dict(recs[rid]["config"]) for impl, rid in PAIR_IDS.items()}
    measured = {impl: x.gbs * x.seq / recs[PAIR_IDS[impl]]["throughput"]["tokens_per_s"] for impl, x in cfgs.items()}
    assert {k: v.cross_entropy_impl for k, v in cfgs.items()} == {"unfused": "unfused", "native": "native", "te": "te"}
    model = load_model("llama3-8b").with_layers(8)
    cluster = load_cluster("h100x4")
    pred = {impl: predict(model, cluster, cfg, c).step_time_s for impl, cfg in cfgs.items()}
    for impl in ("unfused", "native"):
        gap_m, gap_p = measured[impl] - measured["te"], pred[impl] - pred["te"]
        assert gap_m > 0.05 and gap_p == pytest.approx(gap_m, rel=0.35), (impl, gap_m, gap_p)
