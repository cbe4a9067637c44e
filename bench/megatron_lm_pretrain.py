"""A short Megatron-LM pretraining script: megatron-core's own training loop
(``megatron.training.pretrain``: its argument parser, optimizer set-up, schedules, timers and
iteration log lines) on Megatron-LM's mock data, for ``advisor measure/tune --runner command``.

    torchrun --nproc-per-node N bench/megatron_lm_pretrain.py {megatron_model_args} {megatron_args} \\
        --transformer-impl local --mock-data --tokenizer-type NullTokenizer --lr 1e-4 ...

It follows Megatron-LM's ``pretrain_gpt.py`` of megatron-core 0.19 (parse_and_validate_args,
pretrain_cfg_container_from_args, pretrain with a model provider, BlendedMegatronDatasetBuilder
over MockGPTDataset, next-token loss over the loss mask). One difference, so that the same layout
runs the same kernels as the advisor's built-in runner (``runners/megatron_worker.py``): the
layers are that runner's (megatron-core's local spec with its core attention through
``torch.nn.functional.scaled_dot_product_attention``; the local spec's own DotProductAttention is
unfused and quadratic in memory). Needs torch, megatron-core and a GPU.
"""
from __future__ import annotations

import os
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runners"))  # megatron_worker's layers

from megatron.core import parallel_state  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.training import get_args, get_tokenizer, pretrain  # noqa: E402
from megatron.training.argument_utils import pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args  # noqa: E402


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    from megatron_worker import layer_spec  # the built-in runner's layers (local spec + SDPA)

    args = get_args()
    config = config or core_transformer_config_from_args(args)
    spec = layer_spec({"tc": {"num_moe_experts": args.num_experts}}, config, vp_stage)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                    post_process=post_process, parallel_output=True,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                    rotary_base=args.rotary_base, vp_stage=vp_stage)


def _first_or_last(vp_stage) -> bool:
    return (parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
            or parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage))


def get_batch(data_iterator, vp_stage=None):
    """This rank's micro-batch on its GPU (middle pipeline stages take none)."""
    if not _first_or_last(vp_stage):
        return None, None, None, None
    data = next(data_iterator)
    dev = torch.cuda.current_device()
    return (data["tokens"].to(dev, non_blocking=True), data["labels"].to(dev, non_blocking=True),
            data["loss_mask"].to(dev, non_blocking=True), data["position_ids"].to(dev, non_blocking=True))


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1)
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    vp_stage = getattr(getattr(model, "module", model), "vp_stage", None)
    tokens, labels, loss_mask, position_ids = get_batch(data_iterator, vp_stage)
    output = model(tokens, position_ids, None, labels=labels)
    return output, partial(loss_func, loss_mask)


def dataset_config(args) -> GPTDatasetConfig:
    return GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length, blend=None,
                            blend_per_split=None, split="99,1,0", path_to_cache=args.data_cache_path,
                            tokenizer=get_tokenizer(), reset_position_ids=False, reset_attention_mask=False,
                            eod_mask_loss=False, create_attention_mask=False, mid_level_dataset_surplus=0.005)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    if not args.mock_data:
        raise SystemExit("this script trains on Megatron-LM's mock data only: pass --mock-data")

    def on_this_rank():
        return _first_or_last(None) and parallel_state.get_tensor_model_parallel_rank() == 0

    return BlendedMegatronDatasetBuilder(MockGPTDataset, train_val_test_num_samples, on_this_rank,
                                         dataset_config(args)).build()


train_valid_test_datasets_provider.is_distributed = True


def use_prebuilt_dataset_helpers() -> None:
    """Megatron-LM's initialize runs `make` in megatron/core/datasets to build its C++ dataset
    helpers; the megatron-core wheel ships them built (helpers_cpp) and no Makefile, so `make`
    fails and Megatron-LM exits. Use the shipped module instead."""
    import megatron.core.datasets.utils as U

    def compile_helpers():
        from megatron.core.datasets import helpers_cpp  # noqa: F401 - fails loudly if it is missing

    U.compile_helpers = compile_helpers


def main() -> None:
    use_prebuilt_dataset_helpers()
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    cfg = pretrain_cfg_container_from_args(args)
    pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
             model_provider=model_provider)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    main()
