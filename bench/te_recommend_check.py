"""`recommend --stack te`'s #1 against our measured TE runs (issue #22 must-hold: within 3% of the
best measured layout, for each measured model and GPU count).

    python bench/te_recommend_check.py [RUNS.jsonl ...] [--calibration te] [--top 200]

For each (model with its layer count, GPUs, sequence, global batch, precision) measured with the te
stack: recommend's ranking (`api.recommend(..., stack="te")` on the record's model, cluster and
workload) twice: as `recommend --stack te` prints it (the stack's layout defaults: TP-comm overlap,
gradient_accumulation_fusion, FP8 primary weights, expandable segments, the pipeline's outputs freed) and
with the settings our runner ran (none of them; the fair comparison with the measurements). For each: its #1, whether that layout was measured and what it measured against
the best measured layout, and the rank recommend gives the measured best; where #1 was not measured
(no device time here), recommend's own predicted ratio of the measured best to its #1, and whether #1
failed when measured with the row's allocator setting (an OOM of h100x4-te-edge.jsonl; the stack's rows
have expandable segments on, the runner's off). A layout is matched on tp, pp, dp, cp, ep, etp,
vp, mbs, recompute and precision (the runner's fixed settings aside).
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # moe_check, beside this file

from advisor.api import recommend  # noqa: E402
from advisor.models.calibrate import resolve_calibration  # noqa: E402
from advisor.models.dataset import load  # noqa: E402
from advisor.models.profile_fit import on_vm  # noqa: E402
from advisor.search_spaces.space import SpaceOptions  # noqa: E402
from moe_check import runner_router_skews, shape_of  # noqa: E402  (beside this file)

RUNS = [ROOT / "data/measurements/h100x4-te.jsonl", ROOT / "data/measurements/tune-llama3-8b-h100x4-te.jsonl",
        ROOT / "data/measurements/h200x2-te.jsonl",
        ROOT / "data/measurements/h100x4-te-edge.jsonl"]
REPEAT = re.compile(r"-call\d+$")
TARGET = 0.97


def match_key(cfg) -> tuple:
    """A measured run's layout as recommend's ranking names it: the activation knobs (partial
    recompute, offloaded layers, FSDP) apart, so a run with them is not averaged into the plain layout."""
    return (cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.ep, cfg.etp, cfg.vp, cfg.mbs, cfg.recompute, cfg.quant,
            cfg.recompute_layers, tuple(cfg.recompute_modules), cfg.cpu_offload_layers, cfg.fsdp)


def short(cfg) -> str:
    return (f"tp{cfg.tp} pp{cfg.pp} dp{cfg.dp} cp{cfg.cp}" + (f" ep{cfg.ep} etp{cfg.etp}" if cfg.ep * cfg.etp > 1 else "")
            + (f" vp{cfg.vp}" if cfg.vp > 1 else "") + f" mbs{cfg.mbs}" + ("" if cfg.recompute == "none" else f" {cfg.recompute}")
            + (" fsdp" if cfg.fsdp else ""))


def failed_layouts(paths) -> dict:
    """{(model name, layers, GPUs, seq, gbs, precision, match key, expandable segments): status} of
    the runs that did not finish (OOM, crash), read from the raw records (models.dataset skips
    them). The allocator setting (the record's TrainConfig.expandable_segments) is part of the key: a
    layout that ran out of memory with expandable segments off may run with them on (the te stack's
    default)."""
    import json

    from advisor.catalog.specs import TrainConfig

    out, ran = {}, set()
    for p in paths:
        for line in Path(p).read_text().splitlines():
            d = json.loads(line) if line.strip() else {}
            if d.get("stack") != "te" or "config" not in d:
                continue
            cfg = TrainConfig.from_dict(d["config"])
            key = (d.get("model_name"), d.get("layers"), cfg.world_size, cfg.seq, cfg.gbs, cfg.precision, match_key(cfg),
                   cfg.expandable_segments)
            if d.get("status", "ok") == "ok":
                ran.add(key)
            else:
                out[key] = d["status"]
    # a layout that failed once (te-l8b-fp8-16: a config error) but ran on a later call with the
    # same allocator setting is measured, not failed
    return {k: v for k, v in out.items() if k not in ran}


def settings_of(cfg) -> str | None:
    """Which settings a te run ran with: "runner" (the runner's defaults: torch's allocator as it
    comes, BF16 weights), "stack" (the te stack's, as recommend --stack te ranks: expandable
    segments, TE's cross entropy and, in FP8, FP8 primary weights), None (a mix of the two)."""
    if not cfg.expandable_segments and not cfg.fp8_param_gather:
        return "runner"
    if cfg.expandable_segments and cfg.cross_entropy_impl == "te" and (cfg.fp8_param_gather or cfg.quant == "bf16"):
        return "stack"
    return None


def measured_groups(paths) -> dict:
    """{settings: {(model name, GPUs, seq, gbs, precision): {match key: (tokens/s/GPU mean over repeats,
    cfg, model, cluster)}}}: settings None over every te run, "runner" / "stack" over the runs with
    those settings (settings_of)."""
    acc = {s: defaultdict(lambda: defaultdict(list)) for s in (None, "runner", "stack")}
    info = {}
    for r in load([str(p) for p in paths]).records:
        if r.stack != "te":
            continue
        g = (r.model.name, r.cluster.world_size, r.cfg.seq, r.cfg.gbs, r.cfg.precision)
        k = match_key(r.cfg)
        for s in {None, settings_of(r.cfg)}:
            acc[s][g][k].append(r.y["tokens_per_s_per_gpu"])
            info[(s, g, k)] = (r.cfg, r.model, r.cluster)
    return {s: {g: {k: (sum(v) / len(v), *info[(s, g, k)]) for k, v in d.items()} for g, d in a.items()}
            for s, a in acc.items()}


def check(group, meas: dict, calibration: str, top: int, runner_settings: bool, failed: dict | None = None) -> dict:
    """recommend's #1 against the best measured layout of the group. With the runner's settings the
    best is taken among the layouts the runner can run: one that ran out of memory with its allocator
    setting (expandable segments off) and ran only with them on is not the runner's to beat."""
    name, gpus, seq, gbs, prec = group
    _, cfg0, model, cluster = next(iter(meas.values()))
    if runner_settings and failed:
        base = (model.name.split("[")[0], model.num_layers, gpus, seq, gbs, prec)
        runnable = {k: v for k, v in meas.items() if (*base, k, False) not in failed}
        meas = runnable or meas
    # the runner's settings (runners.megatron_args.runner_config): BF16 weights, torch's allocator as it
    # comes (expandable segments off) and megatron-core's default of keeping the pipeline's outputs
    options = SpaceOptions.wide(tp_comm_overlap=False, gradient_accumulation_fusion=False,
                                cross_entropy_impl="native", fp8_param_gather=False, expandable_segments=False,
                                deallocate_pipeline_outputs=False, nccl_lazy_init=False,
                                fsdp=(False,)) if runner_settings else None  # the runner does not run Megatron FSDP
    res = recommend(model, cluster, seq=seq, gbs=gbs, precision=prec, fp8_recipe=cfg0.fp8_recipe, top=top,
                    calibration=calibration, stack="te", options=options)
    ranked = [match_key(x.config) for x in res.recommendations]
    best_k = max(meas, key=lambda k: meas[k][0])
    first = res.recommendations[0] if res.recommendations else None
    k1 = ranked[0] if ranked else None
    pos = ranked.index(best_k) if best_k in ranked else None
    pred_ratio = (res.recommendations[pos].prediction.tokens_per_s_per_gpu / first.prediction.tokens_per_s_per_gpu
                  if pos is not None else None)
    return {"first": first, "k1": k1, "pred_ratio": pred_ratio,
            "ratio": meas[k1][0] / meas[best_k][0] if k1 in meas else None,
            "best": meas[best_k], "best_rank": ranked.index(best_k) + 1 if best_k in ranked else None,
            "n_ranked": len(ranked), "feasible": res.feasible}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", default=[str(p) for p in RUNS])
    ap.add_argument("--calibration", default="default", help="the te profile (default) or a calibration file")
    ap.add_argument("--top", type=int, default=200, help="how deep recommend's ranking is searched for the measured best")
    a = ap.parse_args(argv)
    # the profile with our VM's host issue costs (profile_fit.on_vm): the layouts are ranked for the
    # machine our runs measured
    cal = on_vm(resolve_calibration(a.calibration, "te"))
    # MoE groups ranked for the router our runs ran: the runner's untrained routers' skew measured at
    # init (moe_check.runner_router_skews; te_check predicts these runs with it too), not the trained
    # router's moe_router_skew the profile ships
    skews = runner_router_skews([Path(p) for p in a.paths], "te")
    # each row compares like with like where a group has runs with its settings (sessions 27's x4-te-s27*
    # ran the stack's #1s and the groups' best with the stack's settings); else every run of the group
    by_settings = measured_groups(a.paths)
    groups = by_settings[None]
    failed = failed_layouts(a.paths)
    print(f"recommend --stack te's #1 vs the best measured layout (target: >= {TARGET:.0%} of it)")
    if skews:
        print("MoE groups ranked with the runner's measured at-init router skew: "
              + ", ".join(f"{k} {v:.2f}" for k, v in sorted(skews.items())))
    print(f"{'model':<26}{'GPUs':>4}{'seq':>6}{'gbs':>4} {'prec':<5}{'n':>3}  {'settings':<9} {'#1':<26}"
          f"{'#1 / best measured':>36}  best measured (its rank)")
    fails = stack_fails = 0
    for g in sorted(groups, key=str):
        meas = groups[g]
        if len(meas) < 2:
            continue
        _, _, m0, _ = next(iter(meas.values()))
        skew = skews.get(shape_of(m0)) if m0.is_moe else None
        cal_g = cal if skew is None else dataclasses.replace(cal, constants=cal.constants.replace(moe_router_skew=skew))
        for runner in (False, True):
            own = by_settings["runner" if runner else "stack"].get(g, {})
            r = check(g, own if len(own) >= 2 else meas, cal_g, a.top, runner, failed)
            first = short(r["first"].config) if r["first"] else "-"
            # the stack's allocator default is expandable segments on, the runner's off
            fail = failed.get((m0.name.split("[")[0], m0.num_layers, *g[1:], r["k1"], not runner))
            if fail:
                verdict = f"{fail} when run FAIL"
                fails += runner
                stack_fails += not runner
            elif r["ratio"] is None:
                verdict = ("not measured" + (f" (pred best/#1 {r['pred_ratio']:.3f})" if r["pred_ratio"] else ""))
            else:
                verdict = f"{r['ratio'] * 100:.1f}%" + ("" if r["ratio"] >= TARGET else " FAIL")
                fails += runner and r["ratio"] < TARGET
                stack_fails += (not runner) and r["ratio"] < TARGET
            rank = f"#{r['best_rank']}" if r["best_rank"] else f"not in top {r['n_ranked']}"
            print(f"{g[0]:<26}{g[1]:>4}{g[2]:>6}{g[3]:>4} {g[4]:<5}{len(own) if len(own) >= 2 else len(meas):>3}  "
                  f"{('runner' if runner else 'stack') + ('' if len(own) >= 2 else '*'):<9} "
                  f"{first:<26}{verdict:>36}  {short(r['best'][1])} {r['best'][0]:,.0f} tok/s/GPU ({rank})")
    print(f"\n{fails} group(s) below {TARGET:.0%} with the runner's settings; stack rows below "
          f"{TARGET:.0%} or failed: {stack_fails}")
    print("n: the runs compared (the group's runs with the row's settings; '*': fewer than 2 such runs, "
          "every run of the group)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
