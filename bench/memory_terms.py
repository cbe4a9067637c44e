"""Which memory term of the analytical model is off? For every pipeline stage of every usable
trial with per-stage memory and no recompute: the measured peak allocated memory minus the
model's weights + gradients + optimizer states (with the byte counts of the record's stack
profile: `te` keeps bf16 gradient buffers; the loss with the record's own cross entropy,
TrainConfig.cross_entropy_impl), fitted by least squares as

    const + a_norm * norm activations + a_tp * TP-sharded activations + a_logits * logits   (GiB)

with the model's terms before fragmentation (`models.memory`): "norm" is the part of a layer's
stored activations that tensor parallelism does not shard without sequence parallelism (the two
norm inputs and outputs, 4·s·b·h), "TP-sharded" is the rest (q, k, v, attention output, MLP),
both times the stage's layers and in-flight micro-batches. A coefficient of 1 means the model's
term is right; `const` is what no term explains.

Then the caching allocator's reserved-but-unallocated memory of the same stages (max over the
stage's ranks of peak reserved - peak allocated), against the model's activations + logits
(what `fragmentation` multiplies): dense and MoE apart, and MoE with EP > 1 apart (variable-size
token buffers).

    python bench/memory_terms.py data/measurements/*.jsonl [--stack te] [--moe|--dense] [--model llama3-8b] [--rows]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from advisor.models.calibrate import resolve_calibration
from advisor.models.constants import GIB
from advisor.models.dataset import load
from advisor.models.memory import layer_activation_bytes, outputs_in_flight, stage_memory
from advisor.search_spaces.layout import in_flight_microbatches, layer_kind_counts, stage_layers


def stage_rows(paths, model_prefix: str = "", stack: str = "", moe: bool | None = None):
    """Per measured stage: {id, stage, stack, moe, ep, alloc (allocated - static), free (reserved -
    allocated), norm, sharded, outputs (the pipeline's kept stage outputs), logits (GiB, the model's,
    before fragmentation)}, with the stack's
    profile constants."""
    lines = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            lines.update({f"{Path(path).name}:{n}": line for n, line in enumerate(f, 1)})
    consts = {}
    out = []
    for r in load(paths).records:  # usable records only (`advisor fit` lists the rest)
        mem = json.loads(lines[r.source]).get("memory") or {}
        per_stage = mem.get("peak_gib_per_stage")
        if (not per_stage or r.cfg.recompute != "none" or not r.model.name.startswith(model_prefix)
                or (stack and r.stack != stack) or (moe is not None and r.model.is_moe != moe)):
            continue
        if r.stack not in consts:
            consts[r.stack] = resolve_calibration("default", r.stack).screening_constants
        c = consts[r.stack]
        cfg, m = r.cfg, r.model
        sp = cfg.tp if cfg.sequence_parallel else 1
        norm_per_layer = 4 * cfg.seq / cfg.cp * cfg.mbs * m.hidden_size / sp * c.bytes_activation
        layers = stage_layers(m, cfg)
        alloc, reserved = mem.get("peak_allocated_gib_per_rank") or [], mem.get("peak_reserved_gib_per_rank") or []
        per_rank = len(alloc) // len(per_stage) if alloc and len(alloc) % len(per_stage) == 0 else 0
        for st, sm in enumerate(stage_memory(m, cfg, c, gpu=r.cluster.gpu)[:len(per_stage)]):
            kinds = layer_kind_counts(m, layers[st])
            total = sum(k * layer_activation_bytes(m, i, cfg, c) for i, k in kinds.items())
            inflight = in_flight_microbatches(cfg, st)
            norm = inflight * len(layers[st]) * norm_per_layer / GIB
            sharded = inflight * total / GIB - norm
            static = sm.weights_gib + sm.grads_gib + sm.optimizer_gib
            ranks = range(st * per_rank, (st + 1) * per_rank)
            free = (max(reserved[k] - alloc[k] for k in ranks) if per_rank and len(reserved) == len(alloc)
                    else float("nan"))
            # the stage outputs a pipeline keeps when it does not free them once sent
            # (deallocate_pipeline_outputs off: models.memory.output_in_flight_table)
            kept = 0.0 if cfg.deallocate_pipeline_outputs else (
                outputs_in_flight(cfg, st) * cfg.seq / cfg.cp * cfg.mbs * m.hidden_size / sp * c.bytes_activation / GIB)
            out.append({"id": r.id, "stage": st, "stack": r.stack, "moe": m.is_moe, "ep": cfg.ep,
                        "alloc": per_stage[st] - static, "free": free, "norm": norm, "sharded": sharded,
                        "outputs": kept, "logits": sm.logits_gib / (1.0 + c.fragmentation)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--model", default="", help="only models whose name starts with this")
    ap.add_argument("--stack", default="", help="only records of this stack (local / te)")
    kind = ap.add_mutually_exclusive_group()
    kind.add_argument("--moe", action="store_const", const=True, dest="moe")
    kind.add_argument("--dense", action="store_const", const=False, dest="moe")
    ap.add_argument("--rows", action="store_true", help="print every stage")
    a = ap.parse_args()
    rows = stage_rows(a.paths, a.model, a.stack, a.moe)
    if len(rows) < 5:
        raise SystemExit(f"error: {len(rows)} measured stages without recompute; need at least 5")
    X = np.array([[1.0, r["norm"], r["sharded"], r["logits"]] for r in rows])
    y = np.array([r["alloc"] - r["outputs"] for r in rows])  # the kept stage outputs are known
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    fit = X @ coef
    print(f"{len(rows)} measured stages ({len({r['id'] for r in rows})} trials), allocated - static - kept "
          "pipeline outputs GiB =")
    print(f"  {coef[0]:.2f} + {coef[1]:.2f} x norm + {coef[2]:.2f} x TP-sharded + {coef[3]:.2f} x logits"
          f"   (rms residual {np.sqrt(np.mean((y - fit) ** 2)):.2f} GiB)")
    model = X[:, 1:].sum(1)
    print(f"  measured / model activations + logits: median {np.median(y / model):.2f} "
          f"(range {np.min(y / model):.2f}-{np.max(y / model):.2f})")
    print("reserved - allocated (GiB) / model activations + logits:")
    for label, sel in (("dense", lambda r: not r["moe"]), ("MoE, EP 1", lambda r: r["moe"] and r["ep"] == 1),
                       ("MoE, EP > 1", lambda r: r["moe"] and r["ep"] > 1)):
        g = [r for r in rows if sel(r) and np.isfinite(r["free"])]
        if g:
            f = np.array([r["free"] for r in g])
            act = np.array([r["norm"] + r["sharded"] + r["outputs"] + r["logits"] for r in g])
            print(f"  {label:12s} {len(g):3d} stages: free {np.median(f):5.2f} GiB median ({f.min():.2f}-{f.max():.2f}),"
                  f" free / activations median {np.median(f / act):.3f} ({(f / act).min():.3f}-{(f / act).max():.3f})")
    if a.rows:
        for r, f in zip(rows, fit):
            print(f"  {r['id']:20s} stage {r['stage']}  measured {r['alloc'] - r['outputs']:6.2f}  model "
                  f"{r['norm'] + r['sharded'] + r['logits']:6.2f}  fit {f:6.2f}  free {r['free']:5.2f}")


if __name__ == "__main__":
    main()
