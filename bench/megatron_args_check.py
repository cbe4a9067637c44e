"""Does Megatron-LM's own argument parser accept the Megatron arguments the advisor prints?

For every catalog model on every catalog cluster (and a few `<gpu>x<count>` shapes), the top-1
layout of `advisor recommend`, and every pipeline split of NVIDIA's published H100 presets
(tests/data/published_h100_presets.csv: account-for-embedding / -loss, explicit layouts), (its `megatron_args`: the production arguments, Transformer Engine)
and the same layout as this repo's runner runs it (`--transformer-impl local`) are handed to
megatron-core's ``megatron.training.arguments``: ``parse_args`` (argparse: every flag must exist,
every value must parse), then ``validate_args`` with the cluster's world size (Megatron-LM's own
consistency rules: divisibility, pipeline split, VP, overlap / distributed-optimizer, MoE, MLA).
The user's side of a command line (data, tokenizer, iterations, learning rate) is added as
``USER_ARGS``: the advisor leaves those to the user.

Needs torch and megatron-core (Python >= 3.12)::

    python bench/megatron_args_check.py [--json OUT.json]

prints one line per (model, cluster, form) and exits 1 if any is rejected."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# What a user's own command line adds to the advisor's arguments (they are not the layout's).
USER_ARGS = ["--train-iters", "10", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer"]
EXTRA_CLUSTERS = ("h100x8", "h100x64", "h200x16")


def catalog_top1(clusters=None, calibration="default") -> list[dict]:
    """(model, cluster, world size, config, production args, runner args) of the top-1 layout of
    every catalog model on every catalog cluster plus EXTRA_CLUSTERS."""
    from advisor.api import recommend
    from advisor.catalog import list_models
    from advisor.catalog.loaders import _clusters
    from advisor.catalog.specs import SpecError
    from advisor.runners.megatron_args import megatron_lm_args

    names = list(clusters) if clusters else sorted(_clusters()) + list(EXTRA_CLUSTERS)
    out = []
    for m in list_models():
        for c in names:
            try:
                res = recommend(m.name, c, top=1, calibration=calibration)
            except SpecError as e:  # fits nowhere on this cluster: nothing printed, nothing to check
                out.append({"model": m.name, "cluster": c, "skipped": str(e)})
                continue
            if not res.recommendations:
                out.append({"model": m.name, "cluster": c, "skipped": "no feasible layout"})
                continue
            r = res.recommendations[0]
            out.append({"model": m.name, "cluster": c, "world_size": res.cluster.world_size,
                        "arch_major": 8 if res.cluster.gpu.name.startswith("a100") else 9,
                        "config": r.config.key(), "vocab_size": res.model.vocab_size,
                        "production": shlex.split(r.megatron_args),
                        "runner": megatron_lm_args(res.model, r.config, runner=True)})
    return out


PRESETS = Path(__file__).resolve().parents[1] / "tests" / "data" / "published_h100_presets.csv"


def preset_layouts() -> list[dict]:
    """The published H100 pre-training presets (tests/data/published_h100_presets.csv: NVIDIA's
    layouts of the catalog models) as `recommend` enumerates them: every pipeline split the space
    offers for the preset's TP / PP / CP / VP / EP / MBS (even, account-for-embedding / -loss,
    explicit --pipeline-model-parallel-layout), with the production and runner arguments."""
    import csv

    from advisor.api import megatron_args, resolve
    from advisor.models.published import CATALOG
    from advisor.runners.megatron_args import megatron_lm_args
    from advisor.search_spaces.space import Workload, enumerate_layouts

    seen, out = set(), []
    with open(PRESETS, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["task"] == "pretrain" and not r["num_layers_run"]]
    for r in rows:
        name = CATALOG.get(r["model_key"])
        if name is None:
            continue
        i = lambda k, d=1: int(r[k]) if r[k] else d  # noqa: E731
        want = dict(tp=i("tp"), pp=i("pp"), cp=i("cp"), vp=i("vp"), ep=i("ep"), mbs=i("mbs"))
        gpus = int(r["num_gpus"])
        wl = Workload(seq=int(r["seq_len"]), gbs=int(r["gbs"]),
                      precision="fp8" if r["precision"].upper().startswith("FP8") else "bf16")
        key = (name, gpus, wl, tuple(want.items()))
        if key in seen:
            continue
        seen.add(key)
        m, c = resolve(name, f"h100x{gpus}")
        splits = {}
        for cfg in enumerate_layouts(m, c, wl):
            if cfg.recompute == "none" and all(getattr(cfg, k) == v for k, v in want.items()):
                split = (cfg.account_for_embedding, cfg.account_for_loss, cfg.pipeline_layout,
                         cfg.pp_first_layers, cfg.pp_last_layers)
                splits.setdefault(split, cfg)
        for cfg in splits.values():
            out.append({"model": name, "cluster": f"h100x{gpus} (preset row {r['row_id']})",
                        "world_size": c.world_size, "arch_major": 9, "config": cfg.key(),
                        "vocab_size": m.vocab_size, "production": shlex.split(megatron_args(m, cfg)),
                        "runner": megatron_lm_args(m, cfg, runner=True)})
    return out


HF_CONFIGS = Path(__file__).resolve().parents[1] / "tests" / "data" / "hf_configs"
# The 2025-26 families (tests/data/hf_configs): each on h100x64 at 8K, and at 32K so that the
# top layout of the windowed ones (Gemma, gpt-oss, Phi-3) is likely to use CP (--cp-comm-type).
FAMILIES = ("gemma-2-9b", "gemma-2-27b", "gemma-3-1b", "gemma-3-27b", "phi-3-mini-4k", "phi-4", "olmo-2-7b",
            "olmo-2-13b", "granite-3.1-8b", "granite-3.1-3b-a800m", "glm-4-9b-0414", "glm-4.5", "llama-4-scout",
            "llama-4-maverick", "gpt-oss-120b")


def family_layouts(cluster: str = "h100x64", big: str = "h100x256") -> list[dict]:
    """The top-1 layout of every family config at seq 8192 and 32768, with a CP 2 variant of it
    for the windowed ones (Transformer Engine needs all_gather CP for their windowed layers)."""
    from advisor.api import megatron_args, recommend
    from advisor.catalog.specs import SpecError
    from advisor.runners.megatron_args import megatron_lm_args

    out = []
    for fam in FAMILIES:
        path = str(HF_CONFIGS / f"{fam}.json")
        for seq in (8192, 32768):
            try:
                res = recommend(path, cluster, top=1, seq=seq)
            except SpecError as e:  # GLM-4.5, Llama 4 Maverick: fit from 128 H100 on
                try:
                    res = recommend(path, big, top=1, seq=seq)
                except SpecError:
                    out.append({"model": fam, "cluster": f"{cluster} seq {seq}", "skipped": str(e)})
                    continue
            if not res.recommendations:
                out.append({"model": fam, "cluster": f"{cluster} seq {seq}", "skipped": "no feasible layout"})
                continue
            m, c = res.model, res.cluster
            cfgs = [res.recommendations[0].config]
            if m.window_size and cfgs[0].cp == 1 and cfgs[0].dp % 2 == 0:
                cfgs.append(cfgs[0].replace(cp=2, dp=cfgs[0].dp // 2))
            for cfg in cfgs:
                out.append({"model": fam, "cluster": f"{c.name} seq {seq}", "world_size": c.world_size,
                            "arch_major": 9, "config": cfg.key(), "vocab_size": m.vocab_size,
                            "production": shlex.split(megatron_args(m, cfg)),
                            "runner": megatron_lm_args(m, cfg, runner=True)})
    return out


# Megatron-LM asserts this environment variable with TP > 1 or CP > 1 on GPUs before Blackwell
# (its example scripts export it); the command runner sets it too (runners/command.py).
ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


@contextlib.contextmanager
def _gpu_arch(major: int):
    """validate_args asks the GPU for its compute capability (Hopper: 9). Without a GPU (CPU
    tests), answer for the cluster's GPU; with one, ask it."""
    import torch
    from megatron.training import arguments as A

    if torch.cuda.is_available():
        yield
        return
    saved = A.get_device_arch_version, torch.cuda.get_device_capability
    A.get_device_arch_version = lambda: major
    torch.cuda.get_device_capability = lambda *a, **k: (major, 0)
    try:
        yield
    finally:
        A.get_device_arch_version, torch.cuda.get_device_capability = saved


def megatron_accepts(args: list[str], world_size: int, arch_major: int = 9) -> str | None:
    """None when megatron.training.arguments parses and validates `args` for `world_size` ranks,
    else the first line of its complaint. `arch_major`: the GPU's compute capability when no GPU
    is present (8 Ampere, 9 Hopper)."""
    from megatron.training import arguments as A

    keys = ("WORLD_SIZE", "RANK", "LOCAL_RANK", *ENV)
    old_argv, old_env = sys.argv, {k: os.environ.get(k) for k in keys}
    sys.argv = ["pretrain_gpt.py", *args]
    os.environ.update(WORLD_SIZE=str(world_size), RANK="0", LOCAL_RANK="0", **ENV)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), _gpu_arch(arch_major):
            ns = A.parse_args()
            A.validate_args(ns, {})
        return None
    except SystemExit as e:  # argparse: an unknown flag or a bad value
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        return (lines[-1] if lines else f"argparse exit {e.code}")[:300]
    except Exception as e:  # noqa: BLE001 - validate_args asserts and raises
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
    finally:
        sys.argv = old_argv
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(clusters=None, calibration="default", presets: bool = False, families: bool = True) -> list[dict]:
    rows = []
    items = catalog_top1(clusters, calibration) + (preset_layouts() if presets else [])
    for item in items + (family_layouts() if families else []):
        if "skipped" in item:
            rows.append(item)
            continue
        for form in ("production", "runner"):
            extra = USER_ARGS if form == "production" else []
            if form == "production":
                extra = extra + ["--vocab-size", str(item["vocab_size"])]
            err = megatron_accepts(item[form] + extra, item["world_size"], item["arch_major"])
            rows.append({"model": item["model"], "cluster": item["cluster"], "form": form,
                         "world_size": item["world_size"], "config": item["config"],
                         "accepted": err is None, "error": err,
                         "args": " ".join(item[form] + extra)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write every row (args included) here")
    ap.add_argument("--calibration", default="default")
    ap.add_argument("--no-presets", action="store_true", help="only the catalog's top-1 layouts")
    ap.add_argument("--no-families", action="store_true", help="leave out the HF family configs (tests/data/hf_configs)")
    o = ap.parse_args(argv)
    t0 = time.time()
    import megatron.core
    import torch

    rows = run(calibration=o.calibration, presets=not o.no_presets, families=not o.no_families)
    bad = [r for r in rows if r.get("accepted") is False]
    checked = [r for r in rows if "accepted" in r]
    for r in rows:
        if "skipped" in r:
            print(f"skip    {r['model']:16s} {r['cluster']:12s} {r['skipped'][:100]}")
        else:
            print(f"{'ok' if r['accepted'] else 'REJECT':7s} {r['model']:16s} {r['cluster']:12s} "
                  f"{r['form']:10s} {r['config']}" + (f"  <- {r['error']}" if r["error"] else ""))
    print(f"{len(checked) - len(bad)} of {len(checked)} argument lines accepted by megatron.training.arguments "
          f"(megatron-core {getattr(megatron.core, '__version__', '?')}, torch {torch.__version__}, "
          f"Python {sys.version.split()[0]}); {sum('skipped' in r for r in rows)} pairs fit nowhere; "
          f"{time.time() - t0:.0f} s")
    if o.json:
        Path(o.json).write_text(json.dumps({"rows": rows, "user_args": USER_ARGS}, indent=1) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
