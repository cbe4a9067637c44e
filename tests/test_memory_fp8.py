"""Issue #27: what Transformer Engine keeps for the backward under FP8 (models.memory), checked
term by term and on the te runner's FP8 / BF16 pairs (bench/memory_fp8_pairs.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from advisor.catalog import TrainConfig, load_model
from advisor.models.memory import layer_activation_bytes
from support import load_bench

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name,tp,sp", [("llama3-8b", 1, False), ("llama3-70b", 4, True), ("gpt3-175b", 8, True)])
def test_fp8_saves_a_byte_on_norm_and_activation_outputs_and_adds_one_on_the_attention_output(name, tp, sp):
    """FP8 - BF16 bytes of one layer = -1 B per element of the two norm outputs and the FC2 input
    (their BF16 copies are freed) + 1 B per element of the attention output (the attention keeps
    its BF16 output; the projection's FP8 copy comes on top)."""
    m = load_model(name)
    s, b = 4096, 2
    cfg = TrainConfig(tp=tp, mbs=b, gbs=b, seq=s, sequence_parallel=sp, distributed_optimizer=False,
                      overlap_grad_reduce=False, overlap_param_gather=False)
    bf16 = layer_activation_bytes(m, 0, cfg)
    fp8 = layer_activation_bytes(m, 0, cfg.replace(precision="fp8"))
    shard = tp if sp else 1
    norm_outs = 2 * s * b * m.hidden_size / shard
    fc2_in = s * b * m.ffn_hidden_size / tp
    attn_out = s * b * m.num_attention_heads * m.head_dim / tp
    assert fp8 - bf16 == pytest.approx(-(norm_outs + fc2_in) + attn_out, rel=1e-12)


def test_fp8_pairs_bench_matches_the_measured_ratio():
    rows = load_bench("memory_fp8_pairs").pairs([str(ROOT / "data/measurements/h100x4-te.jsonl")])
    assert len(rows) >= 10 and {r["moe"] for r in rows} == {True, False}
    dense = [r for r in rows if not r["moe"]]
    for r in dense:
        (mb, mf), (pb, pf) = r["measured"], r["predicted"]
        assert abs(pf / pb - mf / mb) < 0.02, r["layout"]
        assert r["d_weights"] > 0 > r["d_activations"]
    # llama3-8b DP4 mbs2: measured FP8 - BF16 = 2.13 GiB; the attention output's FP8 copy is what
    # brings the model there (1.50 GiB without it)
    one = next(r for r in dense if r["model"] == "llama3-8b[8L]" and "dp4" in r["layout"] and "mbs2" in r["layout"])
    assert (one["predicted"][1] - one["predicted"][0]) == pytest.approx(one["measured"][1] - one["measured"][0], abs=0.3)


def test_fp8_pairs_bench_refuses_a_missing_file():
    out = subprocess.run([sys.executable, str(ROOT / "bench/memory_fp8_pairs.py"), "/nonexistent.jsonl"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and out.stderr.strip().startswith("error:") and "Traceback" not in out.stderr
