"""Where a profile's answer stands: the domain it was fitted and checked on (GPUs, number formats,
model families, GPU counts, software versions, with its out-of-sample error there), and one line
for an answer outside it, naming the nearest checked case and its error."""
from __future__ import annotations

import math

from advisor.catalog.specs import ClusterSpec, ModelSpec, TrainConfig

# catalog GPU name -> the published fit set's GPU names (models/published.GPUS, reversed)
_PUBLISHED = {"h100": "H100", "a100-80g": "A100-80GB", "b200": "B200", "gb200": "GB200", "b300": "B300",
              "gb300": "GB300"}


def profile_domain(cal) -> dict:
    """The profile's domain: its own `domain` record where the fit wrote one, else the GPUs and
    models it was trained on."""
    t = getattr(cal, "trained_on", None) or {}
    d = dict(t.get("domain") or {})
    d.setdefault("gpus", list(t.get("gpus") or []))
    d.setdefault("models", list(t.get("models") or []))
    return d


def _error_of(cal) -> float | None:
    cv = getattr(cal, "cv", None) or {}
    for k in ("leave_one_model_out", "leave_one_source_out"):
        if k in cv:
            return float(cv[k]["overall"]["mape"])
    return None


def domain_note(cal, model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig) -> str | None:
    """One line where the answer lies outside the profile's domain (None inside it or without a
    calibration): what is outside, the nearest checked case and its error there."""
    if cal is None:
        return None
    d = profile_domain(cal)
    if not d.get("gpus"):
        return None
    gpu = _PUBLISHED.get(cluster.gpu.name, cluster.gpu.name)
    n = cluster.world_size
    out = []
    if gpu not in d["gpus"]:
        out.append(f"GPU {cluster.gpu.name}")
    if d.get("precisions") and cfg.quant not in d["precisions"]:
        out.append(f"precision {cfg.quant}")
    if d.get("families") and model.family not in d["families"]:
        out.append(f"family {model.family}")
    if d.get("dense_only") and model.is_moe:
        out.append("a mixture-of-experts model")
    lo, hi = d.get("gpu_counts") or (0, math.inf)
    if not lo <= n <= hi:
        out.append(f"{n} GPUs")
    if not out:
        return None
    where = (f"fitted on {', '.join(d['gpus'])}"
             + (f" {'/'.join(d['precisions'])}" if d.get("precisions") else "")
             + (f", {lo}-{hi} GPUs" if d.get("gpu_counts") else "")
             + (f", {', '.join(d['software'][:1])}..{d['software'][-1]}" if d.get("software") else ""))
    checked = d.get("checked") or []
    if checked:
        def dist(x):
            return ((x["gpu"] != gpu) * 4 + (x["precision"] != cfg.quant) * 2
                    + abs(math.log(max(x["gpus"], 1) / n)))
        x = min(checked, key=dist)
        near = (f"nearest checked: {x['model']} on {x['gpus']} {x['gpu']} {x['precision']}, "
                f"{x['error_pct']:+.1f}% out of sample")
    else:
        e = _error_of(cal)
        near = f"its out-of-sample error there: {e:.1f}%" if e is not None else "no out-of-sample error recorded"
    return (f"outside the {getattr(cal, 'profile', None) or 'profile'}'s domain ({', '.join(out)}; {where}); "
            f"{near}")
