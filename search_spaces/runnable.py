"""What a software stack's runner can run: the one place the rule lives (issue #27, "rank only
what can run"). A function of the stack and the layout, per layout (`refusal`) and on the columns
of search_spaces.columns / models.vectorized (`refused`); runners/megatron_args.py refuses with it,
`recommend` and `advisor tune` leave out what it refuses.

Stacks (advisor.models.profiles):
  local  this project's runner, megatron-core's local layers without Transformer Engine (seen on
         megatron-core 0.19.2): no FP8, no sequence parallelism (torch LayerNorm), no context
         parallelism (the local attention spec asserts cp == 1), no TP communication overlap
         (TE userbuffers), no MoE with TP > 1 (megatron-core needs sequence parallelism there), and
         no activation offloading (TE's get_cpu_offload_context).
         The runner turns sequence parallelism off itself (`runs_sequence_parallel`), so a dense
         layout with TP > 1 runs without it.
  te     Megatron-Core with Transformer Engine: none of the above is refused.
Every stack: learned attention sinks (gpt-oss) with CP > 1 (MODEL_RULES): Transformer Engine runs a
non-vanilla softmax under context parallelism only with cp_comm_type a2a (its CP tests skip the
others), which neither the printed arguments (p2p / all_gather) nor the step model price.
This project's runner, whatever the stack, does not run Megatron FSDP (RUNNER_RULES: its worker
builds megatron-core's DistributedDataParallel itself, runners.megatron_args.runner_config): the
local stack (which is that runner) leaves FSDP out of recommend, and `advisor tune` with the megatron
runner never samples it (`runner=True`); the te stack's recommend ranks it (NVIDIA's recipes run it).
"""
from __future__ import annotations

import numpy as np

from advisor.catalog.specs import ModelSpec, TrainConfig

# (key, one-line reason) in the order they are checked; the text is what the runner prints
LOCAL_RULES = (
    ("fp8", "fp8 needs Transformer Engine, which is not installed (bf16 only; mxfp8 / nvfp4 too)"),
    ("sequence_parallel",
     "sequence_parallel fails without Transformer Engine ('sequence parallel not supported by torch LayerNorm')"),
    ("cp", "context parallelism (cp > 1) needs TEDotProductAttention; the local spec asserts cp == 1"),
    ("tp_comm_overlap", "tp_comm_overlap needs Transformer Engine userbuffers"),
    ("moe_tp", "MoE with tp > 1 needs sequence parallelism (megatron-core raises otherwise), "
               "which needs Transformer Engine"),
    ("cpu_offload", "cpu_offload_layers needs Transformer Engine's get_cpu_offload_context (megatron-core "
                    "asserts \"CPU Offloading is enabled when TE is not present\")"),
)
# what this project's runner does not run with any stack's layers
RUNNER_RULES = (
    ("fsdp", "Megatron FSDP (fsdp) is not run by this runner (its worker builds megatron-core's "
             "DistributedDataParallel, not MegatronFSDP); measure it with --runner command"),
)
LOCAL_RULES = LOCAL_RULES + RUNNER_RULES
# what no stack runs as the advisor would print and price it
MODEL_RULES = (
    ("sinks_cp", "learned attention sinks with context parallelism (cp > 1) run in Transformer Engine only "
                 "with cp_comm_type a2a, which the advisor does not price or print; use cp 1"),
)
LOCAL_RULES = LOCAL_RULES + MODEL_RULES
# short labels of the rules for the one line that counts what was left out
LABELS = {"fp8": "FP8", "sequence_parallel": "sequence parallelism", "cp": "CP > 1",
          "tp_comm_overlap": "TP comm overlap", "moe_tp": "MoE with TP > 1", "cpu_offload": "CPU offloading",
          "fsdp": "Megatron FSDP", "sinks_cp": "sinks with CP > 1"}
RESTRICTED_STACKS = ("local",)


def runs_sequence_parallel(stack: str) -> bool:
    """Whether the stack's runner runs sequence parallelism (the local runner turns it off)."""
    return stack not in RESTRICTED_STACKS


def _broken(model: ModelSpec, tp, cp, sp, fp8, tpo, offload=0, fsdp=False) -> dict:
    """Each rule of the local stack: True (or a boolean array) where the layout breaks it."""
    return {"fp8": fp8, "sequence_parallel": sp, "cp": cp > 1, "tp_comm_overlap": tpo,
            "moe_tp": model.is_moe & (tp > 1), "cpu_offload": np.asarray(offload) > 0, "fsdp": fsdp,
            "sinks_cp": model.attention_sinks & (np.asarray(cp) > 1)}


def _rules(stack: str, runner: bool) -> tuple:
    """The rules that apply: the local stack's, or this project's runner's with another stack's layers."""
    return LOCAL_RULES if stack in RESTRICTED_STACKS else RUNNER_RULES + MODEL_RULES if runner else MODEL_RULES


def first_broken_rule(model: ModelSpec, cfg: TrainConfig, stack: str, runner: bool = False) -> str | None:
    """The key (LOCAL_RULES) of the first rule of the stack's runner this layout breaks; None if none.
    `runner`: the stack's layers run by this project's runner (RUNNER_RULES apply to every stack)."""
    rules = _rules(stack, runner)
    if not rules:
        return None
    broken = _broken(model, cfg.tp, cfg.cp, cfg.sequence_parallel, cfg.precision != "bf16", cfg.tp_comm_overlap,
                     cfg.cpu_offload_layers, cfg.fsdp)
    return next((key for key, _ in rules if broken[key]), None)


def refusal(model: ModelSpec, cfg: TrainConfig, stack: str, runner: bool = False) -> str | None:
    """Why the stack's runner cannot run this layout, in one line; None if it can."""
    key = first_broken_rule(model, cfg, stack, runner)
    return dict(LOCAL_RULES)[key] if key else None


def refused(model: ModelSpec, L, stack: str, runner: bool = False) -> tuple[np.ndarray, dict[str, int]]:
    """On columns (models.vectorized.Layouts): a boolean per row, True where the stack's runner
    refuses the layout, and how many rows each rule refuses first (in LOCAL_RULES' order)."""
    n = len(L.tp)
    out = np.zeros(n, bool)
    counts: dict[str, int] = {}
    rules = _rules(stack, runner)
    if not rules:
        return out, counts
    broken = _broken(model, L.tp, L.cp, L.sp, L.fp8, L.tp_overlap, 0 if L.offload is None else L.offload,
                     L.fsdp if L.fsdp is not None else False)
    for key, _ in rules:
        b = np.broadcast_to(np.asarray(broken[key], bool), (n,)) & ~out
        if b.any():
            counts[key] = int(b.sum())
        out |= b
    return out, counts


def left_out_line(stack: str, counts: dict[str, int]) -> str:
    """One line: how many layouts the stack's runner refuses, by rule ("" when none)."""
    total = sum(counts.values())
    if not total:
        return ""
    parts = ", ".join(f"{LABELS[k]} {v:,}" for k, v in counts.items())
    # a model rule (MODEL_RULES) is the stack's own limit, not its runner's
    who = f"the {stack} stack" if set(counts) <= set(dict(MODEL_RULES)) else f"the {stack} stack's runner"
    return f"left out {total:,} layout(s) {who} cannot run ({parts})"
