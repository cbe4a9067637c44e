"""Loaders for the built-in catalog (``catalog/data``), HF ``config.json`` files and cluster strings.

Models and GPUs are found by name, case-insensitively, ignoring punctuation, an ``org/`` prefix,
a leading ``meta-`` / ``nvidia`` / ``amd instinct``, and trailing ``-base`` / ``-instruct`` / ``-hf``
/ ``-v0.1``-style suffixes; each YAML file may list extra ``aliases``.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import warnings
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from advisor.catalog.errors import CatalogError, CatalogNote
from advisor.catalog.hf import model_from_hf_config
from advisor.catalog.specs import ClusterSpec, GPUSpec, MLASpec, ModelSpec, MoESpec, SpecError

_MODEL_KEYS = {f.name for f in dataclasses.fields(ModelSpec)} | {"aliases", "recipe"}
_MOE_KEYS = {f.name for f in dataclasses.fields(MoESpec)}
_MLA_KEYS = {f.name for f in dataclasses.fields(MLASpec)}
_GPU_KEYS = {f.name for f in dataclasses.fields(GPUSpec)} | {"aliases"}
_CLUSTER_KEYS = {"name", "gpu", "nodes", "gpus_per_node", "nvlink_domain_gpus", "intra_node_bw_gbs",
                 "inter_node_bw_gbs", "power_cap_w", "storage_bw_gbs", "source", "description"}

CLUSTER_FORMS = ("<gpu>x<count> (e.g. h100x64), <gpu>x<per-node>x<nodes> (e.g. h100x8x16), "
                 "a catalog cluster name, or a path to a cluster YAML file")


# ---------------------------------------------------------------------------------------- names
_SUFFIX = re.compile(r"(-(base|instruct|chat|hf)|-v\d+\.\d+)+$")
_PREFIX = re.compile(r"^(meta-|nvidia[ -]|amd[ -]instinct[ -]|amd[ -])")


def normalize_name(name: str) -> str:
    """The lookup key of a model or GPU name: 'Meta-Llama-3-70B' and 'llama3-70b' both -> 'llama370b'."""
    n = name.strip().lower().rsplit("/", 1)[-1]
    n = _PREFIX.sub("", n)
    n = _SUFFIX.sub("", n)
    return re.sub(r"[^a-z0-9]", "", n)


def _unknown(kind: str, name: str, names: list[str], hint: str) -> CatalogError:
    close = difflib.get_close_matches(name.lower(), names, n=3, cutoff=0.6)
    if not close:  # try on the normalized keys too ('Llama-3-7B' vs 'llama3-8b')
        by_key = {normalize_name(n): n for n in names}
        close = [by_key[k] for k in difflib.get_close_matches(normalize_name(name), list(by_key), n=3,
                                                              cutoff=0.6)]
    did = f"; did you mean: {', '.join(close)}?" if close else ""
    return CatalogError(f"unknown {kind} {name!r}{did} (see '{hint}')")


# ---------------------------------------------------------------------------------------- files
def data_dir(kind: str):
    return resources.files(__package__) / "data" / kind


# libyaml's parser when PyYAML was built with it (the same safe constructors, ~5x faster: the
# catalog is read on every command); the pure-Python one otherwise
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_yaml(path, what: str) -> dict[str, Any]:
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_LOADER)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise CatalogError(f"{what}: invalid YAML{where}") from None
    if not isinstance(data, dict):
        raise CatalogError(f"{what}: expected a mapping of fields, got {type(data).__name__}")
    return data


def _check_keys(data: Mapping[str, Any], allowed: set[str], what: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise CatalogError(f"{what}: unknown field(s) {', '.join(unknown)}")


def _model_from_yaml(data: dict[str, Any], what: str) -> ModelSpec:
    _check_keys(data, _MODEL_KEYS, what)
    for sub, keys in (("moe", _MOE_KEYS), ("mla", _MLA_KEYS)):
        if data.get(sub) is not None:
            if not isinstance(data[sub], dict):
                raise CatalogError(f"{what}: {sub} must be a mapping")
            _check_keys(data[sub], keys, f"{what}: {sub}")
    return ModelSpec.from_dict(data)


_GPU_FLOATS = ("memory_gib", "hbm_bandwidth_gbs", "bf16_tflops", "fp8_tflops", "tdp_w", "idle_w",
               "slowdown_temp_c", "intra_node_bw_gbs", "network_bw_gbps", "max_operating_temp_c",
               "min_power_limit_w", "max_power_limit_w", "max_sm_clock_mhz", "fp4_tflops",
               "sfu_exp_tera_per_s", "dynamic_power_w", "host_link_gbs", "hbm_power_scale")
_GPU_OPTIONAL = ("max_operating_temp_c", "max_sm_clock_mhz", "fp4_tflops", "sfu_exp_tera_per_s", "dynamic_power_w",
                 "host_link_gbs", "hbm_power_scale")


def _gpu_from_yaml(data: dict[str, Any], what: str) -> GPUSpec:
    _check_keys(data, _GPU_KEYS, what)
    d = dict(data)
    for k in _GPU_FLOATS:
        v = d.get(k)
        if v is None and k in _GPU_OPTIONAL:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise CatalogError(f"{what}: {k} must be a non-negative number (finite), got {v!r}")
        d[k] = float(v)
    if d.get("hbm_power_scale") is not None and d["hbm_power_scale"] <= 0:  # a multiplier of the HBM power
        raise CatalogError(f"{what}: hbm_power_scale must be a positive number, got {data['hbm_power_scale']!r}")
    if d.get("vendor") not in ("nvidia", "amd"):
        raise CatalogError(f"{what}: vendor must be nvidia or amd, got {d.get('vendor')!r}")
    gpn = d.get("gpus_per_node")
    if not isinstance(gpn, int) or isinstance(gpn, bool) or gpn < 1:
        raise CatalogError(f"{what}: gpus_per_node must be a positive integer, got {gpn!r}")
    dom = d.setdefault("nvlink_domain_gpus", gpn)
    if not isinstance(dom, int) or isinstance(dom, bool) or dom < gpn or dom % gpn:
        raise CatalogError(f"{what}: nvlink_domain_gpus must be a whole number of {gpn}-GPU nodes, got {dom!r}")
    sms = d.setdefault("sm_count", 0)
    if not isinstance(sms, int) or isinstance(sms, bool) or sms < 0:
        raise CatalogError(f"{what}: sm_count must be a non-negative integer, got {sms!r}")
    d["generation"] = str(d.get("generation") or "")
    if not 0 < d["min_power_limit_w"] <= d["max_power_limit_w"] <= d["tdp_w"]:
        raise CatalogError(f"{what}: need 0 < min_power_limit_w <= max_power_limit_w <= tdp_w")
    d["sources"] = dict(d.get("sources") or {})
    return GPUSpec.from_dict(d)


def _table(kind: str, build: Callable[[dict, str], Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(name -> spec, lookup key -> name) for one catalog folder."""
    specs: dict[str, Any] = {}
    index: dict[str, str] = {}
    for f in sorted(data_dir(kind).iterdir(), key=lambda p: p.name):
        if not f.name.endswith(".yaml"):
            continue
        what = f"catalog {kind}/{f.name}"
        data = read_yaml(f, what)
        aliases = data.get("aliases") or []
        spec = build(data, what)
        specs[spec.name] = spec
        for key in {normalize_name(spec.name), *(normalize_name(a) for a in aliases)}:
            if index.get(key, spec.name) != spec.name:
                raise CatalogError(f"{what}: name or alias {key!r} also belongs to {index[key]}")
            index[key] = spec.name
    return specs, index


@lru_cache(maxsize=None)
def _models() -> tuple[dict[str, ModelSpec], dict[str, str]]:
    return _table("models", _model_from_yaml)


@lru_cache(maxsize=None)
def _gpus() -> tuple[dict[str, GPUSpec], dict[str, str]]:
    return _table("gpus", _gpu_from_yaml)


@lru_cache(maxsize=None)
def _clusters() -> dict[str, ClusterSpec]:
    out = {}
    for f in sorted(data_dir("clusters").iterdir(), key=lambda p: p.name):
        if f.name.endswith(".yaml"):
            c = _cluster_from_yaml(read_yaml(f, f"catalog clusters/{f.name}"),
                                   f"catalog clusters/{f.name}", None, notes=False)
            out[c.name] = c
    return out


# ---------------------------------------------------------------------------------------- models
def _model_from_path(path: Path) -> ModelSpec:
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise CatalogError(f"{path}: no such file")
    if path.suffix.lower() in (".yaml", ".yml"):
        return _model_from_yaml(read_yaml(path, str(path)), str(path))
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CatalogError(f"{path}: invalid JSON ({e})") from None
    name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return model_from_hf_config(cfg, name, origin=str(path))


def load_model(name_or_path: str) -> ModelSpec:
    """A catalog model by name or alias (case-insensitive), or a HF ``config.json`` / a folder
    holding one / a model YAML file (the catalog's schema)."""
    s = str(name_or_path).strip()
    specs, index = _models()
    p = Path(s).expanduser()
    pathy = s.lower().endswith((".json", ".yaml", ".yml")) or "/" in s or "\\" in s
    if pathy and p.exists():
        return _model_from_path(p)
    key = normalize_name(s)
    if key in index:
        spec = specs[index[key]]
        if key != normalize_name(spec.name):  # an alias: say what it stands for
            warnings.warn(CatalogNote(f"model {s!r} is {spec.name} (an alias in the catalog)"), stacklevel=2)
        return spec
    if s.lower().endswith((".json", ".yaml", ".yml")):
        raise CatalogError(f"{p}: no such file")
    raise _unknown("model", s, list(specs), "advisor catalog models")


@lru_cache(maxsize=None)
def _recipes() -> dict[str, dict]:
    out = {}
    for f in sorted(data_dir("models").iterdir(), key=lambda p: p.name):
        if f.name.endswith(".yaml"):
            data = read_yaml(f, f"catalog models/{f.name}")
            if data.get("recipe"):
                out[str(data.get("name"))] = dict(data["recipe"])
    return out


def model_recipe(model: ModelSpec) -> dict | None:
    """The published pre-training recipe of a catalog model ({"gbs", "seq", "source"}: its global
    batch), or None where the catalog has none (an HF config, or no published batch)."""
    return _recipes().get(model.name)


def list_models() -> list[ModelSpec]:
    return list(_models()[0].values())


# ---------------------------------------------------------------------------------------- GPUs
def load_gpu(name: str) -> GPUSpec:
    """A catalog GPU by name or alias (case-insensitive; NVML / AMD SMI product names work too)."""
    specs, index = _gpus()
    key = normalize_name(str(name))
    if key in index:
        return specs[index[key]]
    raise _unknown("GPU", str(name), list(specs), "advisor catalog gpus")


def list_gpus() -> list[GPUSpec]:
    return list(_gpus()[0].values())


# ---------------------------------------------------------------------------------------- clusters
_COUNT = re.compile(r"^(?P<gpu>[a-z0-9][a-z0-9._-]*?)x(?P<a>\d+)(?:x(?P<b>\d+))?$")


def _power_cap(gpu: GPUSpec, cap: float | None, what: str) -> float:
    """A per-GPU power cap (default: the TDP): a finite number of watts inside the GPU's settable
    power limit (min_power_limit_w .. max_power_limit_w)."""
    cap = gpu.tdp_w if cap is None else float(cap)
    if not math.isfinite(cap) or cap <= 0:
        raise CatalogError(f"{what}: power cap must be a positive finite number of watts, got {cap:g}")
    try:
        gpu.check_power_cap(cap)
    except SpecError as e:
        raise CatalogError(f"{what}: {e}") from None
    return cap


def with_power_cap(cluster: ClusterSpec, cap: float, what: str = "power cap") -> ClusterSpec:
    """The cluster with another per-GPU power cap, checked as a cluster's own is."""
    return dataclasses.replace(cluster, power_cap_w=_power_cap(cluster.gpu, cap, what))


def make_cluster(name: str, gpu: GPUSpec, nodes: int, per_node: int, intra: float | None,
                 inter: float | None, cap: float | None, what: str, storage: float | None = None,
                 domain: int | None = None) -> ClusterSpec:
    """The one cluster constructor: the GPU's catalog figures where a value is None (NVLink
    domain: the GPU's own, an NVL72 rack for GB200 / GB300, capped at whole nodes of `per_node`)."""
    cap = _power_cap(gpu, cap, what)
    if domain is None:  # as many of this cluster's nodes as the GPU's domain joins
        domain = gpu.domain_gpus // gpu.gpus_per_node * per_node
    return ClusterSpec(
        name=name,
        gpu=gpu,
        num_nodes=nodes,
        gpus_per_node=per_node,
        intra_node_bw_gbs=float(gpu.intra_node_bw_gbs if intra is None else intra),
        inter_node_bw_gbs=float(gpu.network_bw_gbs if inter is None else inter),
        power_cap_w=cap,
        storage_bw_gbs=None if storage is None else float(storage),
        nvlink_domain_gpus=domain,
    )


# a bandwidth with its unit: 400Gb/s, 50GB/s, 50 GB/s, 1.8TB/s, 400Gbps; b = bits, B = bytes (case-sensitive)
_BANDWIDTH = re.compile(r"^(?P<v>\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?\s*(?P<p>[MGT])(?P<u>[bB])(?:/s|ps)$")
_PREFIX_IN_G = {"M": 1e-3, "G": 1.0, "T": 1e3}


def bandwidth_gbs(v: Any, what: str) -> float:
    """A bandwidth in GB/s (10^9 bytes/s): a bare number is GB/s; a string carries its unit,
    ``400Gb/s`` (bits: / 8), ``50GB/s``, ``50 GB/s``, ``1.8TB/s``, ``400Gbps``; 'b' is bits and
    'B' bytes, case-sensitive, as in every NIC and GPU datasheet."""
    gbs = v
    if isinstance(v, str):
        s = v.strip()
        m = _BANDWIDTH.match(s)
        try:  # a quoted bare number is GB/s as an unquoted one
            gbs = float(s) if m is None else float(s[:m.start("p")]) * _PREFIX_IN_G[m["p"]] / (
                8.0 if m["u"] == "b" else 1.0)
        except ValueError:
            gbs = None
    if isinstance(gbs, bool) or not isinstance(gbs, (int, float)) or not math.isfinite(gbs) or gbs <= 0:
        raise CatalogError(f"{what} must be a positive number (finite) of GB/s, or a string with its unit "
                           f"('400Gb/s' bits, '50GB/s' bytes), got {v!r}")
    return float(gbs)


def _check_bandwidths(gpu: GPUSpec, intra: float, inter: float, raw_inter: Any, what: str) -> None:
    """One warning line per implausible bandwidth (the values are kept: a warning, not an error).
    Physical bounds, per GPU and per direction: NVLink inside a node is the GPU's datasheet
    figure (catalog intra_node_bw_gbs; no node moves more between its GPUs); a GPU's network
    traffic leaves through its NIC (one per GPU in every reference design of the catalog: DGX /
    HGX / NVL72), network_bw_gbps / 8 GB/s, and never beats NVLink."""
    nic = gpu.network_bw_gbs
    bits = (f"; a bare number is GB/s: if you meant {raw_inter:g} Gb/s, write '{raw_inter:g}Gb/s'"
            if not isinstance(raw_inter, str) and raw_inter is not None else "")
    if intra > gpu.intra_node_bw_gbs:
        warnings.warn(f"{what}: intra_node_bw_gbs {intra:g} GB/s is above the {gpu.name}'s NVLink "
                      f"{gpu.intra_node_bw_gbs:g} GB/s per direction (its datasheet)", stacklevel=3)
    if inter > intra:
        warnings.warn(f"{what}: inter_node_bw_gbs {inter:g} GB/s is above the intra-node {intra:g} GB/s "
                      f"(a network is never faster than NVLink){bits}", stacklevel=3)
    elif inter > nic:
        warnings.warn(f"{what}: inter_node_bw_gbs {inter:g} GB/s is above the {gpu.name}'s NIC "
                      f"{gpu.network_bw_gbps:g} Gb/s = {nic:g} GB/s per GPU{bits}", stacklevel=3)


def _cluster_from_yaml(data: dict[str, Any], what: str, power_cap_w: float | None,
                       notes: bool = True) -> ClusterSpec:
    """A cluster from a YAML mapping. `notes`: say in one note each which default fills a
    missing field (a user's file; the catalog's own files are documented in their sources)."""
    _check_keys(data, _CLUSTER_KEYS, what)
    for k in ("gpu", "nodes"):
        if data.get(k) is None:
            raise CatalogError(f"{what}: missing required field {k!r}")
    gpu = load_gpu(str(data["gpu"]))
    ints = {}
    for k in ("nodes", "gpus_per_node"):
        v = data.get(k, gpu.gpus_per_node if k == "gpus_per_node" else None)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise CatalogError(f"{what}: {k} must be a positive integer, got {v!r}")
        ints[k] = v
    for k in ("power_cap_w", "storage_bw_gbs"):
        v = data.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                              or v <= 0):
            raise CatalogError(f"{what}: {k} must be a positive number (finite), got {v!r}")
    bw = {k: None if data.get(k) is None else bandwidth_gbs(data[k], f"{what}: {k}")
          for k in ("intra_node_bw_gbs", "inter_node_bw_gbs")}
    name = str(data.get("name") or what)
    cap = power_cap_w if power_cap_w is not None else data.get("power_cap_w")
    dom = data.get("nvlink_domain_gpus")
    if dom is not None:
        per, most = ints["gpus_per_node"], gpu.domain_gpus // gpu.gpus_per_node
        if not isinstance(dom, int) or isinstance(dom, bool) or dom < per or dom % per:
            raise CatalogError(f"{what}: nvlink_domain_gpus must be a whole number of {per}-GPU nodes, got {dom!r}")
        if dom // per > most:
            raise CatalogError(f"{what}: nvlink_domain_gpus {dom} is {dom // per} nodes, more than the "
                               f"{most} node(s) one {gpu.name} NVLink domain joins ({gpu.domain_gpus} GPUs)")
    c = make_cluster(name, gpu, ints["nodes"], ints["gpus_per_node"], bw["intra_node_bw_gbs"],
                     bw["inter_node_bw_gbs"], cap, what, data.get("storage_bw_gbs"), dom)
    if notes:
        defaults = {
            "name": f"the file name {name!r}",
            "gpus_per_node": f"{c.gpus_per_node} (per {gpu.name} node)",
            "nvlink_domain_gpus": f"{c.nvlink_domain_gpus} (one {gpu.name} NVLink domain"
                                  + (f", {c.domain_gpus} GPUs of this job in each)" if c.domain_gpus != c.nvlink_domain_gpus
                                     else ")"),
            "intra_node_bw_gbs": f"{c.intra_node_bw_gbs:g} GB/s (the {gpu.name}'s NVLink, per direction)",
            "inter_node_bw_gbs": f"{c.inter_node_bw_gbs:g} GB/s (the {gpu.name}'s NIC, "
                                 f"{gpu.network_bw_gbps:g} Gb/s per GPU)",
            "power_cap_w": f"{c.power_cap_w:g} W (the {gpu.name}'s TDP)",
        }
        for k, used in defaults.items():
            if k == "nvlink_domain_gpus" and gpu.domain_gpus <= gpu.gpus_per_node:
                continue  # an HGX board: the node is the domain, nothing to choose
            if data.get(k) is None and not (k == "power_cap_w" and power_cap_w is not None):
                warnings.warn(CatalogNote(f"{what}: no {k}, using {used}"), stacklevel=3)
        _check_bandwidths(gpu, c.intra_node_bw_gbs, c.inter_node_bw_gbs, data.get("inter_node_bw_gbs"), what)
    return c


def _cluster_from_string(s: str, power_cap_w: float | None) -> ClusterSpec | None:
    m = _COUNT.match(s.lower())
    if not m:
        return None
    gpu = load_gpu(m["gpu"])
    a = int(m["a"])
    gpn = gpu.gpus_per_node
    if m["b"] is not None:  # <gpu>x<per-node>x<nodes>
        per_node, nodes = a, int(m["b"])
        if per_node < 1 or nodes < 1:
            raise CatalogError(f"cluster {s!r}: GPUs per node and nodes must be >= 1")
        if per_node > gpn:
            raise CatalogError(f"cluster {s!r}: a {gpu.name} node holds at most {gpn} GPUs")
    elif a < 1:
        raise CatalogError(f"cluster {s!r}: the GPU count must be >= 1")
    elif a <= gpn:
        per_node, nodes = a, 1
    elif a % gpn == 0:
        per_node, nodes = gpn, a // gpn
    else:
        raise CatalogError(
            f"cluster {s!r}: {a} GPUs is not a multiple of {gpn} GPUs per {gpu.name} node "
            f"(use {m['gpu']}x<per-node>x<nodes> for partial nodes)"
        )
    return make_cluster(s.lower(), gpu, nodes, per_node, None, None, power_cap_w, f"cluster {s!r}")


def load_cluster(spec: str, power_cap_w: float | None = None) -> ClusterSpec:
    """A cluster from ``<gpu>x<count>`` (``h100x64`` = 8 nodes x 8), ``<gpu>x<per-node>x<nodes>``,
    a catalog cluster name, or a YAML file. ``power_cap_w`` (per GPU) overrides the default TDP."""
    s = str(spec).strip()
    if s.lower().endswith((".yaml", ".yml")) or Path(s).is_file():
        p = Path(s).expanduser()
        if not p.is_file():
            raise CatalogError(f"{p}: no such file")
        return _cluster_from_yaml(read_yaml(p, str(p)), str(p), power_cap_w)
    named = _clusters()
    key = normalize_name(s)
    for c in named.values():
        if normalize_name(c.name) == key:
            return c if power_cap_w is None else make_cluster(
                c.name, c.gpu, c.num_nodes, c.gpus_per_node, c.intra_node_bw_gbs, c.inter_node_bw_gbs,
                power_cap_w, f"cluster {c.name!r}", c.storage_bw_gbs, c.nvlink_domain_gpus)
    c = _cluster_from_string(s, power_cap_w)
    if c is not None:
        return c
    hint = ""
    if normalize_name(s) in _gpus()[1]:
        gpu = load_gpu(s)
        hint = f"; did you mean: {s.lower()}x{gpu.gpus_per_node}?"
    else:
        close = difflib.get_close_matches(s.lower(), list(named), n=3, cutoff=0.6)
        hint = f"; did you mean: {', '.join(close)}?" if close else ""
    raise CatalogError(f"cannot read cluster {s!r}{hint} (expected {CLUSTER_FORMS})")


def list_clusters() -> list[ClusterSpec]:
    return list(_clusters().values())
