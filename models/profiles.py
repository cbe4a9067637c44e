"""Stack profiles: one physical model, calibrated for the software stack that runs the layout.

  te     Megatron-Core with Transformer Engine (fused TE layers, FP8 through TE, TP communication
         overlap with userbuffers, bf16 gradient reduction): what platform teams deploy, and so the
         default for `recommend` and `predict`. Fitted on the published Megatron / NeMo /
         Megatron-Bridge runs of data/published/ (bench/fit_profiles.py).
  local  this project's own trial runner (megatron-core's local layers, no Transformer Engine,
         SDPA attention, fp32 gradient reduction). Fitted on data/measurements/ (advisor fit).

A profile is a calibration file (models/calibrate.Calibration) plus the layout defaults of its
stack: knobs a stack turns on by itself that the user does not set per run. A user's own fit
(`advisor fit -o FILE --profile-name NAME`) is a profile too, passed with `--calibration FILE`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from advisor.catalog.specs import FP8_PARAM_QUANTS, SpecError, TrainConfig

DATA = Path(__file__).parent / "data"


@dataclass(frozen=True)
class Stack:
    name: str
    description: str
    file: Path
    # TrainConfig fields the stack sets when the user leaves them unset, as functions of the layout
    layout_defaults: Mapping[str, Any] = field(default_factory=dict)
    # GPU generation (catalog `generation`) -> the profile fitted on that generation's published rows
    generations: Mapping[str, Path] = field(default_factory=dict)
    # Megatron FSDP settings recommend searches (SpaceOptions.fsdp): a layout choice, not a default
    space_fsdp: tuple[bool, ...] = (False,)

    def file_for(self, gpu=None) -> Path:
        """The stack's profile for a GPU: its generation's where one is shipped, else the stack's."""
        f = self.generations.get(getattr(gpu, "generation", ""))
        return f if f is not None and f.is_file() else self.file

    def defaults_for(self, tp: int, sequence_parallel: bool, moe: bool = False) -> dict[str, Any]:
        """The stack's defaults for a layout: TP-comm overlap where TP > 1 with SP; the MoE knobs
        (moe_*) only for a MoE model (a dense model has no router or permutation to fuse)."""
        out = {}
        for k, v in self.layout_defaults.items():
            if k == "tp_comm_overlap":  # TE userbuffers overlap TP communication where SP is on
                out[k] = bool(v) and tp > 1 and sequence_parallel
            elif k.startswith("moe_"):
                if moe:
                    out[k] = v
            else:
                out[k] = v
        return out


STACKS: dict[str, Stack] = {
    "te": Stack(
        "te", "Megatron-Core + Transformer Engine (fitted on published runs)",
        DATA / "te_calibration.joblib",
        # NeMo / Megatron-Bridge performance recipes set tp_comm_overlap for TP > 1 (userbuffers),
        # and their MoE recipes TE's fused permutation (moe_permute_fusion = True, e.g. Megatron-Bridge
        # recipes/qwen/qwen3_moe*.py, deepseek) and a fused (DeepSeek-V3) or CUDA-graphed (Qwen3)
        # router, priced as moe_router_fusion; TE's fused cross entropy (Megatron-Bridge's recipes:
        # cross_entropy_loss_fusion = True, cross_entropy_fusion_impl = "te"); and
        # gradient_accumulation_fusion (Megatron-LM's default, on wherever TE or apex is installed:
        # the wgrad GEMM accumulates into the main grad)
        # FP8 primary weights (Megatron-Bridge / NeMo bf16_with_fp8_mixed(): fp8_param_gather = True,
        # fp8_params = True), where a layout runs FP8 with the distributed optimizer.
        {"tp_comm_overlap": True, "moe_permute_fusion": True, "moe_router_fusion": True,
         "cross_entropy_impl": "te", "gradient_accumulation_fusion": True, "fp8_param_gather": True,
         # torch's allocator with expandable segments (NeMo scripts/performance/executors.py:
         # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True on every GPU but B200)
         "expandable_segments": True,
         # the pipeline frees each stage's output once sent (Megatron-LM's training and Megatron-Bridge's
         # providers: deallocate_pipeline_outputs = True)
         "deallocate_pipeline_outputs": True,
         # NCCL communicators created at each group's first collective (Megatron-Bridge's initialize
         # passes no device_id to init_process_group: TrainConfig.nccl_lazy_init)
         "nccl_lazy_init": True},
        # fitted on the published B200 / GB200 / GB300 rows (bench/fit_blackwell.py); H100's stays
        {"blackwell": DATA / "te_blackwell_calibration.joblib"},
        # with and without Megatron FSDP (optim_grads_params): NVIDIA's Llama3-70B recipes on GB200 /
        # GB300 / B200 / B300 run it at DP 64 (Megatron-Bridge scripts/performance/configs/llama/
        # llama3_workload_base_configs.py: use_megatron_fsdp=True)
        space_fsdp=(False, True)),
    "local": Stack(
        "local", "this project's runner: megatron-core local layers, no Transformer Engine",
        DATA / "default_calibration.joblib", {},
        # searched so that recommend counts what this runner leaves out (search_spaces.runnable: FSDP)
        space_fsdp=(False, True)),
}
DEFAULT_STACK = "te"


def get_stack(name: str | None) -> Stack:
    """The named stack (None: the default one); an unknown name is a one-line error."""
    key = (name or DEFAULT_STACK).strip().lower()
    if key not in STACKS:
        raise SpecError(f"unknown stack {name!r} (known: {', '.join(STACKS)})")
    return STACKS[key]


# SpaceOptions fields a stack sets when the user leaves them None, with the value for a stack
# that does not say: TrainConfig's own defaults (Megatron's)
STACK_OPTION_FALLBACKS = {f.name: f.default for f in fields(TrainConfig)
                          if f.name in ("cross_entropy_impl", "fp8_param_gather", "expandable_segments",
                                        "deallocate_pipeline_outputs", "nccl_lazy_init")}


def stack_option_defaults(stack: str | None) -> dict[str, Any]:
    """The stack's values of STACK_OPTION_FALLBACKS' fields: its loss's cross entropy
    (catalog.specs.CROSS_ENTROPY_IMPLS), FP8 primary weights where a layout can (TrainConfig.
    fp8_param_gather), torch's allocator with expandable segments (TrainConfig.expandable_segments),
    the pipeline's outputs freed once sent (TrainConfig.deallocate_pipeline_outputs)."""
    d = get_stack(stack).layout_defaults
    return {k: d.get(k, fallback) for k, fallback in STACK_OPTION_FALLBACKS.items()}


def stack_cross_entropy(stack: str | None) -> str:
    """The loss's cross entropy a stack's layouts take when the user does not say."""
    return stack_option_defaults(stack)["cross_entropy_impl"]


def apply_layout_defaults(cfg: TrainConfig, stack: str | None, explicit: Mapping[str, Any] = (),
                          moe: bool = False) -> TrainConfig:
    """`cfg` with the stack's layout defaults for the knobs not in `explicit` (what the user set);
    `moe`: the model is a MoE (its moe_* defaults apply)."""
    s = get_stack(stack)
    d = {k: v for k, v in s.defaults_for(cfg.tp, cfg.sequence_parallel, moe).items() if k not in explicit}
    if "fp8_param_gather" in d:  # FP8 weights exist only for an FP8 layout with the distributed optimizer
        d["fp8_param_gather"] = bool(d["fp8_param_gather"]) and cfg.quant_code in FP8_PARAM_QUANTS \
            and cfg.distributed_optimizer
    return cfg.replace(**d) if d else cfg

