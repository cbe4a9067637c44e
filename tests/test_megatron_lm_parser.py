"""The Megatron arguments the advisor prints are accepted by Megatron-LM's own argument parser
(megatron.training.arguments: parse_args, then validate_args for the cluster's world size), for
the top-1 layout of every catalog model on every catalog cluster (bench/megatron_args_check.py).
Needs torch and megatron-core, which needs Python >= 3.12: skipped elsewhere (CI runs 3.11). The
same check runs on the GPU machine (bench/cmdrun_gpu.sh; its output is committed in
data/megatron_lm/)."""
from __future__ import annotations

import pytest

from support import load_bench

pytest.importorskip("torch", reason="megatron.training needs torch")
pytest.importorskip("megatron.training.arguments",
                    reason="megatron-core (>= 0.17 needs Python >= 3.12) is not installed here")
check = load_bench("megatron_args_check")


def test_megatron_lm_rejects_what_it_should():
    ok = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
          "--max-position-embeddings", "128", "--micro-batch-size", "1", "--global-batch-size", "8",
          "--tensor-model-parallel-size", "2"] + check.USER_ARGS + ["--vocab-size", "1000"]
    assert check.megatron_accepts(ok, 8) is None
    assert "unrecognized arguments: --no-such-flag" in check.megatron_accepts(ok + ["--no-such-flag"], 8)
    assert "divisible" in check.megatron_accepts(ok, 3)  # TP 2 on 3 GPUs


def test_every_top1_layout_of_the_catalog_parses():
    rows = check.run(clusters=["dgx-h100-su", "dgx-a100-su", "h100x8", "h100x64"], calibration="none")
    checked = [r for r in rows if "accepted" in r]
    assert len(checked) >= 40
    assert {r["form"] for r in checked} == {"production", "runner"}
    bad = [(r["model"], r["cluster"], r["form"], r["error"]) for r in checked if not r["accepted"]]
    assert not bad
