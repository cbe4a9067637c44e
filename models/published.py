"""Published throughput of real Megatron / NeMo / Megatron-Bridge runs (the `te` stack's fit set),
read into the advisor's own spec types so the model can predict every row.

The rows live in ``data/published/published_fit.csv`` (a verbatim copy of the project's shared fit
set, every row with its source) with the architectures in ``model_archs.csv``. Each row becomes a
`PublishedRun`: the model (the catalog's spec where the catalog has the model, else built from
``model_archs.csv``), a cluster of the row's GPU and size, the layout as printed, the measured
tokens/s/GPU, and the assumptions made where the source left a knob out (each named, so the check
can report them). Rows that cannot be predicted honestly (no layout given, an architecture the
advisor does not model, FP4) are kept with `usable=False` and the reason.

Where a source gives TFLOP/s but no tokens/s, tokens/s = TFLOP/s / (the FLOPs per token of the
formula that source used): Megatron-LM's `num_floating_point_operations` (NeMo's and
Megatron-Bridge's tables use it: non-causal attention, checked on the rows that give both), or the
SC21 paper's formula with full recomputation (Narayanan et al. 2021, eq. 3: 96·B·s·l·h²·(1 + s/6h +
V/16lh)).
"""
from __future__ import annotations

import csv
import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from advisor.catalog import ClusterSpec, ModelSpec, MoESpec, SpecError, TrainConfig, load_gpu, load_model
from advisor.catalog.loaders import make_cluster
from advisor.models.published_recipes import (  # noqa: F401 (re-exported)
    RECIPES, SOURCE_DEFAULTS, RecipeSettings, layout_mismatch, precision_class, recipe_settings, recipes_for,
    split_pending)

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = ROOT / "data" / "published"
FIT_FILE = DATA_DIR / "published_fit.csv"
ARCH_FILE = DATA_DIR / "model_archs.csv"

# published model key -> catalog model (the catalog's spec carries its own source)
CATALOG = {
    "llama3_8b": "llama3-8b", "llama3_70b": "llama3-70b", "llama3.1_405b": "llama3.1-405b",
    "gpt3_175b": "gpt3-175b", "nemotron4_15b": "nemotron4-15b", "nemotron4_340b": "nemotron4-340b",
    "mixtral_8x7b": "mixtral-8x7b", "mixtral_8x22b": "mixtral-8x22b", "qwen3_30b_a3b": "qwen3-30b-a3b",
    "qwen3_235b_a22b": "qwen3-235b-a22b", "deepseek_v3": "deepseek-v3", "gpt_oss_120b": "gpt-oss-120b",
}
GPUS = {"H100": "h100", "A100-80GB": "a100-80g", "B200": "b200", "GB200": "gb200", "B300": "b300",
        "GB300": "gb300"}


@dataclass(frozen=True)
class PublishedRun:
    row_id: str
    source_group: str
    source: str  # repo:path (or title) of the number
    model_key: str
    gpu_type: str
    num_gpus: int
    precision_reported: str
    tokens_per_s_per_gpu: float  # measured (NaN when the row has none)
    model: ModelSpec | None = None
    cluster: ClusterSpec | None = None
    cfg: TrainConfig | None = None
    fp8_recipe: str = ""  # delayed / tensorwise / blockwise where the row says (mxfp8 / nvfp4: the precision)
    assumptions: tuple[str, ...] = ()
    usable: bool = True
    why: str = ""  # why not usable
    family: str = ""  # model family (llama, gpt, nemotron, ...) for grouping
    moe: bool = False
    fsdp: bool = False
    # TrainConfig knobs the row's own recipe sets (RECIPES): kept over a stack's layout defaults
    # (profiles.apply_layout_defaults(cfg, stack, explicit=run.explicit))
    explicit: frozenset = frozenset()
    # memory-relevant settings of the row's recipe that the advisor has no field for
    unmodelled: tuple[str, ...] = ()
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def group(self) -> tuple:
        """Rows that differ only in layout (for rank correlation): model, GPUs, seq, precision."""
        cfg = self.cfg
        return (self.model_key, self.gpu_type, self.num_gpus, cfg.seq if cfg else None,
                cfg.precision if cfg else None)


# ------------------------------------------------------------------------------------------------
# FLOP formulas the sources used (to turn reported TFLOP/s into tokens/s)
# ------------------------------------------------------------------------------------------------

def megatron_flops_per_token(m: ModelSpec, seq: int) -> float:
    """Megatron-LM's `num_floating_point_operations` per token (training, no recompute): 12·l·h²·(
    attention (1 + g/a + s/h)·(a·d/h) + MLP (f/h)·k·gated + logits V/(2lh)), MoE routed experts top-k
    plus shared experts; non-causal attention (the full s×s score matrix)."""
    h, a, L, V = m.hidden_size, m.num_attention_heads, m.num_layers, m.vocab_size
    g = m.kv_heads
    q_ratio = a * m.head_dim / h
    gated = 1.5 if m.activation == "swiglu" else 1.0
    mlp = 0.0
    for i in range(L):
        if m.is_moe_layer(i):
            mlp += (m.moe.ffn_hidden_size / h) * m.moe.top_k * gated
            if m.moe.shared_ffn_hidden_size:
                mlp += (m.moe.shared_ffn_hidden_size / h) * gated
        else:
            ffn = m.ffn_hidden_size
            if m.moe is not None and m.moe.dense_ffn_hidden_size and i < m.moe.first_dense_layers:
                ffn = m.moe.dense_ffn_hidden_size
            mlp += (ffn / h) * gated
    attn = L * (1 + g / a + seq / h) * q_ratio
    return 12.0 * h * h * (attn + mlp + V / (2.0 * h))


def sc21_flops_per_token(m: ModelSpec, seq: int) -> float:
    """Narayanan et al. 2021 (SC21), eq. 3 per token: 96·l·h²·(1 + s/(6h) + V/(16·l·h)), which counts
    the extra forward pass of full activation recomputation."""
    h, L = m.hidden_size, m.num_layers
    return 96.0 * L * h * h * (1 + seq / (6.0 * h) + m.vocab_size / (16.0 * L * h))


# ------------------------------------------------------------------------------------------------
# architectures
# ------------------------------------------------------------------------------------------------

def _int(s: str) -> int | None:
    m = re.match(r"\s*(\d+)", s or "")
    return int(m.group(1)) if m else None


def _arch_model(a: dict, notes: list[str]) -> ModelSpec | None:
    """A ModelSpec from one row of model_archs.csv (None when the advisor cannot model it)."""
    key = a["model_key"]
    if a["arch_type"] not in ("dense", "moe"):
        return None
    h, L, heads = _int(a["hidden_size"]), _int(a["num_layers"]), _int(a["num_attention_heads"])
    if not (h and L and heads):
        return None
    act_norm = (a["activation_norm"] or "").lower()
    gpt_defaults = "gptconfig" in act_norm or act_norm.startswith("gelu")
    ffn = _int(a["ffn_hidden_size"])
    if ffn is None:
        ffn = 4 * h
        notes.append("FFN size not published: 4·hidden (Megatron's default)")
    vocab = _int(a["vocab_size"])
    if vocab is None:
        if key.startswith("llama2"):
            vocab = 32000
            notes.append("vocabulary: Llama 2 tokenizer (32,000)")
        else:
            vocab = 51200
            notes.append("vocabulary: GPT-2 BPE padded to 51,200 (NeMo's GPT benchmarks)")
    kv = _int(a["num_query_groups"]) if "none" not in (a["num_query_groups"] or "").lower() else None
    if kv is None and key.startswith("mlm_gpt"):
        notes.append("attention: multi-head (the README does not state GQA)")
    head_dim = _int(a["kv_channels_or_head_dim"])
    if "squared-relu" in act_norm:
        activation = "relu2"
    elif "swiglu" in act_norm or "geglu" in act_norm or "gated" in act_norm:
        activation = "swiglu"
    else:
        activation = "gelu"
        if not act_norm or "default" in act_norm:
            notes.append("activation: GeLU (Megatron's default)")
    norm = "layernorm" if "layernorm" in act_norm or gpt_defaults or not act_norm else "rmsnorm"
    gpt2_style = "gpt-2 style" in act_norm
    learned = "learned" in act_norm or gpt2_style
    moe = None
    if a["arch_type"] == "moe":
        e, k, f = _int(a["num_moe_experts"]), _int(a["moe_router_topk"]), _int(a["moe_ffn_hidden_size"])
        if not (e and k and f):
            return None
        shared = _int(a["moe_shared_expert_ffn"]) or 0
        moe = MoESpec(num_experts=e, top_k=k, ffn_hidden_size=f, num_shared_experts=1 if shared else 0,
                      shared_ffn_hidden_size=shared)
    try:
        return ModelSpec(
            name=key, num_layers=L, hidden_size=h, ffn_hidden_size=ffn, num_attention_heads=heads,
            vocab_size=vocab, num_query_groups=kv, kv_channels=head_dim, activation=activation,
            normalization=norm, position_embedding="learned" if learned else "rope",
            max_position_embeddings=_int(a["native_seq_length"]) or 4096,
            tied_embeddings=("tied embeddings" in act_norm and "untied" not in act_norm) or gpt2_style,
            add_bias_linear="biases on linears" in act_norm or gpt_defaults,
            moe=moe, family=re.sub(r"[_\d.].*$", "", key), source=a.get("source", ""))
    except SpecError:
        return None


def _archs(path: Path = ARCH_FILE) -> dict[str, dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return {r["model_key"]: r for r in csv.DictReader(f)}


def model_for(key: str, archs: dict[str, dict], notes: list[str]) -> ModelSpec | None:
    if key in CATALOG:
        m = load_model(CATALOG[key])
        if key == "gpt3_175b":  # NeMo's GPT-3 benchmarks use a 51,200-token vocabulary
            m = dataclasses.replace(m, vocab_size=51200)
        return m
    if key in archs:
        return _arch_model(archs[key], notes)
    return None


# ------------------------------------------------------------------------------------------------
# what each row's recipe sets beyond the printed layout (read from the configs the row names)
# ------------------------------------------------------------------------------------------------

# RecipeSettings, RECIPES and the lookup live in models/published_recipes.py (re-exported here)


# ------------------------------------------------------------------------------------------------
# rows
# ------------------------------------------------------------------------------------------------

def _precision(p: str, gpu_type: str) -> tuple[str | None, str]:
    """(advisor precision or None if not modelled, fp8 recipe). "Finer-granularity" FP8 is MXFP8
    on Blackwell and 128x128 blockwise on Hopper (the source's own words)."""
    s = p.upper()
    blackwell = load_gpu(GPUS[gpu_type]).generation == "blackwell" if gpu_type in GPUS else False
    if "NVFP4" in s:
        return "nvfp4", ""
    if "FP4" in s:
        return None, ""
    if "FP8" in s:
        if "MX" in s or ("FINER" in s and blackwell):
            return "mxfp8", ""
        recipe = ("tensorwise" if ("CS" in s or "CURRENT" in s) else "blockwise" if "FINER" in s else "delayed")
        return "fp8", recipe
    return "bf16", ""  # BF16, FP16 mixed (same tensor-core rate), "mixed", "not stated (... BF16 ...)"


def _cluster(gpu_type: str, n: int) -> ClusterSpec:
    gpu = load_gpu(GPUS[gpu_type])
    gpn = gpu.gpus_per_node  # NVL72 racks: 4-GPU trays, the ranks spread evenly over the racks
    per = n if n <= gpn else gpn if n % gpn == 0 else math.gcd(n, gpn)
    return make_cluster(f"{gpu.name}x{n}", gpu, n // per, per, None, None, None, f"published {gpu_type}x{n}")


def _measured(r: dict, model: ModelSpec | None, seq: int | None, notes: list[str]) -> float:
    for k in ("reported_tokens_per_sec_per_gpu", "derived_tokens_per_sec_per_gpu"):
        v = (r.get(k) or "").replace(",", "")
        if v:
            try:
                return float(v)
            except ValueError:
                pass
    tf = (r.get("reported_tflops_per_gpu") or "").replace(",", "")
    if tf and model is not None and seq and model.mla is None:
        if r["source_group"] == "megatron_lm_sc21_a100":
            notes.append("tokens/s from TFLOP/s with the SC21 formula (full recompute counted)")
            return float(tf) * 1e12 / sc21_flops_per_token(model, seq)
        notes.append("tokens/s from TFLOP/s with Megatron's FLOP formula")
        return float(tf) * 1e12 / megatron_flops_per_token(model, seq)
    return math.nan


def _row(r: dict, archs: dict[str, dict]) -> PublishedRun:
    notes: list[str] = []
    key, gpu_type = r["model_key"], r["gpu_type"]
    src = f"{r['source_repo']}:{r['source_path']}" if r["source_repo"] else r["source_url_or_title"]
    n = _int(r["num_gpus"]) or 0
    base = dict(row_id=r["row_id"], source_group=r["source_group"], source=src, model_key=key,
                gpu_type=gpu_type, num_gpus=n, precision_reported=r["precision"], raw=r)

    def unusable(why: str, **kw) -> PublishedRun:
        return PublishedRun(tokens_per_s_per_gpu=kw.pop("tps", math.nan), usable=False, why=why, **base, **kw)

    if r.get("task", "pretrain") != "pretrain":
        return unusable(f"not pretraining ({r['task']}: packed fine-tuning data / frozen weights)")
    model = model_for(key, archs, notes)
    if model is None:
        return unusable("architecture not modelled (hybrid / unknown / not in model_archs.csv)")
    layers = _int(r["num_layers_run"])
    if layers and layers != model.num_layers:
        model = model.with_layers(layers)
        notes.append(f"proxy run: {layers} of the model's layers")
    seq = _int(r["seq_len"])
    tps = _measured(r, model, seq, notes)
    if not n or gpu_type not in GPUS:
        return unusable("no GPU count or an unknown GPU", tps=tps, model=model)
    precision, fp8_recipe = _precision(r["precision"], gpu_type)
    if precision is None:
        return unusable("FP4 training is not modelled", tps=tps, model=model)
    if not math.isfinite(tps):
        return unusable("no throughput given", model=model)
    tp, pp = _int(r["tp"]), _int(r["pp"])
    gbs = _int(r["gbs"])
    if not (tp and pp and gbs and seq):
        return unusable("layout not given (TP / PP / global batch / sequence)", tps=tps, model=model)
    cp, vp, ep, etp = (_int(r[k]) or 1 for k in ("cp", "vp", "ep", "etp"))
    mbs = _int(r["mbs"])
    if mbs is None:
        mbs = 1
        notes.append("micro-batch not given: 1")
    gbs, mbs, swap = read_batch(gbs, mbs, n // (tp * pp * cp) if n % (tp * pp * cp) == 0 else None, _int(r.get("ga")))
    if swap:
        notes.append(swap)
    if not r["vp"] and pp > 1:
        notes.append("virtual pipeline not given: 1")
    fsdp_col = (r.get("fsdp") or "").strip()
    fsdp = fsdp_col not in ("", "0")
    if fsdp:
        notes.append("FSDP: Megatron FSDP optim_grads_params (TrainConfig.fsdp: weights, gradients and optimizer "
                     "states sharded over the DP ranks; per-unit gathers and reduce-scatters priced by models/fsdp_time.py)")
    rc = (r.get("recompute") or "").lower()
    recompute = "full" if rc.startswith("full") else "selective" if rc.startswith("selective") else "none"
    found = recipes_for(r["source_group"], key, gpu_type, fsdp, precision_class(precision, fp8_recipe),
                        r.get("source_version", ""), gbs)
    row_layout = {"tp": tp, "pp": pp, "vp": vp, "cp": cp, "ep": ep, "mbs": mbs}
    recipe = next((s for s in found if not layout_mismatch(s, row_layout)), None)
    if found and recipe is None:
        notes.append(f"recipe read ({found[0].source.split(', ')[-1]}) not applied: its layout differs "
                     f"({layout_mismatch(found[0], row_layout)}; the row ran another version of the config)")
    if not rc and not (recipe and "recompute" in recipe.fields):
        notes.append("recompute not given: none")
    cluster = _cluster(gpu_type, n)
    mp = tp * pp * cp
    if n % mp:
        return unusable(f"tp·pp·cp = {mp} does not divide {n} GPUs", tps=tps, model=model, cluster=cluster)
    dp = n // mp
    try:
        cfg = TrainConfig(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, vp=vp, mbs=mbs, gbs=gbs, seq=seq,
                          precision=precision, fp8_recipe=fp8_recipe or "delayed", recompute=recompute, sequence_parallel=tp > 1,
                          distributed_optimizer=dp * cp > 1, overlap_grad_reduce=dp * cp > 1,
                          overlap_param_gather=dp * cp > 1, fsdp=fsdp and dp * cp > 1)
    except SpecError as e:
        return unusable(f"layout: {e}", tps=tps, model=model, cluster=cluster)
    explicit: frozenset = frozenset()
    unmodelled: tuple[str, ...] = ()
    if recipe is not None:
        pending, missing = split_pending(recipe.pending)
        unmodelled = recipe.unmodelled + missing
        # the row's own recompute column wins; TP-comm overlap exists only with TP > 1 and SP
        fields = {k: v for k, v in {**recipe.fields, **pending}.items()
                  if not (k == "recompute" and rc) and not (k == "tp_comm_overlap" and tp == 1)}
        try:
            cfg = cfg.replace(**fields)
        except SpecError as e:
            return unusable(f"layout with the recipe's settings: {e}", tps=tps, model=model, cluster=cluster)
        explicit = frozenset(fields)
        notes.append(f"recipe settings ({recipe.source}): "
                     + ", ".join(f"{k}={v}" for k, v in sorted(fields.items())))
        notes.extend(f"recipe setting not modelled: {u}" for u in unmodelled)
        notes.extend(recipe.notes)
    src_fields, src_why = SOURCE_DEFAULTS.get(r["source_group"], ({}, ""))
    src_fields = {k: v for k, v in src_fields.items() if k not in explicit}
    if src_fields:  # what the source's software ran by default (no recipe says otherwise)
        cfg = cfg.replace(**src_fields)
        explicit = explicit | frozenset(src_fields)
        notes.append(f"software default of the source: {src_why}")
    split_given = cfg.account_for_embedding or cfg.account_for_loss or cfg.pipeline_layout
    if pp > 1 and model.num_layers % pp and not split_given:  # not said: the split Megatron's recipes use
        cfg, how = _uneven_split(model, cfg)
        if how:
            notes.append(f"uneven pipeline split not given: {how}")
    note = (r.get("notes") or "").lower()
    if model.is_moe and ("force-balanced" in note or "token-drop" in note):
        # NVIDIA's MoE tables: dropless with forced-balanced routing, or capacity-capped (dropping)
        cfg = cfg.replace(moe_router="forced")
        notes.append("MoE routing balanced (forced or token-dropping), as the source says")
    return PublishedRun(tokens_per_s_per_gpu=tps, model=model, cluster=cluster, cfg=cfg, fp8_recipe=fp8_recipe,
                        assumptions=tuple(notes), family=model.family, moe=model.is_moe, fsdp=fsdp,
                        explicit=explicit, unmodelled=unmodelled, **base)


def read_batch(gbs: int, mbs: int, dp: int | None, ga: int | None) -> tuple[int, int, str]:
    """(global batch, micro-batch, note) as the row's own numbers allow. A printed global batch
    smaller than one micro-batch per data-parallel rank cannot run (Megatron asserts gbs divisible
    by mbs x DP); when the two printed values swapped satisfy gbs = mbs x DP x GA with the row's own
    gradient-accumulation count, the row printed them in each other's column (row 630, Mixtral-8x22B
    B200 at 65,536 tokens: printed gbs 1 / mbs 64, GA 16 at DP 4 = 256 / (TP2 PP4 CP8): gbs 64, mbs 1)."""
    if not dp or not ga or gbs % (mbs * dp) == 0:
        return gbs, mbs, ""
    if mbs == gbs * dp * ga:
        return mbs, gbs, (f"global batch {gbs} / micro-batch {mbs} as printed cannot run at DP {dp}; read swapped "
                          f"(gbs {mbs}, mbs {gbs}: GA {ga} = {mbs} / ({gbs} x {dp}), the row's own GA)")
    return gbs, mbs, ""


def _uneven_split(model: ModelSpec, cfg: TrainConfig) -> tuple[TrainConfig, str]:
    """The first of the search space's uneven splits (embedding / loss accounted as a layer, as
    NVIDIA's 405B and Qwen3-235B recipes do; then first / last trimmed; then an explicit layout)
    that allows the row's virtual pipeline size."""
    from advisor.search_spaces.space import SpaceOptions, split_choices

    for fields, vps in split_choices(model.num_layers, cfg.pp, SpaceOptions(max_vp=max(cfg.vp, 8))):
        if cfg.vp in vps:
            if "pipeline_layout" in fields:
                return cfg.replace(**fields), f"pipeline layout {fields['pipeline_layout']}"
            return cfg.replace(**fields), ", ".join(f"{k}={v}" for k, v in fields.items())
    return cfg, ""


def load(path: str | Path = FIT_FILE, arch_path: str | Path = ARCH_FILE) -> list[PublishedRun]:
    """Every row of the fit set as a PublishedRun (usable or not, with the reason)."""
    archs = _archs(Path(arch_path))
    with open(path, newline="", encoding="utf-8") as f:
        return [_row(r, archs) for r in csv.DictReader(f)]
