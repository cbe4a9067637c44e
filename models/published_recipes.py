"""What the recipe behind each group of published rows (models/published.py) sets beyond the
printed layout, read from the configs the rows name, and how a row finds its recipe.

A `Recipe` is keyed by source group, model and GPU and, where the recipe depends on them, by
FSDP, precision class (`precision_class`: "bf16", "fp8" (Megatron-Bridge's FP8_CS presets; the
Bridge pages' "FP8" rows), "mxfp8", "nvfp4"), the container (the row's ``source_version``) and
the global batch (Megatron-Bridge's V1 / V2 variants differ by it). `RecipeSettings.layout` is
the layout the read config version prints (TP, PP, VP, CP, EP, micro-batch): a row whose own
layout differs ran another version of the config (its container's), so the settings are not
carried to it (the loader says so in the row's notes).

`RecipeSettings.pending` holds Megatron settings under the names of TrainConfig fields other
engineers are adding (`PENDING_FIELDS`): `split_pending` applies those TrainConfig has, and names
the others "recipe setting not modelled".

Megatron-Bridge sources (NVIDIA-NeMo/Megatron-Bridge; commit as read with the read_file tool):
- scripts/performance/configs/llama/llama3_workload_base_configs.py @ 00919dcf1fe13c0acf65e131f244378f0a6cd2b5
- scripts/performance/configs/llama/llama3_llm_pretrain.py @ 2a0d46e2c5540be8ff92977c3e55c7f10bce1d3e
  (FSDP: ddp.fsdp_double_buffer = True, gradient_accumulation_fusion = False,
  suggested_communication_unit_size = 800000000; tp_comm_overlap off for NVFP4)
- scripts/performance/configs/llama/llama31_workload_base_configs.py @ 0013c9a8ed4d655cd4e8ad8f918b11588e53c85d
- scripts/performance/configs/deepseek/deepseek_workload_base_configs.py @ 042641823051ce167c52b0ae289941a227c11535
- scripts/performance/configs/gpt_oss/gpt_oss_workload_base_configs.py @ 07eea52d4523a69fc8975cef34938d61ae13f9e2
- scripts/performance/configs/deepseek/deepseek_workload_base_configs.py as stored in the forks
  dingqingy-nv/Megatron-Bridge @ 0a0e1537ab76eb2fdb0e52b651f6d373315693a5 (read whole) and
  kocchop/Megatron-Bridge @ 6219b1a8fc23ce44fd96700ab87dfb5ff0b045b0 (the same B300 V2 lines): the
  B300 V2 preset at PP8 (no VP) mbs 2, the layout the B300 MXFP8 rows of containers 26.04.01 / 26.06 print
- scripts/performance/configs/qwen3/qwen3_30b_a3b_llm_pretrain.yaml (the perf_matrix era) as stored in the
  forks y-okochi/Megatron-Bridge @ 7919cbae0ce78d6dcbfbbd8145e45c33e6507308 and salberdi-nvidia/
  Megatron-Bridge @ bb10eafb7f3a7cc812fd27e1b5086a5e94aceee6 (same h100 block): H100 TP1 PP2 VP24 EP8
  mbs 2 for fp8_cs, the layout the H100 rows of containers 25.09 / 25.11 print (NVIDIA-NeMo's stored
  version @ 48b5204a prints VP24 mbs 1, the .py presets @ 58fa56a3 VP12 mbs 2: not these rows' layout)
- searched, no stored version prints the row's layout (the rows keep no recipe): GB300 Llama3 70B of
  container 26.02.01 (NVFP4 TP1 PP1 mbs 2, MXFP8 PP4 VP1 mbs 2: every stored llama3 workload / perf_matrix
  version has GB300 FP8_MX / NVFP4 at PP4 VP5 mbs 1); GB200 Llama3 70B MXFP8 of 25.09 (TP2 PP4 VP5 mbs 2:
  every stored version runs FP8_MX at mbs 1); GPT-OSS 120B of 25.11 (H100 PP4 EP8 mbs 4, B200 EP8 mbs 4:
  the stored versions have H100 PP4 EP8 mbs 1 or EP8 mbs 8 without PP, B200 EP64 mbs 4 or EP8 mbs 8)
- how the keys become TransformerConfig settings (scripts/performance/utils, set_recompute_overrides):
  recompute_num_layers -> recompute_granularity "full", recompute_method "block", that many
  layers; cpu_offloading_num_layers > 0 -> cpu_offloading True, cpu_offloading_weights False
  (activations only); recompute_modules -> recompute_granularity "selective" of those modules;
  moe_flex_dispatcher_backend (hybridep / deepep) -> moe_token_dispatcher_type "flex".
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from advisor.catalog import TrainConfig

# Megatron settings under the advisor's future TrainConfig field names, and what each implies for
# the fields TrainConfig has (set together with it, only when it is applied)
PENDING_FIELDS = {
    "cpu_offload_layers": "Bridge cpu_offloading_num_layers: activations of that many layers offloaded to the host",
    "recompute_layers": "Bridge recompute_num_layers: full recompute (method block) of that many layers per stage",
    "recompute_modules": "Bridge recompute_modules: selective recompute of those modules",
}
PENDING_IMPLIES = {"recompute_layers": {"recompute": "full"}, "recompute_modules": {"recompute": "selective"}}


@dataclass(frozen=True)
class RecipeSettings:
    """Memory-relevant settings of the recipe behind a group of rows: `fields` (TrainConfig knobs,
    kept over the stack's layout defaults), `source` (the files they were read from), `pending`
    (settings under TrainConfig field names still being added: `split_pending`), `unmodelled`
    (settings the advisor has no field for, named for the notes), `layout` (the layout the read
    config prints: rows with another layout ran another version and get none of it)."""
    fields: dict
    source: str
    unmodelled: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # settings read but not carried, and why
    pending: dict = field(default_factory=dict)
    layout: dict = field(default_factory=dict)  # tp, pp, vp, cp, ep, mbs of the read config


@dataclass(frozen=True)
class Recipe:
    source_group: str
    model_key: str
    gpu_type: str
    settings: RecipeSettings
    fsdp: bool = False
    precisions: frozenset = frozenset()  # precision classes; empty: any
    containers: frozenset = frozenset()  # source_version strings; empty: any
    gbs: int | None = None  # the config variant's global batch; None: any

    def matches(self, source_group: str, model_key: str, gpu_type: str, fsdp: bool, precision: str,
                container: str, gbs: int | None) -> bool:
        return ((self.source_group, self.model_key, self.gpu_type, self.fsdp) == (source_group, model_key, gpu_type, fsdp)
                and (not self.precisions or precision in self.precisions)
                and (not self.containers or container in self.containers)
                and (self.gbs is None or gbs == self.gbs))


def precision_class(precision: str, fp8_recipe: str = "") -> str:
    """The recipe family's precision key of an advisor precision: bf16, fp8 (per-tensor: delayed or
    current scaling; Megatron-Bridge's FP8_CS presets), fp8_blockwise, mxfp8, nvfp4."""
    if precision == "fp8" and fp8_recipe == "blockwise":
        return "fp8_blockwise"
    return precision


def trainconfig_fields() -> frozenset:
    return frozenset(f.name for f in dataclasses.fields(TrainConfig))


def split_pending(pending: dict, names: frozenset | None = None) -> tuple[dict, tuple[str, ...]]:
    """(TrainConfig fields to set, "recipe setting not modelled" lines) of a recipe's `pending`:
    a setting is applied, with what it implies (PENDING_IMPLIES), when TrainConfig (or `names`)
    has its field, otherwise named."""
    names = trainconfig_fields() if names is None else names
    applied: dict = {}
    missing: list[str] = []
    for k, v in pending.items():
        if k in names:
            applied.update({i: iv for i, iv in PENDING_IMPLIES.get(k, {}).items() if i in names})
            applied[k] = v
        else:
            missing.append(f"{k}={v!r} ({PENDING_FIELDS.get(k, 'no TrainConfig field yet')})")
    return applied, tuple(missing)


def layout_mismatch(settings: RecipeSettings, row_layout: dict) -> str:
    """'' when the row's layout is the read config's, else what differs (k row vs config)."""
    diff = [f"{k} {row_layout.get(k)} vs {v}" for k, v in settings.layout.items() if row_layout.get(k) != v]
    return ", ".join(diff)


# ------------------------------------------------------------------------------------------------
# the recipes
# ------------------------------------------------------------------------------------------------

# Megatron-Bridge performance recipes (rows of megatron_bridge_perf_summary). Common to all:
# scripts/performance/utils/helpers.py set_common_perf_overrides: cross_entropy_fusion_impl = "te";
# the Megatron-Bridge Llama recipes (src/megatron/bridge/recipes/llama/llama3.py) recompute_granularity
# = None, fine_grained_activation_offloading = False, use_distributed_optimizer = True; the perf
# recipes' env PYTORCH_CUDA_ALLOC_CONF = "expandable_segments:True" (src/megatron/bridge/recipes/
# llama/h100/llama3.py, llama31.py); bf16_with_fp8_current_scaling_mixed(): fp8_param_gather = True
# (src/megatron/bridge/training/mixed_precision.py), the te stack's default already.
BRIDGE = {"recompute": "none", "cross_entropy_impl": "te", "expandable_segments": True}
BRIDGE_SRC = ("NVIDIA-NeMo/Megatron-Bridge scripts/performance/utils/helpers.py (set_common_perf_overrides), "
              "src/megatron/bridge/recipes/llama/llama3.py")
BMB = "megatron_bridge_perf_summary"
_L3 = "scripts/performance/configs/llama/llama3_llm_pretrain.py@2a0d46e2, llama3_workload_base_configs.py@00919dcf"
_L31 = "scripts/performance/configs/llama/llama31_workload_base_configs.py@0013c9a8"
_DS = "scripts/performance/configs/deepseek/deepseek_workload_base_configs.py@04264182"
_DS_OLD = "scripts/performance/configs/deepseek/deepseek_workload_base_configs.py (earlier version, id 52245127557)"
_OSS = "scripts/performance/configs/gpt_oss/gpt_oss_workload_base_configs.py@07eea52d"
_DS_B300_V2 = ("scripts/performance/configs/deepseek/deepseek_workload_base_configs.py (fork dingqingy-nv/"
               "Megatron-Bridge@0a0e1537; kocchop/Megatron-Bridge@6219b1a8 the same B300 V2)")
_QW3_YAML = ("scripts/performance/configs/qwen3/qwen3_30b_a3b_llm_pretrain.yaml (fork y-okochi/Megatron-Bridge"
             "@7919cbae; salberdi-nvidia/Megatron-Bridge@bb10eafb the same)")
FSDP_UNMODELLED = ("ddp.fsdp_double_buffer = True (a second all-gather buffer of the FSDP units)",
                   "ddp.suggested_communication_unit_size = 800000000")
CUDA_GRAPH = "cuda_graph_impl {} scope {} (graph-captured static buffers)"
# Megatron-Bridge llama31_405b_pretrain_config: embedding and loss counted as layers in the split
L405 = {**BRIDGE, "account_for_embedding": True, "account_for_loss": True}


def _lay(tp=1, pp=1, vp=1, cp=1, ep=1, mbs=1) -> dict:
    return {"tp": tp, "pp": pp, "vp": vp, "cp": cp, "ep": ep, "mbs": mbs}


def _bridge(model: str, gpu: str, precisions: str, src: str, layout: dict, fields: dict | None = None,
            pending: dict | None = None, unmodelled: tuple = (), fsdp: bool = False, gbs: int | None = None,
            notes: tuple = (), containers: tuple = ()) -> Recipe:
    return Recipe(BMB, model, gpu, RecipeSettings(
        {**BRIDGE, **(fields or {})}, BRIDGE_SRC + ", " + src, unmodelled=unmodelled, notes=notes,
        pending=pending or {}, layout=layout), fsdp=fsdp, precisions=frozenset(precisions.split()), gbs=gbs,
        containers=frozenset(containers))


def _llama3_70b() -> list[Recipe]:
    """LLAMA3_70B_PRETRAIN_CONFIG_{GPU}_{PREC}_V1/V2 (V1 GBS 128, V2 GBS 256: same settings). The
    base recipe's CommOverlapConfig(tp_comm_overlap=True), off for NVFP4 (llama3_llm_pretrain.py)."""
    fs = {"gradient_accumulation_fusion": False}
    out = []
    for gpu, prec, mbs, off, extra in (("GB300", "bf16", 2, 30, ("ddp.nccl_ub = True",)), ("GB300", "fp8", 2, 20, ()),
                                       ("GB200", "bf16", 1, 20, ()), ("GB200", "fp8", 2, 40, ()),
                                       ("B300", "bf16 fp8", 1, 0, ()), ("B200", "fp8", 1, 5, ())):
        out.append(_bridge("llama3_70b", gpu, prec, _L3, _lay(mbs=mbs), fs,
                           {"cpu_offload_layers": off} if off else None, FSDP_UNMODELLED + extra, fsdp=True))
    for gpu, tp in (("GB300", 1), ("B300", 1), ("GB200", 2), ("B200", 2)):
        out.append(_bridge("llama3_70b", gpu, "mxfp8", _L3, _lay(tp=tp, pp=4, vp=5), {"tp_comm_overlap": tp > 1}))
        cg = (CUDA_GRAPH.format("none", "full_iteration"),) if gpu != "B200" else ()
        out.append(_bridge("llama3_70b", gpu, "nvfp4", _L3, _lay(tp=tp, pp=4, vp=5), {"tp_comm_overlap": False},
                           unmodelled=cg))
    out.append(_bridge("llama3_70b", "B200", "bf16", _L3, _lay(tp=2, pp=4, vp=5, cp=2), {"tp_comm_overlap": True},
                       unmodelled=(CUDA_GRAPH.format("local", "full_iteration"),)))
    return out


def _llama31_405b() -> list[Recipe]:
    """LLAMA31_405B_PRETRAIN_CONFIG_*: V1 GBS 64 on 128 GPUs, V2 GBS 1536 on 256 (its GB300 / GB200
    FP8_CS V2 turn FSDP and offloading off; its GB200 NVFP4 V2 sets recompute_num_layers None);
    B300 / B200 V2 are the GB300 / GB200 V2 presets."""
    out = [
        _bridge("llama3.1_405b", "GB300", "bf16", _L31, _lay(tp=2), pending={"cpu_offload_layers": 40},
                unmodelled=FSDP_UNMODELLED, fsdp=True, fields={"account_for_embedding": True, "account_for_loss": True}),
        _bridge("llama3.1_405b", "GB300", "fp8", _L31, _lay(tp=2), pending={"cpu_offload_layers": 10},
                unmodelled=FSDP_UNMODELLED, fsdp=True, gbs=64, fields={"account_for_embedding": True, "account_for_loss": True}),
        _bridge("llama3.1_405b", "GB200", "fp8", _L31, _lay(tp=2), pending={"cpu_offload_layers": 92},
                unmodelled=FSDP_UNMODELLED, fsdp=True, gbs=64, fields={"account_for_embedding": True, "account_for_loss": True}),
        _bridge("llama3.1_405b", "GB200", "nvfp4", _L31, _lay(tp=4, pp=16, vp=8), L405, {"recompute_layers": 1},
                (CUDA_GRAPH.format("none", "[]"),), gbs=64),
    ]
    v2 = (("fp8", _lay(tp=4, pp=16, vp=4)), ("mxfp8", _lay(tp=4, pp=16, vp=8)), ("nvfp4", _lay(tp=4, pp=16, vp=8)),
          ("bf16", _lay(tp=4, pp=16, vp=8)))
    v2_gb300 = (("fp8", _lay(tp=4, pp=8, vp=4)), ("mxfp8", _lay(tp=2, pp=8, vp=4, cp=2)),
                ("nvfp4", _lay(tp=4, pp=8, vp=4)))
    for gpus, presets in ((("GB200", "B200"), v2), (("GB300", "B300"), v2_gb300)):
        for gpu in gpus:
            out += [_bridge("llama3.1_405b", gpu, p, _L31, lay, L405, gbs=1536) for p, lay in presets]
    return out


def _deepseek_v3() -> list[Recipe]:
    """DEEPSEEK_V3_PRETRAIN_CONFIG_{GPU}[_{PREC}]_V1/V2 (V1 GBS 2048, V2 4096 on Blackwell; same
    settings); moe_flex_dispatcher_backend hybridep / deepep (moe_token_dispatcher_type "flex")."""
    flex = {"moe_dispatcher": "flex"}
    # the presets' pp_layout places the multi-token-prediction layer ('m') on the last chunk; the
    # advisor's model has no MTP: the layout is carried without it, the layer named as not modelled
    mtp = "the pp_layout's multi-token-prediction layer 'm' (last pipeline chunk)"
    cg_attn = CUDA_GRAPH.format("transformer_engine", "attn, moe_router, moe_preprocess")
    cg_full = CUDA_GRAPH.format("full_iteration", "[]")
    mx = ("cutedsl_fused_grouped_mlp = True",)
    gb300 = {**flex, "pipeline_layout": "Et*4|(t*4|)*14tL"}  # printed "Et*4|(t*4|)*14tmL"
    b200_v2 = {**flex, "moe_a2a_overlap": True, "pipeline_layout": "Et*4|(t*4|)*14tL"}
    out = []
    for gbs in (2048, 4096):
        out += [
            _bridge("deepseek_v3", "GB200", "fp8", _DS, _lay(pp=4, vp=4, ep=64), flex, {"recompute_modules": ("mlp",)},
                    (cg_attn,), gbs=gbs),
            _bridge("deepseek_v3", "GB200", "bf16", _DS, _lay(pp=4, vp=4, ep=64), flex,
                    {"recompute_modules": ("mla_up_proj",)}, (cg_attn,), gbs=gbs),
            _bridge("deepseek_v3", "GB200", "mxfp8", _DS, _lay(pp=4, vp=4, ep=64), {**flex, "moe_a2a_overlap": True},
                    {"recompute_modules": ("mla_up_proj",)}, (cg_full,) + mx, gbs=gbs),
            _bridge("deepseek_v3", "GB200", "nvfp4", _DS, _lay(pp=4, vp=4, ep=64), flex,
                    {"recompute_modules": ("mla_up_proj",)}, (cg_full,) + mx, gbs=gbs),
            _bridge("deepseek_v3", "GB300", "fp8", _DS, _lay(pp=2, vp=8, ep=32, mbs=2), gb300,
                    {"recompute_modules": ("mla_up_proj",)}, (mtp,), gbs=gbs),
            # GB300_BF16 replaces GB300_V1's layout knobs but keeps its pp_layout (16 chunks = PP4 x VP4)
            _bridge("deepseek_v3", "GB300", "bf16", _DS, _lay(pp=4, vp=4, ep=64), gb300,
                    {"recompute_modules": ("moe_act",)}, (cg_attn, mtp), gbs=gbs),
            _bridge("deepseek_v3", "GB300", "mxfp8", _DS, _lay(pp=2, vp=8, ep=32), {**gb300, "moe_a2a_overlap": True},
                    None, (cg_full,) + mx + (mtp,), gbs=gbs, notes=("GB300 FP8_MX: recompute_modules [] (none)",)),
            _bridge("deepseek_v3", "GB300", "nvfp4", _DS, _lay(pp=2, vp=8, ep=32), gb300, None, (cg_full,) + mx + (mtp,),
                    gbs=gbs, notes=("GB300 NVFP4 (FP8_MX's): recompute_modules [] (none)",)),
            _bridge("deepseek_v3", "B300", "bf16 fp8", _DS, _lay(pp=8, vp=2, ep=8), flex,
                    {"recompute_modules": ("mla_up_proj",)}, (cg_attn,), gbs=gbs),
            _bridge("deepseek_v3", "B300", "mxfp8", _DS, _lay(pp=8, vp=2, ep=8), {**flex, "moe_a2a_overlap": True},
                    {"recompute_modules": ("mla_up_proj",)}, (cg_full,) + mx, gbs=gbs),
            _bridge("deepseek_v3", "B300", "nvfp4", _DS, _lay(pp=8, vp=2, ep=8, mbs=2), flex,
                    {"recompute_modules": ("mla_up_proj",)}, (cg_attn,), gbs=gbs),
        ]
    # an earlier stored version of the same file (read_file id 52245127557; the tool shows no
    # commit): GB300 FP8_CS / FP8_MX / NVFP4 V1 and V2 all GB300_V1 (mbs 2, PP2 VP8 EP32, the same
    # pp_layout, recompute_modules ["mla_up_proj"]), the layout the GB300 MXFP8 rows of containers
    # 26.02 - 26.04.01 print; tried after the newer version (recipes_for: first whose layout matches)
    for gbs in (2048, 4096):
        out.append(_bridge("deepseek_v3", "GB300", "fp8 mxfp8 nvfp4", _DS_OLD, _lay(pp=2, vp=8, ep=32, mbs=2), gb300,
                           {"recompute_modules": ("mla_up_proj",)}, (mtp,), gbs=gbs))
    out += [
        _bridge("deepseek_v3", "B200", "bf16 fp8 mxfp8 nvfp4", _DS, _lay(pp=16, ep=8), flex,
                {"recompute_modules": ("mla_up_proj",)}, gbs=2048),
        _bridge("deepseek_v3", "B200", "bf16 fp8", _DS, _lay(pp=16, ep=8), flex,
                {"recompute_modules": ("mla_up_proj",)}, gbs=4096),
        _bridge("deepseek_v3", "B200", "mxfp8", _DS, _lay(pp=8, vp=2, ep=32), b200_v2,
                {"recompute_modules": ("mla_up_proj", "mlp")}, (cg_attn, mtp), gbs=4096),
        _bridge("deepseek_v3", "B200", "nvfp4", _DS, _lay(pp=8, vp=2, ep=32), b200_v2,
                {"recompute_modules": ("mla_up_proj", "layernorm", "moe_act")}, (mtp,), gbs=4096),
        # H100 V1 (GBS 8192) / V2 (16384): TP2 PP8 VP4 EP64, pp_layout "Et|(tt|)*30mL"
        _bridge("deepseek_v3", "H100", "bf16 fp8", _DS, _lay(tp=2, pp=8, vp=4, ep=64),
                {**flex, "pipeline_layout": "Et|(tt|)*30L"}, {"recompute_modules": ("mla_up_proj", "mlp")}, (mtp,)),
    ]
    # a later version (_DS_B300_V2): DEEPSEEK_V3_PRETRAIN_CONFIG_B300_V2 = B300_V1 (EP8, hybridep,
    # moe_a2a_overlap False, recompute_modules ["mla_up_proj"], no pp_layout) with GBS 4096, mbs 2, PP8,
    # VP None, recompute_modules ["mla_up_proj"], cuda_graph_impl transformer_engine scope attn,
    # moe_router, moe_preprocess; B300 BF16 / FP8_CS / FP8_MX / NVFP4 V2 all that preset. Keyed to the
    # containers whose B300 MXFP8 rows print its layout (rows 78, 125)
    out.append(_bridge("deepseek_v3", "B300", "mxfp8", _DS_B300_V2, _lay(pp=8, ep=8, mbs=2), flex,
                       {"recompute_modules": ("mla_up_proj",)}, (cg_attn,), gbs=4096,
                       containers=("NeMo container 26.04.01", "NeMo container 26.06")))
    return out


def _qwen3_30b_a3b() -> list[Recipe]:
    """The perf_matrix-era qwen3_30b_a3b_llm_pretrain.yaml (_QW3_YAML): ConfigContainer.model
    cross_entropy_fusion_impl "te", bias_activation_fusion true, recompute_granularity / method /
    num_layers null, moe_router_fusion true; perf_matrix h100 num_gpus_16: TP1 PP2 CP1 VP24 EP8 ETP1,
    GBS 512, cuda_graphs false, fsdp false, fp8_cs mbs 2 (bf16 mbs 1). Keyed to the containers whose
    H100 FP8 rows print that layout (rows 299: 25.11, 327: 25.09)."""
    return [_bridge("qwen3_30b_a3b", "H100", "fp8", _QW3_YAML, _lay(pp=2, vp=24, ep=8, mbs=2),
                    {"moe_router_fusion": True}, unmodelled=("model.bias_activation_fusion = True",), gbs=512,
                    containers=("NeMo container 25.09", "NeMo container 25.11"))]


def _gpt_oss_120b() -> list[Recipe]:
    """GPT_OSS_120B_PRETRAIN_CONFIG_{GPU}_{PREC}_V1 (GBS 512) / V2 (GBS 1280)."""
    rc = {"recompute_modules": ("layernorm", "moe_act")}
    cg = (CUDA_GRAPH.format("transformer_engine", "attn, moe_router, moe_preprocess"),)
    out = []
    for gbs in (512, 1280):
        v2 = gbs == 1280
        out += [
            _bridge("gpt_oss_120b", "GB200", "bf16 mxfp8" if not v2 else "bf16", _OSS, _lay(ep=64, mbs=4),
                    {"moe_a2a_overlap": v2}, rc, gbs=gbs),
            _bridge("gpt_oss_120b", "B200", "bf16 mxfp8", _OSS, _lay(ep=8 if v2 else 64, mbs=4), None, rc, gbs=gbs),
            _bridge("gpt_oss_120b", "GB300", "bf16 mxfp8" if not v2 else "bf16", _OSS, _lay(ep=64, mbs=4), None,
                    None, cg, gbs=gbs),
            _bridge("gpt_oss_120b", "B300", "bf16 mxfp8" if not v2 else "bf16", _OSS, _lay(ep=8 if v2 else 64, mbs=4),
                    {"moe_dispatcher": "flex"} if v2 else None, None, cg, gbs=gbs),
            _bridge("gpt_oss_120b", "H100", "bf16 fp8", _OSS, _lay(pp=4, ep=8), None, rc, gbs=gbs),
        ]
    # FP8_MX V2 (GB300 / GB200 / B300): hybridep, a2a overlap, recompute_modules [] (none)
    mx = {"moe_dispatcher": "flex", "moe_a2a_overlap": True}
    mx_un = (CUDA_GRAPH.format("full_iteration", "[]"), "cutedsl_fused_grouped_mlp = True")
    out += [_bridge("gpt_oss_120b", "GB300", "mxfp8", _OSS, _lay(ep=16, mbs=4), mx, None, mx_un, gbs=1280),
            _bridge("gpt_oss_120b", "GB200", "mxfp8", _OSS, _lay(ep=64, mbs=4), mx, None, mx_un, gbs=1280),
            _bridge("gpt_oss_120b", "B300", "mxfp8", _OSS, _lay(ep=8, mbs=4), mx, None, mx_un[1:], gbs=1280)]
    return out


# scripts/performance/configs/llama3/llama3_70b_llm_pretrain.py llama3_70b_h100_fp8_config: TP4 PP8
# VP5 mbs 1, tp_comm_overlap_cfg = userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192 (the base recipe's
# CommOverlapConfig(tp_comm_overlap=True)); no recompute, offloading or FSDP (scripts/performance/
# configs/llama/llama3_workload_base_configs.py LLAMA3_70B_PRETRAIN_CONFIG_H100_FP8_CS_V1/V2)
_H100 = [
    Recipe(BMB, "llama3_70b", "H100", RecipeSettings(
        {**BRIDGE, "tp_comm_overlap": True},
        BRIDGE_SRC + ", scripts/performance/configs/llama3/llama3_70b_llm_pretrain.py",
        notes=("HEAD's perf recipe (src/megatron/bridge/recipes/llama/h100/llama3.py llama3_70b_pretrain_64gpu_h100_"
               "fp8cs_config) sets pipeline_model_parallel_layout 'Et*2|(t*2|)*34,t*3|(t*2|)*3,tL': not carried "
               "(the rows' containers may predate it; pipeline rank 0, the fullest, holds the same chunks as the "
               "even split)",))),
    # src/megatron/bridge/recipes/llama/llama3.py llama31_405b_pretrain_config:
    # account_for_embedding_in_pipeline_split = True, account_for_loss_in_pipeline_split = True
    # (126 layers + 2 = 128 over PP8 x VP8); src/megatron/bridge/recipes/llama/h100/llama31.py
    # llama31_405b_pretrain_1024gpu_h100_fp8cs_config: TP8 PP8 CP2 VP8, userbuffers_fp8_h100_h16384_
    # tp8_cp2_mbs1_seqlen8192; scripts/performance/configs/llama/llama31_workload_base_configs.py
    # LLAMA31_405B_PRETRAIN_CONFIG_H100_FP8_CS_V1/V2: no recompute, offloading or FSDP
    Recipe(BMB, "llama3.1_405b", "H100", RecipeSettings(
        {**L405, "tp_comm_overlap": True}, BRIDGE_SRC + ", src/megatron/bridge/recipes/llama/h100/llama31.py")),
    # the FSDP rows (fsdp column 8, containers 25.09 / 25.11): scripts/performance/configs/llama3/
    # llama3_8b_llm_pretrain.py llama3_8b_h100_8gpus_fp8_config: for fp8_recipe "cs"
    # set_megatron_fsdp_overrides (ddp.use_megatron_fsdp, data_parallel_sharding_strategy =
    # "optim_grads_params"), ddp.keep_fp8_transpose_cache = True, ddp.nccl_ub = True,
    # model.gradient_accumulation_fusion = False; CP1 mbs 1; no recompute
    Recipe(BMB, "llama3_8b", "H100", RecipeSettings(
        {**BRIDGE, "gradient_accumulation_fusion": False},
        BRIDGE_SRC + ", scripts/performance/configs/llama3/llama3_8b_llm_pretrain.py",
        ("ddp.nccl_ub (NCCL user-buffer registration of the FSDP buffers)",
         "ddp.keep_fp8_transpose_cache = True")), fsdp=True),
    # NeMo 2.0 (container 25.02): scripts/performance/llm/pretrain_gpt3_175b.py with
    # recommended_model_configs/model_configs_h100.csv (gpt3 175b fp8 512 GPUs: TP4 PP8 VP6 mbs 2,
    # recompute_layers 0, activation_offload_layers 0, use_mcore_fsdp 0); nemo/collections/llm/recipes/
    # gpt3_175b.py pretrain_performance_optimizations: MegatronCommOverlapCallback(tp_comm_overlap=True,
    # defer_embedding_wgrad_compute=True, wgrad_deferral_limit=50); NeMo 2.0 GPTConfig
    # cross_entropy_loss_fusion = True: megatron-core's fused vocab-parallel cross entropy ("native")
    Recipe("nemo_framework_docs_perf_summary", "gpt3_175b", "H100", RecipeSettings(
        {"recompute": "none", "cross_entropy_impl": "native", "tp_comm_overlap": True},
        "NVIDIA/NeMo scripts/performance/llm/pretrain_gpt3_175b.py, scripts/performance/recommended_model_configs/"
        "model_configs_h100.csv, nemo/collections/llm/recipes/gpt3_175b.py",
        ("defer_embedding_wgrad_compute (wgrad_deferral_limit 50): the last stage keeps the output layer's "
         "input and output gradient of up to 50 micro-batches",))),
    # NeMo 24.07 (NeMo-Framework-Launcher launcher_scripts/conf/training/nemotron/nemotron_340b.yaml:
    # TP8 PP8 VP12 mbs 1, the row's layout): activations_checkpoint_granularity null,
    # cross_entropy_loss_fusion True (megatron-core's fused cross entropy, "native"), ub_tp_comm_overlap
    # True, defer_embedding_wgrad_compute True with wgrad_deferral_limit 22, fsdp False
    Recipe("nemo_2407_perf_summary", "nemotron4_340b", "H100", RecipeSettings(
        {"recompute": "none", "cross_entropy_impl": "native", "tp_comm_overlap": True},
        "NVIDIA/NeMo-Framework-Launcher launcher_scripts/conf/training/nemotron/nemotron_340b.yaml",
        ("defer_embedding_wgrad_compute (wgrad_deferral_limit 22): the last stage keeps the output layer's "
         "input and output gradient of up to 22 micro-batches",))),
]

# NeMo 2.0 Blackwell rows (nemo_framework_docs_perf_summary, containers 25.02 (B200) / 25.04 (GB200)):
# NVIDIA/NeMo scripts/performance/recommended_model_configs/model_configs_b200.csv @ 026c682ec2a262389f0ac13cccd45df99d6a902e
# and model_configs_gb200.csv @ 06c0e70057f272483a1a33c6bb5a9baf7be48cdc (pre_train, fp8 lines): the
# layout, cuda_graphs, use_mcore_fsdp, recompute_layers, activation_offload_layers (NeMo's
# cpu_offloading_num_layers), recompute_modules; NeMo 2.0 GPTConfig cross_entropy_loss_fusion = True
# (megatron-core's fused cross entropy, "native"). (model, layout, FSDP, cuda_graphs, pending)
_NEMO_CSV = {
    "B200": ("model_configs_b200.csv@026c682e", (
        ("gpt3_175b", _lay(tp=4, pp=4, vp=6, mbs=2), False, 0, None),  # the 512-GPU line
        ("llama3_8b", _lay(mbs=2), False, 1, None),
        ("llama3_70b", _lay(tp=2, pp=4, cp=2, vp=5), False, 1, None),
        ("llama3.1_405b", _lay(tp=4, pp=8, cp=2, vp=8), False, 0, None),
        ("nemotron4_15b", _lay(mbs=2), False, 1, None),
        ("nemotron4_340b", _lay(tp=8, pp=4, vp=12), False, 1, None),
        ("mixtral_8x7b", _lay(ep=8, mbs=2), False, 1, None),
        # gbs 64, mbs 1: what row 630 prints swapped (models/published.py read_batch)
        ("mixtral_8x22b", _lay(tp=2, pp=4, cp=8, ep=8, vp=14), False, 0, None))),
    "GB200": ("model_configs_gb200.csv@06c0e700", (
        ("gpt3_175b", _lay(tp=4, pp=4, vp=12, mbs=2), False, 1, None),
        ("llama3_8b", _lay(mbs=4), False, 1, None),
        ("llama3_70b", _lay(), True, 0, None),
        ("llama3.1_405b", _lay(tp=2), True, 0, {"cpu_offload_layers": 95}),
        ("nemotron4_15b", _lay(mbs=2), False, 1, None),
        ("nemotron4_340b", _lay(tp=8, pp=4, vp=12), False, 1, None),
        ("mixtral_8x7b", _lay(ep=8, mbs=2), False, 1, None))),
}


def _nemo_blackwell() -> list[Recipe]:
    out = []
    for gpu, (src, lines) in _NEMO_CSV.items():
        for model, lay, fsdp, graphs, pending in lines:
            out.append(Recipe("nemo_framework_docs_perf_summary", model, gpu, RecipeSettings(
                {"recompute": "none", "cross_entropy_impl": "native"},
                "NVIDIA/NeMo scripts/performance/recommended_model_configs/" + src,
                ("cuda_graphs 1 (graph-captured static buffers)",) if graphs else (), pending=pending or {},
                layout=lay), fsdp=fsdp, precisions=frozenset({"fp8"})))
    return out


RECIPES: tuple[Recipe, ...] = tuple(_H100 + _llama3_70b() + _llama31_405b() + _deepseek_v3() + _gpt_oss_120b()
                                    + _qwen3_30b_a3b() + _nemo_blackwell())


# What each source's software ran where neither the row nor a recipe read for it says, from the
# software's own defaults at the source's date: {source_group: (TrainConfig fields, why)}. A row's
# recipe (RECIPES) wins over these.
SOURCE_DEFAULTS: dict[str, tuple[dict, str]] = {
    # NeMo 1.0 (the NeMo-Framework-Launcher configs of containers 24.03 / 24.07) and NeMo 2.0 (GPTConfig,
    # containers 25.x) set cross_entropy_loss_fusion True with megatron-core's only fused implementation
    # then, fused_vocab_parallel_cross_entropy ("native"; cross_entropy_fusion_impl "te" came in 2025,
    # and NeMo 2.0 keeps megatron-core's default, "native")
    "nemo_2407_perf_summary": ({"cross_entropy_impl": "native"}, "NeMo 24.07: cross_entropy_loss_fusion True, "
                               "megatron-core's fused vocab-parallel cross entropy (no TE implementation then)"),
    "nemo_long_sequence_cp": ({"cross_entropy_impl": "native"}, "NeMo 24.03: cross_entropy_loss_fusion True, "
                              "megatron-core's fused vocab-parallel cross entropy (no TE implementation then)"),
    "nemo_framework_docs_perf_summary": ({"cross_entropy_impl": "native"}, "NeMo 2.0 GPTConfig: "
                                         "cross_entropy_loss_fusion True, cross_entropy_fusion_impl native"),
    # Megatron-Core r0.8.0 (2024): the README names its flags (the DP / TP / PP overlaps), not
    # --cross-entropy-loss-fusion: Megatron-LM's default, the unfused vocab-parallel cross entropy
    "megatron_lm_readme_h100_weak_scaling": ({"cross_entropy_impl": "unfused"}, "Megatron-Core r0.8.0: "
                                             "--cross-entropy-loss-fusion not among the README's flags (Megatron-LM's "
                                             "default, unfused)"),
}


def recipes_for(source_group: str, model_key: str, gpu_type: str, fsdp: bool, precision: str = "",
                container: str = "", gbs: int | None = None) -> list[RecipeSettings]:
    """Every RECIPES entry of a row, newest read version first (the loader takes the first whose
    layout is the row's)."""
    return [r.settings for r in RECIPES if r.matches(source_group, model_key, gpu_type, fsdp, precision, container, gbs)]


def recipe_settings(source_group: str, model_key: str, gpu_type: str, fsdp: bool, precision: str = "",
                    container: str = "", gbs: int | None = None) -> RecipeSettings | None:
    """The RECIPES entry of a row (None: none read). `precision` is a `precision_class`; an entry
    keyed by precision, container or global batch matches only rows that give them."""
    return next(iter(recipes_for(source_group, model_key, gpu_type, fsdp, precision, container, gbs)), None)
