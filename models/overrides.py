"""What-if overrides (`--set KEY=VALUE`): typed keys for the cluster (gpu, nodes, gpus, power_cap),
the model (layers) and the layout, applied to a model, cluster and layout or to recommend's workload."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from advisor.catalog.specs import ClusterSpec, ModelSpec, SpecError

__all__ = ["CLUSTER_KEYS", "MODEL_KEYS", "LAYOUT_INT", "LAYOUT_BOOL", "LAYOUT_STR", "OVERRIDE_KEYS", "parse_sets",
           "apply_overrides", "override_workload"]

CLUSTER_KEYS = ("gpu", "nodes", "gpus", "gpus_per_node", "power_cap")
MODEL_KEYS = ("layers",)
LAYOUT_INT = ("tp", "pp", "dp", "cp", "ep", "etp", "vp", "mbs", "gbs", "seq", "pp_first_layers", "pp_last_layers")
LAYOUT_BOOL = ("sequence_parallel", "distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather",
               "tp_comm_overlap")
LAYOUT_STR = ("precision", "recompute")
OVERRIDE_KEYS = CLUSTER_KEYS + MODEL_KEYS + LAYOUT_INT + LAYOUT_BOOL + LAYOUT_STR


def parse_sets(sets: Sequence[str] | Mapping[str, Any]) -> dict[str, Any]:
    """['gpu=h200', 'nodes=16', 'power_cap=500', 'mbs=4'] -> typed {key: value}."""
    items = list(sets.items()) if isinstance(sets, Mapping) else []
    if not isinstance(sets, Mapping):
        for s in sets:
            if "=" not in str(s):
                raise SpecError(f"--set {s!r}: expected KEY=VALUE (keys: {', '.join(OVERRIDE_KEYS)})")
            k, v = str(s).split("=", 1)
            items.append((k.strip().replace("-", "_"), v.strip()))
    out: dict[str, Any] = {}
    for k, v in items:
        k = {"power_cap_w": "power_cap", "num_nodes": "nodes", "world_size": "gpus"}.get(k, k)
        if k not in OVERRIDE_KEYS:
            from advisor.catalog.errors import did_you_mean

            raise SpecError(f"--set {k}: unknown key{did_you_mean(k, OVERRIDE_KEYS)} (known: {', '.join(OVERRIDE_KEYS)})")
        try:
            if k in LAYOUT_INT or k in ("nodes", "gpus", "gpus_per_node", "layers"):
                out[k] = int(v)
            elif k == "power_cap":
                out[k] = float(v)
            elif k in LAYOUT_BOOL:
                if str(v).lower() not in ("1", "0", "true", "false", "on", "off", "yes", "no"):
                    raise ValueError
                out[k] = str(v).lower() in ("1", "true", "on", "yes")
            else:
                out[k] = str(v).lower()
        except (TypeError, ValueError):
            raise SpecError(f"--set {k}={v}: not a valid value for {k}") from None
        if isinstance(out[k], (int, float)) and not isinstance(out[k], bool) and not (
                math.isfinite(out[k]) and out[k] > 0):
            raise SpecError(f"--set {k}={v}: must be positive and finite")
    return out


def apply_overrides(model: ModelSpec, cluster: ClusterSpec, values: Mapping[str, Any] | None,
                    sets: Sequence[str] | Mapping[str, Any]) -> tuple[ModelSpec, ClusterSpec, dict]:
    """What-if: the model, cluster and layout values with `sets` applied. A new GPU keeps the
    node shape (and takes that GPU's links and TDP); nodes / gpus keep the GPU and its links. The
    layout's DP is left to be derived again when the GPU count changes."""
    from advisor.catalog import load_cluster, load_gpu, with_power_cap

    o = parse_sets(sets)
    values = dict(values or {})
    if "layers" in o:
        model = model.with_layers(o["layers"])
    before = cluster.world_size
    if "gpu" in o:
        gpu = load_gpu(o["gpu"])
        cluster = load_cluster(f"{o['gpu']}x{cluster.gpus_per_node}x{cluster.num_nodes}")
        if gpu.name != cluster.gpu.name:  # pragma: no cover - load_cluster resolves the same GPU
            raise SpecError(f"--set gpu={o['gpu']}: resolved to {cluster.gpu.name}")
    if "gpus_per_node" in o or "nodes" in o:
        per, nodes = o.get("gpus_per_node", cluster.gpus_per_node), o.get("nodes", cluster.num_nodes)
        cluster = dataclasses.replace(cluster, num_nodes=nodes, gpus_per_node=per,
                                      name=f"{cluster.gpu.name}x{per}x{nodes}")
    if "gpus" in o:
        cluster = load_cluster(f"{cluster.gpu.name}x{o['gpus']}")
    if "power_cap" in o:
        cluster = with_power_cap(cluster, o["power_cap"], f"--set power_cap={o['power_cap']:g}")
    if cluster.world_size != before and "dp" not in o:
        values.pop("dp", None)
    for k in LAYOUT_INT + LAYOUT_BOOL + LAYOUT_STR:
        if k in o:
            values[k] = o[k]
    return model, cluster, values


def override_workload(model: ModelSpec, cluster: ClusterSpec, sets, seq, gbs, precision, options):
    """What-if for recommend: cluster / model keys, the workload (seq, gbs, precision) and the
    knobs that narrow the search (mbs, recompute); layout knobs that recommend searches are
    refused with a hint."""
    model, cluster, v = apply_overrides(model, cluster, {}, sets)
    searched = sorted(set(v) - {"seq", "gbs", "precision", "mbs", "recompute", "tp_comm_overlap"})
    if searched:
        raise SpecError(f"--set {searched[0]}: recommend searches this knob; use 'advisor predict' to fix it")
    if "mbs" in v:
        options = dataclasses.replace(options, mbs=(v["mbs"],))
    if "recompute" in v:
        options = dataclasses.replace(options, recompute=(v["recompute"],))
    if "tp_comm_overlap" in v:
        options = dataclasses.replace(options, tp_comm_overlap=v["tp_comm_overlap"])
    return model, cluster, v.get("seq", seq), v.get("gbs", gbs), v.get("precision", precision), options
