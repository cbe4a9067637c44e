"""What separates GB200 from GB300 (issue #25): the shipped te-blackwell profile's per-term times on
the paired published rows, and the physical candidates that could close the GB300 / GB200 gap, each
with the value it would need.

    python bench/blackwell_terms.py            # per pair group: the step's terms in microseconds per
                                               # token and GPU, GB200 vs GB300, and their ratio
    python bench/blackwell_terms.py --candidates   # each candidate's pair ratios (median per group) and
                                               # the value of its quantity that meets the measured one
    python bench/blackwell_terms.py --offload  # the 70B FP8 pairs with the presets' CPU activation
                                               # offloading priced over NVLink-C2C (OFFLOADED_LAYERS)
    python bench/blackwell_terms.py --versus B200,GB200   # GB200 / B200 on pairs of one container
    (--same-container: only pairs run in one NeMo container)

Pairs: the fit rows (bench/fit_blackwell.py: dense, usable, legal) of one model, format and GPU count
on both GB200 and GB300 (every GB200 row against every GB300 row: layouts and containers may
differ, as in fit_blackwell --pairs). Per-term times are per token per GPU (step term / (global
batch x sequence / GPUs)), so layouts of different batch sizes compare. The candidates change only
the GPU's catalog entry (a replaced GPUSpec / ClusterSpec) under the shipped profile's constants:
    gb200_cap_w      the watts GB200's power limiter holds (its 1,050 W span kept): a lower effective
                     board budget (static power above the 150 W estimate, a share of the superchip's
                     power taken by the Grace CPU / C2C, a lower configured TGP)
    gb300_span_w     GB300's dynamic power span (energy per unit of work at the maximum clock, 1,110 W
                     in the catalog): lower = more efficient silicon, a higher clock under 1,400 W
    gb300_max_clock  GB300 at its maximum clock under any load (the upper bound of every GB300
                     power term)
    hbm_watts        GB300's HBM power share (of its span) scaled so its HBM draws GB200's watts, and
                     below (the share the measured ratio would need)
    hbm_sm_issue     memory-bound kernels' bandwidth scaling with SMs x clock (Little's law: bytes in
                     flight per SM) on GB300: its HBM rate x (160 x 2,070) / (152 x 2,062), the upper
                     bound of the candidate (every memory-bound byte issue-limited)
"""
from __future__ import annotations

import dataclasses
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from advisor.models import profile_fit as F  # noqa: E402
from advisor.models import published as P  # noqa: E402
from advisor.models.calibrate import resolve_calibration  # noqa: E402
from advisor.models.predict import predict  # noqa: E402

TERMS = ("gemm_s", "attention_s", "memory_bound_s", "fp8_cast_s", "tp_comm_s", "cp_comm_s", "pp_p2p_s",
         "dp_comm_exposed_s", "pipeline_bubble_s", "layer_overhead_s", "optimizer_s", "step_overhead_s")
PAIR = ("GB200", "GB300")


def blackwell_constants():
    return resolve_calibration("te", gpu=type("G", (), {"generation": "blackwell"})()).constants


def container(x) -> str:
    return x.run.raw.get("source_version", "")


def pair_groups(rows=None, same_container: bool = False, pair: tuple[str, str] = PAIR) -> dict[tuple, dict[str, list]]:
    """{(model, format, GPUs): {"GB200": [rows], "GB300": [rows], "pairs": [(GB200 row, GB300 row)]}}
    for groups with both GPUs (`pair`: another two, first the denominator); `same_container`: only
    pairs of one software release (NeMo container)."""
    if rows is None:
        rows, _ = F.fit_rows(P.load(), "te", lambda r: r.gpu_type in pair and not r.moe)
    g = defaultdict(lambda: {k: [] for k in pair})
    for x in rows:
        g[(x.run.model_key, x.cfg.quant, x.run.num_gpus)][x.run.gpu_type].append(x)
    out = {}
    for k, v in sorted(g.items()):
        pairs = [(a, b) for a in v[pair[0]] for b in v[pair[1]]
                 if not same_container or container(a) == container(b)]
        if pairs:
            out[k] = {pair[0]: list({id(a): a for a, _ in pairs}.values()),
                      pair[1]: list({id(b): b for _, b in pairs}.values()), "pairs": pairs}
    return out


def versus(pair: tuple[str, str], c=None, say=print) -> dict:
    """Measured and predicted pair[1] / pair[0] per group of one container (e.g. GB200 over B200:
    the same die, 152 vs 148 SMs, 1,200 vs 1,000 W)."""
    c = c or blackwell_constants()
    out = {}
    for k, v in pair_groups(same_container=True, pair=pair).items():
        out[k] = (measured_ratio(v), group_ratio(v, c, pair[1], {}))
        say(f"{k[0]:14} {k[1]:15} {k[2]:4} {len(v['pairs']):3} pairs: {pair[1]} / {pair[0]} measured "
            f"{out[k][0]:.3f}, model {out[k][1]:.3f}")
    return out


def tokens_per_gpu(x) -> float:
    return x.cfg.gbs * x.cfg.seq / x.run.num_gpus


def with_gpu(cluster, **gpu_changes):
    """The cluster with its GPU's catalog entry changed (`power_cap_w` sets the cluster's cap)."""
    cap = gpu_changes.pop("power_cap_w", None)
    gpu = dataclasses.replace(cluster.gpu, **gpu_changes) if gpu_changes else cluster.gpu
    return dataclasses.replace(cluster, gpu=gpu, power_cap_w=cluster.power_cap_w if cap is None else cap)


def predicted(x, c, changes: dict | None = None):
    """x's prediction with `changes` to its GPU (with_gpu's keywords; "constants": a dict of the
    profile's constants to replace for this row)."""
    changes = dict(changes or {})
    c = c.replace(**changes.pop("constants")) if "constants" in changes else c
    cl = with_gpu(x.run.cluster, **changes) if changes else x.run.cluster
    return predict(x.run.model, cl, x.cfg, c, check_legal=False)


def term_table(c=None, same_container: bool = False, say=print) -> dict:
    """Per pair group and GPU: the measured tokens/s (median), each term in us per token per GPU
    (median over the group's rows), the clock ratio; and GB200 / GB300 per term."""
    c = c or blackwell_constants()
    out = {}
    for k, v in pair_groups(same_container=same_container).items():
        res = {}
        for gpu in PAIR:
            ps = [(x, predicted(x, c)) for x in v[gpu]]
            res[gpu] = {
                "measured": float(np.median([x.y for x, _ in ps])),
                "predicted": float(np.median([p.tokens_per_s_per_gpu for _, p in ps])),
                "clock": float(np.median([p.clock_ratio for _, p in ps])),
                "layouts": sorted({f"t{x.cfg.tp}p{x.cfg.pp}c{x.cfg.cp}v{x.cfg.vp}m{x.cfg.mbs}" for x, _ in ps}),
                "us_per_token": {t: float(np.median([p.breakdown.get(t, 0.0) / tokens_per_gpu(x) * 1e6
                                                     for x, p in ps])) for t in TERMS},
            }
            res[gpu]["us_per_token"]["step"] = float(np.median([p.step_time_s / tokens_per_gpu(x) * 1e6 for x, p in ps]))
        out[k] = res
        a, b = res["GB200"], res["GB300"]
        say(f"{k[0]} {k[1]} {k[2]} GPUs ({len(v['pairs'])} pairs): measured GB300 / GB200 {measured_ratio(v):.3f}, "
            f"model {group_ratio(v, c, 'GB200', {}):.3f} (medians over the pairs); clock {a['clock']:.3f} / {b['clock']:.3f}; "
            f"layouts {','.join(a['layouts'])} / {','.join(b['layouts'])}")
        say(f"  {'term (us/token/GPU)':22} {'GB200':>9} {'GB300':>9} {'GB200/GB300':>11} {'share GB200':>11}")
        for t in ("step",) + TERMS:
            ta, tb = a["us_per_token"][t], b["us_per_token"][t]
            if ta == 0 and tb == 0:
                continue
            ratio = f"{ta / tb:11.3f}" if tb > 0 else f"{'-':>11}"
            say(f"  {t.removesuffix('_s'):22} {ta:9.3f} {tb:9.3f} {ratio} {ta / a['us_per_token']['step'] * 100:10.1f}%")
    return out


def gpu_entry(name: str):
    from advisor.catalog.loaders import load_gpu

    return load_gpu(name)


@dataclass(frozen=True)
class Candidate:
    gpu: str                  # the GPU whose rows it changes
    changes: Callable         # value -> with_gpu changes
    span: tuple | None        # the range solve searches (None: no quantity, one fixed change)
    shipped: float | None     # the value the catalog gives (the model as shipped)
    reference: float | None   # a value to show the ratio at, with why
    why: str = ""


def candidate_changes() -> dict[str, Candidate]:
    g200, g300, b200 = gpu_entry("gb200"), gpu_entry("gb300"), gpu_entry("b200")
    hbm = blackwell_constants().memory_hbm_power
    issue = (g300.sm_count * g300.max_sm_clock_mhz) / (g200.sm_count * g200.max_sm_clock_mhz)
    return {
        "gb200_cap_w": Candidate("GB200", lambda w: {"dynamic_power_w": g200.power_span_w, "power_cap_w": w},
                                 (g200.idle_w + 100.0, g200.max_power_limit_w), g200.max_power_limit_w,
                                 b200.max_power_limit_w, "the HGX B200's limit (the same die)"),
        "gb300_span_w": Candidate("GB300", lambda w: {"dynamic_power_w": w}, (300.0, g300.power_span_w * 1.5),
                                  g300.power_span_w, g200.power_span_w, "GB200's span, not rescaled"),
        "gb300_max_clock": Candidate("GB300", lambda _: {"dynamic_power_w": 1e-6}, None, None, None,
                                     "no power limit"),
        # HBM power (models/dvfs.py: D x memory_hbm_power per unit of bandwidth) is a share of the span,
        # so GB300's rescaled span gives its HBM 1,110 / 1,050 of GB200's watts; the same 8 TB/s HBM3e
        # draws the same: the share x GB200's span / GB300's (k = 1050 / 1110) takes the difference out
        "hbm_watts": Candidate("GB300", lambda k: {"constants": {"memory_hbm_power": hbm * k}}, (0.1, 1.0), 1.0,
                               g200.power_span_w / g300.power_span_w, "GB200's HBM watts"),
        "hbm_sm_issue": Candidate("GB300", lambda k: {"hbm_bandwidth_gbs": g300.hbm_bandwidth_gbs * k}, (1.0, 1.5),
                                  1.0, issue, "SMs x clock, GB300 / GB200"),
    }


def measured_ratio(v) -> float:
    """Median over the group's pairs of measured GB300 / GB200 tokens/s per GPU."""
    return float(np.median([b.y / a.y for a, b in v["pairs"]]))


def group_ratio(v, c, gpu: str, changes: dict) -> float:
    """Median over the group's pairs of predicted second / first GPU (GB300 / GB200) with `changes`
    on `gpu`'s rows."""
    rows = {id(x): x for pair in v["pairs"] for x in pair}
    tps = {i: predicted(x, c, changes if x.run.gpu_type == gpu else None).tokens_per_s_per_gpu
           for i, x in rows.items()}
    return float(np.median([tps[id(b)] / tps[id(a)] for a, b in v["pairs"]]))


def solve(v, c, gpu, fn, lo, hi, target, iters: int = 30) -> float | None:
    """The value in [lo, hi] whose pair ratio meets `target` (bisection; None: outside the range)."""
    f = lambda w: group_ratio(v, c, gpu, fn(w)) - target  # noqa: E731
    flo, fhi = f(lo), f(hi)
    if flo * fhi > 0:
        return None
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        fm = f(mid)
        if fm * flo > 0:
            lo, flo = mid, fm
        else:
            hi = mid
    return 0.5 * (lo + hi)


def candidates(c=None, same_container: bool = False, say=print) -> dict:
    """Per pair group: measured GB300 / GB200 and the model's, then per candidate the model's ratio
    at its bound (or shipped-to-bound) and the value that meets the measured ratio."""
    c = c or blackwell_constants()
    cands = candidate_changes()
    out = {}
    for k, v in pair_groups(same_container=same_container).items():
        meas = measured_ratio(v)
        base = group_ratio(v, c, "GB200", {})
        row = {"measured": meas, "model": base}
        for name, cand in cands.items():
            if cand.span is None:
                row[name] = {"ratio": group_ratio(v, c, cand.gpu, cand.changes(None))}
                continue
            row[name] = {"ratio_at": (cand.reference, group_ratio(v, c, cand.gpu, cand.changes(cand.reference))),
                         "needed": solve(v, c, cand.gpu, cand.changes, cand.span[0], cand.span[1], meas)}
        if not out:
            say("candidates: " + "; ".join(f"{n} (reference {x.reference:.4g}: {x.why}; shipped {x.shipped:.4g})"
                                           if x.span else f"{n} ({x.why})" for n, x in cands.items()))
        say(f"{k[0]:14} {k[1]:15} {k[2]:4} {len(v['pairs']):3} measured {meas:.3f} model {base:.3f} | "
            + " | ".join(_describe(n, row[n]) for n in cands))
        out[k] = row
    return out


def _describe(name: str, r: dict) -> str:
    if "ratio" in r:
        return f"{name}: {r['ratio']:.3f}"
    b, q = r["ratio_at"]
    need = "out of range" if r["needed"] is None else f"{r['needed']:.4g}"
    return f"{name}: {q:.3f} at {b:.4g}, needs {need}"


# CPU activation offloading, the one Grace / NVLink-C2C term the pairs carry: Megatron-Bridge's
# llama3-70B FP8 current-scaling presets (scripts/performance/configs/llama/llama3_workload_base_configs.py,
# LLAMA3_70B_PRETRAIN_CONFIG_GB200_FP8_CS_V1 / _GB300_FP8_CS_V1: Megatron-FSDP, MBS 2) offload 40 of the
# 80 layers' activations on GB200 and 20 on GB300 (more HBM); the model prices neither. The host link:
# NVLink-C2C, 900 GB/s both directions per Grace, which serves two GPUs: 225 GB/s per GPU and direction
# when both stream at once, 450 when one does (NVIDIA GB200 NVL72 datasheet's 900 GB/s C2C).
OFFLOADED_LAYERS = {"GB200": 40, "GB300": 20}
C2C_GBS = (225.0, 450.0)


def offload_bound(c=None, bandwidths=C2C_GBS + (150.0, 100.0), say=print) -> dict:
    """The 70B FP8 pairs with the presets' activation offloading priced again at each host bandwidth
    (GB/s per GPU, one direction), on top of the model's own pricing of the rows' cpu_offload_layers
    (models/offload.py; "no offload" below: nothing added to it): each offloaded layer's activations
    (models.memory.layer_activation_bytes) go out during the next layer's forward and come back during
    the backward (twice the forward's time); what the transfer takes beyond the compute it overlaps
    is exposed, per microbatch. A diagnostic of how the ratio moves with the link, not a prediction."""
    from advisor.models.memory import layer_activation_bytes

    c = c or blackwell_constants()
    v = pair_groups(same_container=True)[("llama3_70b", "fp8", 64)]
    tps = {}
    for bw in (None,) + tuple(bandwidths):
        for x in v["GB200"] + v["GB300"]:
            p = predicted(x, c)
            if bw is None:
                tps[(None, id(x))] = p.tokens_per_s_per_gpu
                continue
            mb = x.cfg.gbs // (x.cfg.mbs * x.cfg.dp)
            fwd = p.step_time_s / mb / 3.0 / x.run.model.num_layers  # forward of one layer, one microbatch
            move = layer_activation_bytes(x.run.model, 0, x.cfg, c) / (bw * 1e9)
            exposed = OFFLOADED_LAYERS[x.run.gpu_type] * (max(0.0, move - fwd) + max(0.0, move - 2.0 * fwd))
            tps[(bw, id(x))] = p.tokens_per_s_per_gpu * p.step_time_s / (p.step_time_s + mb * exposed)
    out = {bw: float(np.median([tps[(bw, id(b))] / tps[(bw, id(a))] for a, b in v["pairs"]]))
           for bw in (None,) + tuple(bandwidths)}
    say(f"llama3_70b fp8 64 GPUs, offloaded layers {OFFLOADED_LAYERS}: measured GB300 / GB200 {measured_ratio(v):.3f}; "
        "model " + ", ".join(f"{r:.3f} ({'no offload' if bw is None else f'{bw:g} GB/s'})" for bw, r in out.items()))
    return out


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--candidates", action="store_true")
    ap.add_argument("--same-container", action="store_true", help="only pairs of one NeMo container")
    ap.add_argument("--offload", action="store_true", help="the 70B FP8 pairs with CPU offloading priced")
    ap.add_argument("--versus", help="two GPUs, e.g. B200,GB200: their same-container pairs' ratio")
    a = ap.parse_args(argv)
    if a.versus:
        versus(tuple(g.strip().upper() for g in a.versus.split(",")))
    elif a.offload:
        offload_bound()
    elif a.candidates:
        candidates(same_container=a.same_container)
    else:
        term_table(same_container=a.same_container)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
