"""Checks the advisor's pipeline splits and Megatron arguments against megatron-core itself
(torch + megatron-core 0.19.2; no GPU needed, no process group).

1. Layer placement: for every split the search space generates (even, --account-for-embedding/
   loss-in-pipeline-split, first / last stage, --pipeline-model-parallel-layout) over a grid of
   layer counts, pp and vp, plus the published presets: megatron-core's TransformerConfig
   (its own validation) and get_num_layers_to_build / get_transformer_layer_offset for every
   (pipeline rank, virtual stage) against advisor.search_spaces.layout.pipeline_plan.
2. Arguments: `advisor recommend`'s top-1 for every catalog model on several clusters, and the
   published presets as `advisor predict` would print them: the Megatron-LM command line parsed by
   megatron-training's own parser (add_megatron_arguments), then validate_args, then
   core_transformer_config_from_args (the TransformerConfig a run would build).

    python bench/megatron_layout_check.py --out DIR      # on a machine with torch + megatron-core
    python bench/megatron_layout_check.py --dry-run      # CPU rehearsal: the advisor side only

Writes DIR/layout_check.jsonl (one line per case) and prints a summary table.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.api import layout_from_flags, megatron_args, recommend, resolve  # noqa: E402
from advisor.catalog import load_model  # noqa: E402
from advisor.catalog.specs import TrainConfig  # noqa: E402
from advisor.search_spaces.layout import pipeline_plan  # noqa: E402
from advisor.search_spaces.space import SpaceOptions, split_choices  # noqa: E402

GRID_LAYERS = (32, 48, 56, 61, 80, 94, 96, 126)
GRID_PP = (2, 3, 4, 8, 16)
PRESETS = [  # (model, cluster, flags): the published H100 presets that need an uneven split
    ("llama3.1-405b", "h100x1024", dict(tp=8, pp=8, cp=2, vp=8, mbs=1, gbs=1536, seq=8192,
                                        account_for_embedding=True, account_for_loss=True)),
    ("qwen3-235b-a22b", "h100x256", dict(tp=2, pp=8, vp=4, ep=32, mbs=1, gbs=8192, seq=4096,
                                         account_for_embedding=True, account_for_loss=True)),
    ("deepseek-v3", "h100x1024", dict(tp=2, pp=8, ep=64, mbs=1, gbs=8192, seq=4096, pipeline_layout="Et|(tt|)*30L")),
    ("llama3-70b", "h100x64", dict(tp=4, pp=4, cp=2, vp=5, mbs=1, gbs=128, seq=8192)),
    ("nemotron4-340b", "h100x128", dict(tp=8, pp=8, vp=12, mbs=1, gbs=32, seq=4096)),
    ("qwen3-30b-a3b", "h100x16", dict(tp=1, pp=2, vp=24, ep=8, mbs=2, gbs=512, seq=4096)),
]
RECOMMEND = [(m, c) for m in ("llama3-8b", "llama3-70b", "llama3.1-405b", "gpt3-175b", "nemotron4-15b",
                              "nemotron4-340b", "mixtral-8x7b", "mixtral-8x22b", "qwen3-30b-a3b",
                              "qwen3-235b-a22b", "deepseek-v3")
             for c in ("h100x64", "h100x1024")]


def split_cases() -> list[tuple[int, TrainConfig]]:
    out = []
    for n in GRID_LAYERS:
        for pp in GRID_PP:
            for split, vps in split_choices(n, pp, SpaceOptions()):
                for vp in vps:
                    out.append((n, TrainConfig(pp=pp, vp=vp, gbs=pp * 4, **split)))
    return out


def megatron_split(n: int, cfg: TrainConfig) -> list[tuple[int, int]]:
    """(offset, layers) of every chunk in chunk order, as megatron-core builds them."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    vp = cfg.vp if cfg.vp > 1 else None
    tc = TransformerConfig(num_layers=n, hidden_size=64, num_attention_heads=8, pipeline_dtype=torch.bfloat16,
                           pipeline_model_parallel_size=cfg.pp, virtual_pipeline_model_parallel_size=vp,
                           num_layers_in_first_pipeline_stage=cfg.pp_first_layers,
                           num_layers_in_last_pipeline_stage=cfg.pp_last_layers,
                           account_for_embedding_in_pipeline_split=cfg.account_for_embedding,
                           account_for_loss_in_pipeline_split=cfg.account_for_loss,
                           pipeline_model_parallel_layout=cfg.pipeline_layout)
    ps.set_pipeline_model_parallel_world_size(cfg.pp)
    ps.set_virtual_pipeline_model_parallel_world_size(vp)
    out = []
    for s in range(cfg.vp):
        for r in range(cfg.pp):
            ps.set_pipeline_model_parallel_rank(r)
            stage = s if vp else None
            out.append((get_transformer_layer_offset(tc, vp_stage=stage, pp_rank=r),
                        get_num_layers_to_build(tc, vp_stage=stage, pp_rank=r)))
    return out


def _has_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def parse_and_validate(args: list[str], world: int, vocab: int) -> dict:
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.arguments import add_megatron_arguments, validate_args

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    # what a run adds (data, tokenizer, iterations); without Transformer Engine on this machine, the
    # TE-only RoPE fusion off so that the TransformerConfig can be built
    extra = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab),
             "--train-iters", "10", "--lr", "1e-4"] + ([] if _has_te() else ["--no-rope-fusion"])
    out = {"parsed": False, "validated": False, "config": False}
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            ns = parser.parse_args(args + extra)
    except SystemExit:
        out["error"] = "parse: " + err.getvalue().strip().splitlines()[-1]
        return out
    out["parsed"] = True
    ns.rank, ns.world_size = 0, world
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            validate_args(ns, {})
        out["validated"] = True
        with contextlib.redirect_stdout(io.StringIO()):
            tc = core_transformer_config_from_args(ns)
        out["config"] = True
        out["vp"] = tc.virtual_pipeline_model_parallel_size
    except Exception as e:  # noqa: BLE001 - recorded: the message is the finding
        out["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dry-run", action="store_true", help="advisor side only (no torch / megatron)")
    a = ap.parse_args()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron-LM asserts it with TP / CP
    rows = []
    t0 = time.time()
    for n, cfg in split_cases():
        plan = pipeline_plan(n, cfg)
        ours = [(r.start, len(r)) for r in plan.chunk_ranges]
        row = {"check": "split", "layers": n, "pp": cfg.pp, "vp": cfg.vp, "first": cfg.pp_first_layers,
               "last": cfg.pp_last_layers, "acc_e": cfg.account_for_embedding, "acc_l": cfg.account_for_loss,
               "layout": cfg.pipeline_layout, "advisor": ours}
        if not a.dry_run:
            try:
                theirs = megatron_split(n, cfg)
                row.update(megatron=theirs, match=theirs == ours)
            except Exception as e:  # noqa: BLE001
                row.update(match=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
    cases = []
    for model, cluster, flags in PRESETS:
        m, c = resolve(model, cluster)
        cases.append(("preset", model, cluster, m, c, layout_from_flags(m, c, flags)))
    for model, cluster in RECOMMEND:
        try:
            res = recommend(model, cluster, top=1, calibration=None)
        except Exception as e:  # noqa: BLE001 - e.g. fits nowhere: recorded
            rows.append({"check": "args", "source": "recommend", "model": model, "cluster": cluster,
                         "error": f"advisor: {e}"})
            continue
        cases.append(("recommend", model, cluster, res.model, res.cluster, res.recommendations[0].config))
    for source, model, cluster, m, c, cfg in cases:
        args = shlex.split(megatron_args(m, cfg))
        row = {"check": "args", "source": source, "model": model, "cluster": cluster, "key": cfg.key(),
               "args": shlex.join(args)}
        if not a.dry_run:
            row.update(parse_and_validate(args, c.world_size, load_model(model).vocab_size))
        rows.append(row)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "layout_check.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    splits = [r for r in rows if r["check"] == "split"]
    argrows = [r for r in rows if r["check"] == "args"]
    print(f"{len(splits)} splits, {len(argrows)} argument lines, {time.time() - t0:.1f} s"
          + (" (dry run: advisor side only)" if a.dry_run else ""))
    if not a.dry_run:
        bad = [r for r in splits if not r.get("match")]
        print(f"splits: {len(splits) - len(bad)} match megatron-core, {len(bad)} do not")
        for r in bad[:20]:
            print("  MISMATCH", {k: r.get(k) for k in ("layers", "pp", "vp", "first", "last", "acc_e", "acc_l",
                                                        "layout", "error")})
        print(f"{'source':<10} {'model':<16} {'cluster':<10} {'parsed':>6} {'valid':>6} {'config':>6}  error")
        for r in argrows:
            print(f"{r['source']:<10} {r['model']:<16} {r['cluster']:<10} {str(r.get('parsed', '-')):>6} "
                  f"{str(r.get('validated', '-')):>6} {str(r.get('config', '-')):>6}  {r.get('error', '')}")


if __name__ == "__main__":
    main()
