"""Which memory term of the analytical model is off? For every pipeline stage of every usable
trial with per-stage memory and no recompute: the measured peak allocated memory minus the
model's weights + gradients + optimizer states, fitted by least squares as

    const + a_norm * norm activations + a_tp * TP-sharded activations + a_logits * logits   (GiB)

with the model's terms before fragmentation (`models.memory`): "norm" is the part of a layer's
stored activations that tensor parallelism does not shard without sequence parallelism (the two
norm inputs and outputs, 4·s·b·h), "TP-sharded" is the rest (q, k, v, attention output, MLP),
both times the stage's layers and in-flight micro-batches. A coefficient of 1 means the model's
term is right; `const` is what no term explains.

    python bench/memory_terms.py data/measurements/*.jsonl [--model llama3-8b] [--rows]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from advisor.models.constants import DEFAULT, GIB
from advisor.models.dataset import load
from advisor.models.memory import layer_activation_bytes, stage_memory
from advisor.search_spaces.layout import in_flight_microbatches, layer_kind_counts, stage_layers


def stage_rows(paths, model_prefix: str = ""):
    """(id, stage, allocated - static, norm GiB, TP-sharded GiB, logits GiB) per measured stage."""
    lines = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            lines.update({f"{Path(path).name}:{n}": line for n, line in enumerate(f, 1)})
    out = []
    for r in load(paths).records:  # usable records only (`advisor fit` lists the rest)
        per_stage = (json.loads(lines[r.source]).get("memory") or {}).get("peak_gib_per_stage")
        if not per_stage or r.cfg.recompute != "none" or not r.model.name.startswith(model_prefix):
            continue
        cfg, m = r.cfg, r.model
        sp = cfg.tp if cfg.sequence_parallel else 1
        norm_per_layer = 4 * cfg.seq / cfg.cp * cfg.mbs * m.hidden_size / sp * DEFAULT.bytes_activation
        layers = stage_layers(m, cfg)
        for st, sm in enumerate(stage_memory(m, cfg, DEFAULT)[:len(per_stage)]):
            kinds = layer_kind_counts(m, layers[st])
            total = sum(k * layer_activation_bytes(m, i, cfg, DEFAULT) for i, k in kinds.items())
            inflight = in_flight_microbatches(cfg, st)
            norm = inflight * len(layers[st]) * norm_per_layer / GIB
            sharded = inflight * total / GIB - norm
            static = sm.weights_gib + sm.grads_gib + sm.optimizer_gib
            out.append((r.id, st, per_stage[st] - static, norm, sharded,
                        sm.logits_gib / (1.0 + DEFAULT.fragmentation)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--model", default="", help="only models whose name starts with this")
    ap.add_argument("--rows", action="store_true", help="print every stage")
    a = ap.parse_args()
    rows = stage_rows(a.paths, a.model)
    if len(rows) < 5:
        raise SystemExit(f"error: {len(rows)} measured stages without recompute; need at least 5")
    X = np.array([[1.0, nm, sh, lg] for _, _, _, nm, sh, lg in rows])
    y = np.array([row[2] for row in rows])
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    fit = X @ coef
    print(f"{len(rows)} measured stages ({len({row[0] for row in rows})} trials), allocated - static GiB =")
    print(f"  {coef[0]:.2f} + {coef[1]:.2f} x norm + {coef[2]:.2f} x TP-sharded + {coef[3]:.2f} x logits"
          f"   (rms residual {np.sqrt(np.mean((y - fit) ** 2)):.2f} GiB)")
    model = X[:, 1:].sum(1)
    print(f"  measured / model activations + logits: median {np.median(y / model):.2f} "
          f"(range {np.min(y / model):.2f}-{np.max(y / model):.2f})")
    if a.rows:
        for (rid, st, meas, nm, sh, lg), f in zip(rows, fit):
            print(f"  {rid:18s} stage {st}  measured {meas:6.2f}  model {nm + sh + lg:6.2f}  fit {f:6.2f}")


if __name__ == "__main__":
    main()
