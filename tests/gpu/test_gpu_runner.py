"""The real trial runner on GPUs (torchrun + megatron-core): a tiny model through TP/PP/DP, an
OOM and telemetry. Skipped without CUDA; run on a GPU machine with
``python3 -m pytest -q -m gpu tests/gpu``."""
from __future__ import annotations

import pytest

from advisor.catalog.specs import ModelSpec
from advisor.runners import measure as M

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

TINY = ModelSpec(name="tiny", num_layers=4, hidden_size=512, ffn_hidden_size=1408,
                 num_attention_heads=8, num_query_groups=4, vocab_size=32000)


def test_batch_on_local_gpus(tmp_path):
    n = torch.cuda.device_count()
    layouts = [dict(mbs=1), dict(mbs=2, recompute="selective"), dict(mbs=1, recompute="full")]
    if n >= 2:
        layouts += [dict(tp=2, mbs=1), dict(pp=2, mbs=1), dict(pp=2, vp=2, mbs=1)]
    entries = [M.make_entry(TINY, n, seq=1024, gbs=8 * (n // (l.get("tp", 1) * l.get("pp", 1))),
                            warmup=1, steps=3, **l) for l in layouts]
    # an OOM: a huge micro-batch of a wide model
    entries.append(M.make_entry(ModelSpec(name="wide", num_layers=2, hidden_size=8192, ffn_hidden_size=32768,
                                          num_attention_heads=64, vocab_size=256000),
                                n, seq=8192, mbs=64, gbs=64 * n, warmup=1, steps=1))
    entries.append(M.make_entry(TINY, n, seq=1024, mbs=1, gbs=8 * n, warmup=1, steps=3))  # goes on
    ds = tmp_path / "m.jsonl"
    recs = M.run_batch(entries, ds, n, run_dir=tmp_path / "run", timeout=120)
    assert [r["status"] for r in recs] == ["ok"] * (len(entries) - 2) + ["oom", "ok"]
    assert len(M.read_jsonl(ds)) == len(entries)
    for r in recs:
        if r["status"] != "ok":
            continue
        assert r["steps"]["measured"] == 3 and r["throughput"]["tokens_per_s"] > 0
        assert len(r["rank_map"]) == n and all(rm["uuid"].startswith("GPU-") for rm in r["rank_map"])
        assert max(r["memory"]["start_allocated_gib_per_rank"]) < 1.0  # nothing left from earlier jobs
        if r["telemetry"] is not None:
            assert set(r["telemetry"]["per_gpu"]) == {rm["uuid"] for rm in r["rank_map"]}
