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


def test_activation_offloading_arguments_parse():
    """TrainConfig.cpu_offload_layers as the advisor prints it (runners/megatron_args.offload_args),
    in the production arguments of a layout Megatron-LM validates."""
    from advisor.catalog import load_model
    from advisor.catalog.specs import TrainConfig
    from advisor.runners.megatron_args import megatron_lm_args

    cfg = TrainConfig(dp=8, mbs=1, gbs=16, seq=2048, cpu_offload_layers=2)
    m = load_model("llama3-8b").with_layers(4)
    args = megatron_lm_args(m, cfg) + check.USER_ARGS + ["--vocab-size", str(m.vocab_size)]
    assert "--cpu-offloading-num-layers" in args
    assert check.megatron_accepts(args, 8) is None


def test_every_top1_layout_of_the_catalog_parses():
    rows = check.run(clusters=["dgx-h100-su", "dgx-a100-su", "h100x8", "h100x64"], calibration="none")
    checked = [r for r in rows if "accepted" in r]
    assert len(checked) >= 40
    assert {r["form"] for r in checked} == {"production", "runner"}
    bad = [(r["model"], r["cluster"], r["form"], r["error"]) for r in checked if not r["accepted"]]
    assert not bad


def test_the_pretrain_script_sets_up_megatron_lm_up_to_its_data(monkeypatch):
    """bench/megatron_lm_pretrain.py with {megatron_model_args} {megatron_args} and the fixed flags of
    bench/cmdrun_gpu.sh, on CPU: Megatron-LM's parse_and_validate_args, its config container and
    transformer config, its dataset sizing (get_train_valid_test_num_samples) and the mock datasets.
    (What needs a GPU, the model and the loop, runs in bench/cmdrun_gpu.sh.)"""
    import shlex
    import sys
    from pathlib import Path

    from advisor.catalog import load_model
    from advisor.catalog.specs import TrainConfig
    from advisor.runners import command as C

    root = Path(__file__).resolve().parents[1]
    fixed = [ln for ln in (root / "bench" / "cmdrun_gpu.sh").read_text().split('MLM_FIXED="', 1)[1].split('"', 1)[0]
             .replace("\\\n", " ").split()]
    model, cfg = load_model("llama3-8b").with_layers(4), TrainConfig(mbs=2, gbs=16, seq=2048, recompute="selective")
    values = C.placeholder_values(model, cfg, 9, C.NodeInfo(1, master_port=1), "t", root, root / "s")
    argv = shlex.split(values["megatron_model_args"]) + shlex.split(values["megatron_args"]) + fixed
    monkeypatch.setattr(sys, "argv", ["megatron_lm_pretrain.py", *argv])
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    pre = load_bench("megatron_lm_pretrain")
    from megatron.training import global_vars
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.training import get_train_valid_test_num_samples

    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", None)
    args = pre.parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    pretrain_cfg_container_from_args(args)
    tc = pre.core_transformer_config_from_args(args)
    assert (tc.num_layers, tc.hidden_size, tc.recompute_granularity, tc.bf16) == (4, 4096, "selective", True)
    assert args.train_iters == 9 and args.micro_batch_size == 2 and args.padded_vocab_size == 128256
    sizes = get_train_valid_test_num_samples()
    assert sizes == (9 * 16, 0, 0)
    train, _, _ = pre.BlendedMegatronDatasetBuilder(pre.MockGPTDataset, list(sizes), lambda: True,
                                                    pre.dataset_config(args)).build()
    assert train[0]["tokens"].shape == (2048,)


def test_every_published_h100_preset_split_parses():
    """NVIDIA's H100 presets with each pipeline split the space offers for them
    (--account-for-embedding/loss-in-pipeline-split, --pipeline-model-parallel-layout)."""
    items = check.preset_layouts()
    assert len(items) >= 15
    assert any("--pipeline-model-parallel-layout" in i["production"] for i in items)
    assert any("--account-for-embedding-in-pipeline-split" in i["production"] for i in items)
    bad = []
    for it in items:
        for form in ("production", "runner"):
            extra = check.USER_ARGS + ["--vocab-size", str(it["vocab_size"])] if form == "production" else []
            err = check.megatron_accepts(it[form] + extra, it["world_size"], it["arch_major"])
            if err:
                bad.append((it["model"], it["cluster"], form, err))
    assert not bad
