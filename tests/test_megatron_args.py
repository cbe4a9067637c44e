"""Config -> megatron-core TransformerConfig kwargs / Megatron-LM args, and the refusal rules
(pure, no torch)."""
from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest

from advisor.catalog import load_model
from advisor.catalog.specs import ModelSpec, MoESpec, TrainConfig
from advisor.runners import megatron_args as MA

LLAMA = load_model("llama3-8b").with_layers(8)
MIXTRAL = load_model("mixtral-8x7b").with_layers(4)
GPT = ModelSpec(name="gpt3-2.7b", num_layers=8, hidden_size=2560, ffn_hidden_size=10240,
                num_attention_heads=32, vocab_size=50257, activation="gelu", normalization="layernorm",
                position_embedding="learned", max_position_embeddings=2048, add_bias_linear=True,
                tied_embeddings=True)


def test_llama_kwargs():
    kw = MA.transformer_config_kwargs(LLAMA, TrainConfig(tp=2, pp=2, dp=1, vp=2, mbs=1, gbs=8))
    json.dumps(kw)  # plain JSON: travels to the worker
    assert kw["num_layers"] == 8 and kw["hidden_size"] == 4096 and kw["ffn_hidden_size"] == 14336
    assert kw["num_attention_heads"] == 32 and kw["num_query_groups"] == 8 and kw["kv_channels"] == 128
    assert kw["normalization"] == "RMSNorm" and kw["gated_linear_unit"] and kw["activation_func"] == "silu"
    assert kw["tensor_model_parallel_size"] == 2 and kw["pipeline_model_parallel_size"] == 2
    assert kw["virtual_pipeline_model_parallel_size"] == 2
    assert kw["transformer_impl"] == "local" and kw["bf16"] and kw["params_dtype"] == "bfloat16"
    assert not kw["add_bias_linear"] and not kw["gradient_accumulation_fusion"]
    assert "recompute_granularity" not in kw and "num_moe_experts" not in kw


def test_gpt_and_recompute_kwargs():
    kw = MA.transformer_config_kwargs(GPT, TrainConfig(recompute="selective"))
    assert kw["normalization"] == "LayerNorm" and kw["activation_func"] == "gelu"
    assert not kw["gated_linear_unit"] and kw["add_bias_linear"] and kw["add_qkv_bias"]
    assert kw["virtual_pipeline_model_parallel_size"] is None
    assert kw["recompute_granularity"] == "selective" and kw["recompute_modules"] == ["core_attn"]
    full = MA.transformer_config_kwargs(GPT, TrainConfig(recompute="full"))
    assert (full["recompute_granularity"], full["recompute_method"], full["recompute_num_layers"]) == (
        "full", "uniform", 1)
    mk = MA.model_kwargs(GPT, TrainConfig(tp=4, seq=4096))
    assert mk["position_embedding_type"] == "learned_absolute" and mk["share_embeddings_and_output_weights"]
    assert mk["vocab_size"] == 50688 and mk["vocab_size"] % 512 == 0 and mk["max_sequence_length"] == 4096


def test_moe_kwargs_and_dense_first_layers():
    kw = MA.transformer_config_kwargs(MIXTRAL, TrainConfig(ep=4, dp=4))
    assert kw["num_moe_experts"] == 8 and kw["moe_router_topk"] == 2 and kw["moe_ffn_hidden_size"] == 14336
    assert kw["moe_grouped_gemm"] is False and kw["expert_model_parallel_size"] == 4
    assert "moe_layer_freq" not in kw  # every layer is MoE
    m = ModelSpec(name="ds", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                  vocab_size=100, moe=MoESpec(num_experts=4, top_k=2, ffn_hidden_size=32,
                                              first_dense_layers=1, shared_ffn_hidden_size=64))
    kw = MA.transformer_config_kwargs(m, TrainConfig())
    assert kw["moe_layer_freq"] == [0, 1, 1, 1] and kw["moe_shared_expert_intermediate_size"] == 64
    args = MA.megatron_lm_args(m, TrainConfig(), runner=True)
    assert args[args.index("--moe-layer-freq") + 1] == "[0,1,1,1]"
    te = MA.megatron_lm_args(m, TrainConfig())  # production: run-length form Megatron evaluates
    assert te[te.index("--moe-layer-freq") + 1] == "[0]+[1]*3"


def test_megatron_lm_args_runner():
    cfg = TrainConfig(tp=2, pp=2, vp=2, dp=1, mbs=1, gbs=8, recompute="full")
    s = MA.megatron_lm_args_string(LLAMA, cfg, runner=True)
    assert s == MA.megatron_lm_args_string(LLAMA, cfg, impl="local")
    a = shlex.split(s)
    assert a[a.index("--tensor-model-parallel-size") + 1] == "2"
    assert a[a.index("--num-virtual-stages-per-pipeline-rank") + 1] == "2"
    assert a[a.index("--num-query-groups") + 1] == "8"
    for flag in ("--swiglu", "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce",
                 "--transformer-impl", "--untie-embeddings-and-output-weights", "--disable-bias-linear"):
        assert flag in a
    assert a[a.index("--recompute-granularity") + 1] == "full"
    assert a[a.index("--transformer-impl") + 1] == "local" and "--mock-data" in a
    assert a[a.index("--train-iters") + 1] == "20" and "--no-rope-fusion" in a
    sel = MA.megatron_lm_args(LLAMA, TrainConfig(recompute="selective"), 5, runner=True)
    assert sel[sel.index("--recompute-modules") + 1] == "core_attn"
    assert sel[sel.index("--train-iters") + 1] == "5"
    g = MA.megatron_lm_args(GPT, TrainConfig(distributed_optimizer=False), runner=True)
    assert "--swiglu" not in g and "--use-distributed-optimizer" not in g
    assert "--overlap-param-gather" not in g  # only with the distributed optimizer
    assert g[g.index("--position-embedding-type") + 1] == "learned_absolute"


def test_mla_and_moe_knobs_reach_the_worker():
    """MLA runs (MLATransformerConfig kwargs); dispatcher, router and grouped GEMM reach the job."""
    ds = load_model("deepseek-v3").with_layers(4)
    cfg = TrainConfig(moe_dispatcher="allgather", moe_router="forced", moe_grouped_gemm=False)
    assert MA.refusal_reason(ds, cfg) is None
    kw = MA.transformer_config_kwargs(ds, cfg)
    assert kw["multi_latent_attention"] and kw["q_lora_rank"] == 1536 and kw["kv_lora_rank"] == 512
    assert kw["moe_token_dispatcher_type"] == "allgather" and kw["moe_router_force_load_balancing"]
    assert MA.moe_job_keys(ds, cfg)["moe_experts"] == "sequential"
    assert MA.moe_job_keys(ds, TrainConfig())["moe_experts"] == "grouped"
    assert MA.moe_job_keys(LLAMA, TrainConfig()) == {}
    te = MA.megatron_lm_args(ds, cfg)
    assert "--moe-grouped-gemm" not in te and "--moe-router-force-load-balancing" in te
    assert te[te.index("--moe-token-dispatcher-type") + 1] == "allgather"
    assert "--moe-grouped-gemm" in MA.megatron_lm_args(ds, TrainConfig())


@pytest.mark.parametrize("model,cfg,world,needle", [
    (LLAMA, TrainConfig(precision="fp8"), None, "fp8 needs Transformer Engine"),
    (LLAMA, TrainConfig(tp=2, sequence_parallel=True), None, "sequence_parallel"),
    (LLAMA, TrainConfig(cp=2), None, "context parallelism"),
    (LLAMA, TrainConfig(tp_comm_overlap=True), None, "tp_comm_overlap"),
    (LLAMA, TrainConfig(tp=2, dp=1), 4, "world size 4"),
    (LLAMA, TrainConfig(dp=4, mbs=2, gbs=12), None, "gbs=12"),
    (GPT, TrainConfig(tp=3), None, "attention heads"),
    (LLAMA.with_layers(6), TrainConfig(pp=4), None, "6 layers"),
    (LLAMA, TrainConfig(pp=2, vp=3, gbs=8), None, "vp=3 does not divide the 4 layers"),
    (LLAMA, TrainConfig(vp=2), None, "needs pp ≥ 2"),
    (LLAMA, TrainConfig(pp=4, vp=2, mbs=1, gbs=2), None, "multiple of pp"),
    (MIXTRAL, TrainConfig(ep=3, dp=3, gbs=3), None, "ep=3 does not divide the 8 experts"),
    (MIXTRAL, TrainConfig(tp=2, dp=2, ep=2, gbs=2), None, "sequence parallelism"),
    (MIXTRAL, TrainConfig(ep=4, dp=2, gbs=2), None, "does not divide"),
    (LLAMA, TrainConfig(ep=2, dp=2, gbs=2), None, "mixture-of-experts"),
    (LLAMA, TrainConfig(pp=2, pp_first_layers=9), None, "does not add up to 8 layers"),
    # megatron divides num_query_groups by tp: 8 KV groups cannot go over tp=16
    (LLAMA, TrainConfig(tp=16), None, "tp=16 does not divide the 8 KV groups"),
    (GPT, TrainConfig(seq=4096), None, "2048 learned positions"),
    (ModelSpec(name="odd-ffn", num_layers=2, hidden_size=256, ffn_hidden_size=1004,
               num_attention_heads=8, vocab_size=1000), TrainConfig(tp=8), None,
     "does not divide the FFN size 1004"),
])
def test_refusals(model, cfg, world, needle):
    reason = MA.refusal_reason(model, cfg, world)
    assert reason and needle in reason and "\n" not in reason
    with pytest.raises(MA.RefusedError):
        MA.check_runnable(model, cfg, world)


@pytest.mark.parametrize("model,cfg", [
    (LLAMA, TrainConfig(tp=2, pp=2, dp=1, mbs=1, gbs=8)),
    (LLAMA, TrainConfig(pp=4, vp=2, mbs=1, gbs=8)),
    (LLAMA, TrainConfig(tp=4, mbs=4, gbs=32, recompute="full")),
    (LLAMA, TrainConfig(pp=3, pp_first_layers=2, pp_last_layers=2, dp=1)),
    (MIXTRAL, TrainConfig(ep=4, dp=4, mbs=1, gbs=16)),
    (GPT, TrainConfig(dp=4, mbs=8, gbs=64, seq=2048)),
])
def test_runnable(model, cfg):
    assert MA.refusal_reason(model, cfg, cfg.world_size) is None


def test_padded_vocab_and_effective_config():
    assert MA.padded_vocab_size(128256, 1) == 128256 and MA.padded_vocab_size(32000, 3) == 32256
    assert MA.padded_vocab_size(32000, 8) == 32768
    c = MA.effective_config(TrainConfig(distributed_optimizer=False))
    assert c.overlap_param_gather is False
    assert MA.ddp_kwargs(TrainConfig())["use_distributed_optimizer"] is True


# ------------------------------------------------------------------ production (Transformer Engine)
DEEPSEEK = load_model("deepseek-v3").with_layers(8)
USERS_OWN = ("--mock-data", "--tokenizer-type", "--train-iters", "--lr", "--weight-decay", "--clip-grad",
             "--optimizer", "--use-flash-attn", "--vocab-size", "--recompute-modules",
             "--moe-aux-loss-coeff", "--moe-router-load-balancing-type")


def _val(a, flag):
    return a[a.index(flag) + 1]


def test_production_args_are_transformer_engine_without_runner_choices():
    cfg = TrainConfig(tp=2, pp=2, vp=2, dp=2, mbs=2, gbs=64, seq=8192, recompute="selective")
    a = MA.megatron_lm_args(LLAMA, cfg)
    assert a == shlex.split(MA.megatron_lm_args_string(LLAMA, cfg))
    assert _val(a, "--transformer-impl") == "transformer_engine" and "--bf16" in a
    for flag in USERS_OWN:
        assert flag not in a, flag
    assert not [x for x in a if x.startswith("--no-") and x.endswith("-fusion")]
    assert (_val(a, "--tensor-model-parallel-size"), _val(a, "--pipeline-model-parallel-size"),
            _val(a, "--context-parallel-size"), _val(a, "--num-virtual-stages-per-pipeline-rank")) == (
        "2", "2", "1", "2")
    assert (_val(a, "--micro-batch-size"), _val(a, "--global-batch-size"), _val(a, "--seq-length")) == (
        "2", "64", "8192")
    assert _val(a, "--recompute-granularity") == "selective"  # megatron's default module: core_attn
    assert _val(a, "--num-query-groups") == "8" and "--swiglu" in a and "--disable-bias-linear" in a
    for flag in ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"):
        assert flag in a
    assert "--fp8-format" not in a and "--sequence-parallel" not in a and "--num-experts" not in a
    assert "--expert-model-parallel-size" not in a  # dense model


def test_production_args_fp8_sp_overlap_full_recompute_uneven_pipeline():
    cfg = TrainConfig(tp=4, pp=3, dp=1, precision="fp8", sequence_parallel=True, tp_comm_overlap=True,
                      recompute="full", pp_first_layers=2, pp_last_layers=2, gbs=8)
    a = MA.megatron_lm_args(LLAMA, cfg)
    i = a.index("--fp8-format")
    assert a[i:i + 6] == ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
                          "--fp8-amax-compute-algo", "max"] and "--bf16" in a
    assert "--sequence-parallel" in a and "--tp-comm-overlap" in a
    assert (_val(a, "--recompute-granularity"), _val(a, "--recompute-method"),
            _val(a, "--recompute-num-layers")) == ("full", "uniform", "1")
    assert (_val(a, "--decoder-first-pipeline-num-layers"),
            _val(a, "--decoder-last-pipeline-num-layers")) == ("2", "2")
    # Megatron-LM asserts --overlap-param-gather comes with --overlap-grad-reduce (and dist. opt.)
    b = MA.megatron_lm_args(LLAMA, TrainConfig(overlap_grad_reduce=False))
    assert "--overlap-param-gather" not in b and "--overlap-grad-reduce" not in b
    c = MA.megatron_lm_args(LLAMA, TrainConfig(distributed_optimizer=False))
    assert "--overlap-param-gather" not in c and "--use-distributed-optimizer" not in c
    with pytest.raises(MA.SpecError):
        MA.megatron_lm_args(LLAMA, cfg, impl="apex")


def test_production_args_mla_and_moe():
    a = MA.megatron_lm_args(DEEPSEEK, TrainConfig(ep=8, dp=8, etp=1, gbs=64))
    m = DEEPSEEK.mla
    assert "--multi-latent-attention" in a
    assert (_val(a, "--q-lora-rank"), _val(a, "--kv-lora-rank"), _val(a, "--qk-head-dim"),
            _val(a, "--qk-pos-emb-head-dim"), _val(a, "--v-head-dim")) == tuple(
        str(x) for x in (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim))
    assert (_val(a, "--num-experts"), _val(a, "--moe-router-topk"), _val(a, "--moe-ffn-hidden-size"),
            _val(a, "--moe-shared-expert-intermediate-size")) == ("256", "8", "2048", "2048")
    assert _val(a, "--moe-layer-freq") == "[0]*3+[1]*5"  # 3 dense layers kept in the proxy
    assert "--moe-grouped-gemm" in a and _val(a, "--moe-token-dispatcher-type") == "alltoall"
    assert (_val(a, "--expert-model-parallel-size"), _val(a, "--expert-tensor-parallel-size")) == ("8", "1")
    mx = MA.megatron_lm_args(MIXTRAL, TrainConfig(ep=4, dp=4))
    assert "--moe-layer-freq" not in mx and "--multi-latent-attention" not in mx
    no_q_compression = dataclasses.replace(DEEPSEEK, mla=dataclasses.replace(m, q_lora_rank=0))
    assert "--q-lora-rank" not in MA.megatron_lm_args(no_q_compression, TrainConfig(ep=8, dp=8))


# ----------------------------------------------- every flag we emit exists in megatron-core 0.19
WHEELS = sorted((Path(__file__).resolve().parents[1] / ".whl").glob("megatron_core-*.whl"))


def _megatron_lm_flags(wheel: Path) -> dict[str, set | None]:
    """{flag: allowed values or None} of the Megatron-LM parser in the wheel's
    megatron/training/arguments.py: literal add_argument(...) flags, and the flags
    ArgumentGroupFactory derives from dataclass fields (its naming rules, emulated on the AST:
    --field-name; bool fields not defaulting to False become --no-x / --disable-x; argparse_meta
    arg_names win; Literal[...] gives the choices)."""
    import ast
    import zipfile

    z = zipfile.ZipFile(wheel)
    tree = ast.parse(z.read("megatron/training/arguments.py").decode())
    flags: dict[str, set | None] = {}
    owner: dict[int, ast.AST] = {}
    local_lists: dict[int, dict[str, set]] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            env = local_lists.setdefault(id(fn), {})
            for n in ast.walk(fn):
                owner[id(n)] = fn
                if (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
                        and isinstance(n.value, (ast.List, ast.Tuple))):
                    env[n.targets[0].id] = {e.value for e in n.value.elts if isinstance(e, ast.Constant)}

    def consts(node):
        return {e.value for e in node.elts if isinstance(e, ast.Constant)} if isinstance(
            node, (ast.List, ast.Tuple)) else None

    factories = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name == "add_argument":
            choices = next((consts(k.value) for k in node.keywords if k.arg == "choices"), None)
            for x in node.args:
                if isinstance(x, ast.Constant) and isinstance(x.value, str) and x.value.startswith("--"):
                    flags[x.value] = choices
        elif name == "ArgumentGroupFactory" and node.args and isinstance(node.args[0], ast.Name):
            excl: set = set()
            for k in node.keywords:
                if k.arg == "exclude":
                    excl = (local_lists.get(id(owner.get(id(node))), {}).get(k.value.id, set())
                            if isinstance(k.value, ast.Name) else consts(k.value) or set())
            factories.append((node.args[0].id, excl))
    classes: dict[str, ast.ClassDef] = {}
    for n in z.namelist():
        if n.startswith("megatron/") and n.endswith(".py"):
            src = z.read(n).decode("utf-8", "replace")
            if "@dataclass" in src:
                for c in ast.parse(src).body:
                    if isinstance(c, ast.ClassDef):
                        classes.setdefault(c.name, c)

    def fields(name, seen=()):
        c = classes.get(name)
        if c is None or name in seen:
            return {}
        out = {}
        for b in c.bases:
            out.update(fields(getattr(b, "id", getattr(b, "attr", None)), seen + (name,)))
        for st in c.body:
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) \
                    and "ClassVar" not in ast.unparse(st.annotation):
                out[st.target.id] = st
        return out

    for cls, excl in factories:
        fs = fields(cls)
        assert fs, f"dataclass {cls} not found in the wheel"
        for fname, st in fs.items():
            if fname in excl:
                continue
            default, names, value = None, None, st.value
            if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
                kw = {k.arg: k.value for k in value.keywords}
                if isinstance(kw.get("init"), ast.Constant) and kw["init"].value is False:
                    continue
                if isinstance(kw.get("default"), ast.Constant):
                    default = kw["default"].value
                meta = kw.get("metadata")
                for k, v in zip(getattr(meta, "keys", []), getattr(meta, "values", [])):
                    if getattr(k, "value", None) == "argparse_meta":
                        for k2, v2 in zip(getattr(v, "keys", []), getattr(v, "values", [])):
                            if getattr(k2, "value", None) == "arg_names":
                                names = sorted(consts(v2))
            elif isinstance(value, ast.Constant):
                default = value.value
            ann = ast.unparse(st.annotation).replace(" ", "")
            choices = None
            for sub in ast.walk(st.annotation):
                if isinstance(sub, ast.Subscript) and getattr(sub.value, "id", None) == "Literal":
                    sl = sub.slice
                    choices = consts(sl) if isinstance(sl, ast.Tuple) else {sl.value}
            dashed = fname.replace("_", "-")
            if names:
                new = names
            elif ann in ("bool", "Optional[bool]", "bool|None") and default is not False:
                new = [f"--no-{dashed}", f"--disable-{dashed}"]
            else:
                new = [f"--{dashed}"]
            for f in new:
                flags[f] = choices
    return flags


@pytest.mark.skipif(not WHEELS, reason="no megatron-core wheel in .whl/")
def test_every_emitted_flag_exists_in_megatron_core_wheel():
    known = _megatron_lm_flags(WHEELS[-1])
    # the emulation finds both kinds of flags, and nothing made up
    for f in ("--tensor-model-parallel-size", "--num-experts", "--fp8-format", "--disable-bias-linear",
              "--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage"):
        assert f in known, f
    assert "--virtual-pipeline-model-parallel-size" not in known  # excluded in arguments.py
    hf = Path(__file__).parent / "data" / "hf_configs"
    models = [LLAMA, MIXTRAL, GPT, DEEPSEEK, load_model("nemotron4-15b").with_layers(4),
              load_model("qwen3-30b-a3b").with_layers(4)] + [
        load_model(str(hf / f)).with_layers(12) for f in (
            "gemma-2-9b.json", "gemma-3-27b.json", "llama-4-maverick.json", "glm-4.5.json", "gpt-oss-120b.json",
            "phi-3-mini-4k.json", "olmo-2-7b.json", "granite-3.1-3b-a800m.json")]
    cfgs = [TrainConfig(), TrainConfig(tp=2, pp=2, vp=2, recompute="selective"),
            TrainConfig(tp=4, pp=3, precision="fp8", sequence_parallel=True, tp_comm_overlap=True,
                        recompute="full", pp_first_layers=2, pp_last_layers=2, cp=2, ep=2, etp=2),
            TrainConfig(distributed_optimizer=False, overlap_grad_reduce=False),
            TrainConfig(pp=2, vp=2, account_for_embedding=True, account_for_loss=True),
            TrainConfig(pp=2, vp=2, pipeline_layout="Et|(t|)*2tL"),
            TrainConfig(dp=4, fsdp=True, precision="fp8", fp8_param_gather=True)]
    emitted = 0
    for m in models:
        for c in cfgs:
            for kw in ({}, {"runner": True}):
                a = MA.megatron_lm_args(m, c, **kw)
                for i, x in enumerate(a):
                    if not x.startswith("--"):
                        continue
                    assert x in known, f"{x} is not a Megatron-LM argument ({m.name}, {kw})"
                    choices = known[x]
                    if choices is not None and i + 1 < len(a) and not a[i + 1].startswith("--"):
                        assert a[i + 1] in {str(v) for v in choices}, (x, a[i + 1], choices)
                    emitted += 1
    assert emitted > 500


def test_issue24_moe_knobs_print_as_megatron_0_19_flags():
    """Capacity factor and padding, the flex dispatcher with DeepEP, the 1F1B all-to-all overlap,
    shared-expert overlap and router fusion: in the production args, the layout-only args, the
    runner's args and the TransformerConfig kwargs (field names of megatron-core 0.19's
    TransformerConfig / ModelParallelConfig, from which Megatron-LM builds these flags)."""
    ds = load_model("deepseek-v3").with_layers(4)
    cfg = TrainConfig(dp=8, ep=8, gbs=64, moe_dispatcher="flex", moe_capacity_factor=1.25,
                      moe_a2a_overlap=True, moe_router_fusion=True, moe_permute_fusion=True)
    for a in (MA.megatron_lm_args(ds, cfg), MA.layout_args(cfg)):
        assert _val(a, "--moe-token-dispatcher-type") == "flex"
        assert _val(a, "--moe-flex-dispatcher-backend") == "deepep"
        assert _val(a, "--moe-expert-capacity-factor") == "1.25"
        assert "--moe-pad-expert-input-to-capacity" not in a
        assert "--overlap-moe-expert-parallel-comm" in a and "--delay-wgrad-compute" in a
        assert "--moe-router-fusion" in a and "--moe-shared-expert-overlap" not in a
        assert "--moe-permute-fusion" in a
    pad = TrainConfig(dp=8, ep=8, gbs=64, moe_capacity_factor=1.0, moe_pad_to_capacity=True,
                      moe_shared_expert_overlap=True)
    a = MA.megatron_lm_args(ds, pad, runner=True)
    assert "--moe-pad-expert-input-to-capacity" in a and "--moe-shared-expert-overlap" in a
    assert _val(a, "--moe-token-dispatcher-type") == "alltoall" and "--moe-flex-dispatcher-backend" not in a
    kw = MA.transformer_config_kwargs(ds, cfg, stack="te")
    assert kw["moe_token_dispatcher_type"] == "flex" and kw["moe_flex_dispatcher_backend"] == "deepep"
    assert kw["moe_expert_capacity_factor"] == 1.25 and not kw["moe_pad_expert_input_to_capacity"]
    assert kw["overlap_moe_expert_parallel_comm"] and kw["delay_wgrad_compute"] and kw["moe_router_fusion"]
    assert kw["moe_permute_fusion"]
    # defaults print nothing new
    plain = MA.megatron_lm_args(ds, TrainConfig(dp=8, ep=8, gbs=64))
    assert not {"--moe-expert-capacity-factor", "--overlap-moe-expert-parallel-comm", "--moe-router-fusion",
                "--moe-flex-dispatcher-backend", "--moe-permute-fusion"} & set(plain)
    # the runner's machines have no DeepEP; the local stack has no fused router
    assert "DeepEP" in MA.refusal_reason(ds, cfg, stack="te")
    assert "Transformer Engine" in MA.refusal_reason(ds, TrainConfig(dp=8, ep=8, gbs=64, moe_router_fusion=True))
    assert "Transformer Engine" in MA.refusal_reason(ds, TrainConfig(dp=8, ep=8, gbs=64, moe_permute_fusion=True))


@pytest.mark.parametrize("changes,needle", [
    ({"moe_pad_to_capacity": True}, "needs moe_capacity_factor"),
    ({"moe_capacity_factor": 0.0}, "positive number"),
    ({"moe_capacity_factor": float("nan")}, "positive number"),
    ({"moe_a2a_overlap": 1}, "true or false"),
    ({"moe_dispatcher": "deepep"}, "alltoall, allgather, flex"),
])
def test_moe_knob_values_are_checked(changes, needle):
    with pytest.raises(MA.SpecError, match=needle):
        TrainConfig(**changes)


@pytest.mark.parametrize("changes,needle", [
    ({"moe_dispatcher": "flex", "moe_capacity_factor": 1.0, "moe_pad_to_capacity": True}, "does not pad"),
    ({"moe_a2a_overlap": True, "ep": 1}, "needs ep > 1"),
    ({"moe_a2a_overlap": True, "moe_dispatcher": "allgather"}, "alltoall or flex"),
    ({"moe_a2a_overlap": True, "recompute": "full"}, "full recompute"),
    ({"moe_a2a_overlap": True, "pp": 2, "dp": 4}, "vp > 1"),
    ({"moe_a2a_overlap": True, "moe_shared_expert_overlap": True}, "excludes shared-expert"),
    ({"moe_shared_expert_overlap": True, "moe_dispatcher": "allgather"}, "alltoall or flex"),
])
def test_moe_knob_combinations_megatron_refuses(changes, needle):
    from advisor.search_spaces.layout import violations

    base = dict(dp=8, ep=8, gbs=64)
    cfg = TrainConfig(**{**base, **changes})
    assert any(needle in v for v in violations(load_model("deepseek-v3").with_layers(8), None, cfg))


def test_gpt_oss_features_reach_the_runner_and_the_args():
    """gpt-oss's clamped quick-GeGLU, sliding window on every other layer and learned sinks: the te
    runner's TransformerConfig carries all three (TE's DotProductAttention takes the window and the
    softmax type; megatron-core's quick_gelu with glu_linear_offset 1 and the clamp), the local
    spec's SDPA gets neither attention feature, and the printed args say --quick-geglu (with its
    offset and clamp) instead of --swiglu."""
    oss = load_model("gpt-oss-120b").with_layers(4)
    assert oss.activation_clamp == 7.0
    cfg = TrainConfig(ep=8, dp=8)
    te = MA.transformer_config_kwargs(oss, cfg, "te")
    assert te["activation_func"] == "quick_gelu" and te["gated_linear_unit"]
    assert (te["glu_linear_offset"], te["activation_func_clamp_value"]) == (1.0, 7.0)
    assert te["window_size"] == (127, 0) and te["window_attn_skip_freq"] == [1, 0, 1, 0]
    assert te["softmax_type"] == "learnable" and te["bias_activation_fusion"]
    local = MA.transformer_config_kwargs(oss, cfg, "local")
    assert "window_size" not in local and "softmax_type" not in local
    a = MA.megatron_lm_args(oss, cfg)
    i = a.index("--quick-geglu")
    assert a[i + 1:i + 5] == ["--glu-linear-offset", "1.0", "--activation-func-clamp-value", "7"]
    assert "--swiglu" not in a
    plain = dataclasses.replace(oss, activation_clamp=0.0, attention_sinks=False, window_size=0, window_pattern=())
    kw = MA.transformer_config_kwargs(plain, cfg, "te")
    assert kw["activation_func"] == "silu" and "glu_linear_offset" not in kw and "window_size" not in kw
    assert "--swiglu" in MA.megatron_lm_args(plain, cfg)


def test_activation_clamp_is_checked():
    base = load_model("llama3-8b")
    with pytest.raises(Exception, match="activation_clamp must be a non-negative number"):
        dataclasses.replace(base, activation_clamp=-1.0)
    with pytest.raises(Exception, match="activation_clamp needs the gated activation"):
        dataclasses.replace(load_model("nemotron4-15b"), activation_clamp=7.0)
