"""Structure and legality of one layout: which layers each pipeline stage holds, how many
microbatches are in flight, and the rules a Megatron layout must satisfy (each with its reason).
Pure functions; no prediction here."""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property, lru_cache

from advisor.catalog.specs import ClusterSpec, ModelSpec, SpecError, TrainConfig, check_precision


class IllegalLayout(SpecError):
    """A layout breaks a rule; the message names the rule."""


def stage_layer_counts(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Transformer layers per pipeline stage. An even split, or Megatron's uneven split where the
    first and/or last stage get a set number of layers and the rest is spread evenly."""
    if pp == 1:
        return [num_layers]
    if first is None and last is None:
        base, extra = divmod(num_layers, pp)
        if extra:
            raise IllegalLayout(f"{num_layers} layers do not split evenly over pp={pp} stages "
                                f"(give --pp-first-layers/--pp-last-layers, --account-for-embedding/"
                                f"--account-for-loss or --pipeline-layout for an uneven split)")
        return [base] * pp
    middle_stages = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if rest < 0 or (middle_stages == 0 and rest != 0):
        raise IllegalLayout(f"uneven split first={first} last={last} does not add up to {num_layers} layers over pp={pp}")
    if middle_stages:
        base, extra = divmod(rest, middle_stages)
        if extra:
            raise IllegalLayout(f"after first={first} / last={last} layers, {rest} layers do not split evenly "
                                f"over the {middle_stages} middle stages")
    else:
        base = 0
    counts = [base] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    if min(counts) < 1:
        raise IllegalLayout(f"pipeline split {counts} leaves a stage without layers")
    return counts


# ------------------------------------------------------------------------------------------------
# Pipeline plan: which layers, embedding and loss each (pipeline rank, virtual chunk) holds
# ------------------------------------------------------------------------------------------------

LAYOUT_CHARS = {"E": "embedding", "t": "transformer layer", "m": "multi-token-prediction layer", "L": "loss"}


def parse_pipeline_layout(layout: str) -> list[str]:
    """megatron-core's layout string as one string of layer letters per pipeline chunk, in its
    order (chunk i is virtual stage i // pp of pipeline rank i % pp). The grammar is that of
    ``PipelineParallelLayerLayout.parse_str_to_list`` (megatron-core 0.19.2): commas are
    cosmetic, ``(...)*n`` and then ``x*n`` repeat (no nesting), ``|`` separates chunks, and the
    letters are E (embedding), t (transformer layer), m (MTP layer) and L (loss)."""
    s = layout.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        s = re.sub(pattern, lambda x: x.group(1) * int(x.group(2)), s)
    chunks = s.split("|")
    for c in chunks:
        bad = next((ch for ch in c if ch not in LAYOUT_CHARS), None)
        if bad is not None:
            raise IllegalLayout(f"pipeline layout {layout!r}: {bad!r} is not a layer letter "
                                f"(E, t, m, L; '|' between chunks, (..)*n and x*n repeat)")
    return chunks


@dataclass(frozen=True)
class PipelinePlan:
    """Decoder layers of each pipeline chunk in megatron-core's order (chunk i = virtual stage
    i // pp of rank i % pp; layers are numbered in chunk order). The embedding is built on the
    first chunk of rank 0 and the output layer with the loss on the last chunk of the last rank,
    whatever the split (megatron-core 0.19.2 gives GPTModel pre_process / post_process from
    parallel_state.is_pipeline_first / last_stage; a layout's E and L letters must sit there)."""

    pp: int
    vp: int
    chunk_layers: tuple[int, ...]

    @property
    def embedding_rank(self) -> int:
        return 0

    @property
    def loss_rank(self) -> int:
        return self.pp - 1

    @cached_property
    def chunk_ranges(self) -> tuple[range, ...]:
        out, start = [], 0
        for n in self.chunk_layers:
            out.append(range(start, start + n))
            start += n
        return tuple(out)

    def rank_chunks(self, rank: int) -> tuple[int, ...]:
        """Chunk indices of a rank, in virtual-stage order."""
        return tuple(range(rank, len(self.chunk_layers), self.pp))

    @cached_property
    def counts(self) -> tuple[int, ...]:
        """Decoder layers per pipeline rank (all its chunks together)."""
        return tuple(sum(self.chunk_layers[c] for c in self.rank_chunks(r)) for r in range(self.pp))

    @cached_property
    def rank_layers(self) -> tuple[range | tuple[int, ...], ...]:
        """Layer indices per rank: a range when they are contiguous (vp = 1), else a tuple."""
        out = []
        for r in range(self.pp):
            rs = [self.chunk_ranges[c] for c in self.rank_chunks(r)]
            if len(rs) == 1:
                out.append(rs[0])
            else:
                out.append(tuple(i for x in rs for i in x))
        return tuple(out)


def _even_chunks(total: int, pp: int, vp: int) -> tuple[int, ...]:
    return (total // (pp * vp),) * (pp * vp)


@lru_cache(maxsize=4096)
def plan_from_parts(num_layers: int, pp: int, vp: int, first: int | None, last: int | None, acc_e: bool, acc_l: bool,
          layout: str | None) -> PipelinePlan:
    if layout is not None:
        if first is not None or last is not None or acc_e or acc_l:
            raise IllegalLayout("a pipeline layout cannot be combined with --pp-first-layers/--pp-last-layers or "
                                "--account-for-embedding/--account-for-loss (megatron-core refuses it)")
        chunks = parse_pipeline_layout(layout)
        if len(chunks) % pp:
            raise IllegalLayout(f"pipeline layout {layout!r} has {len(chunks)} chunks, not a multiple of pp={pp}")
        if len(chunks) // pp != vp:
            raise IllegalLayout(f"pipeline layout {layout!r} has {len(chunks) // pp} virtual stages per rank "
                                f"({len(chunks)} chunks / pp={pp}) but vp={vp}")
        flat = "".join(chunks)
        if flat.count("m"):
            raise IllegalLayout(f"pipeline layout {layout!r} places multi-token-prediction layers ('m'), which "
                                f"this model spec does not have: drop them")
        if not flat.startswith("E") or flat.count("E") != 1:
            raise IllegalLayout(f"pipeline layout {layout!r}: the embedding 'E' must come exactly once, first")
        if not flat.endswith("L") or flat.count("L") != 1:
            raise IllegalLayout(f"pipeline layout {layout!r}: the loss 'L' must come exactly once, last")
        if flat.count("t") != num_layers:
            raise IllegalLayout(f"pipeline layout {layout!r} places {flat.count('t')} transformer layers, "
                                f"the model has {num_layers}")
        if "E" not in chunks[0] or "L" not in chunks[-1]:  # megatron builds them there
            raise IllegalLayout(f"pipeline layout {layout!r}: the embedding 'E' must be in the first chunk and the "
                                f"loss 'L' in the last one")
        return PipelinePlan(pp, vp, tuple(c.count("t") for c in chunks))
    if acc_e or acc_l:
        if first is not None or last is not None:
            raise IllegalLayout("--account-for-embedding/--account-for-loss cannot be combined with "
                                "--pp-first-layers/--pp-last-layers (megatron-core refuses it)")
        total = num_layers + acc_e + acc_l
        if total % pp:
            raise IllegalLayout(f"{num_layers} layers{' + embedding' if acc_e else ''}{' + loss' if acc_l else ''} "
                                f"= {total} do not split evenly over pp={pp} stages")
        if (total // pp) % vp:
            raise IllegalLayout(f"vp={vp} does not divide the {total // pp} layers (embedding and loss "
                                f"counted) of a pipeline stage")
        c = list(_even_chunks(total, pp, vp))
        c[0] -= acc_e
        c[-1] -= acc_l
        if min(c) < 0:
            raise IllegalLayout(f"{total} layers over {pp * vp} chunks leave no room for the embedding and the loss")
        return PipelinePlan(pp, vp, tuple(c))
    counts = stage_layer_counts(num_layers, pp, first, last)
    if vp > 1:
        bad = [k for k in counts if k % vp]
        if bad:
            raise IllegalLayout(f"vp={vp} does not divide the {bad[0]} layers of a pipeline stage")
    per = [k // vp for k in counts]
    return PipelinePlan(pp, vp, tuple(per[r] for _ in range(vp) for r in range(pp)))


def pipeline_plan(model: ModelSpec | int, cfg: TrainConfig) -> PipelinePlan:
    """The config's pipeline plan (even, first/last, account-for or explicit layout); raises
    IllegalLayout naming the rule when the split is not one megatron-core builds."""
    n = model if isinstance(model, int) else model.num_layers
    return plan_from_parts(n, cfg.pp, cfg.vp, cfg.pp_first_layers, cfg.pp_last_layers, bool(cfg.account_for_embedding),
                 bool(cfg.account_for_loss), cfg.pipeline_layout)


def layer_counts(model: ModelSpec | int, cfg: TrainConfig) -> list[int]:
    """Transformer layers per pipeline rank for the config's split."""
    return list(pipeline_plan(model, cfg).counts)


def stage_layers(model: ModelSpec, cfg: TrainConfig, counts: list[int] | None = None) -> list[range | tuple[int, ...]]:
    """Layer indices held by each pipeline stage (all virtual chunks of a rank together, in
    megatron-core's interleaved order), for the config's split, or contiguous ranges of
    `counts` layers per stage (any split, e.g. one placement tries)."""
    if counts is None:
        return list(pipeline_plan(model, cfg).rank_layers)
    if len(counts) != cfg.pp or sum(counts) != model.num_layers or min(counts) < 1:
        raise IllegalLayout(f"split {list(counts)} is not {cfg.pp} stages of >= 1 layer adding up to {model.num_layers}")
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def holds_embedding(model: ModelSpec, cfg: TrainConfig, stage: int) -> bool:
    return stage == pipeline_plan(model, cfg).embedding_rank


def holds_loss(model: ModelSpec, cfg: TrainConfig, stage: int) -> bool:
    """The stage computes the output layer, the logits and the cross entropy."""
    return stage == pipeline_plan(model, cfg).loss_rank


def layer_kind(model: ModelSpec, layer: int) -> str:
    """Layers of the same kind cost the same: 'moe', 'dense_first' (DeepSeek's leading dense
    layers) or 'dense', with '/w<window>' for a windowed (local) attention layer."""
    w = model.layer_window(layer)
    suffix = f"/w{w}" if w else ""
    if model.is_moe_layer(layer):
        return "moe" + suffix
    if model.moe is not None and layer < model.moe.first_dense_layers:
        return "dense_first" + suffix
    return "dense" + suffix


def layer_kind_counts(model: ModelSpec, layers: range | tuple[int, ...]) -> dict[int, int]:
    """{representative layer index: number of layers of its kind} for a range of layers; the
    representative of a kind is its first layer in the model, the same for every range."""
    if model.moe is None and not model.window_size:  # one kind
        return {0: len(layers)} if len(layers) else {}
    return dict(_kind_counts(model, layers if isinstance(layers, (range, tuple)) else tuple(layers)))


@lru_cache(maxsize=256)
def kind_representatives(model: ModelSpec) -> tuple[int, ...]:
    """The representative (first layer of its kind) of every layer."""
    first: dict[str, int] = {}
    return tuple(first.setdefault(layer_kind(model, i), i) for i in range(model.num_layers))


@lru_cache(maxsize=8192)
def _kind_counts(model: ModelSpec, layers: range | tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    reps = kind_representatives(model)
    counts: dict[int, int] = {}
    for i in layers:
        counts[reps[i]] = counts.get(reps[i], 0) + 1
    return tuple(counts.items())


@lru_cache(maxsize=4096)
def rank_kinds(model: ModelSpec, plan: PipelinePlan) -> tuple[dict[int, int], ...]:
    """layer_kind_counts of every rank's layers (read only)."""
    return tuple(layer_kind_counts(model, layers) for layers in plan.rank_layers)


@lru_cache(maxsize=4096)
def chunk_kinds(model: ModelSpec, plan: PipelinePlan) -> tuple[dict[int, int], ...]:
    """layer_kind_counts of every chunk's layers, in chunk order (read only)."""
    return tuple(layer_kind_counts(model, layers) for layers in plan.chunk_ranges)


@lru_cache(maxsize=8192)
def in_flight_layers(model: ModelSpec, plan: PipelinePlan, num_microbatches: int) -> tuple[dict[int, float], ...]:
    """Per rank, {kind representative: layer-microbatches of that kind whose activations the rank
    holds at its peak}: each chunk's layers times its in-flight microbatches (in_flight_chunks)."""
    cfg = TrainConfig(pp=plan.pp, vp=plan.vp, gbs=num_microbatches)
    per_chunk = chunk_kinds(model, plan)
    out = []
    for r in range(plan.pp):
        w: dict[int, float] = {}
        for n, ch in zip(in_flight_chunks(cfg, r), plan.rank_chunks(r)):
            for i, k in per_chunk[ch].items():
                w[i] = w.get(i, 0.0) + n * k
        out.append(w)
    return tuple(out)


def in_flight_chunks(cfg: TrainConfig, stage: int) -> list[int]:
    """Microbatches whose activations each virtual chunk of a stage holds at the stage's peak (the
    end of the warm-up), chunk by chunk. 1F1B: min(m, pp - stage). Interleaved: megatron-core's
    warm-up, (pp - stage - 1)·2 + (vp - 1)·pp forwards plus the first steady one, taken in its
    schedule order (groups of pp microbatches through chunk 0, then chunk 1, ...)."""
    m, p, v = cfg.num_microbatches, cfg.pp, cfg.vp
    if p == 1:
        return [1] * v
    if v == 1:
        return [min(m, p - stage)]
    w = min(m * v, (p - stage - 1) * 2 + (v - 1) * p + 1)
    cycles, rest = divmod(w, p * v)
    return [cycles * p + min(p, max(0, rest - k * p)) for k in range(v)]


def in_flight_microbatches(cfg: TrainConfig, stage: int) -> float:
    """Microbatches whose activations a stage holds at its peak, in units of 'all layers of the
    stage' (1F1B: min(m, pp - stage); interleaved: Megatron's warm-up count of chunks / vp)."""
    return sum(in_flight_chunks(cfg, stage)) / cfg.vp


def bubble_fraction(cfg: TrainConfig) -> float:
    """The schedule's idle time relative to its busy time with equal stages, (p - 1) / (v·m): the
    ratio the literature quotes (it exceeds 1 when m < p - 1). The share of the step a pipeline
    actually idles, with the stages' real costs, is StepTime.bubble_fraction."""
    return (cfg.pp - 1) / (cfg.vp * cfg.num_microbatches)


def moe_knob_violations(model: ModelSpec, cfg: TrainConfig) -> list[str]:
    """What megatron-core 0.19's TransformerConfig.__post_init__ refuses among the MoE knobs."""
    out = []
    flex = cfg.moe_dispatcher == "flex"
    if flex and cfg.moe_pad_to_capacity:
        out.append("the flex dispatcher with DeepEP does not pad to capacity (megatron-core raises)")
    if cfg.moe_shared_expert_overlap and cfg.moe_dispatcher == "allgather":
        out.append("shared-expert overlap needs the alltoall or flex dispatcher")
    if cfg.moe_a2a_overlap:
        if cfg.ep <= 1:
            out.append("the MoE all-to-all overlap needs ep > 1")
        if cfg.moe_dispatcher == "allgather":
            out.append("the MoE all-to-all overlap needs the alltoall or flex dispatcher")
        if cfg.recompute == "full":
            out.append("the MoE all-to-all overlap does not run with full recompute")
        if cfg.pp > 1 and cfg.vp <= 1:
            out.append("the MoE all-to-all overlap needs interleaving (vp > 1) when pp > 1")
        if cfg.moe_shared_expert_overlap:
            out.append("the MoE all-to-all overlap excludes shared-expert overlap")
    return out


def recompute_violations(model: ModelSpec, cfg: TrainConfig) -> list[str]:
    """What megatron-core refuses (or what does nothing) among the partial-recompute knobs on this
    model: more block-recompute layers than a virtual chunk holds, "mla_up_proj" without MLA,
    "moe_act" without grouped GEMM (megatron-core raises), MoE modules on a dense model,
    "shared_experts" with shared-expert overlap (megatron-core raises)."""
    out = []
    n = cfg.recompute_layers
    if n is not None and cfg.recompute == "full":
        try:
            most = max(pipeline_plan(model, cfg).chunk_layers)
        except IllegalLayout:
            most = None  # reported by violations
        if most is not None and n > most:
            out.append(f"recompute_layers={n} exceeds the {most} layers of a virtual chunk")
    mods = set(cfg.recompute_modules)
    if "mla_up_proj" in mods and model.mla is None:
        out.append("recompute module mla_up_proj needs multi-latent attention")
    moe_mods = sorted(mods & {"moe_act", "moe", "shared_experts"})
    if moe_mods and not model.is_moe:
        out.append(f"recompute module(s) {', '.join(moe_mods)} need a mixture-of-experts model")
    if model.is_moe:
        if "moe_act" in mods and not cfg.moe_grouped_gemm:
            out.append("recompute module moe_act needs moe_grouped_gemm (megatron-core raises)")
        if "shared_experts" in mods and cfg.moe_shared_expert_overlap:
            out.append("recompute module shared_experts does not run with moe_shared_expert_overlap (megatron-core raises)")
        if "shared_experts" in mods and not model.moe.shared_ffn_hidden_size:
            out.append("recompute module shared_experts needs a model with shared experts")
        if "moe" in mods and cfg.moe_a2a_overlap:
            out.append("recompute module moe does not run with the MoE all-to-all overlap (megatron-core asserts)")
    return out


def violations(model: ModelSpec, cluster: ClusterSpec | None, cfg: TrainConfig) -> list[str]:
    """Every rule the layout breaks, as one-line reasons (empty when legal)."""
    out: list[str] = []
    kv = model.kv_heads
    if model.num_attention_heads % cfg.tp:
        out.append(f"tp={cfg.tp} does not divide the {model.num_attention_heads} attention heads")
    if model.ffn_hidden_size % cfg.tp:
        out.append(f"tp={cfg.tp} does not divide the FFN size {model.ffn_hidden_size}")
    if model.mla is None and kv % cfg.tp:
        # megatron.core.transformer.attention divides num_query_groups by the TP size
        out.append(f"tp={cfg.tp} does not divide the {kv} KV groups")
    if cluster is not None:
        if cfg.tp > cluster.domain_gpus:
            out.append(f"tp={cfg.tp} spans more than one NVLink domain ({cluster.domain_gpus} GPUs of the job per domain)")
        if cfg.world_size != cluster.world_size:
            out.append(f"tp·pp·cp·dp = {cfg.tp}·{cfg.pp}·{cfg.cp}·{cfg.dp} = {cfg.world_size} "
                       f"≠ {cluster.world_size} GPUs in the cluster")
    try:
        pipeline_plan(model, cfg)
    except IllegalLayout as e:
        out.append(str(e))
    if cfg.vp > 1 and cfg.pp < 2:
        out.append("virtual pipeline (vp > 1) needs pp ≥ 2")
    if cfg.vp > 1 and cfg.num_microbatches % cfg.pp:
        out.append(f"interleaved schedule needs the {cfg.num_microbatches} microbatches to be a multiple of pp={cfg.pp}")
    if cfg.gbs % (cfg.mbs * cfg.dp):
        out.append(f"gbs={cfg.gbs} is not a multiple of mbs·dp = {cfg.mbs}·{cfg.dp}")
    if cfg.seq % (2 * cfg.cp) and cfg.cp > 1:
        out.append(f"seq={cfg.seq} is not a multiple of 2·cp = {2 * cfg.cp} (load-balanced context parallelism)")
    if model.max_position_embeddings and model.position_embedding == "learned" and cfg.seq > model.max_position_embeddings:
        out.append(f"seq={cfg.seq} exceeds the model's {model.max_position_embeddings} learned positions")
    if model.is_moe:
        e = model.num_experts
        if e % cfg.ep:
            out.append(f"ep={cfg.ep} does not divide the {e} experts")
        if (cfg.dp * cfg.cp * cfg.tp) % (cfg.ep * cfg.etp):
            out.append(f"ep·etp = {cfg.ep}·{cfg.etp} does not divide dp·cp·tp = {cfg.dp * cfg.cp * cfg.tp}")
        if model.moe.ffn_hidden_size % cfg.etp:
            out.append(f"etp={cfg.etp} does not divide the expert FFN size {model.moe.ffn_hidden_size}")
        if cluster is not None and cfg.etp > cluster.domain_gpus:
            out.append(f"etp={cfg.etp} spans more than one NVLink domain")
        out += moe_knob_violations(model, cfg)
    else:
        if cfg.ep > 1:
            out.append(f"ep={cfg.ep} needs a mixture-of-experts model")
        if cfg.etp > 1:
            out.append(f"etp={cfg.etp} needs a mixture-of-experts model")
    out += recompute_violations(model, cfg)
    if cfg.sequence_parallel and cfg.tp == 1:
        out.append("sequence parallel needs tp > 1")
    if cfg.tp_comm_overlap and not cfg.sequence_parallel:
        out.append("tp_comm_overlap needs sequence_parallel")
    if cfg.overlap_param_gather and not cfg.distributed_optimizer:
        out.append("overlap_param_gather needs the distributed optimizer")
    if cfg.cpu_offload_layers:
        out += offload_violations(model, cluster, cfg)
    if cfg.precision != "bf16" and cluster is not None:
        try:
            check_precision(cluster.gpu, cfg.precision)
        except SpecError as e:
            out.append(str(e))
    return out


def offload_violations(model: ModelSpec, cluster: ClusterSpec | None, cfg: TrainConfig) -> list[str]:
    """The rules activation offloading (TrainConfig.cpu_offload_layers) breaks: megatron-core's
    TransformerConfig.__post_init__ "CPU offloading can be done only for layers less than
    {num_layers}" (TE's synchronizer never offloads the last layer), and a GPU whose host link the
    catalog does not give (GPUSpec.host_link_gbs: the copies' time cannot be predicted)."""
    out = []
    if cfg.cpu_offload_layers >= model.num_layers:
        out.append(f"cpu_offload_layers={cfg.cpu_offload_layers} must be below the {model.num_layers} layers "
                   "(megatron-core: \"CPU offloading can be done only for layers less than num_layers\")")
    if cluster is not None and not cluster.gpu.host_link_gbs > 0:
        out.append(f"cpu_offload_layers needs the host link bandwidth of {cluster.gpu.name}, which the catalog "
                   "does not give (host_link_gbs)")
    return out


def layout_refusal(model: ModelSpec, cfg: TrainConfig, world_size: int | None = None) -> str | None:
    """Why a runner that runs every legal layout (the command runner: the user's own stack; the
    simulated runner) refuses `cfg`, in one line: a world size that is not the trial's, else the
    first rule it breaks (violations, no cluster); None when it runs it."""
    if world_size is not None and cfg.world_size != world_size:
        return f"world size {world_size} != tp*pp*cp*dp = {cfg.world_size}"
    v = violations(model, None, cfg)
    return f"illegal layout: {v[0]}" if v else None


def check(model: ModelSpec, cluster: ClusterSpec | None, cfg: TrainConfig) -> None:
    """Raise IllegalLayout naming the first rule the layout breaks."""
    v = violations(model, cluster, cfg)
    if v:
        raise IllegalLayout(f"illegal layout: {v[0]}")
