"""Structure and legality of one layout: which layers each pipeline stage holds, how many
microbatches are in flight, and the rules a Megatron layout must satisfy (each with its reason).
Pure functions; no prediction here."""
from __future__ import annotations

from advisor.catalog.specs import ClusterSpec, ModelSpec, SpecError, TrainConfig


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
                                f"(give --pp-first-layers/--pp-last-layers for an uneven split)")
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


def stage_layers(model: ModelSpec, cfg: TrainConfig, counts: list[int] | None = None) -> list[range]:
    """Layer indices held by each pipeline stage (all virtual chunks of a rank together), for the
    config's split or for `counts` layers per stage (any split, e.g. one placement tries)."""
    if counts is None:
        counts = stage_layer_counts(model.num_layers, cfg.pp, cfg.pp_first_layers, cfg.pp_last_layers)
    elif len(counts) != cfg.pp or sum(counts) != model.num_layers or min(counts) < 1:
        raise IllegalLayout(f"split {list(counts)} is not {cfg.pp} stages of >= 1 layer adding up to {model.num_layers}")
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def layer_kind(model: ModelSpec, layer: int) -> str:
    """Layers of the same kind cost the same: 'moe', 'dense_first' (DeepSeek's leading dense
    layers) or 'dense'."""
    if model.is_moe_layer(layer):
        return "moe"
    if model.moe is not None and layer < model.moe.first_dense_layers:
        return "dense_first"
    return "dense"


def layer_kind_counts(model: ModelSpec, layers: range) -> dict[int, int]:
    """{representative layer index: number of layers of its kind} for a range of layers. Memoised
    by the model object's identity (recommend asks for the same stages of one model for every
    layout it ranks; hashing a ModelSpec costs more than the count): the memo keeps the model
    alive, so an id is never reused while its entry exists."""
    key = (id(model), layers.start, layers.stop)
    hit = _KIND_MEMO.get(key)
    if hit is None or hit[0] is not model:
        if len(_KIND_MEMO) > 8192:
            _KIND_MEMO.clear()
        hit = _KIND_MEMO[key] = (model, _layer_kind_counts(model, layers))
    return dict(hit[1])


_KIND_MEMO: dict[tuple, tuple] = {}


def _layer_kind_counts(model: ModelSpec, layers: range) -> tuple[tuple[int, int], ...]:
    reps: dict[str, int] = {}
    counts: dict[int, int] = {}
    for i in layers:
        k = layer_kind(model, i)
        rep = reps.setdefault(k, i)
        counts[rep] = counts.get(rep, 0) + 1
    return tuple(counts.items())


def in_flight_microbatches(cfg: TrainConfig, stage: int) -> float:
    """Microbatches whose activations a stage holds at its peak, in units of 'all layers of the
    stage' (1F1B: min(m, pp - stage); interleaved: Megatron's warm-up count of chunks / vp)."""
    m, p, v = cfg.num_microbatches, cfg.pp, cfg.vp
    if p == 1:
        return 1.0
    if v == 1:
        return float(min(m, p - stage))
    chunks = min(m * v, (p - stage - 1) * 2 + (v - 1) * p + 1)
    return chunks / v


def bubble_fraction(cfg: TrainConfig) -> float:
    """Idle fraction relative to the ideal pipeline time with equal stages: (p - 1) / (v·m)."""
    return (cfg.pp - 1) / (cfg.vp * cfg.num_microbatches)


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
        if cfg.tp > cluster.gpus_per_node:
            out.append(f"tp={cfg.tp} spans more than one node ({cluster.gpus_per_node} GPUs per node)")
        if cfg.world_size != cluster.world_size:
            out.append(f"tp·pp·cp·dp = {cfg.tp}·{cfg.pp}·{cfg.cp}·{cfg.dp} = {cfg.world_size} "
                       f"≠ {cluster.world_size} GPUs in the cluster")
    try:
        counts = stage_layer_counts(model.num_layers, cfg.pp, cfg.pp_first_layers, cfg.pp_last_layers)
        if cfg.vp > 1:
            bad = [c for c in counts if c % cfg.vp]
            if bad:
                out.append(f"vp={cfg.vp} does not divide the {bad[0]} layers of a pipeline stage")
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
        if cluster is not None and cfg.etp > cluster.gpus_per_node:
            out.append(f"etp={cfg.etp} spans more than one node")
    else:
        if cfg.ep > 1:
            out.append(f"ep={cfg.ep} needs a mixture-of-experts model")
        if cfg.etp > 1:
            out.append(f"etp={cfg.etp} needs a mixture-of-experts model")
    if cfg.sequence_parallel and cfg.tp == 1:
        out.append("sequence parallel needs tp > 1")
    if cfg.tp_comm_overlap and not cfg.sequence_parallel:
        out.append("tp_comm_overlap needs sequence_parallel")
    if cfg.overlap_param_gather and not cfg.distributed_optimizer:
        out.append("overlap_param_gather needs the distributed optimizer")
    if cfg.precision == "fp8" and cluster is not None and not cluster.gpu.fp8_tflops:
        out.append(f"{cluster.gpu.name} has no fp8 tensor cores")
    return out


def check(model: ModelSpec, cluster: ClusterSpec | None, cfg: TrainConfig) -> None:
    """Raise IllegalLayout naming the first rule the layout breaks."""
    v = violations(model, cluster, cfg)
    if v:
        raise IllegalLayout(f"illegal layout: {v[0]}")
