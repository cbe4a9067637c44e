"""How well the MoE model (models/moe.py) predicts what it measures.

    python bench/moe_check.py [--quick] [--no-published] [--constants-out models/data/moe_local_fit.json]
    python bench/moe_check.py --write-te    # the TE stack's MoE constants into models/data/te_calibration.joblib
    python bench/moe_check.py --host        # our VM's MoE host issue costs fitted on our TE MoE runs

1. Our runner (`local` stack): every ok MoE record of data/measurements/ (1 x H100 proxies of
   four shapes, and the 4 x H200 Mixtral proxy). The MoE constants of `MOE_LOCAL_FIT` are fitted
   on the other shapes and checked on the one left out (leave-one-shape-out), on top of the
   `local` profile's dense constants. Per held-out shape: tokens/s MAPE, memory MAPE (peak
   reserved), and the MAPE of each timed sub-step (router, permute, experts) against the runner's
   CUDA-event times (runners/moe_probe.py). Must hold: tokens/s <= 10%, memory <= 8%.
   The fit on all shapes is what models/constants.py ships (printed at the end).
2. Load imbalance: the busiest of EP groups of experts over the mean, from the tokens per expert
   the runner recorded with forced-balanced routing, grouped as EP = 2, 4, 8 ranks would hold
   them, against `moe.imbalance`.
3. Published H100 MoE runs (`te` stack, data/published/published_fit.csv: Qwen3 30B-A3B /
   235B-A22B, GPT-OSS 120B, DeepSeek-V3): predicted with the te profile's constants plus
   `MOE_TE_SETTINGS`, then with `MOE_TE_FIT` fitted leaving one model out. Goal MAPE <= 25%.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from advisor.models import moe as MOE  # noqa: E402
from advisor.models.calibrate import DEFAULT_FILE, Calibration  # noqa: E402
from advisor.models.constants import DEFAULT, Constants  # noqa: E402
from advisor.models.dataset import load  # noqa: E402
from advisor.models.predict import predict  # noqa: E402
from advisor.models.profile_fit import without_host  # noqa: E402

MEASUREMENTS = ROOT / "data" / "measurements"
TOKENS_MAPE_MAX, MEMORY_MAPE_MAX, PUBLISHED_MAPE_GOAL = 10.0, 8.0, 25.0
TERMS = {"router_s": "moe_router_s", "permute_s": "moe_permute_s", "expert_s": "moe_expert_gemm_s"}


def shape_of(model) -> str:
    return model.name.split("[")[0].replace("-proxy", "")


def moe_rows(stack: str = "local") -> list[dict]:
    """[{record, probe terms (or None)}] for every usable MoE record of the runner's `stack`
    (a record without "stack" is the local one)."""
    files = sorted(MEASUREMENTS.glob("*.jsonl"))
    ds = load(files)
    probes, leaked = {}, {}
    for f in files:
        for line in open(f):
            r = json.loads(line)
            if r.get("moe_probe"):
                probes[r["id"]] = r["moe_probe"]["terms"]
            start = (r.get("memory") or {}).get("start_allocated_gib_per_rank") or []
            leaked[r["id"]] = max([x for x in start if x is not None], default=0.0)
    rows = [{"rec": r, "terms": probes.get(r.id)} for r in ds.records
            if r.model.is_moe and r.stack == stack]
    skews = runner_router_skews(files, stack)
    # the te stack's runs: each run's own at-init skew (run_router_skews: it falls with the
    # microbatch); the local runs keep their shape's (the estimate section 1's fit was checked with)
    own = run_router_skews(files, stack) if stack == "te" else {}
    for row in rows:
        row["skew"] = own.get(row["rec"].id, skews.get(shape_of(row["rec"].model)))
    for row in rows:  # memory of jobs that started on a GPU still holding an earlier job's leak
        if leaked.get(row["rec"].id, 0.0) > 1.0:  # (fixed in the worker since): not a memory target
            row["rec"].y = dict(row["rec"].y, memory_gib_per_gpu=math.nan)
    return rows


def runner_router_skews(files, stack: str = "local") -> dict[str, float]:
    """{shape: moe_router_skew} of the runner's untrained (at-init) aux-loss routers, measured: the
    tokens per expert that runners/moe_probe.py recorded in the aux-loss runs of the shape on
    `stack`, through moe.router_skew_from_counts: its EP = 1 runs (all E experts on one rank: the
    estimate tests/test_moe.py checks against the busiest EP group) where it has any, else rank 0's
    local experts of its EP > 1 runs (the te stack's Qwen3 proxy). A property of the run's router
    (random init, our data), not of the step's timing: an input of each run's prediction, as the
    layout is. A trained router's skew (models/constants.py moe_router_skew, 0.3) is what the
    shipped profiles predict with."""
    calls, experts = defaultdict(lambda: ([], [])), {}
    for r in aux_loss_probes(files, stack):
        shape = r["model"]["name"].split("[")[0].replace("-proxy", "")
        calls[shape][0 if r["config"].get("ep") == 1 else 1].extend(r["moe_probe"]["tokens_per_expert"])
        experts[shape] = r["model"]["moe"]["num_experts"]
    return {s: MOE.router_skew_from_counts(ep1 or epn, experts[s]) for s, (ep1, epn) in calls.items()}


def run_router_skews(files, stack: str = "te") -> dict[str, float]:
    """{record id: moe_router_skew} of each aux-loss run of `stack` with recorded tokens per expert:
    its own at-init router skew (moe.router_skew_from_counts of the counts runners/moe_probe.py
    recorded in that run: all E experts at EP = 1, rank 0's local experts at EP > 1). What the
    runner's untrained router did in that run: the skew falls with the sequences per microbatch
    (te Qwen3 proxy, EP 4: 6.3 / 4.5 / 3.1 / 0.8 at mbs 1 / 2 / 4 / 16, about skew_1 / sqrt(mbs) up
    to mbs 4: a sequence's tokens lean to the same experts at init, and more sequences average the
    lean out), which one skew per shape (runner_router_skews) cannot follow."""
    return {r["id"]: MOE.router_skew_from_counts(r["moe_probe"]["tokens_per_expert"], r["model"]["moe"]["num_experts"])
            for r in aux_loss_probes(files, stack)}


def aux_loss_probes(files, stack: str):
    """The ok records of `stack` in `files` with an aux-loss router and recorded tokens per expert."""
    for f in files:
        for line in open(f):
            r = json.loads(line)
            cfg, probe = r.get("config") or {}, r.get("moe_probe") or {}
            if (r.get("status") == "ok" and r.get("stack", "local") == stack
                    and cfg.get("moe_router") == "aux_loss" and probe.get("tokens_per_expert")):
                yield r


_RUN_C: dict = {}


def run_constants(row: dict, c: Constants) -> Constants:
    """`c` with the run's measured router skew (runner_router_skews) where its router is aux-loss."""
    skew = row.get("skew")
    if skew is None or row["rec"].cfg.moe_router != "aux_loss":
        return c
    key = (id(c), skew)
    hit = _RUN_C.get(key)
    if hit is not None and hit[0] is c:
        return hit[1]
    if len(_RUN_C) > 256:
        _RUN_C.clear()
    out = c.replace(moe_router_skew=skew)
    _RUN_C[key] = (c, out)
    return out


def local_base() -> Constants:
    """The `local` profile's constants (fitted on this runner's dense measurements)."""
    return Calibration.load(DEFAULT_FILE).screening_constants


def predict_row(row: dict, c: Constants) -> dict:
    r = row["rec"]
    p = predict(r.model, r.cluster, r.cfg, run_constants(row, c), check_legal=False)
    return {"tps": p.tokens_per_s_per_gpu, "mem": p.memory_gib_per_gpu,
            **{k: p.breakdown[v] for k, v in TERMS.items()}}


def timed_alone(row: dict) -> bool:
    """Whether the runner's sub-step times are the step model's terms: grouped GEMM experts (behind
    SequentialMLP's host-bound loop the GPU starves and every later sub-step's events measure host
    time) and EP = 1. With EP > 1 the probe times one rank (rank 0): its experts hold its own share
    of the tokens, not the busiest rank's that the model prices, and its all-to-all absorbs the
    wait for the busiest rank; only the whole step and memory are targets there."""
    return bool(row["terms"]) and row["rec"].cfg.moe_grouped_gemm and row["rec"].cfg.ep == 1


def residuals(rows: list[dict], c: Constants) -> np.ndarray:
    out = []
    for row in rows:
        p = predict_row(row, c)
        y = row["rec"].y
        out.append(math.log(p["tps"] / y["tokens_per_s_per_gpu"]))
        if math.isfinite(y["memory_gib_per_gpu"]):
            out.append(math.log(p["mem"] / y["memory_gib_per_gpu"]))
        # each sub-step on its own, at half the weight of the whole step; only where the experts
        # ran as grouped GEMMs: behind SequentialMLP's host-bound expert loop the GPU starves and
        # every later sub-step's events measure host time
        for k in TERMS:
            if timed_alone(row) and row["terms"].get(k, 0) > 0 and p[k] > 0:
                out.append(0.5 * math.log(p[k] / row["terms"][k]))
    return np.array(out)


def fit(rows: list[dict], base: Constants, bounds: dict[str, tuple[float, float]], max_nfev: int = 40,
        res_fn=residuals) -> Constants:
    """Bounded least squares in the log of each constant (soft-L1), a weak pull to the start."""
    from scipy.optimize import least_squares

    names = list(bounds)
    # start strictly inside the bounds: a start on a bound (moe_act_ffn_per_token's 6.0) makes the
    # first trust-region step vanish and the fit stop where it began (ftol, 2 evaluations)
    v0 = np.array([min(max(getattr(base, n), bounds[n][0] * 1.01), bounds[n][1] * 0.99) for n in names])
    lo = np.log(np.array([bounds[n][0] for n in names]) / v0)
    hi = np.log(np.array([bounds[n][1] for n in names]) / v0)

    def consts(x):
        return base.replace(**{n: float(v) for n, v in zip(names, v0 * np.exp(x))})

    def resid(x):
        return np.concatenate([res_fn(rows, consts(x)), 0.01 * x])

    res = least_squares(resid, np.zeros(len(names)), bounds=(lo, hi), loss="soft_l1", f_scale=0.05,
                        diff_step=1e-3, max_nfev=max_nfev)
    return consts(res.x)


def mape(pairs) -> float:
    pairs = [(p, y) for p, y in pairs if y and math.isfinite(y) and y > 0 and math.isfinite(p)]
    return 100 * statistics.mean(abs(p - y) / y for p, y in pairs) if pairs else math.nan


def errors(rows: list[dict], c: Constants) -> dict:
    pr = [predict_row(r, c) for r in rows]
    out = {"n": len(rows),
           "tps": mape((p["tps"], r["rec"].y["tokens_per_s_per_gpu"]) for p, r in zip(pr, rows)),
           "mem": mape((p["mem"], r["rec"].y["memory_gib_per_gpu"]) for p, r in zip(pr, rows))}
    for k in TERMS:
        out[k] = mape((p[k], r["terms"].get(k)) for p, r in zip(pr, rows) if timed_alone(r))
    return out


# The local profile's constants refitted with the MoE ones: only memory (the optimizer step's
# transient and the runtime overhead). Its step constants stay as `advisor fit` made them, so the MoE
# constants fitted here are the ones the local profile predicts with; the per-step cost they once
# absorbed (step_overhead_s 0.0955 s) is the local stack's per-parameter gradient accumulation and
# optimizer traffic (grad_accum_bytes_per_param, optimizer_bytes_per_param).
LOCAL_REFIT = {"bytes_optimizer_transient": (0.5, 8.0), "runtime_overhead_gib": (0.1, 6.0)}
LOCAL_FIT = {**MOE.MOE_LOCAL_FIT, **LOCAL_REFIT}


def local_check(quick: bool) -> tuple[bool, Constants]:
    rows = moe_rows()
    base = local_base()
    shapes = sorted({shape_of(r["rec"].model) for r in rows})
    print(f"== 1. our runner (local stack): {len(rows)} MoE records, shapes: {', '.join(shapes)}")
    nfev = 15 if quick else 40
    print(f"   analytical (local profile's dense constants, models/constants.py MoE defaults):")
    a = errors(rows, base)
    print(f"   all rows: tokens/s MAPE {a['tps']:.1f}%, memory MAPE {a['mem']:.1f}%")
    print(f"\n   leave one shape out (MOE_LOCAL_FIT fitted on the others, max_nfev {nfev}):")
    print(f"   | held-out shape | rows | tokens/s MAPE | memory MAPE | router MAPE | permute MAPE | experts MAPE |")
    print(f"   |---|---|---|---|---|---|---|")
    ok = True
    tot_t, tot_m = [], []
    for s in shapes:
        train = [r for r in rows if shape_of(r["rec"].model) != s]
        test = [r for r in rows if shape_of(r["rec"].model) == s]
        t0 = time.time()
        c = fit(train, base, LOCAL_FIT, nfev)
        e = errors(test, c)
        tot_t.append((e["tps"], e["n"]))
        tot_m.append((e["mem"], e["n"]))
        good = e["tps"] <= TOKENS_MAPE_MAX and e["mem"] <= MEMORY_MAPE_MAX
        ok &= good
        print(f"   | {s} | {e['n']} | {e['tps']:.1f}% | {e['mem']:.1f}% | {e['router_s']:.0f}% | "
              f"{e['permute_s']:.0f}% | {e['expert_s']:.0f}% |{'' if good else ' FAIL'} ({time.time() - t0:.0f} s)")
    wt = sum(n for _, n in tot_t)
    print(f"   | all held out (row-weighted) | {wt} | {sum(x * n for x, n in tot_t) / wt:.1f}% | "
          f"{sum(x * n for x, n in tot_m) / wt:.1f}% | | | |")
    print(f"   must hold per shape: tokens/s <= {TOKENS_MAPE_MAX:.0f}%, memory <= {MEMORY_MAPE_MAX:.0f}%: "
          f"{'PASS' if ok else 'FAIL'}")
    c_all = fit(rows, base, LOCAL_FIT, nfev)
    e = errors(rows, c_all)
    print(f"\n   fitted on all shapes (in sample): tokens/s {e['tps']:.1f}%, memory {e['mem']:.1f}%, router "
          f"{e['router_s']:.0f}%, permute {e['permute_s']:.0f}%, experts {e['expert_s']:.0f}%")
    print("   " + ", ".join(f"{n}={getattr(c_all, n):.4g}" for n in LOCAL_FIT))
    return ok, c_all


def multi_gpu_check() -> bool:
    """The multi-GPU MoE runs (4 x H100: EP 1 / 2 / 4, all-to-all and allgather dispatchers, PP 2,
    sequence 2K-8K; data/measurements/h100x4-moe-*.jsonl) predicted with the shipped `local`
    profile (what `--stack local` predicts with; fitted before these runs existed): out of sample
    in the GPU count, the EP and the dispatcher."""
    c = local_base()
    rows = [r for r in moe_rows() if r["rec"].cfg.world_size > 1]
    if not rows:
        return True
    groups = defaultdict(list)
    for row in rows:
        r = row["rec"]
        p = predict(r.model, r.cluster, r.cfg, run_constants(row, c), check_legal=False)
        y = r.y
        key = f"EP{r.cfg.ep} {r.cfg.moe_dispatcher}" + (f" PP{r.cfg.pp}" if r.cfg.pp > 1 else "")
        groups[key].append((p.tokens_per_s_per_gpu, y["tokens_per_s_per_gpu"], p.memory_gib_per_gpu,
                            y["memory_gib_per_gpu"], p.mean_power_w, y.get("mean_power_w", math.nan)))
    print(f"\n== 1b. multi-GPU MoE runs, never fitted (the shipped local profile): {len(rows)} records")
    print("   | group | rows | tokens/s MAPE | memory MAPE | mean power MAPE |")
    print("   |---|---|---|---|---|")
    allv = [v for vs in groups.values() for v in vs]
    for k in sorted(groups) + ["all"]:
        v = allv if k == "all" else groups[k]
        print(f"   | {k} | {len(v)} | {mape((a[0], a[1]) for a in v):.1f}% | {mape((a[2], a[3]) for a in v):.1f}% | "
              f"{mape((a[4], a[5]) for a in v):.1f}% |")
    t, m = mape((a[0], a[1]) for a in allv), mape((a[2], a[3]) for a in allv)
    ok = t <= TOKENS_MAPE_MAX and m <= MEMORY_MAPE_MAX
    print(f"   must hold: tokens/s <= {TOKENS_MAPE_MAX:.0f}%, memory <= {MEMORY_MAPE_MAX:.0f}%: {'PASS' if ok else 'FAIL'}")
    return ok


def imbalance_check() -> None:
    print("\n== 2. load imbalance of forced-balanced routing: busiest EP group of experts / mean")
    print("   | shape | tokens/expert | EP | measured | model |")
    print("   |---|---|---|---|---|")
    for f in sorted(MEASUREMENTS.glob("h100x1-moe*.jsonl")):
        for line in open(f):
            r = json.loads(line)
            if r["status"] != "ok" or r["config"].get("moe_router") != "forced" or not r.get("moe_probe"):
                continue
            calls = r["moe_probe"]["tokens_per_expert"]
            E = len(calls[0])
            k = r["model"]["moe"]["top_k"]
            for ep in sorted({2, 4, 8, E}):
                if E % ep or ep > E:
                    continue
                ratios = []
                for cnt in calls:
                    groups = [sum(cnt[i * E // ep:(i + 1) * E // ep]) for i in range(ep)]
                    ratios.append(max(groups) / (sum(groups) / ep))
                tokens = sum(calls[0]) / k  # tokens of one microbatch
                model = MOE.expected_max_over_mean(ep, tokens * k / ep)
                print(f"   | {r['model']['name'].split('[')[0]} | {sum(calls[0]) / E:.0f} | {ep}"
                      f"{' (=E)' if ep == E else ''} | {statistics.mean(ratios):.3f} | {model:.3f} |")


def recipe_split(model, cluster, cfg):
    """A pipeline split the published recipes' PP x VP can run: as given, else with the embedding
    and the loss counted as layers (Qwen3-235B: 94 + 2 = 96 on PP8 VP4), else megatron-core's
    layout with the embedding beside the first layer and the loss alone in the last chunk
    (DeepSeek-V3: 'Et|(tt|)*30L', the recipes' own placement without the MTP layer)."""
    from advisor.search_spaces.layout import violations

    if not violations(model, cluster, cfg):
        return cfg
    acc = cfg.replace(account_for_embedding=True, account_for_loss=True)
    if not violations(model, cluster, acc):
        return acc
    chunks, rest = cfg.pp * cfg.vp, model.num_layers - 1
    if chunks > 2 and rest % (chunks - 2) == 0:
        lay = cfg.replace(pipeline_layout=f"Et|({'t' * (rest // (chunks - 2))}|)*{chunks - 2}L")
        if not violations(model, cluster, lay):
            return lay
    return cfg


def te_on_vm() -> Constants:
    """The shipped te profile's constants with the TE stack's MoE settings (moe.te_moe_constants) and
    our VM's host issue costs, dense and MoE, as the profile records them (profile_fit.on_vm): how
    our TE runs are predicted."""
    import dataclasses

    from advisor.models.profile_fit import on_vm
    from advisor.models.profiles import STACKS

    cal = Calibration.load(STACKS["te"].file)
    return on_vm(dataclasses.replace(cal, constants=MOE.te_moe_constants(cal.screening_constants))).constants


def own_log_errors(rows: list[dict], c: Constants) -> np.ndarray:
    """log(predicted / measured tokens/s) of our own runs (moe_rows entries), each with its own router
    skew (run_constants)."""
    return np.array([math.log(predict(x["rec"].model, x["rec"].cluster, x["rec"].cfg, run_constants(x, c),
                                      check_legal=False).tokens_per_s_per_gpu / x["rec"].y["tokens_per_s_per_gpu"])
                     for x in rows])


def host_check(quick: bool) -> None:
    """Our VM's MoE host issue costs (moe.MOE_VM_HOST_FIT) fitted on our TE MoE runs (first record of
    each job; the published rows carry no host cost), on all of them and leaving each proxy shape
    out: the values moe.MOE_TE_VM_HOST ships and how they carry to a shape the fit has not seen."""
    from scipy.optimize import least_squares

    te = te_on_vm()
    own = [r for r in moe_rows("te") if "-call" not in r["rec"].id]
    names = list(MOE.MOE_VM_HOST_FIT)
    lo = np.array([MOE.MOE_VM_HOST_FIT[n][0] for n in names])
    hi = np.array([MOE.MOE_VM_HOST_FIT[n][1] for n in names])

    def consts(u):
        return te.replace(**{n: float(v) for n, v in zip(names, lo + (hi - lo) * u)})

    def fit_on(rows):  # bounded soft-L1 least squares from two starts, the better optimum
        best = None
        for u0 in (np.full(len(names), 0.3), np.full(len(names), 0.7)):
            r = least_squares(lambda u: own_log_errors(rows, consts(u)), u0, bounds=(0.0, 1.0), loss="soft_l1", f_scale=0.1,
                              diff_step=1e-2, max_nfev=15 if quick else 40)
            best = r if best is None or r.cost < best.cost else best
        return consts(best.x)

    def mape(e):
        return 100 * float(np.mean(np.abs(np.exp(e) - 1)))

    def values(c):
        return ", ".join(f"{n}={getattr(c, n) * 1e3:.3g} ms" for n in names)

    print(f"\n== our VM's MoE host issue costs, fitted on our {len(own)} TE MoE runs (ranges: "
          + ", ".join(f"{n} {a * 1e3:g}-{b * 1e3:g} ms" for n, (a, b) in MOE.MOE_VM_HOST_FIT.items()) + ")")
    print(f"   shipped (moe.MOE_TE_VM_HOST): {values(te)}: MAPE {mape(own_log_errors(own, te)):.1f}%")
    c_all = fit_on(own)
    print(f"   fitted on all: {values(c_all)}: MAPE {mape(own_log_errors(own, c_all)):.1f}%")
    for shape in sorted({shape_of(x["rec"].model) for x in own}):
        held = [x for x in own if shape_of(x["rec"].model) == shape]
        c = fit_on([x for x in own if shape_of(x["rec"].model) != shape])
        e = own_log_errors(held, c)
        print(f"   {shape} left out ({len(held)} runs): MAPE {mape(e):.1f}%, median bias "
              f"{100 * (math.exp(float(np.median(e))) - 1):+.1f}%, worst {100 * (math.exp(e[np.argmax(np.abs(e))]) - 1):+.1f}% "
              f"({values(c)})")


def published_check(quick: bool) -> None:
    from advisor.models import published as P
    from advisor.models.profiles import STACKS, apply_layout_defaults

    runs = [r for r in P.load() if r.moe and r.usable and r.gpu_type == "H100"]
    # the published rows with no host issue cost (their hosts), our TE runs with our VM's
    # (profile_fit.vm_host's dense ones, moe.MOE_TE_VM_HOST: fitted on our runs only, --host)
    te = te_on_vm()
    rows = []
    for r in runs:
        cfg = apply_layout_defaults(r.cfg, "te", r.explicit, moe=True)  # the recipe's own settings win
        notes = (r.raw.get("notes") or "").lower()
        if "force-balanced" in notes or "token-drop" in notes:
            cfg = cfg.replace(moe_router="forced")  # NVIDIA's footnote: forced-balanced routing
        cfg = recipe_split(r.model, r.cluster, cfg)
        if cfg.ep * cfg.etp > r.cluster.gpus_per_node:
            # EP across nodes: NVIDIA's H100 recipes dispatch with the flex dispatcher (Megatron-Bridge
            # scripts/performance/configs/deepseek/deepseek_workload_base_configs.py, H100:
            # moe_flex_dispatcher_backend; yanring/Megatron-MoE-ModelZoo best_practice/Qwen3: DeepEP
            # for Qwen3-235B on H100); the rows do not name it
            cfg = cfg.replace(moe_dispatcher="flex")
        rows.append({"run": r, "cfg": cfg})

    published_c = {}

    def pred(row, c):
        hit = published_c.get(id(c))
        if hit is None or hit[0] is not c:
            if len(published_c) > 64:
                published_c.clear()
            hit = published_c[id(c)] = (c, without_host(MOE.without_moe_host(c)))
        return predict(row["run"].model, row["run"].cluster, row["cfg"], hit[1], check_legal=False)

    # a layout republished by several container versions counts once in the fit (as the te
    # profile's own fit weighs them, models/profile_fit.fit_rows)
    dup = defaultdict(int)
    for x in rows:
        dup[(x["run"].model_key, x["cfg"].key(), x["run"].precision_reported)] += 1
    for x in rows:
        x["w"] = 1.0 / math.sqrt(dup[(x["run"].model_key, x["cfg"].key(), x["run"].precision_reported)])

    # our own TE MoE runs (4 x H100, data/measurements/h100x4-te.jsonl, first record of each job) join
    # every fit: they pin the expert phase (grouped GEMM rate, GroupedLinear's host time) that the
    # published rows see only through whole steps
    own = [r for r in moe_rows("te") if "-call" not in r["rec"].id]

    def own_err(c):
        return own_log_errors(own, c)

    def pub_err(rs, c):  # each published row's weighted log error
        return [x["w"] * math.log(pred(x, c).tokens_per_s_per_gpu / x["run"].tokens_per_s_per_gpu) for x in rs]

    def res_fn(rs, c):
        return np.concatenate([pub_err(rs, c), own_err(c)])

    print(f"\n== 3. published H100 MoE runs (te profile + MOE_TE_SETTINGS): {len(rows)} rows")
    models = sorted({x["run"].model_key for x in rows})
    fitted = {}
    for mk in models:
        train = [x for x in rows if x["run"].model_key != mk]
        fitted[mk] = fit(train, te, MOE.MOE_TE_FIT, 10 if quick else 25, res_fn=res_fn)
    print("   | model | GPUs | layout | precision | measured tok/s/GPU | te + MoE settings | error | "
          "leave-model-out fit | error | a2a share |")
    print("   |---|---|---|---|---|---|---|---|---|---|")
    e0, e1 = defaultdict(list), defaultdict(list)
    for x in rows:
        r, cfg = x["run"], x["cfg"]
        p0 = pred(x, te)
        p1 = pred(x, fitted[r.model_key])
        y = r.tokens_per_s_per_gpu
        e0[r.model_key].append(abs(p0.tokens_per_s_per_gpu / y - 1))
        e1[r.model_key].append(abs(p1.tokens_per_s_per_gpu / y - 1))
        lay = f"TP{cfg.tp} PP{cfg.pp} VP{cfg.vp} EP{cfg.ep} mbs{cfg.mbs} gbs{cfg.gbs}"
        print(f"   | {r.model_key} | {r.num_gpus} | {lay} | {r.precision_reported[:12]} | {y:.0f} | "
              f"{p0.tokens_per_s_per_gpu:.0f} | {p0.tokens_per_s_per_gpu / y - 1:+.0%} | "
              f"{p1.tokens_per_s_per_gpu:.0f} | {p1.tokens_per_s_per_gpu / y - 1:+.0%} | "
              f"{p1.breakdown['moe_dispatch_s'] / p1.step_time_s:.0%} |")
    all0 = [v for vs in e0.values() for v in vs]
    all1 = [v for vs in e1.values() for v in vs]
    print(f"   MAPE: te + MoE settings {100 * statistics.mean(all0):.1f}%, leave-one-model-out fit "
          f"{100 * statistics.mean(all1):.1f}% (goal <= {PUBLISHED_MAPE_GOAL:.0f}%); per model: "
          + ", ".join(f"{k} {100 * statistics.mean(e1[k]):.0f}%" for k in models))
    own_mape = statistics.mean(abs(math.exp(v) - 1) for k in models for v in own_err(fitted[k]))
    print(f"   our {len(own)} TE MoE runs (in every fit): {100 * statistics.mean(abs(math.exp(v) - 1) for v in own_err(te)):.1f}% "
          f"with the shipped settings, {100 * own_mape:.1f}% mean over the leave-one-model-out fits")
    # our TE runs out of sample: each proxy shape predicted by a fit on the published rows and the
    # other shape's runs
    for shape in sorted({shape_of(x["rec"].model) for x in own}):
        held = [x for x in own if shape_of(x["rec"].model) == shape]
        keep = [x for x in own if shape_of(x["rec"].model) != shape]

        def res_shape(rs, c, keep=keep):
            return np.concatenate([pub_err(rs, c), own_log_errors(keep, c)])
        c_s = fit(rows, te, MOE.MOE_TE_FIT, 10 if quick else 25, res_fn=res_shape)
        errs = [float(v) for v in np.exp(own_log_errors(held, c_s)) - 1]
        print(f"   our TE runs, {shape} left out of the fit ({len(held)} runs): MAPE "
              f"{100 * statistics.mean(abs(v) for v in errs):.1f}%, bias {100 * statistics.mean(errs):+.1f}%, "
              f"worst {100 * max(errs, key=abs):+.1f}%")
    c_all = fit(rows, te, MOE.MOE_TE_FIT, 10 if quick else 25, res_fn=res_fn)
    e = statistics.mean(abs(pred(x, c_all).tokens_per_s_per_gpu / x["run"].tokens_per_s_per_gpu - 1) for x in rows)
    e_own = statistics.mean(abs(math.exp(v) - 1) for v in own_err(c_all))
    print(f"   proposed te values (fitted on all {len(rows)} rows and our TE runs, in sample {100 * e:.1f}%, "
          f"our TE runs {100 * e_own:.1f}%): "
          + ", ".join(f"{n}={getattr(c_all, n):.4g} (range {MOE.MOE_TE_FIT[n][0]:g}-{MOE.MOE_TE_FIT[n][1]:g})"
                      for n in MOE.MOE_TE_FIT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer fit iterations")
    ap.add_argument("--no-published", action="store_true")
    ap.add_argument("--host", action="store_true", help="only fit our VM's MoE host issue costs on our TE MoE runs")
    ap.add_argument("--constants-out", type=Path, help="write the all-shape local fit as JSON")
    ap.add_argument("--write-te", action="store_true",
                    help="write the TE stack's MoE constants (moe.te_moe_constants) into the shipped te profile "
                         "and exit (its dense constants unchanged: MoE constants act on MoE layers only)")
    a = ap.parse_args(argv)
    if a.write_te:
        from advisor.models.profiles import STACKS

        from advisor.models.profile_fit import with_vm_host

        cal = Calibration.load(STACKS["te"].file)
        cal.constants = MOE.te_moe_constants(cal.constants)  # no MoE host cost: the published hosts
        cal.fit_info = with_vm_host(cal.fit_info or {})  # ... our VM's apart (profile_fit.on_vm)
        cal.save(STACKS["te"].file)
        print(f"wrote {STACKS['te'].file}")
        return 0
    t0 = time.time()
    if a.host:
        host_check(a.quick)
        print(f"\n({time.time() - t0:.0f} s)")
        return 0
    ok, c = local_check(a.quick)
    if a.constants_out:
        a.constants_out.write_text(json.dumps({
            "what": "MoE constants (and the local profile's refitted dense ones) fitted on all MoE records "
                    "of data/measurements/ by bench/moe_check.py; tests/test_moe.py checks the data against them",
            "command": "python bench/moe_check.py --constants-out models/data/moe_local_fit.json",
            "constants": {n: getattr(c, n) for n in LOCAL_FIT}}, indent=1) + "\n")
    ok &= multi_gpu_check()
    imbalance_check()
    if not a.no_published:
        published_check(a.quick)
    print(f"\n({time.time() - t0:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
