"""The built-in catalog, its loaders, HF config.json parsing and cluster strings."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from advisor.catalog.errors import CatalogNote
from advisor.catalog import (
    CatalogError,
    ClusterSpec,
    GPUSpec,
    ModelSpec,
    SpecError,
    list_clusters,
    list_gpus,
    list_models,
    load_cluster,
    load_gpu,
    load_model,
    model_from_hf_config,
)

HF = Path(__file__).parent / "data" / "hf_configs"

REQUIRED_MODELS = [
    "llama3-8b", "llama3-70b", "llama3.1-405b", "gpt3-175b", "mixtral-8x7b", "mixtral-8x22b",
    "nemotron4-15b", "nemotron4-340b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "gpt-oss-120b",
]
REQUIRED_GPUS = ["a100-80g", "h100", "h200", "b200", "mi250x", "mi300x"]
GPU_NUMBERS = [f.name for f in dataclasses.fields(GPUSpec)
               if f.name not in ("name", "vendor", "sources", "max_operating_temp_c", "max_sm_clock_mhz",
                                 "nvlink_domain_gpus", "fp4_tflops", "sfu_exp_tera_per_s", "dynamic_power_w",
                                 "sm_count", "host_link_gbs", "hbm_power_scale")]


def arch(m: ModelSpec) -> dict:
    """Everything but the name and the source."""
    d = m.to_dict()
    d.pop("name"), d.pop("source")
    return d


# ------------------------------------------------------------------------------------ catalog data
def test_required_models_present_and_sourced():
    names = {m.name for m in list_models()}
    assert set(REQUIRED_MODELS) <= names
    for m in list_models():
        assert isinstance(m, ModelSpec)
        assert m.source.strip(), m.name
        assert load_model(m.name) is m


def test_required_gpus_present_and_every_number_sourced():
    names = {g.name for g in list_gpus()}
    assert set(REQUIRED_GPUS) <= names
    for g in list_gpus():
        assert isinstance(g, GPUSpec)
        missing = [f for f in GPU_NUMBERS if not g.sources.get(f, "").strip()]
        # a domain beyond the node (NVL72) and FP4 tensor cores each need their datasheet line
        missing += [f for f, on in (("nvlink_domain_gpus", g.domain_gpus > g.gpus_per_node),
                                    ("fp4_tflops", g.fp4_tflops > 0),
                                    ("sfu_exp_tera_per_s", g.sfu_exp_tera_per_s > 0),
                                    ("dynamic_power_w", g.dynamic_power_w > 0),
                                    ("sm_count", g.sm_count > 0),
                                    ("host_link_gbs", g.host_link_gbs > 0),
                                    # a memory power measured off the H100's (its own DVFS sweep)
                                    ("hbm_power_scale", g.hbm_power_scale != 1.0)) if on and not g.sources.get(f, "").strip()]
        assert not missing, f"{g.name}: no source for {missing}"
        for opt in ("max_operating_temp_c", "max_sm_clock_mhz"):
            if getattr(g, opt) is not None:
                assert g.sources.get(opt), (g.name, opt)
        assert 0 < g.min_power_limit_w <= g.max_power_limit_w <= g.tdp_w
        assert 0 < g.idle_w < g.tdp_w
        assert g.bf16_tflops > 0 and g.memory_gib > 0 and g.gpus_per_node >= 1
        assert load_gpu(g.name) is g


@pytest.mark.parametrize("name", ["a100-80g", "mi250x"])
def test_no_fp8_on_ampere_and_cdna2(name):
    g = load_gpu(name)
    assert g.fp8_tflops == 0
    with pytest.raises(SpecError):
        g.peak_tflops("fp8")


def test_measured_hopper_numbers():
    h100, h200 = load_gpu("h100"), load_gpu("h200")
    assert h100.memory_gib == pytest.approx(81559 / 1024, abs=0.01)
    assert h200.memory_gib == pytest.approx(143771 / 1024, abs=0.01)
    for g in (h100, h200):
        assert g.intra_node_bw_gbs == 450 and g.network_bw_gbps == 400 and g.gpus_per_node == 8
        assert g.bf16_tflops == pytest.approx(989.4) and g.fp8_tflops == pytest.approx(1978.9)
        assert g.slowdown_temp_c == 89 and g.max_operating_temp_c == 87
        assert "measured" in g.sources["idle_w"]


def test_specific_architectures():
    gpt3 = load_model("gpt3-175b")
    assert (gpt3.num_layers, gpt3.hidden_size, gpt3.num_attention_heads, gpt3.ffn_hidden_size) == (
        96, 12288, 96, 49152)
    assert gpt3.vocab_size == 50257 and gpt3.max_position_embeddings == 2048
    assert (gpt3.activation, gpt3.normalization, gpt3.position_embedding) == ("gelu", "layernorm", "learned")
    assert gpt3.tied_embeddings and gpt3.add_bias_linear and gpt3.num_query_groups is None

    ds = load_model("deepseek-v3")
    assert ds.num_layers == 61 and ds.hidden_size == 7168 and ds.vocab_size == 129280
    assert ds.mla.q_lora_rank == 1536 and ds.mla.kv_lora_rank == 512
    assert (ds.mla.qk_nope_head_dim, ds.mla.qk_rope_head_dim, ds.mla.v_head_dim) == (128, 64, 128)
    assert ds.moe.num_experts == 256 and ds.moe.top_k == 8 and ds.moe.ffn_hidden_size == 2048
    assert ds.moe.num_shared_experts == 1 and ds.moe.shared_ffn_hidden_size == 2048
    assert ds.moe.first_dense_layers == 3 and ds.moe.dense_ffn_hidden_size == 18432
    assert ds.num_moe_layers == 58

    for n in ("nemotron4-15b", "nemotron4-340b"):
        m = load_model(n)
        assert m.activation == "relu2" and m.normalization == "layernorm" and m.num_query_groups == 8

    for n in ("qwen3-30b-a3b", "qwen3-235b-a22b"):
        m = load_model(n)
        assert m.head_dim == 128 and not m.qkv_bias and m.num_moe_layers == m.num_layers


# ------------------------------------------------------------------------------------ names
@pytest.mark.parametrize("alias, name", [
    ("llama3-70b", "llama3-70b"),
    ("llama-3-70b", "llama3-70b"),
    ("Meta-Llama-3-70B", "llama3-70b"),
    ("LLAMA3-70B", "llama3-70b"),
    ("meta-llama/Meta-Llama-3-8B", "llama3-8b"),
    ("Llama-3.1-405B", "llama3.1-405b"),
    ("Mixtral-8x7B-Instruct-v0.1", "mixtral-8x7b"),
    ("Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b"),
    ("deepseek-ai/DeepSeek-V3", "deepseek-v3"),
    ("GPT-3", "gpt3-175b"),
    ("Nemotron-4-340B-Base", "nemotron4-340b"),
])
def test_model_aliases(alias, name):
    assert load_model(alias).name == name


@pytest.mark.parametrize("alias, name", [
    ("H100", "h100"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100-80g"), ("AMD Instinct MI300X", "mi300x"), ("b200", "b200"),
])
def test_gpu_aliases(alias, name):
    assert load_gpu(alias).name == name


def test_unknown_model_suggests_close_names():
    with pytest.raises(CatalogError) as e:
        load_model("llama3-7b")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("unknown model 'llama3-7b'; did you mean: ")
    assert "llama3-8b" in msg and "llama3-70b" in msg and "advisor catalog models" in msg
    assert isinstance(e.value, SpecError)


def test_unknown_gpu_suggests_close_names():
    with pytest.raises(CatalogError, match=r"unknown GPU 'h110'; did you mean: .*h100"):
        load_gpu("h110")
    with pytest.raises(CatalogError, match=r"^unknown GPU 'tpu-v5' \(see"):
        load_gpu("tpu-v5")


# ------------------------------------------------------------------------------------ HF configs
@pytest.mark.parametrize("fixture, catalog_name", [
    ("llama3-8b.json", "llama3-8b"),
    ("llama3.1-405b.json", "llama3.1-405b"),
    ("mixtral-8x7b.json", "mixtral-8x7b"),
    ("qwen3-30b-a3b.json", "qwen3-30b-a3b"),
    ("deepseek-v3.json", "deepseek-v3"),
    ("nemotron4-15b.json", "nemotron4-15b"),
])
def test_hf_config_matches_catalog(fixture, catalog_name):
    from_hf = load_model(str(HF / fixture))
    assert from_hf.name == Path(fixture).stem
    assert arch(from_hf) == arch(load_model(catalog_name))


def test_hf_gpt2():
    m = load_model(str(HF / "gpt2.json"))
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size) == (12, 768, 12, 3072)
    assert m.vocab_size == 50257 and m.max_position_embeddings == 1024
    assert (m.activation, m.normalization, m.position_embedding) == ("gelu", "layernorm", "learned")
    assert m.tied_embeddings and m.add_bias_linear and m.qkv_bias and m.num_query_groups is None


def test_hf_qwen2_has_qkv_bias_qwen3_not():
    q2 = load_model(str(HF / "qwen2-7b.json"))
    assert q2.qkv_bias and not q2.add_bias_linear and q2.num_query_groups == 4 and q2.family == "qwen2"
    assert not load_model(str(HF / "qwen3-30b-a3b.json")).qkv_bias


def test_hf_folder_with_config_json(tmp_path):
    d = tmp_path / "Meta-Llama-3-8B"
    d.mkdir()
    (d / "config.json").write_text((HF / "llama3-8b.json").read_text())
    m = load_model(str(d))
    assert m.name == "Meta-Llama-3-8B" and arch(m) == arch(load_model("llama3-8b"))
    assert load_model(str(d / "config.json")).name == "Meta-Llama-3-8B"


def _cfg(name: str) -> dict:
    return json.loads((HF / name).read_text())


def test_hf_defaults_and_head_dim():
    cfg = _cfg("llama3-8b.json")
    del cfg["num_key_value_heads"]  # default: MHA
    cfg["head_dim"] = 256
    m = model_from_hf_config(cfg, "x")
    assert m.num_query_groups is None and m.kv_channels == 256 and m.head_dim == 256


def test_hf_head_dim_is_never_floored():
    """hidden / heads with a remainder and no head_dim: refused in one line (the head dim would be
    127.97; 127 would model another network). With head_dim given it is taken as it is."""
    cfg = {**_cfg("llama3-8b.json"), "hidden_size": 4095}
    with pytest.raises(CatalogError) as e:
        model_from_hf_config(cfg, "x")
    assert str(e.value) == ("config.json: hidden_size 4095 is not a multiple of num_attention_heads 32, so the "
                            "head dim would be 127.969; give head_dim")
    m = model_from_hf_config({**cfg, "head_dim": 128}, "x")
    assert m.kv_channels == 128 and m.head_dim == 128
    gpt2 = {**_cfg("gpt2.json"), "n_embd": 770}
    with pytest.raises(CatalogError, match="n_embd 770 is not a multiple of n_head 12"):
        model_from_hf_config(gpt2, "x")
    ds = {**_cfg("deepseek-v3.json"), "hidden_size": 7000}  # MLA: head dims are its own fields
    assert model_from_hf_config(ds, "x").head_dim == 128


def test_hf_qwen3_moe_sparse_step_and_mlp_only_layers():
    cfg = _cfg("qwen3-30b-a3b.json")
    cfg["decoder_sparse_step"] = 2  # MoE on layers 1, 3, 5, ...
    m = model_from_hf_config(cfg, "x")
    assert [i for i in range(6) if m.is_moe_layer(i)] == [1, 3, 5]
    assert m.moe.dense_ffn_hidden_size == 6144
    cfg = _cfg("qwen3-30b-a3b.json")
    cfg["mlp_only_layers"] = [0, 1]
    m = model_from_hf_config(cfg, "x")
    assert m.moe.first_dense_layers == 2 and m.num_moe_layers == 46
    cfg["mlp_only_layers"] = [5]  # a hole in the middle: not representable
    with pytest.raises(CatalogError, match="MoE layer pattern"):
        model_from_hf_config(cfg, "x")


def test_hf_deepseek_without_q_lora():
    cfg = _cfg("deepseek-v3.json")
    cfg["q_lora_rank"] = None  # DeepSeek-V2-Lite style
    assert model_from_hf_config(cfg, "x").mla.q_lora_rank == 0


def test_hf_missing_field():
    cfg = _cfg("llama3-8b.json")
    del cfg["num_hidden_layers"]
    with pytest.raises(CatalogError) as e:
        model_from_hf_config(cfg, "x")
    assert str(e.value) == "config.json: missing required field 'num_hidden_layers' for model_type llama"


def test_hf_missing_field_in_file_names_the_file(tmp_path):
    cfg = _cfg("mixtral-8x7b.json")
    del cfg["num_local_experts"]
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    with pytest.raises(CatalogError, match=r"config.json: missing required field 'num_local_experts' "
                                           r"for model_type mixtral$"):
        load_model(str(p))


@pytest.mark.parametrize("fixture, field, model_type", [
    ("qwen3-30b-a3b.json", "num_experts", "qwen3_moe"),
    ("deepseek-v3.json", "n_routed_experts", "deepseek_v3"),
])
@pytest.mark.parametrize("how", ["absent", "null"])
def test_hf_moe_without_expert_count_is_an_error_not_a_dense_model(fixture, field, model_type, how):
    cfg = _cfg(fixture)
    if how == "absent":
        del cfg[field]
    else:
        cfg[field] = None
    with pytest.raises(CatalogError) as e:
        model_from_hf_config(cfg, "x")
    assert str(e.value) == f"config.json: missing required field {field!r} for model_type {model_type}"


def test_hf_moe_without_expert_count_is_one_line_at_the_cli(tmp_path):
    import subprocess
    import sys

    cfg = _cfg("qwen3-30b-a3b.json")
    del cfg["num_experts"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    p = subprocess.run([sys.executable, "-m", "advisor", "recommend", "--model", str(path), "--cluster", "h100x8"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip() == f"error: {path}: missing required field 'num_experts' for model_type qwen3_moe"


def test_hf_qwen3_moe_with_zero_experts_is_dense():
    cfg = _cfg("qwen3-30b-a3b.json")
    cfg["num_experts"] = 0  # explicit: transformers builds only dense MLPs
    assert not model_from_hf_config(cfg, "x").is_moe


# Published sizes: Mistral-7B-v0.1's checkpoint holds 7,241,732,096 parameters (HF model page:
# 7.24B); the Qwen3-8B model card: 8.2B parameters, 6.95B of them non-embedding.
@pytest.mark.parametrize("fixture, family, total, non_embedding", [
    ("mistral-7b.json", "mistral", 7.24e9, None),
    ("qwen3-8b.json", "qwen3", 8.2e9, 6.95e9),
])
def test_hf_dense_mistral_and_qwen3_match_published_sizes(fixture, family, total, non_embedding):
    from advisor.models.flops import total_params

    m = load_model(str(HF / fixture))
    assert m.family == family and not m.is_moe and m.num_query_groups == 8
    assert (m.activation, m.normalization, m.position_embedding) == ("swiglu", "rmsnorm", "rope")
    assert not m.qkv_bias and not m.add_bias_linear and not m.tied_embeddings
    n = total_params(m)
    assert n == pytest.approx(total, rel=0.01)
    if non_embedding is not None:
        assert n - 2 * m.vocab_size * m.hidden_size == pytest.approx(non_embedding, rel=0.01)


def test_hf_unsupported_model_type():
    with pytest.raises(CatalogError, match=r"unsupported model_type 'bert'"):
        model_from_hf_config({"model_type": "bert"}, "x")
    with pytest.raises(CatalogError, match=r"unsupported model_type None"):
        model_from_hf_config({}, "x")


def test_hf_invalid_json_and_missing_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(CatalogError, match="invalid JSON"):
        load_model(str(p))
    with pytest.raises(CatalogError, match="no such file"):
        load_model(str(tmp_path / "nope.json"))


def test_model_yaml_file(tmp_path):
    p = tmp_path / "tiny.yaml"
    p.write_text("name: tiny\nnum_layers: 2\nhidden_size: 64\nffn_hidden_size: 256\n"
                 "num_attention_heads: 4\nvocab_size: 1000\nsource: test\n")
    m = load_model(str(p))
    assert m.name == "tiny" and m.num_layers == 2
    p.write_text("name: tiny\nnum_layer: 2\n")
    with pytest.raises(CatalogError, match="unknown field"):
        load_model(str(p))


# ------------------------------------------------------------------------------------ clusters
def test_cluster_string_full_nodes():
    c = load_cluster("h100x64")
    assert isinstance(c, ClusterSpec)
    assert (c.num_nodes, c.gpus_per_node, c.world_size) == (8, 8, 64)
    assert c.intra_node_bw_gbs == 450 and c.inter_node_bw_gbs == 50
    assert c.power_cap_w == 700 and c.gpu.name == "h100" and c.name == "h100x64"


def test_cluster_string_partial_node_and_explicit_shape():
    c = load_cluster("h100x4")
    assert (c.num_nodes, c.gpus_per_node) == (1, 4)
    c = load_cluster("h200x8x16")
    assert (c.num_nodes, c.gpus_per_node, c.world_size) == (16, 8, 128)
    c = load_cluster("mi300xx16")  # a GPU name ending in 'x'
    assert c.gpu.name == "mi300x" and (c.num_nodes, c.gpus_per_node) == (2, 8)
    c = load_cluster("MI250Xx8")
    assert c.gpu.name == "mi250x" and c.inter_node_bw_gbs == 12.5


def test_cluster_power_cap():
    assert load_cluster("h100x8", power_cap_w=500).power_cap_w == 500
    with pytest.raises(CatalogError, match="above"):
        load_cluster("h100x8", power_cap_w=800)
    for low in (50, 81, 199):  # an H100 SXM cannot be set below 200 W (measured, nvidia-smi -q)
        with pytest.raises(CatalogError, match="below the h100 minimum power limit of 200 W"):
            load_cluster("h100x8", power_cap_w=low)
    assert load_cluster("h100x8", power_cap_w=200).power_cap_w == 200
    with pytest.raises(CatalogError, match="only 750 W is settable"):
        load_cluster("mi300xx8", power_cap_w=600)


@pytest.mark.parametrize("bad", ["h100x12", "h100x0", "h100x16x2", "h100", "h100x", "x64", "h100*64", ""])
def test_cluster_bad_strings(bad):
    with pytest.raises(CatalogError) as e:
        load_cluster(bad)
    assert "\n" not in str(e.value)


def test_cluster_bad_string_names_expected_form():
    with pytest.raises(CatalogError, match=r"\(expected <gpu>x<count> \(e\.g\. h100x64\)"):
        load_cluster("sixty-four h100s")
    with pytest.raises(CatalogError, match="not a multiple of 8"):
        load_cluster("h100x12")
    with pytest.raises(CatalogError, match="unknown GPU 'h900'"):
        load_cluster("h900x8")


def test_named_clusters():
    clusters = list_clusters()
    assert clusters
    for c in clusters:
        assert load_cluster(c.name) == c
    su = load_cluster("dgx-h100-su")
    assert su.world_size == 256 and su.inter_node_bw_gbs == 50
    assert load_cluster("dgx-h100-su", power_cap_w=600).power_cap_w == 600


def test_cluster_yaml(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text("name: lab\ngpu: h200\nnodes: 2\n")
    with pytest.warns(CatalogNote, match="no gpus_per_node, using 8"):
        c = load_cluster(str(p))
    assert (c.name, c.num_nodes, c.gpus_per_node, c.world_size) == ("lab", 2, 8, 16)
    assert c.intra_node_bw_gbs == 450 and c.inter_node_bw_gbs == 50 and c.power_cap_w == 700
    p.write_text("name: lab\ngpu: h100\nnodes: 4\ngpus_per_node: 4\nintra_node_bw_gbs: 200\n"
                 "inter_node_bw_gbs: 25\npower_cap_w: 550\n")
    c = load_cluster(str(p))
    assert (c.num_nodes, c.gpus_per_node, c.intra_node_bw_gbs, c.inter_node_bw_gbs, c.power_cap_w) == (
        4, 4, 200, 25, 550)
    assert load_cluster(str(p), power_cap_w=400).power_cap_w == 400


@pytest.mark.parametrize("text, match", [
    ("gpu: h100\n", "missing required field 'nodes'"),
    ("nodes: 2\n", "missing required field 'gpu'"),
    ("gpu: h100\nnodes: 0\n", "nodes must be a positive integer"),
    ("gpu: h100\nnodes: 2\nnode_count: 3\n", "unknown field"),
    ("gpu: h100\nnodes: 2\ninter_node_bw_gbs: fast\n", "positive number"),
    ("- a\n- b\n", "expected a mapping"),
    ("gpu: [h100\n", "invalid YAML"),
])
def test_cluster_yaml_errors(tmp_path, text, match):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(CatalogError, match=match):
        load_cluster(str(p))


def test_cluster_yaml_missing_file(tmp_path):
    with pytest.raises(CatalogError, match="no such file"):
        load_cluster(str(tmp_path / "none.yaml"))


def test_cluster_suggestions():
    with pytest.raises(CatalogError, match=r"did you mean: h100x8\?"):
        load_cluster("h100")
    with pytest.raises(CatalogError, match=r"did you mean: dgx-h100-su"):
        load_cluster("dgx-h100-s")


@pytest.mark.parametrize("cap", [float("nan"), float("inf"), -5.0, 0.0])
def test_power_cap_must_be_positive_and_finite(cap):
    from advisor.catalog import load_cluster
    from advisor.catalog.loaders import CatalogError

    with pytest.raises(CatalogError, match="positive finite"):
        load_cluster("h100x8", power_cap_w=cap)
    assert load_cluster("h100x8", power_cap_w=350).power_cap_w == 350.0


@pytest.mark.parametrize("value, gbs", [
    ("400Gb/s", 50), ("50GB/s", 50), ("50 GB/s", 50), ("400 Gbps", 50), ("1.8TB/s", 1800), (25, 25), ("25", 25),
])
def test_cluster_yaml_bandwidth_units(tmp_path, value, gbs):
    """b is bits, B is bytes (case-sensitive); a bare number is GB/s."""
    p = tmp_path / "c.yaml"
    p.write_text(f"gpu: h100\nnodes: 2\nintra_node_bw_gbs: 2TB/s\ninter_node_bw_gbs: {value!r}\n".replace("'", '"'))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert load_cluster(str(p)).inter_node_bw_gbs == pytest.approx(gbs)


@pytest.mark.parametrize("value", ["400gb/s", "400 GiB", "GB/s", "-5GB/s", "0Gb/s"])
def test_cluster_yaml_bandwidth_bad_units(tmp_path, value):
    p = tmp_path / "c.yaml"
    p.write_text(f'gpu: h100\nnodes: 2\ninter_node_bw_gbs: "{value}"\n')
    with pytest.raises(CatalogError, match=r"inter_node_bw_gbs must be a positive number \(finite\) of GB/s"):
        load_cluster(str(p))


def _cli_stderr(*args: str) -> list[str]:
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "advisor", *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stderr.splitlines()


def test_cluster_yaml_defaults_are_noted_and_implausible_bandwidths_warned(tmp_path):
    """One `note:` line per default filled in, one `warning:` line per implausible bare number
    (400 read as GB/s is 8x the H100's 400 Gb/s NIC; 5000 GB/s is above NVLink); a complete,
    plausible file prints nothing."""
    p = tmp_path / "c.yaml"
    p.write_text("gpu: h100\nnodes: 8\ninter_node_bw_gbs: 400\n")
    err = _cli_stderr("predict", "-m", "llama3-8b", "-c", str(p), "--tp", "8")
    notes = [ln for ln in err if ln.startswith("note:")]
    assert len(notes) == 4 and all(str(p) in n for n in notes)
    for field in ("name", "gpus_per_node", "intra_node_bw_gbs", "power_cap_w"):
        assert sum(f"no {field}," in n for n in notes) == 1
    warns = [ln for ln in err if ln.startswith("warning:")]
    assert len(warns) == 1 and "inter_node_bw_gbs 400 GB/s" in warns[0] and "'400Gb/s'" in warns[0]
    p.write_text("name: x\ngpu: h100\nnodes: 8\ngpus_per_node: 8\nintra_node_bw_gbs: 450\n"
                 "inter_node_bw_gbs: 5000\npower_cap_w: 700\n")
    err = _cli_stderr("predict", "-m", "llama3-8b", "-c", str(p), "--tp", "8")
    assert len(err) == 1 and err[0].startswith("warning:") and "above the intra-node 450 GB/s" in err[0]
    p.write_text("name: x\ngpu: h100\nnodes: 8\ngpus_per_node: 8\nintra_node_bw_gbs: 450 GB/s\n"
                 "inter_node_bw_gbs: 400Gb/s\npower_cap_w: 700\n")
    assert _cli_stderr("predict", "-m", "llama3-8b", "-c", str(p), "--tp", "8") == []


def test_model_alias_says_what_it_resolved_to():
    """`llama-3-405b` is an alias of llama3.1-405b: one `note:` line says so; a catalog name (in
    any case or punctuation) says nothing."""
    with pytest.warns(CatalogNote, match=r"'llama-3-405b' is llama3.1-405b"):
        assert load_model("llama-3-405b").name == "llama3.1-405b"
    err = _cli_stderr("predict", "-m", "llama-3-405b", "-c", "h100x1024", "--tp", "8", "--pp", "8",
                      "--account-for-embedding", "--account-for-loss", "--json")
    assert err == ["note: model 'llama-3-405b' is llama3.1-405b (an alias in the catalog)"]
    assert _cli_stderr("predict", "-m", "Llama3-70B", "-c", "h100x64", "--tp", "8", "--json") == []


def test_gpu_hbm_power_scale_must_be_positive():
    """GPUSpec.hbm_power_scale multiplies the HBM power term (models/dvfs.py): 0 would silently drop
    it, so the loader refuses it in one line."""
    import yaml

    from advisor.catalog import loaders as L

    data = yaml.safe_load((Path(L.__file__).parent / "data" / "gpus" / "h200.yaml").read_text())
    assert L._gpu_from_yaml(dict(data), "h200.yaml").hbm_power_scale == pytest.approx(1.317)
    for bad, says in ((0, "a positive number"), (0.0, "a positive number"), (-1, "a non-negative number")):
        with pytest.raises(CatalogError, match=f"hbm_power_scale must be {says}"):
            L._gpu_from_yaml({**data, "hbm_power_scale": bad}, "h200.yaml")
