"""Physical properties of the analytical model over a grid: every catalog model x TP / CP / PP / VP x
sequence 2k-128k x bf16 / fp8 x (micro-batch, recompute) in (1, full), (1, none), (4, none), with the
default constants and with each shipped profile's.

- MFU never above what the GPU's best GEMMs allow (BF16: gemm_efficiency_max of the dense peak;
  FP8: the FP8 GEMMs' best rate), and never above 70% in BF16 on Hopper;
- attention work per GPU does not depend on how it is split (TP x CP GPUs share it);
- step time and memory move the right way when a knob moves.
"""
from __future__ import annotations

import itertools

import pytest

from advisor.catalog import TrainConfig, list_models, load_cluster, load_model
from advisor.models import DEFAULT, predict
from advisor.models.calibrate import resolve_calibration
from advisor.models.memory import peak_memory_gib
from advisor.models.profiles import STACKS
from advisor.models.step_time import step_time
from advisor.search_spaces.layout import violations

SEQS = (2048, 8192, 32768, 131072)


def _constants():
    out = [("default", DEFAULT)]
    for name in STACKS:
        cal = resolve_calibration(name)
        if cal is not None:
            out.append((name, cal.constants))
    return out


CONSTANTS = _constants()


# (micro-batch, recompute): full recompute at mbs 1 is the slowest per FLOP (the old grid);
# no recompute at mbs 4 (the largest GEMMs, no recomputed forward) is where MFU is highest.
BATCH_RECOMPUTE = ((1, "full"), (1, "none"), (4, "none"))


def _layouts(model, cluster, seq, precision):
    n = cluster.world_size
    for tp, cp, pp in itertools.product((1, 2, 8), (1, 2, 4), (1, 2, 4)):
        if n % (tp * cp * pp) or model.num_layers % pp:
            continue
        dp = n // (tp * cp * pp)
        for vp, (mbs, recompute) in itertools.product((1, 2), BATCH_RECOMPUTE):
            if vp > 1 and (pp == 1 or (model.num_layers // pp) % vp):
                continue
            cfg = TrainConfig(tp=tp, pp=pp, cp=cp, dp=dp, vp=vp, mbs=mbs, gbs=8 * dp * pp, seq=seq,
                              precision=precision, recompute=recompute, sequence_parallel=tp > 1,
                              distributed_optimizer=dp * cp > 1, overlap_grad_reduce=dp * cp > 1,
                              overlap_param_gather=dp * cp > 1)
            if not violations(model, cluster, cfg):
                yield cfg


@pytest.mark.parametrize("cname,c", CONSTANTS, ids=[n for n, _ in CONSTANTS])
def test_mfu_never_above_the_best_gemm_rate(cname, c):
    cluster = load_cluster("h100x64")
    gpu = cluster.gpu
    checked = 0
    for m in list_models():
        for seq, precision in itertools.product(SEQS, ("bf16", "fp8")):
            if m.position_embedding == "learned" and seq > m.max_position_embeddings:
                continue
            for cfg in _layouts(m, cluster, seq, precision):
                p = predict(m, cluster, cfg, c, check_legal=False)
                if precision == "bf16":
                    assert p.mfu <= c.gemm_efficiency_max + 1e-9, (m.name, cfg.key(), p.mfu)
                    assert p.mfu <= 0.70, (m.name, cfg.key(), p.mfu)  # no BF16 Hopper run above 70% MFU
                else:
                    best = c.gemm_efficiency_max_fp8 * gpu.fp8_tflops
                    assert p.tflops_per_gpu <= best + 1e-6, (m.name, cfg.key(), p.tflops_per_gpu)
                checked += 1
    assert checked > 500


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b", "deepseek-v3", "qwen3-30b-a3b"])
@pytest.mark.parametrize("seq", SEQS)
def test_attention_work_per_gpu_does_not_depend_on_the_split(name, seq):
    """TP splits heads, CP splits queries (each attending over the whole causal context): the GPUs
    of a TP x CP group share one sequence's attention, so its FLOPs x tp x cp are constant; the time
    differs only by the rate of CP's shorter ring chunks (seq / cp keys per call: the fused kernel's
    rate L / (L + attention_half_tokens), constants.attention_half_tokens)."""
    m = load_model(name)
    cluster = load_cluster("h100x64")
    half = DEFAULT.attention_half_tokens
    sat = lambda n: n / (n + half)  # noqa: E731
    work = {}
    for tp, cp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8)):
        cfg = TrainConfig(tp=tp, cp=cp, dp=64 // (tp * cp), mbs=1, gbs=64 // (tp * cp), seq=seq,
                          sequence_parallel=tp > 1)
        st = step_time(m, cluster, cfg)
        work[(tp, cp)] = st.stages[0].attention_s * tp * cp * sat(seq / cp) / sat(seq)
    ref = work[(1, 1)]
    assert ref > 0
    for (tp, cp), v in work.items():
        assert v == pytest.approx(ref, rel=1e-9), (tp, cp)


@pytest.mark.parametrize("cname,c", CONSTANTS, ids=[n for n, _ in CONSTANTS])
def test_knobs_move_step_time_and_memory_the_right_way(cname, c):
    cluster = load_cluster("h100x64")
    base = dict(tp=4, pp=4, cp=1, dp=4, vp=1, mbs=1, gbs=128, seq=8192, sequence_parallel=True)
    for name in ("llama3-70b", "llama3-8b", "mixtral-8x7b"):
        m = load_model(name)

        def run(**kw):
            cfg = TrainConfig(**{**base, **kw})
            assert not violations(m, cluster, cfg), (name, kw)
            p = predict(m, cluster, cfg, c, check_legal=False)
            return p.step_time_s, p.memory_gib_per_gpu

        t0, mem0 = run()
        # full recompute: less memory, more time; selective: not more memory, not less time
        t, mem = run(recompute="full")
        assert mem < mem0 and t > t0
        t, mem = run(recompute="selective")
        assert mem <= mem0 + 1e-9 and t >= t0 - 1e-12
        # a larger micro-batch needs more activation memory
        assert run(mbs=2)[1] > mem0
        # TP 8 instead of 4 (same PP): less memory per GPU
        assert run(tp=8, dp=2)[1] < mem0
        # more pipeline stages: less memory on the fullest stage
        assert run(pp=8, dp=2)[1] < mem0
        # CP 2 halves the activations of a sequence
        assert run(cp=2, dp=2)[1] < mem0
        # a longer sequence costs more time per sequence
        t_long, _ = run(seq=16384, gbs=128)
        assert t_long > t0
        # fp8 is faster than bf16 and at most twice as fast
        t_fp8, _ = run(precision="fp8")
        assert t0 / 2 < t_fp8 < t0
        # the interleaved schedule shrinks the bubble: not slower with the same microbatches
        assert run(vp=2)[0] <= t0 * 1.02
    # memory follows the model's size
    assert peak_memory_gib(load_model("llama3-70b"), TrainConfig(**base), c) > \
        peak_memory_gib(load_model("llama3-8b"), TrainConfig(**base), c)
