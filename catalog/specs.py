"""The spec types shared by every layer: model architecture, GPU, cluster, training layout.

Everything here is plain data (frozen dataclasses) with ``to_dict`` / ``from_dict`` so that the
same objects travel through the CLI, JSONL datasets, Optuna user attributes and Ray tasks.
Validation of *legality* (does TP divide the heads, ...) lives in ``advisor.search_spaces``;
these types only check that values have the right kind and range.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

Precision = Literal["bf16", "fp8", "mxfp8", "nvfp4"]
Recompute = Literal["none", "selective", "full"]

# Training number formats of the linear layers (Transformer Engine): "fp8" per-tensor scaled
# E4M3/E5M2 (Hopper and later; recipe: FP8_RECIPES), "mxfp8" E4M3 with one E8M0 scale per 32
# elements (Blackwell's tensor cores scale in hardware), "nvfp4" E2M1 with an E4M3 scale per 16
# elements and a per-tensor FP32 scale (Blackwell only).
PRECISIONS: tuple[str, ...] = ("bf16", "fp8", "mxfp8", "nvfp4")
# FP8 scaling recipes of Megatron's --fp8-recipe for precision fp8: "delayed" (amax history),
# "tensorwise" (current per-tensor scaling), "blockwise" (128x128 weight / 1x128 activation blocks)
FP8_RECIPES: tuple[str, ...] = ("delayed", "tensorwise", "blockwise")
BLOCK_SCALED: tuple[str, ...] = ("mxfp8", "nvfp4")  # formats only Blackwell's tensor cores run
# What the linear layers' GEMMs run in, one name per (precision, fp8 recipe): the code of a layout
# is its index (models.vectorized carries it as a column; 0 = bf16)
QUANTS: tuple[str, ...] = ("bf16", "fp8", "fp8-tensorwise", "fp8-blockwise", "mxfp8", "nvfp4")
# GPU generations (GPUSpec.generation) whose FP8 tensor cores take either operand layout, so that
# Transformer Engine keeps no transpose of a per-tensor-scaled FP8 operand (GPUSpec.fp8_transposed_copy)
FP8_ANY_LAYOUT_GENERATIONS: tuple[str, ...] = ("blackwell",)
# the QUANTS codes whose weights can be kept in FP8 (TrainConfig.fp8_param_gather)
FP8_PARAM_QUANTS: tuple[int, ...] = (1, 2, 3, 4)


def quant_name(precision: str, fp8_recipe: str = "delayed") -> str:
    """The QUANTS name of a precision and FP8 recipe ('fp8' is delayed scaling)."""
    if precision == "fp8" and fp8_recipe != "delayed":
        return f"fp8-{fp8_recipe}"
    return precision


def quant_parts(code: int) -> tuple[str, str]:
    """(precision, fp8_recipe) of a QUANTS code."""
    name = QUANTS[int(code)]
    if name.startswith("fp8-"):
        return "fp8", name[4:]
    return name, "delayed"
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")
# megatron-core TransformerConfig.recompute_modules choices (selective recompute; default
# ["core_attn"]): "moe_act", "layernorm", "mla_up_proj" use output-discarding checkpointing, the
# others normal checkpointing (transformer_config.py). In megatron-core's order, which is the order
# TrainConfig keeps them in (a set to megatron) and the bit order of search_spaces.columns' code.
RECOMPUTE_MODULES: tuple[str, ...] = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                                      "shared_experts")
# Mixture of experts: Megatron's token dispatchers (--moe-token-dispatcher-type) and routers
# ("aux_loss": a trained router kept near balance by the auxiliary loss; "forced": random logits,
# --moe-router-force-load-balancing, what NVIDIA's published MoE benchmarks run). "flex" is
# megatron-core 0.19's flex dispatcher with its DeepEP backend (--moe-token-dispatcher-type flex
# --moe-flex-dispatcher-backend deepep; --moe-enable-deepep is the deprecated spelling).
MOE_DISPATCHERS: tuple[str, ...] = ("alltoall", "allgather", "flex")
MOE_ROUTERS: tuple[str, ...] = ("aux_loss", "forced")
# The loss's cross entropy (Megatron-LM's --cross-entropy-loss-fusion and --cross-entropy-fusion-impl;
# megatron-core's LanguageModule.compute_language_model_loss): "unfused" (no loss fusion:
# tensor_parallel.vocab_parallel_cross_entropy, Megatron's default), "native" (fused, megatron-core's
# fusions/fused_cross_entropy.py), "te" (fused, Transformer Engine's parallel_cross_entropy, what
# NVIDIA's recipes set). What each holds per logit: models.memory.CROSS_ENTROPY_FP32_COPIES.
CROSS_ENTROPY_IMPLS: tuple[str, ...] = ("unfused", "native", "te")
# Attention of a layer (ModelSpec.window_type): "sliding": each query sees the `window_size` keys
# up to itself (Mistral, Gemma 2/3, gpt-oss, Phi-3); "chunked": the keys of its own block of
# `window_size` tokens up to itself (Llama 4's local layers).
WINDOW_TYPES: tuple[str, ...] = ("sliding", "chunked")
# QK normalisation (ModelSpec.qk_norm): "head": an RMSNorm over each head's q and k (Qwen3, Gemma 3,
# GLM-4.5, Megatron's --qk-layernorm); "full": over the whole q and k projection (OLMo 2); "l2":
# a weightless L2 norm per head (Llama 4).
QK_NORMS: tuple[str, ...] = ("none", "head", "full", "l2")
# Where the layer's norms sit (ModelSpec.norm_placement): "pre" (Llama), "pre+post" (Gemma 2/3,
# GLM-4: a norm before and after attention and MLP), "post" (OLMo 2: after, none before).
NORM_PLACEMENTS: tuple[str, ...] = ("pre", "pre+post", "post")


class SpecError(ValueError):
    """A spec (model, GPU, cluster or layout) is malformed. The message is one line for the user."""


def check_precision(gpu: "GPUSpec", precision: str) -> None:
    """A SpecError (one line) where the GPU's tensor cores cannot run `precision`."""
    if precision in BLOCK_SCALED and gpu.generation != "blackwell":
        raise SpecError(f"precision {precision} needs Blackwell tensor cores (B200, B300, GB200, GB300); "
                        f"the {gpu.name} has none (use bf16 or fp8)")
    if precision in ("fp8", "mxfp8") and not gpu.fp8_tflops:
        raise SpecError(f"GPU {gpu.name} has no fp8 tensor cores")
    if precision == "nvfp4" and not gpu.fp4_tflops:
        raise SpecError(f"GPU {gpu.name} has no fp4 tensor cores")


def _from_known_fields(cls, data: Mapping[str, Any]):
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3)."""

    q_lora_rank: int  # 0 means no query compression (plain q projection)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class MoESpec:
    """Mixture of experts on the MLP of (some) layers."""

    num_experts: int
    top_k: int
    ffn_hidden_size: int  # per routed expert
    num_shared_experts: int = 0
    shared_ffn_hidden_size: int = 0  # total hidden size of the shared expert(s); 0 = none
    first_dense_layers: int = 0  # leading layers with a dense MLP (DeepSeek-V3: 3)
    dense_ffn_hidden_size: int = 0  # MLP size of those dense layers
    layer_freq: int = 1  # every layer_freq-th layer (after the dense ones) is MoE


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, in Megatron's terms."""

    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    vocab_size: int
    num_query_groups: int | None = None  # KV heads (GQA); None = MHA
    kv_channels: int | None = None  # head dim; None = hidden / heads
    activation: Literal["swiglu", "gelu", "relu2"] = "swiglu"
    normalization: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    position_embedding: Literal["rope", "learned"] = "rope"
    max_position_embeddings: int = 4096
    tied_embeddings: bool = False
    add_bias_linear: bool = False
    qkv_bias: bool = False
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    family: str = "llama"
    source: str = ""
    # Attention pattern per layer: window_size > 0 makes the layers that window_pattern marks 1
    # local (window_type), the others full causal; window_pattern repeats over the layers (Megatron's
    # --window-attn-skip-freq list form: 1 = windowed); empty = every layer windowed.
    window_size: int = 0
    window_type: str = "sliding"
    window_pattern: tuple[int, ...] = ()
    attention_sinks: bool = False  # a learned sink logit per head (gpt-oss; TE softmax_type "learnable")
    qk_norm: str = "none"
    norm_placement: str = "pre"
    attn_logit_softcap: float = 0.0  # tanh soft-capping of attention scores (Gemma 2); 0 = none
    final_logit_softcap: float = 0.0  # of the output logits (Gemma 2); 0 = none
    rotary_percent: float = 1.0  # share of the head dim that RoPE rotates (GLM-4: 0.5)
    nope_pattern: tuple[int, ...] = ()  # repeating, 1 = a layer without RoPE (Llama 4's global layers)
    # gpt-oss's clamped gated activation: quick-GeLU(min(gate, c)) x (clamp(linear, -c, c) + 1), c
    # this value (7.0); megatron-core's quick_gelu with glu_linear_offset 1 and
    # activation_func_clamp_value (Megatron-LM: --quick-geglu --glu-linear-offset 1.0
    # --activation-func-clamp-value C). Priced as the gated activation it is (activation "swiglu");
    # 0 = none.
    activation_clamp: float = 0.0

    def __post_init__(self) -> None:
        for n in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size"):
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise SpecError(f"model {self.name!r}: {n} must be a positive integer, got {v!r}")
        if self.num_query_groups is not None and self.num_attention_heads % self.num_query_groups:
            raise SpecError(
                f"model {self.name!r}: num_attention_heads ({self.num_attention_heads}) is not a "
                f"multiple of num_query_groups ({self.num_query_groups})"
            )
        for n, allowed in (("window_type", WINDOW_TYPES), ("qk_norm", QK_NORMS),
                           ("norm_placement", NORM_PLACEMENTS)):
            if getattr(self, n) not in allowed:
                raise SpecError(f"model {self.name!r}: {n} must be one of {', '.join(allowed)}, "
                                f"got {getattr(self, n)!r}")
        if (not isinstance(self.activation_clamp, (int, float)) or isinstance(self.activation_clamp, bool)
                or not self.activation_clamp >= 0):
            raise SpecError(f"model {self.name!r}: activation_clamp must be a non-negative number, "
                            f"got {self.activation_clamp!r}")
        if self.activation_clamp and self.activation != "swiglu":
            raise SpecError(f"model {self.name!r}: activation_clamp needs the gated activation (swiglu), "
                            f"got activation {self.activation!r}")
        if not isinstance(self.window_size, int) or isinstance(self.window_size, bool) or self.window_size < 0:
            raise SpecError(f"model {self.name!r}: window_size must be a non-negative integer, got {self.window_size!r}")
        for n in ("window_pattern", "nope_pattern"):
            v = getattr(self, n)
            if not isinstance(v, tuple):  # YAML / JSON give lists
                object.__setattr__(self, n, v := tuple(v))
            if any(x not in (0, 1) or isinstance(x, bool) for x in v):
                raise SpecError(f"model {self.name!r}: {n} must hold 0s and 1s, got {list(v)!r}")

    def __hash__(self) -> int:
        """The fields' hash, computed once: the models cache per-model results (layer kinds,
        parameters per pipeline stage) keyed by the spec, thousands of times per recommend."""
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:  # str hashes differ between processes: never ship the cached one
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    def layer_window(self, layer: int) -> int:
        """Keys window of a layer's attention (0 = full causal attention over the sequence)."""
        if not self.window_size:
            return 0
        p = self.window_pattern
        return self.window_size if not p or p[layer % len(p)] else 0

    @property
    def has_windows(self) -> bool:
        return any(self.layer_window(i) for i in range(self.num_layers))

    @property
    def norms_per_layer(self) -> int:
        """Hidden-size norms in one layer (2 before attention / MLP, 2 more after with pre+post)."""
        return 4 if self.norm_placement == "pre+post" else 2

    @property
    def is_moe(self) -> bool:
        return self.moe is not None and self.moe.num_experts > 1

    @property
    def num_experts(self) -> int:
        return self.moe.num_experts if self.moe else 1

    def is_moe_layer(self, layer: int) -> bool:
        """Layer index (0-based) carries routed experts."""
        if not self.is_moe:
            return False
        m = self.moe
        if layer < m.first_dense_layers:
            return False
        return (layer - m.first_dense_layers) % m.layer_freq == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def with_layers(self, num_layers: int) -> "ModelSpec":
        """A proxy with fewer layers (as NVIDIA's benchmarks do); dense-first layers kept in ratio."""
        moe = self.moe
        if moe is not None and moe.first_dense_layers:
            keep = min(moe.first_dense_layers, max(0, num_layers - 1))
            moe = dataclasses.replace(moe, first_dense_layers=keep)
        return dataclasses.replace(self, num_layers=num_layers, moe=moe,
                                   name=f"{self.name}[{num_layers}L]")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelSpec":
        d = dict(data)
        if d.get("moe"):
            d["moe"] = _from_known_fields(MoESpec, d["moe"])
        else:
            d["moe"] = None
        if d.get("mla"):
            d["mla"] = _from_known_fields(MLASpec, d["mla"])
        else:
            d["mla"] = None
        try:
            return _from_known_fields(cls, d)
        except TypeError as e:  # missing required field
            raise SpecError(f"model {d.get('name', '?')!r}: {e}") from None


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator model. Bandwidths in GB/s (10^9 bytes/s), one direction, per GPU."""

    name: str
    vendor: Literal["nvidia", "amd"]
    memory_gib: float
    hbm_bandwidth_gbs: float
    bf16_tflops: float  # dense peak
    fp8_tflops: float  # dense peak; 0 = unsupported
    tdp_w: float
    idle_w: float
    slowdown_temp_c: float
    intra_node_bw_gbs: float  # NVLink / xGMI, one direction, per GPU
    gpus_per_node: int
    network_bw_gbps: float  # scale-out NIC bandwidth per GPU in Gb/s
    min_power_limit_w: float  # the lowest power limit the driver accepts (nvidia-smi -pl)
    max_power_limit_w: float  # the highest
    max_operating_temp_c: float | None = None
    max_sm_clock_mhz: float | None = None  # boost clock; None where no source gives it
    # streaming multiprocessors the board enables (0 = not known). Where it and max_sm_clock_mhz are
    # known, the tensor peaks are SMs x dense FLOP per clock per SM x max_sm_clock_mhz: the rate at
    # the clock the DVFS model's x = 1 means (models/dvfs.py), not a datasheet rate quoted at a
    # lower clock (Blackwell datasheets quote each board at its own, lower one)
    sm_count: int = 0
    # GPUs one NVLink domain joins (NVLink switch trays of an NVL72 rack: 72; an HGX board: its
    # node, 0 = gpus_per_node); a node (gpus_per_node) is what one host / compute tray holds
    nvlink_domain_gpus: int = 0
    # the chip generation ("ampere", "hopper", "blackwell", "cdna2", "cdna3"): which stack profile
    # answers for it (models/profiles.py) and which number formats its tensor cores run
    generation: str = ""
    fp4_tflops: float = 0.0  # dense NVFP4 / MXFP4 peak; 0 = no FP4 tensor cores
    # exponentials per second of its special function units (MUFU.EX2), in 10^12/s: the softmax of
    # fused attention (models/step_time.softmax_stretch); 0 = not known (attention at the tensor rate)
    sfu_exp_tera_per_s: float = 0.0
    # watts above idle that the DVFS model's power fractions are of (models/dvfs.py): what the
    # silicon draws for a given work at its maximum clock, not the board's power limit. 0 = tdp_w -
    # idle_w (the GPU at its own design point, as H100 is in the fitted sweep); a board that ships
    # a chip another board ships, at the same clocks but a higher power limit (GB300 vs GB200,
    # B300 vs B200: the same BF16 / FP8 tensor rates), takes that board's span, so the extra
    # limit buys clock under load instead of scaling the demand with it
    dynamic_power_w: float = 0.0
    # the memory system's power at a given share of the GPU's HBM bandwidth, relative to the GPU the
    # DVFS constants were fitted on (H100: Constants.memory_hbm_power, a fraction of the power span
    # at the full bandwidth): each GPU's own DVFS sweep fits it (bench/dvfs_fit.py --gpu NAME:
    # memory_hbm_power of its sweep / the H100's). 1 = as the H100 (no sweep of this GPU)
    hbm_power_scale: float = 1.0
    # the GPU's link to its host's memory, GB/s one direction (PCIe x16, or NVLink-C2C's share on a
    # Grace superchip): what activation offloading (TrainConfig.cpu_offload_layers) copies over;
    # 0 = not known (offloading is then refused: search_spaces.layout.violations)
    host_link_gbs: float = 0.0
    sources: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def power_span_w(self) -> float:
        """Watts above idle the DVFS fractions are of (dynamic_power_w, else tdp_w - idle_w)."""
        return self.dynamic_power_w if self.dynamic_power_w > 0 else self.tdp_w - self.idle_w

    @property
    def fp8_transposed_copy(self) -> bool:
        """Whether Transformer Engine keeps a transposed copy of a per-tensor-scaled FP8 operand
        (delayed / current scaling: weights, GEMM inputs, output gradients) next to its data. The
        FP8 tensor cores of Hopper and Ada take only the TN layout, so the wgrad / dgrad GEMMs read a
        transpose TE makes (2 copies); Blackwell's take either layout and TE makes none (1 copy:
        transformer_engine/pytorch/csrc/quantizer.cpp, Float8 quantizers: create_transpose =
        columnwise_usage && !nvte_is_non_tn_fp8_gemm_supported(), i.e. compute capability < 10).
        False where the GPU has no FP8 tensor cores (no FP8 operand to copy). A generation not
        named in FP8_ANY_LAYOUT_GENERATIONS (MI300X's "cdna3", or none given) counts as TN-only."""
        return self.fp8_tflops > 0 and self.generation not in FP8_ANY_LAYOUT_GENERATIONS

    @property
    def domain_gpus(self) -> int:
        """GPUs of one NVLink domain (the node where the catalog gives no larger domain)."""
        return max(self.nvlink_domain_gpus, self.gpus_per_node)

    @property
    def network_bw_gbs(self) -> float:
        return self.network_bw_gbps / 8.0

    def check_power_cap(self, cap: float) -> None:
        """A cap the driver would refuse (outside min_power_limit_w .. max_power_limit_w) is a
        SpecError naming the settable range."""
        lo, hi = self.min_power_limit_w, self.max_power_limit_w
        rng = f"settable {lo:g}-{hi:g} W" if lo < hi else f"only {hi:g} W is settable"
        if cap > hi:
            raise SpecError(f"power cap {cap:g} W is above the {self.name} maximum power limit of {hi:g} W ({rng})")
        if cap < lo:
            raise SpecError(f"power cap {cap:g} W is below the {self.name} minimum power limit of {lo:g} W ({rng})")

    def peak_tflops(self, precision: str) -> float:
        """Dense tensor-core peak of the GEMMs that run in `precision` (MXFP8 runs at the FP8
        rate, NVFP4 at the FP4 one)."""
        check_precision(self, precision)
        if precision in ("fp8", "mxfp8"):
            return self.fp8_tflops
        if precision == "nvfp4":
            return self.fp4_tflops
        return self.bf16_tflops

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "GPUSpec":
        try:
            return _from_known_fields(cls, data)
        except TypeError as e:
            raise SpecError(f"GPU {data.get('name', '?')!r}: {e}") from None


@dataclass(frozen=True)
class ClusterSpec:
    """Homogeneous nodes of one GPU type. Bandwidths per GPU, one direction, GB/s."""

    name: str
    gpu: GPUSpec
    num_nodes: int
    gpus_per_node: int
    intra_node_bw_gbs: float
    inter_node_bw_gbs: float
    power_cap_w: float  # per GPU; the GPU's TDP unless a lower cap is set
    # aggregate write / read bandwidth of the checkpoint storage, GB/s (None: not given; `advisor
    # plan` then takes models.goodput.DEFAULT_STORAGE_BW_GBS, with its source)
    storage_bw_gbs: float | None = None
    # GPUs of one NVLink domain (an NVL72 rack: 72 over 18 trays of 4; 0 = one node); the job's
    # ranks spread evenly over the domains it spans: `domain_gpus` of them share each one
    nvlink_domain_gpus: int = 0

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.gpus_per_node < 1:
            raise SpecError(f"cluster {self.name!r}: nodes and GPUs per node must be >= 1")
        dom = self.nvlink_domain_gpus or self.gpus_per_node
        if dom < self.gpus_per_node or dom % self.gpus_per_node:
            raise SpecError(f"cluster {self.name!r}: nvlink_domain_gpus ({dom}) must be a multiple of the "
                            f"{self.gpus_per_node} GPUs per node")
        object.__setattr__(self, "_domain", job_domain(self.world_size, self.gpus_per_node, dom))
        if self.power_cap_w <= self.gpu.idle_w:
            raise SpecError(
                f"cluster {self.name!r}: power cap {self.power_cap_w:g} W is not above the GPU's "
                f"idle power {self.gpu.idle_w:g} W"
            )

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def domain_gpus(self) -> int:
        """The job's GPUs inside one NVLink domain: groups of ranks within it talk over NVLink."""
        return self._domain

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["gpu"] = self.gpu.name
        d["domain_gpus"] = self.domain_gpus
        d["world_size"] = self.world_size
        return d


def job_domain(world: int, per_node: int, domain: int) -> int:
    """GPUs of a `world`-GPU job inside each NVLink domain of `domain` GPUs, whole nodes of
    `per_node`, the ranks spread evenly (a 128-GPU GB200 job on two NVL72 racks: 64 + 64): the
    largest divisor of the world that is whole nodes and fits a domain."""
    if world <= domain:
        return world
    return max(d for d in range(per_node, domain + 1, per_node) if world % d == 0)


@dataclass(frozen=True)
class TrainConfig:
    """One training layout plus workload, Megatron-style. DP is derived from the world size.

    How the layers are split over the pipeline (defaults: an even split, Megatron's default):
    - ``pp_first_layers`` / ``pp_last_layers``: transformer layers on the first / last stage
      (``--decoder-first/last-pipeline-num-layers``), the rest spread evenly;
    - ``account_for_embedding`` / ``account_for_loss``: the embedding / the output layer and loss
      count as one layer each in an even split (``--account-for-embedding/loss-in-pipeline-split``);
    - ``pipeline_layout``: an explicit layout in megatron-core's string form
      (``--pipeline-model-parallel-layout``, e.g. ``"Et|(tt|)*30L"``; its stage count is pp·vp).
    Rules on these live in ``advisor.search_spaces.layout``.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    vp: int = 1  # virtual pipeline chunks per rank (1 = no interleaving)
    mbs: int = 1
    gbs: int = 1
    seq: int = 4096
    precision: Precision = "bf16"
    fp8_recipe: str = "delayed"  # Megatron's --fp8-recipe for precision fp8 (FP8_RECIPES)
    recompute: Recompute = "none"
    # Partial recompute (issue #27). With recompute "full": Megatron's block method on this many
    # layers of each virtual chunk (megatron-core TransformerBlock._checkpointed_forward, method
    # "block": the first recompute_num_layers layers of the chunk are checkpointed one by one, the
    # others keep everything; --recompute-method block --recompute-num-layers N); None = every layer
    # (method uniform with one layer per unit, the behaviour before these fields).
    recompute_layers: int | None = None
    # With recompute "selective": the modules recomputed (RECOMPUTE_MODULES, --recompute-modules);
    # () = megatron-core's default, ("core_attn",).
    recompute_modules: tuple[str, ...] = ()
    sequence_parallel: bool = False
    distributed_optimizer: bool = True
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    tp_comm_overlap: bool = False
    # The weight-gradient GEMM accumulates into the main gradient itself (--gradient-accumulation-
    # fusion: TE's fuse_wgrad_accumulation, apex's fused_weight_gradient_mlp_cuda for the output
    # layer). Off: megatron's DDP hook adds each weight gradient into the main grad after the GEMM,
    # one more read and write of the main grad per parameter and microbatch (models/step_time.py).
    # megatron-core's TransformerConfig default is off; NVIDIA's recipes turn it on (the te stack's
    # layout default); this project's runner runs it off (apex is missing on its machines).
    gradient_accumulation_fusion: bool = False
    pp_first_layers: int | None = None
    pp_last_layers: int | None = None
    account_for_embedding: bool = False
    account_for_loss: bool = False
    pipeline_layout: str | None = None
    # Mixture of experts (ignored for dense models): token dispatcher, grouped GEMM for the local
    # experts (False: one GEMM per expert, megatron-core's SequentialMLP), router balancing.
    moe_dispatcher: str = "alltoall"
    moe_grouped_gemm: bool = True
    moe_router: str = "aux_loss"
    # Token dropping: each expert takes at most capacity = ceil(factor x mean tokens) of each source
    # rank (--moe-expert-capacity-factor; None = dropless); with moe_pad_to_capacity every expert's
    # input is padded up to the capacity (--moe-pad-expert-input-to-capacity).
    moe_capacity_factor: float | None = None
    moe_pad_to_capacity: bool = False
    # The 1F1B all-to-all overlap: the dispatch / combine of one microbatch runs behind the other's
    # compute (--overlap-moe-expert-parallel-comm, with --delay-wgrad-compute).
    moe_a2a_overlap: bool = False
    # Shared experts run on a side stream behind the dispatch (--moe-shared-expert-overlap).
    moe_shared_expert_overlap: bool = False
    # TE's fused top-k / score / aux-loss kernels (--moe-router-fusion).
    moe_router_fusion: bool = False
    # TE's fused permute / unpermute / chunk-sort kernels (--moe-permute-fusion; megatron-core's
    # default is off, Megatron-Bridge's MoE recipes turn it on).
    moe_permute_fusion: bool = False
    # The loss's cross entropy (CROSS_ENTROPY_IMPLS; the te stack's layout default is "te").
    cross_entropy_impl: str = "unfused"
    # FP8 primary weights (Megatron-LM --fp8-param-gather; megatron-core DistributedDataParallelConfig.
    # fp8_param_gather with TransformerConfig.fp8_param; NeMo / Megatron-Bridge bf16_with_fp8_mixed():
    # fp8_param_gather = True): TE's linear-layer weights are kept in FP8 only (data + the transpose
    # Hopper's FP8 GEMMs need), no BF16 copy, and the distributed optimizer all-gathers them in FP8.
    # Needs an FP8-family precision and the distributed optimizer (Megatron-LM's validate_args);
    # the te stack's layout default is on where those hold.
    fp8_param_gather: bool = False
    # torch's caching allocator with expandable segments (PYTORCH_CUDA_ALLOC_CONF=
    # expandable_segments:True, an environment variable of the launch, not a Megatron argument):
    # one segment per stream that grows by mapping pages instead of a new cudaMalloc for each
    # request no cached block can serve, which removes most of the reserved-but-unallocated memory
    # (models/allocator_memory.py). NeMo's performance scripts set it (scripts/performance/
    # executors.py, every GPU but B200); the te stack's layout default is on; this project's runner
    # runs it off (runners/megatron_args.runner_config, so its records say so).
    expandable_segments: bool = False
    # The pipeline frees each stage output's data once it is sent (megatron-core ModelParallelConfig.
    # deallocate_pipeline_outputs, default False; Megatron-LM's training sets it True for every run,
    # megatron/training/argument_utils.py core_transformer_config_from_args, as Megatron-Bridge's
    # providers do, so NVIDIA's published recipes run with it). Off, a stage keeps the output tensor
    # (s / CP (/ TP with sequence parallelism) x b x h, BF16) of every chunk-microbatch in flight until
    # its backward (models/memory.py). Does nothing with PP = 1. The te stack's layout default is on;
    # this project's runner builds megatron-core's config with the default (off: runner_config, so
    # its records say so).
    deallocate_pipeline_outputs: bool = False
    # Megatron FSDP with the optim_grads_params sharding strategy (Megatron-LM --use-megatron-fsdp
    # --data-parallel-sharding-strategy optim_grads_params, megatron-core DistributedDataParallelConfig.
    # use_megatron_fsdp; Megatron-Bridge set_megatron_fsdp_overrides): weights, gradients and optimizer
    # states all sharded over the data-parallel ranks (x CP; experts over their expert-DP group); each
    # FSDP unit (a transformer layer; the embedding and output layer on their own) is all-gathered
    # before its forward and backward and its gradient reduce-scattered after (models/memory.py).
    # Megatron-LM turns the distributed optimizer on with it; here it needs it on.
    fsdp: bool = False
    # NCCL communicators created at each process group's first collective (lazy) instead of all at
    # once when megatron-core opens its ~20 groups (eager). torch.distributed creates them eagerly
    # only when init_process_group is given device_id (torch docs: "the communicator is immediately
    # formed ... sub-groups will use ncclCommSplit"): Megatron-Bridge's initialize
    # (src/megatron/bridge/training/initialize.py, _initialize_distributed) does not pass it, so a
    # group no training step uses (a one-rank group, the plain DP group beside DP x CP, the
    # model-parallel group ...) never holds a communicator (models/outside_memory.py). This
    # project's runner passes device_id (eager: runners/megatron_args.runner_config); the te stack's
    # layout default is lazy (NVIDIA's published recipes run through Megatron-Bridge / NeMo).
    nccl_lazy_init: bool = False
    # Activations of the first N transformer layers of each microbatch offloaded to host memory
    # (megatron-core TransformerConfig.cpu_offloading / cpu_offloading_num_layers, Megatron-LM
    # --cpu-offloading --cpu-offloading-num-layers N, Megatron-Bridge model.cpu_offloading_num_layers;
    # model activations only: cpu_offloading_weights off, as Megatron-Bridge's performance scripts set
    # it). Transformer Engine's get_cpu_offload_context (transformer_engine/pytorch/cpu_offload.py,
    # DefaultOffloadSynchronizer) copies layer i's saved tensors to pinned host memory on a side stream
    # from layer i + 1's forward on and frees them before layer L - N + i's; it reloads them from layer
    # L - 1 - N + i's backward on: the activations the GPU holds peak at (L - N) layers
    # (models/offload.py). megatron-core's TransformerConfig.__post_init__ refuses (checked on
    # NVIDIA/Megatron-LM megatron/core/transformer/transformer_config.py):
    #   "CPU offloading can be done only for layers less than {num_layers}" (num_layers <= N),
    #   "Currently there is no support for Pipeline parallelism with CPU offloading" (pp > 1),
    #   "CPU offloading does not work when activation recomputation is enabled" (recompute set);
    # and TransformerBlock asserts "CPU Offloading is enabled when TE is not present" (te stack only).
    cpu_offload_layers: int = 0

    def __post_init__(self) -> None:
        cf = self.moe_capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not cf > 0
                               or cf != cf or cf == float("inf")):
            raise SpecError(f"moe_capacity_factor must be a positive number or None (dropless), got {cf!r}")
        for n in ("moe_pad_to_capacity", "moe_a2a_overlap", "moe_shared_expert_overlap", "moe_router_fusion",
                  "moe_permute_fusion", "gradient_accumulation_fusion", "fp8_param_gather",
                  "expandable_segments", "deallocate_pipeline_outputs", "fsdp", "nccl_lazy_init"):
            if not isinstance(getattr(self, n), bool):
                raise SpecError(f"{n} must be true or false, got {getattr(self, n)!r}")
        if self.moe_pad_to_capacity and cf is None:
            raise SpecError("moe_pad_to_capacity needs moe_capacity_factor (megatron-core raises otherwise)")
        if self.moe_dispatcher not in MOE_DISPATCHERS:
            raise SpecError(f"moe_dispatcher must be one of {', '.join(MOE_DISPATCHERS)}, got {self.moe_dispatcher!r}")
        if self.fp8_param_gather and not (self.precision in ("fp8", "mxfp8") and self.distributed_optimizer):
            raise SpecError("fp8_param_gather needs precision fp8 or mxfp8 and the distributed optimizer "
                            f"(got precision {self.precision}, distributed optimizer {self.distributed_optimizer})")
        if self.fsdp and not self.distributed_optimizer:
            raise SpecError("fsdp (Megatron FSDP) needs the distributed optimizer (Megatron-LM turns it on with "
                            "--use-megatron-fsdp)")
        if self.cross_entropy_impl not in CROSS_ENTROPY_IMPLS:
            raise SpecError(f"cross_entropy_impl must be one of {', '.join(CROSS_ENTROPY_IMPLS)}, "
                            f"got {self.cross_entropy_impl!r}")
        if self.moe_router not in MOE_ROUTERS:
            raise SpecError(f"moe_router must be one of {', '.join(MOE_ROUTERS)}, got {self.moe_router!r}")
        if not isinstance(self.moe_grouped_gemm, bool):
            raise SpecError(f"moe_grouped_gemm must be true or false, got {self.moe_grouped_gemm!r}")
        for n in ("tp", "pp", "dp", "cp", "ep", "etp", "vp", "mbs", "gbs", "seq"):
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SpecError(f"{n} must be a positive integer, got {v!r}")
        if self.precision not in PRECISIONS:
            raise SpecError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise SpecError(f"fp8_recipe must be one of {', '.join(FP8_RECIPES)}, got {self.fp8_recipe!r}")
        if self.recompute not in RECOMPUTE_MODES:
            raise SpecError(
                f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {self.recompute!r}"
            )
        n = self.cpu_offload_layers
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise SpecError(f"cpu_offload_layers must be a non-negative integer, got {n!r}")
        if n and self.pp > 1:
            raise SpecError("cpu_offload_layers needs pp = 1 (megatron-core: \"Currently there is no support for "
                            "Pipeline parallelism with CPU offloading\")")
        if n and self.recompute != "none":
            raise SpecError("cpu_offload_layers needs recompute none (megatron-core: \"CPU offloading does not "
                            "work when activation recomputation is enabled\")")
        self._check_recompute_knobs()
        if self.pipeline_layout is not None and (not isinstance(self.pipeline_layout, str)
                                                 or not self.pipeline_layout.strip()):
            raise SpecError(f"pipeline_layout must be a non-empty string, got {self.pipeline_layout!r}")

    def _check_recompute_knobs(self) -> None:
        """recompute_layers / recompute_modules: their types and the mode each needs (megatron-core's
        TransformerConfig.__post_init__: recompute_num_layers must be None for selective, the
        modules are read only for selective); the modules become a tuple in RECOMPUTE_MODULES order."""
        n = self.recompute_layers
        if n is not None:
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise SpecError(f"recompute_layers must be a non-negative integer or None (every layer), got {n!r}")
            if self.recompute != "full":
                raise SpecError(f"recompute_layers needs recompute 'full' (the block method), got recompute {self.recompute!r}")
        mods = self.recompute_modules
        if isinstance(mods, list):
            mods = tuple(mods)
            object.__setattr__(self, "recompute_modules", mods)
        if not isinstance(mods, tuple) or not all(isinstance(m, str) for m in mods):
            raise SpecError(f"recompute_modules must be a list of module names, got {mods!r}")
        bad = [m for m in mods if m not in RECOMPUTE_MODULES]
        if bad:
            raise SpecError(f"unknown recompute module(s) {', '.join(map(repr, bad))}: "
                            f"choose from {', '.join(RECOMPUTE_MODULES)}")
        if len(set(mods)) != len(mods):
            raise SpecError(f"recompute_modules names a module twice: {mods!r}")
        object.__setattr__(self, "recompute_modules", tuple(sorted(mods, key=RECOMPUTE_MODULES.index)))
        if mods and self.recompute != "selective":
            raise SpecError(f"recompute_modules needs recompute 'selective', got recompute {self.recompute!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def quant(self) -> str:
        """What the linear layers run in (QUANTS: 'bf16', 'fp8', 'fp8-tensorwise', 'mxfp8', ...)."""
        return quant_name(self.precision, self.fp8_recipe)

    @property
    def quant_code(self) -> int:
        return QUANTS.index(self.quant)

    @property
    def num_microbatches(self) -> int:
        """Microbatches per pipeline per step (gbs / (mbs * dp)); legality checked elsewhere."""
        return max(1, self.gbs // (self.mbs * self.dp))

    @property
    def tokens_per_step(self) -> int:
        return self.gbs * self.seq

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of the expert weights: (dp * cp * tp) / (ep * etp)."""
        return max(1, (self.dp * self.cp * self.tp) // (self.ep * self.etp))

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """dataclasses.asdict (every field is a number, a string, a bool or None: no copies)."""
        return {f: getattr(self, f) for f in _TRAIN_FIELDS}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise SpecError(f"unknown layout key(s): {', '.join(unknown)}")
        return cls(**dict(data))

    def key(self) -> str:
        """A short stable label, e.g. 'tp2-pp4-dp8-cp1-ep1-vp1-mbs1-gbs512-selective'; the
        embedding / loss accounting and an explicit pipeline layout are appended only when set."""
        return (
            f"tp{self.tp}-pp{self.pp}-dp{self.dp}-cp{self.cp}-ep{self.ep}-etp{self.etp}-vp{self.vp}"
            f"-mbs{self.mbs}-gbs{self.gbs}-seq{self.seq}-{self.quant}-{self.recompute}"
            + ("-acce" if self.account_for_embedding else "") + ("-accl" if self.account_for_loss else "")
            + (f"-layout[{self.pipeline_layout}]" if self.pipeline_layout else "")
            + knobs_key(self.moe_knobs(), self.recompute_layers, self.recompute_modules, self.cpu_offload_layers,
                        self.fsdp)
        )

    def moe_key(self) -> str:
        """The MoE knobs that differ from the defaults, e.g. '-allgather-seqmlp-forced' ('' if none)."""
        return moe_knobs_key(self.moe_knobs())

    def moe_knobs(self) -> tuple:
        """The MoE knobs (MOE_KNOBS) as a tuple: what the array model keeps per row."""
        return tuple(getattr(self, k) for k in MOE_KNOBS)


def recompute_knobs_key(layers: int | None, modules: tuple[str, ...]) -> str:
    """'-rcl4' for recompute_layers 4, '-rcm[mlp+layernorm]' for recompute_modules ('' at defaults)."""
    return (f"-rcl{layers}" if layers is not None else "") + (f"-rcm[{'+'.join(modules)}]" if modules else "")


def knobs_key(moe_knobs: tuple, recompute_layers: int | None, recompute_modules: tuple[str, ...],
              cpu_offload_layers: int, fsdp: bool) -> str:
    """The tail of TrainConfig.key() (and of search_spaces.columns.Layouts.key): the MoE, partial
    recompute, offloading and FSDP knobs that differ from their defaults."""
    return (moe_knobs_key(moe_knobs) + recompute_knobs_key(recompute_layers, recompute_modules)
            + (f"-offload{cpu_offload_layers}" if cpu_offload_layers else "") + ("-fsdp" if fsdp else ""))


# The TrainConfig fields of the MoE knobs, in the order of TrainConfig.moe_knobs() / Layouts.extras.
MOE_KNOBS: tuple[str, ...] = ("moe_dispatcher", "moe_grouped_gemm", "moe_router", "moe_capacity_factor",
                              "moe_pad_to_capacity", "moe_a2a_overlap", "moe_shared_expert_overlap",
                              "moe_router_fusion", "moe_permute_fusion")
MOE_KNOB_DEFAULTS: tuple = ("alltoall", True, "aux_loss", None, False, False, False, False, False)


def moe_knobs_key(knobs: tuple) -> str:
    """The key suffix of a MOE_KNOBS tuple: the knobs that differ from the defaults."""
    disp, grouped, router, cf, pad, a2a, shared, fusion, pfusion = knobs
    return ((f"-{disp}" if disp != "alltoall" else "")
            + ("-seqmlp" if not grouped else "")
            + (f"-{router}" if router != "aux_loss" else "")
            + (f"-cf{cf:g}" if cf is not None else "") + ("-pad" if pad else "")
            + ("-a2aovl" if a2a else "") + ("-shovl" if shared else "") + ("-rfuse" if fusion else "")
            + ("-pfuse" if pfusion else ""))


_TRAIN_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig))
