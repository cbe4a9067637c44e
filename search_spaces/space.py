"""All legal layouts for a model x cluster x workload, and the same space for Optuna.

The enumeration is exhaustive over TP (within a node; divides heads and KV groups), CP, PP (even
splits; when the layers do not divide, Megatron's uneven splits: embedding / loss counted as a
layer, first / last stage trimmed, or an explicit pipeline layout, see `split_choices`), virtual pipeline,
EP / expert TP for MoE models, micro-batch and recompute; DP is derived. Sequence parallelism is on
whenever TP > 1, the distributed optimizer whenever there is data parallelism, and gradient
reduce / parameter gather overlap with it (the settings every Megatron recipe uses); the space
can be widened through `SpaceOptions`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Iterator

from advisor.catalog.specs import ClusterSpec, ModelSpec, SpecError, TrainConfig
from advisor.search_spaces.layout import violations


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def powers_of_two_upto(n: int) -> list[int]:
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return out


@dataclass(frozen=True)
class Workload:
    seq: int
    gbs: int
    precision: str = "bf16"
    fp8_recipe: str = "delayed"  # Megatron's --fp8-recipe when precision is fp8

    def __post_init__(self) -> None:
        if self.seq < 1 or self.gbs < 1:
            raise SpecError("seq and gbs must be positive")


@dataclass(frozen=True)
class SpaceOptions:
    mbs: tuple[int, ...] = (1, 2, 4, 8)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    max_vp: int = 32  # NVIDIA's H100 presets go to one layer per chunk (VP 12, 20, 24)
    max_cp: int = 16
    min_tokens_per_cp_rank: int = 2048
    uneven_pipeline: bool = True
    max_layout_vp: int = 8  # explicit layouts are generated for vp up to this that no other split allows:
    every_layout_vp: bool = False  # every such vp (True) or the powers of two (False)
    tp_comm_overlap: bool = False  # needs Transformer Engine
    gradient_accumulation_fusion: bool = False  # TrainConfig.gradient_accumulation_fusion of every layout
    sequence_parallel: bool = True  # whenever TP > 1 (off where the stack's runner cannot run it)
    distributed_optimizer: tuple[bool, ...] = (True,)
    # the loss's cross entropy (catalog.specs.CROSS_ENTROPY_IMPLS); None: the stack's layout default
    # where a stack is known (advisor.api.recommend, advisor.study.make_plan), else "unfused"
    cross_entropy_impl: str | None = None
    # FP8 primary weights where the layout runs FP8 with the distributed optimizer
    # (TrainConfig.fp8_param_gather); None: the stack's layout default
    fp8_param_gather: bool | None = None
    # torch's allocator with expandable segments (TrainConfig.expandable_segments); None: the stack's
    # layout default
    expandable_segments: bool | None = None
    # the pipeline frees each stage's output once sent (TrainConfig.deallocate_pipeline_outputs); None:
    # the stack's layout default
    deallocate_pipeline_outputs: bool | None = None
    # NCCL communicators at each group's first collective (TrainConfig.nccl_lazy_init); None: the
    # stack's layout default
    nccl_lazy_init: bool | None = None
    # Megatron FSDP (optim_grads_params, TrainConfig.fsdp) choices: (False,) never, (True,) or (False, True)
    # on the layouts fsdp_applies to (a bool is read as a one-choice tuple)
    fsdp: tuple[bool, ...] = (False,)
    moe_fusion: bool = False  # TE's fused router and permutation on a MoE model (the te stack's recipes)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.fsdp, bool):
            object.__setattr__(self, "fsdp", (self.fsdp,))

    @classmethod
    def wide(cls, **kw) -> "SpaceOptions":
        """recommend's space: micro-batches up to 16 and an explicit pipeline layout for every VP
        up to 32 that no other split allows (issue #15; the arrays of models.vectorized rank it in
        about the time the narrower space took). The defaults stay the narrower space that
        `advisor tune` declares to Optuna (a stored study's distributions must not change)."""
        return cls(**{"mbs": (1, 2, 4, 8, 16), "max_layout_vp": 32, "every_layout_vp": True, **kw})


def pipeline_splits(num_layers: int, pp: int, allow_uneven: bool) -> list[tuple[int | None, int | None]]:
    """(first, last) layer counts for pp stages: (None, None) for an even split; otherwise the
    middle stages take ceil(L/pp) layers and the first and last share the rest."""
    if pp == 1 or num_layers % pp == 0:
        return [(None, None)] if num_layers >= pp else []
    if not allow_uneven or pp < 3:
        if allow_uneven and pp == 2:
            first = num_layers // 2
            return [(first, None)]
        return []
    k = -(-num_layers // pp)
    rest = num_layers - (pp - 2) * k
    first = rest // 2
    last = rest - first
    if first < 1:
        return []
    return [(first, last)]


@lru_cache(maxsize=4096)
def balanced_layout(num_layers: int, pp: int, vp: int) -> str | None:
    """A megatron-core pipeline layout string for pp·vp chunks in which the embedding and the loss
    count as one layer each and every chunk holds k or k - 1 of these units. The short chunks are
    the loss chunk, then the embedding chunk, then spread so that every rank gets as many short
    chunks as the others (later chunks first). DeepSeek-V3's 61 layers on PP8 VP4 give
    "Et|(tt|)*30L", the layout Megatron-LM's DeepSeek-V3 example uses without MTP. None when a
    chunk would be left with nothing."""
    chunks = pp * vp
    units = num_layers + 2
    k = -(-units // chunks)
    slack = chunks * k - units
    if k < 1 or slack >= chunks or (k == 1 and slack > 0):
        return None
    short = [chunks - 1, 0][:slack]
    per_rank = [0] * pp
    for ch in short:
        per_rank[ch % pp] += 1
    rest = [ch for ch in range(chunks - 2, 0, -1)]
    while len(short) < slack:
        ch = min((c for c in rest if c not in short), key=lambda c: (per_rank[c % pp], -c))
        short.append(ch)
        per_rank[ch % pp] += 1
    size = [k - (ch in short) for ch in range(chunks)]
    size[0] -= 1  # the embedding
    size[-1] -= 1  # the loss
    if min(size) < 0:
        return None
    names = [("E" if ch == 0 else "") + _t(size[ch]) + ("L" if ch == chunks - 1 else "") for ch in range(chunks)]
    out, i = [], 0
    while i < chunks:
        j = i
        while j + 1 < chunks and names[j + 1] == names[i]:
            j += 1
        n = j - i + 1
        out.append(f"({names[i]}|)*{n}" if n > 1 else names[i] + "|")
        i = j + 1
    s = "".join(out)
    return s[:-1] if s.endswith("|") else s


def _t(n: int) -> str:
    return "t" * n if n <= 3 else f"t*{n}"


def split_choices(num_layers: int, pp: int, options: SpaceOptions) -> list[tuple[dict, list[int]]]:
    """The pipeline splits of num_layers over pp ranks, each as (TrainConfig fields, the vp values
    it allows). An even split when it exists. Otherwise Megatron's uneven splits: the embedding
    and / or the loss counted as a layer (--account-for-*-in-pipeline-split, as NVIDIA's 405B and
    Qwen3-235B presets do), the first / last stage trimmed (--decoder-first/last-pipeline-num-
    layers) when that accounting does not split either, and for a vp that none of them allows
    (up to max_layout_vp: every one with every_layout_vp, else the powers of two) an explicit
    --pipeline-model-parallel-layout (`balanced_layout`)."""
    if pp == 1:
        return [({}, [1])]
    if num_layers < pp:
        return []

    def vps(*counts: int) -> list[int]:
        return [v for v in range(1, options.max_vp + 1) if all(c % v == 0 and c >= v for c in counts)]

    if num_layers % pp == 0:
        return [({}, vps(num_layers // pp))]
    if not options.uneven_pipeline:
        return []
    out: list[tuple[dict, list[int]]] = []
    for acc_e, acc_l in ((True, True), (False, True), (True, False)):  # both, then the loss (heavier)
        total = num_layers + acc_e + acc_l
        if total % pp == 0:
            out.append(({"account_for_embedding": acc_e, "account_for_loss": acc_l}, vps(total // pp)))
            break
    if not out:  # the embedding / loss accounting fits better: the first / last split is only a fallback
        from advisor.search_spaces.layout import stage_layer_counts

        for first, last in pipeline_splits(num_layers, pp, True):
            counts = stage_layer_counts(num_layers, pp, first, last)
            out.append(({"pp_first_layers": first, "pp_last_layers": last}, vps(*counts)))
    covered = {v for _, vs in out for v in vs}
    top = min(options.max_vp, options.max_layout_vp)
    for v in (range(2, top + 1) if options.every_layout_vp else powers_of_two_upto(top)[1:]):
        if v not in covered:
            layout = balanced_layout(num_layers, pp, v)
            if layout is not None:
                out.append(({"pipeline_layout": layout}, [v]))
    return out


def enumerate_layouts(model: ModelSpec, cluster: ClusterSpec, workload: Workload,
                      options: SpaceOptions = SpaceOptions(),
                      keep: Callable[[TrainConfig], bool] | None = None) -> Iterator[TrainConfig]:
    """Every legal layout (optionally filtered by `keep`, e.g. a memory check)."""
    for tp, cp, pp, dp in model_parallel_choices(model, cluster, workload, options):
        for split, vps in split_choices(model.num_layers, pp, options):
            yield from _inner(model, cluster, workload, options, tp, cp, pp, dp, split, vps, keep)


def model_parallel_choices(model: ModelSpec, cluster: ClusterSpec, workload: Workload,
                           options: SpaceOptions) -> Iterator[tuple[int, int, int, int]]:
    """(tp, cp, pp, dp) of the space, in enumeration order (search_spaces.columns shares it)."""
    world = cluster.world_size
    gpn = cluster.domain_gpus  # TP stays inside the NVLink domain (an NVL72 rack: up to its 72 GPUs)
    heads, kv = model.num_attention_heads, model.kv_heads
    tps = [t for t in divisors(gpn) if heads % t == 0 and (model.mla is not None or kv % t == 0)]
    cps = [c for c in powers_of_two_upto(options.max_cp)
           if c == 1 or (workload.seq % (2 * c) == 0 and workload.seq // c >= options.min_tokens_per_cp_rank)]
    for tp in tps:
        for cp in cps:
            if world % (tp * cp):
                continue
            for pp in divisors(world // (tp * cp)):
                if pp > model.num_layers:
                    continue
                dp = world // (tp * cp * pp)
                if workload.gbs % dp:
                    continue
                yield tp, cp, pp, dp


def fsdp_applies(dist, dp, cp, pp):
    """Where the space offers Megatron FSDP (bools or arrays): with the distributed optimizer (which
    Megatron-LM turns on with --use-megatron-fsdp), a DP x CP group to shard over, and no pipeline.
    NVIDIA's FSDP recipes are PP 1 (Megatron-Bridge llama3_workload_base_configs.py: Llama3-70B on
    GB200 / GB300 / B200 / B300, DP 64); megatron-core 0.19's arguments.py does not assert PP 1 with
    --use-megatron-fsdp, but its schedules handle Megatron FSDP only in forward_backward_no_pipelining
    (synchronize_param_gather) and the pipeline support is still being added (Megatron-LM pull
    request #6486, "Enable Pipeline Parallelism Support for M-FSDP v2", open): not searched with PP > 1."""
    return dist & (dp * cp > 1) & (pp == 1)


def fsdp_choices(options: SpaceOptions, dist: bool, dp: int, cp: int, pp: int) -> list[bool]:
    """The FSDP settings of one layout, in the options' order (off where fsdp_applies does not)."""
    ok = bool(fsdp_applies(dist, dp, cp, pp))
    return list(dict.fromkeys(f and ok for f in options.fsdp))


def expert_choices(model: ModelSpec, tp: int, cp: int, dp: int) -> tuple[list[int], list[int]]:
    """(EP sizes, expert-TP sizes) to try: divisors of the experts that divide dp·cp·tp, and 1 or TP."""
    if model.is_moe:
        return [e for e in divisors(model.num_experts) if (dp * cp * tp) % e == 0], sorted({1, tp})
    return [1], [1]


def _inner(model, cluster, workload, options, tp, cp, pp, dp, split, vps, keep):
    eps, etps = expert_choices(model, tp, cp, dp)
    per_dp = workload.gbs // dp
    for mbs in options.mbs:
        if per_dp % mbs:
            continue
        m = per_dp // mbs
        for vp in vps:
            if vp > 1 and m % pp:
                continue
            for ep in eps:
                for etp in etps:
                    if (dp * cp * tp) % (ep * etp):
                        continue
                    if model.is_moe and model.moe.ffn_hidden_size % etp:
                        continue
                    for dist, fsdp in [(d, f) for d in options.distributed_optimizer
                                       for f in fsdp_choices(options, d and dp * cp > 1, dp, cp, pp)]:
                        for rc in options.recompute:
                            cfg = TrainConfig(
                                tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, vp=vp, mbs=mbs,
                                gbs=workload.gbs, seq=workload.seq, precision=workload.precision,
                                fp8_recipe=workload.fp8_recipe,
                                recompute=rc, sequence_parallel=options.sequence_parallel and tp > 1,
                                distributed_optimizer=dist and dp * cp > 1,
                                overlap_grad_reduce=dp * cp > 1,
                                overlap_param_gather=dist and dp * cp > 1,
                                tp_comm_overlap=options.tp_comm_overlap and tp > 1,
                                cross_entropy_impl=options.cross_entropy_impl or "unfused",
                                fp8_param_gather=bool(options.fp8_param_gather) and dist and dp * cp > 1
                                and workload.precision in ("fp8", "mxfp8"),
                                expandable_segments=bool(options.expandable_segments),
                                deallocate_pipeline_outputs=bool(options.deallocate_pipeline_outputs),
                                nccl_lazy_init=bool(options.nccl_lazy_init),
                                fsdp=fsdp,
                                moe_router_fusion=options.moe_fusion and model.is_moe,
                                moe_permute_fusion=options.moe_fusion and model.is_moe,
                                gradient_accumulation_fusion=options.gradient_accumulation_fusion,
                                **split,
                            )
                            if keep is None or keep(cfg):
                                yield cfg


def is_legal(model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig) -> bool:
    return not violations(model, cluster, cfg)


# ------------------------------------------------------------------------------------------------
# Optuna
# ------------------------------------------------------------------------------------------------

def layout_choices(model: ModelSpec, cluster: ClusterSpec, workload: Workload,
                   options: SpaceOptions = SpaceOptions()) -> list[TrainConfig]:
    return list(enumerate_layouts(model, cluster, workload, options))


OPTUNA_KNOBS = ("tp", "pp", "cp", "ep", "etp", "vp", "mbs", "recompute", "distributed_optimizer")


def optuna_space(layouts: list[TrainConfig]) -> dict[str, list]:
    """One categorical parameter per knob that is a free choice in `layouts` (DP, the pipeline
    split and the flags that follow from TP / DP are derived), with its sorted choices. The choices are a
    fixed function of the space, so every driver of a study declares the same distributions."""
    if not layouts:
        raise SpecError("the layout space is empty")
    space = {}
    for k in OPTUNA_KNOBS:
        others = [o for o in OPTUNA_KNOBS if o != k]
        groups: dict[tuple, set] = {}
        for c in layouts:
            groups.setdefault(tuple(getattr(c, o) for o in others), set()).add(getattr(c, k))
        if any(len(v) > 1 for v in groups.values()):  # a free choice, not derived from the others
            space[k] = sorted({getattr(c, k) for c in layouts}, key=lambda v: (str(type(v)), v))
    return space


def layout_params(cfg: TrainConfig, space: dict[str, list]) -> dict:
    """The Optuna parameters that select `cfg` (for ``study.enqueue_trial``)."""
    return {k: getattr(cfg, k) for k in space}


def layout_key(cfg: TrainConfig) -> str:
    """`TrainConfig.key()` plus the knobs it leaves out that the Optuna space can vary."""
    return cfg.key() + ("" if cfg.distributed_optimizer or cfg.dp * cfg.cp == 1 else "-nodistopt")


def resolve_params(params: dict, layouts: list[TrainConfig], space: dict[str, list]) -> TrainConfig:
    """The layout with exactly these knob values, or else the nearest legal one: fewest knobs
    changed, earlier knobs (TP, PP, ...) kept first, then the layout key as a tie-break."""
    keys = list(space)

    def distance(c: TrainConfig) -> tuple:
        return tuple(0 if getattr(c, k) == params.get(k) else 1 for k in keys)

    return min(layouts, key=lambda c: (sum(distance(c)), distance(c), c.key()))


def optuna_suggest(trial, layouts: list[TrainConfig], space: dict[str, list] | None = None) -> TrainConfig:
    """Suggest one layout from `layouts` with one categorical parameter per knob, so samplers see
    the structure (TPE models each knob). A combination that is not legal resolves to the nearest
    legal layout: the trial's value then stands for that layout (a projection onto the legal set),
    and the layout actually chosen is the trial's `layout` user attribute."""
    space = optuna_space(layouts) if space is None else space
    picked = {k: trial.suggest_categorical(k, v) for k, v in space.items()}
    best = resolve_params(picked, layouts, space)
    trial.set_user_attr("layout", best.to_dict())
    trial.set_user_attr("layout_key", layout_key(best))
    trial.set_user_attr("exact", layout_params(best, space) == picked)
    return best
