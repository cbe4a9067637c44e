"""Python API of the advisor: recommend layouts, predict one layout or a batch.

    from advisor.api import recommend, predict_layout
    result = recommend("llama3-70b", "h100x64")
    result.recommendations[0].config.to_dict()
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

from advisor.catalog import ClusterSpec, ModelSpec, SpecError, TrainConfig, load_cluster, load_model, with_power_cap
from advisor.catalog.specs import check_precision
from advisor.models.domain import domain_note
from advisor.models import DEFAULT, Constants, Prediction, memory_band, predict
from advisor.models.memory import stage_memory
from advisor.models.objectives import OBJECTIVE_CAPS, OBJECTIVES, rank_order, score_arrays, score_prediction
from advisor.models.power import CapSweep, cap_grid, cap_sweep, stage_caps, sweep_of
from advisor.models.ranking import CapTable, best_at_cap, cap_evaluator, predict_at
from advisor.screen import RECOMPUTE_COST, NoFeasibleLayout, screen
from advisor.search_spaces.layout import IllegalLayout, violations
from advisor.search_spaces.runnable import runs_sequence_parallel
from advisor.search_spaces.space import SpaceOptions, Workload


# What recommend / predict / tune predict with unless told otherwise, in the API and the CLI alike
# (the CLI's --calibration reads it): "default" = the calibration shipped in models/data (or the
# analytical model when none is shipped), "none" = the analytical model, or a calibration file.
DEFAULT_CALIBRATION = "default"


# Default global batch (sequences), as public recipes scale it: about 8K tokens per GPU per step,
# the median of the 30 H100 pre-training rows of 64+ GPUs in ../shared/benchmarks/published_fit.csv
# (1K-131K tokens/GPU; e.g. Llama 3.1 405B on 1024 H100: 512 and 1536 x 8192; DeepSeek-V3 on 1024:
# 8192 x 4096), never above the 16M-token batch of Llama 3 405B on 8K-16K H100 (Llama 3 paper,
# Table 4: 2048 x 8192 tokens) and never below 128 sequences (what small recipes use).
DEFAULT_TOKENS_PER_GPU = 8192
DEFAULT_MAX_BATCH_TOKENS = 16 * 2 ** 20
DEFAULT_MIN_GBS = 128


def default_gbs(world_size: int, seq: int) -> int:
    """The default global batch: ~8K tokens per GPU, capped at 16M tokens, at least 128
    sequences; then the nearest odd(world)·2^k of at least 128 (log scale), so that it is a
    multiple of every data-parallel size of the cluster up to 2^k (a power of two for
    power-of-two clusters)."""
    tokens = min(world_size * DEFAULT_TOKENS_PER_GPU, DEFAULT_MAX_BATCH_TOKENS)
    want = max(DEFAULT_MIN_GBS, tokens // max(1, seq))
    gbs = world_size // (world_size & -world_size)  # the odd part of the GPU count
    while gbs < DEFAULT_MIN_GBS or gbs * 2 <= want:
        gbs *= 2
    return gbs * 2 if gbs < want and (gbs * 2) / want < want / gbs else gbs


def default_workload(model: ModelSpec, cluster: ClusterSpec, seq: int | None = None,
                     gbs: int | None = None, precision: str = "bf16", fp8_recipe: str = "delayed") -> Workload:
    """seq: the model's context up to 8192; gbs: `default_gbs` (128 sequences up to 128 GPUs at
    seq 8192, then ~8K tokens per GPU up to Llama 3's 16M-token batch)."""
    if seq is None:
        seq = min(model.max_position_embeddings or 8192, 8192)
    if gbs is None:
        gbs = default_gbs(cluster.world_size, seq)
    return Workload(seq=seq, gbs=gbs, precision=precision, fp8_recipe=fp8_recipe)


def resolve(model: str | ModelSpec, cluster: str | ClusterSpec, power_cap_w: float | None = None
            ) -> tuple[ModelSpec, ClusterSpec]:
    m = model if isinstance(model, ModelSpec) else load_model(model)
    if isinstance(cluster, ClusterSpec):
        c = cluster if power_cap_w is None else with_power_cap(cluster, power_cap_w)
    else:
        c = load_cluster(cluster, power_cap_w=power_cap_w)
    return m, c


@dataclass
class Recommendation:
    rank: int
    config: TrainConfig
    prediction: Prediction
    megatron_args: str
    reason: str
    score: float
    power_cap_w: float = 0.0          # the per-GPU cap this layout is recommended at
    power_caps: dict = field(default_factory=dict)   # models.power.CapSweep.to_dict() (energy / balanced)
    stage_caps: dict = field(default_factory=dict)   # models.power.StageCaps.to_dict() (PP > 1)
    memory: dict = field(default_factory=dict)  # models.memory_band.memory_fit: interval, headroom, tightest stage
    # what the model has that Megatron-LM's arguments cannot say (runners.megatron_args.megatron_notes)
    megatron_notes: list = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "config": self.config.to_dict(), "prediction": self.prediction.to_dict(),
                "power_cap_w": self.power_cap_w, "power_caps": self.power_caps, "stage_caps": self.stage_caps,
                "memory": self.memory, "megatron_args": self.megatron_args, "megatron_notes": self.megatron_notes,
                "reason": self.reason}


@dataclass
class RecommendResult:
    model: ModelSpec
    cluster: ClusterSpec
    workload: Workload
    objective: str
    candidates_evaluated: int
    feasible: int
    elapsed_s: float
    recommendations: list[Recommendation] = field(default_factory=list)
    calibration: str | None = None  # the calibration file used, None = analytical model only
    warnings: list[str] = field(default_factory=list)  # about the top layout: cause and fix
    # every layout that fits, with the prediction it was ranked by (the HTML report plots them), in
    # the search space's order, not the ranking's (`recommendations` are ranked; `rank_scores` are
    # the scores alone, sorted); and the Calibration object itself; neither is in to_dict()
    candidates: list[tuple[TrainConfig, Prediction]] = field(default_factory=list, repr=False)
    calibrated_with: Any = field(default=None, repr=False)
    stack: str = "te"  # the software stack the layouts are predicted for
    profile: str | None = None  # the calibration profile's name (None = analytical model only)
    # ranking scores of every feasible layout (best first), for placing another layout among them
    rank_scores: list[float] = field(default_factory=list, repr=False)
    rank_basis: tuple[float, float] = (1.0, 1.0)  # the best tokens/s and J/token the scores used
    compared: list["Comparison"] = field(default_factory=list)
    power_caps: list[float] = field(default_factory=list)  # the caps tried (energy / balanced)
    memory_margin: float = 0.05  # the share of the GPU's memory a layout's upper bound leaves free
    left_out: dict = field(default_factory=dict)  # what the stack's runner cannot run (advisor.screen)
    # one line where the answer lies outside the profile's fitted domain (models.domain)
    domain_note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "domain_note": self.domain_note,
            "model": self.model.name,
            "cluster": self.cluster.to_dict(),
            "workload": {"seq": self.workload.seq, "gbs": self.workload.gbs,
                         "precision": self.workload.precision, "fp8_recipe": self.workload.fp8_recipe,
                         "objective": self.objective,
                         "power_caps_w": self.power_caps},
            "candidates_evaluated": self.candidates_evaluated,
            "feasible": self.feasible,
            "left_out": self.left_out,
            "memory_margin": self.memory_margin,
            "ranked": len(self.rank_scores),  # the feasible ones but heavier recomputes of a layout that fits
            "elapsed_s": self.elapsed_s,
            "calibration": self.calibration,
            "stack": self.stack,
            "profile": self.profile,
            "recommendations": [r.to_dict() for r in self.recommendations],
            "warnings": list(self.warnings),
            **({"compared": [x.to_dict() for x in self.compared]} if self.compared else {}),
        }


def explain(model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, p: Prediction,
            best: Prediction | None = None) -> str:
    """Why this layout: the few facts that decide it, in one line."""
    parts = []
    if best is not None and best is not p:
        parts.append(f"{(1 - p.tokens_per_s_per_gpu / best.tokens_per_s_per_gpu) * 100:.1f}% slower than #1")
    gpn = cluster.domain_gpus
    if cfg.tp > 1:
        parts.append(f"TP={cfg.tp} inside a {gpn}-GPU NVLink domain")
    if cfg.pp > 1:
        vp = f"×VP={cfg.vp} " if cfg.vp > 1 else ""
        parts.append(f"PP={cfg.pp} {vp}with {cfg.num_microbatches} microbatches: {p.bubble_fraction * 100:.1f}% "
                     f"of the pipeline time in the bubble")
        split = split_label(cfg)
        if split:
            parts.append(f"{model.num_layers} layers split {split}")
    if cfg.cp > 1:
        parts.append(f"CP={cfg.cp} splits the {cfg.seq}-token sequence")
    bd = p.breakdown
    if model.is_moe:  # why this EP: experts per GPU, where the all-to-all runs, its share, imbalance
        from advisor.models.moe import ep_reason

        parts.append(ep_reason(model, cfg, cluster, bd, p.step_time_s, DEFAULT))
    if cfg.dp > 1:
        hidden = bd["dp_comm_total_s"] - bd["dp_comm_exposed_s"]
        share = hidden / bd["dp_comm_total_s"] * 100 if bd["dp_comm_total_s"] else 100
        parts.append(f"DP={cfg.dp} hides {share:.0f}% of gradient traffic")
    if cfg.recompute != "none":
        parts.append(f"{cfg.recompute} recompute to fit memory")
    parts.append(f"{p.memory_gib_per_gpu:.0f} of {cluster.gpu.memory_gib:.0f} GiB on the fullest stage")
    comm = bd["tp_comm_s"] + bd["cp_comm_s"] + bd["ep_comm_s"] + bd["pp_p2p_s"] + bd["dp_comm_exposed_s"]
    parts.append(f"exposed communication {comm / p.step_time_s * 100:.0f}% of the step")
    parts.append(f"throttled {p.throttle_fraction:.0%}" + (f" ({p.throttle_reason})" if p.throttle_reason != "none" else ""))
    return "; ".join(parts)


WARN_BUBBLE = 0.15  # a DP=1 top layout idling more than this in its pipeline bubble
WARN_MFU = 0.25  # a top layout below this MFU


def scale_warnings(model: ModelSpec, cluster: ClusterSpec, wl: Workload, cfg: TrainConfig, p: Prediction,
                   gbs_given: bool = True) -> list[str]:
    """Warnings about a (top) layout that runs the cluster badly, each with its cause and a fix:
    DP=1 with a pipeline bubble above 15%, or MFU below 25%."""
    out = []
    world = cluster.world_size
    tokens_gpu = wl.gbs * wl.seq / world
    m = cfg.num_microbatches
    bigger = default_gbs(world, wl.seq)
    if bigger <= wl.gbs:  # enough microbatches for a <= 5% bubble with this pipeline
        need = -(-19 * (cfg.pp - 1) // cfg.vp)
        bigger = wl.gbs * max(2, 2 ** math.ceil(math.log2(max(1, need * cfg.mbs * cfg.dp / wl.gbs))))
    gbs_fix = (f"raise --gbs (e.g. --gbs {bigger}, {bigger * wl.seq / 2 ** 20:.0f}M tokens"
               + (", the default for this cluster" if bigger == default_gbs(world, wl.seq) and gbs_given else "")
               + ") or use fewer GPUs")
    if cfg.dp == 1 and p.bubble_fraction > WARN_BUBBLE:
        out.append(f"the top layout has DP=1 and idles {p.bubble_fraction:.0%} of the pipeline time in its bubble: "
                   f"gbs={wl.gbs} gives its PP={cfg.pp} pipeline only {m} microbatches"
                   + (f" (×VP={cfg.vp})" if cfg.vp > 1 else "")
                   + f", and one replica spans all {world} GPUs; fix: {gbs_fix}")
    if p.mfu < WARN_MFU:
        bd = p.breakdown
        step = p.step_time_s
        losses = {
            "the pipeline bubble": bd["pipeline_bubble_s"],
            "exposed communication": bd["tp_comm_s"] + bd["cp_comm_s"] + bd["ep_comm_s"] + bd["pp_p2p_s"]
            + bd["dp_comm_exposed_s"],
            "memory-bound kernels": bd["memory_bound_s"],
            "recompute": bd["recompute_s"],
            "the optimizer step": bd["optimizer_s"],
        }
        what, secs = max(losses.items(), key=lambda kv: kv[1])
        cause = (f"{what} takes {secs / step:.0%} of the step, with {tokens_gpu:,.0f} tokens per GPU per step "
                 f"(gbs={wl.gbs} × seq {wl.seq} over {world} GPUs)")
        if what == "recompute":
            fix = "more GPUs per replica (higher TP/PP) so that less recompute fits, or a GPU with more memory"
        elif tokens_gpu < DEFAULT_TOKENS_PER_GPU or what in ("the pipeline bubble", "the optimizer step"):
            fix = gbs_fix
        else:
            fix = f"use fewer GPUs for {model.name}, or {gbs_fix.replace(' or use fewer GPUs', '')}"
        out.append(f"the top layout reaches only {p.mfu:.0%} MFU: {cause}; fix: {fix}")
    return out


def split_label(cfg: TrainConfig) -> str:
    """How an uneven pipeline split is made, in words ('' for an even split)."""
    if cfg.pipeline_layout:
        return f"by the layout {cfg.pipeline_layout}"
    acc = [w for w, on in (("embedding", cfg.account_for_embedding), ("loss", cfg.account_for_loss)) if on]
    if acc:
        return f"evenly with the {' and the '.join(acc)} counted as a layer"
    if cfg.pp_first_layers is not None or cfg.pp_last_layers is not None:
        return (f"with {cfg.pp_first_layers if cfg.pp_first_layers is not None else 'even'} on the first and "
                f"{cfg.pp_last_layers if cfg.pp_last_layers is not None else 'even'} on the last stage")
    return ""


def megatron_args(model: ModelSpec, cfg: TrainConfig) -> str:
    from advisor.runners.megatron_args import megatron_lm_args_string

    return megatron_lm_args_string(model, cfg)


def megatron_notes(model: ModelSpec) -> list[str]:
    from advisor.runners import megatron_args as ma

    return ma.megatron_notes(model)


def recommend(model: str | ModelSpec, cluster: str | ClusterSpec, *, seq: int | None = None,
              gbs: int | None = None, precision: str = "bf16", top: int = 5,
              objective: str = "throughput", power_cap_w: float | None = None,
              constants: Constants = DEFAULT, options: SpaceOptions | None = None,
              calibration: Any = DEFAULT_CALIBRATION, overrides: Iterable[str] = (),
              stack: str | None = None, power_caps: str | Sequence[float] | None = None,
              memory_margin: float | None = None, fp8_recipe: str = "delayed") -> RecommendResult:
    """Rank every legal layout the stack's runner can run that fits in memory by the objective (a
    layout with more recompute than the cheapest mode that fits it is counted as fitting, not
    ranked; a layout fits when its memory interval's upper bound is under the GPU's memory less
    `memory_margin`, advisor.screen). `stack`: the
    software stack ("te": Megatron-Core with Transformer Engine, the default; "local": this
    project's runner; see advisor.models.profiles); `calibration`: "default" (the stack's shipped
    profile), a Calibration, a file or None (the analytical model with `constants`); `overrides`: what-if
    KEY=VALUE strings (gpu=h200, nodes=16, power_cap=500, mbs=4, ...). With the energy or
    balanced objective the per-GPU power cap is chosen with the layout, from `power_caps`
    ("LO:HI:STEP" watts, a list, or default the GPU's settable range in 25 W steps): energy takes
    each layout's cap with the least J/token, balanced the least J/token within 5% of its
    fastest step. Every recommendation with PP > 1 also gets per-stage caps (stage_caps)."""
    from advisor.models.profiles import get_stack, stack_option_defaults

    st = get_stack(stack)
    if options is None:
        options = SpaceOptions.wide(tp_comm_overlap=bool(st.layout_defaults.get("tp_comm_overlap")),
                                    moe_fusion=bool(st.layout_defaults.get("moe_permute_fusion")),
                                    gradient_accumulation_fusion=bool(st.layout_defaults.get("gradient_accumulation_fusion")),
                                    fsdp=st.space_fsdp)
    # what the user left to the stack (te: TE's fused cross entropy, FP8 primary weights and
    # expandable segments, as NVIDIA's recipes)
    unset = {k: v for k, v in stack_option_defaults(st.name).items() if getattr(options, k) is None}
    if unset:
        options = dataclasses.replace(options, **unset)
    if objective not in OBJECTIVES:
        raise SpecError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if top < 1:
        raise SpecError("--top must be at least 1")
    t0 = time.perf_counter()
    m, c = resolve(model, cluster, power_cap_w)
    cal = load_calibration(calibration, st.name, c.gpu)
    # memory screen with the constants of the level calibration uses for memory; rank with the
    # calibrated constants (the level used for tokens/s); only the head is re-scored in full
    screen_constants = cal.screening_constants if cal is not None else constants
    rank_constants = cal.constants if cal is not None else constants
    if overrides:
        from advisor.models.overrides import override_workload

        m, c, seq, gbs, precision, options = override_workload(m, c, overrides, seq, gbs, precision, options)
    check_precision(c.gpu, precision)
    wl = default_workload(m, c, seq, gbs, precision, fp8_recipe)
    if not runs_sequence_parallel(st.name) and options.sequence_parallel:  # as the stack's runner runs them
        options = dataclasses.replace(options, sequence_parallel=False)
    from advisor.models import vectorized as vz

    from advisor.search_spaces.columns import enumerate_columns

    L_all = enumerate_columns(m, c, wl, options)  # enumerate_layouts' layouts, as columns
    evaluated = len(L_all)
    if evaluated == 0:
        raise NoFeasibleLayout(
            f"no legal layout of {m.name} on {c.name} with seq={wl.seq} gbs={wl.gbs} "
            f"(gbs must be a multiple of the data-parallel size; try another --gbs)")
    scr = screen(m, c, L_all, screen_constants, st.name, memory_margin)
    feasible, sc_margin = scr.feasible, scr.margin
    L = L_all.take(scr.keep)
    R = vz.evaluate(m, c, L, rank_constants, memory=False)
    tps_a, e_a, risk_a = R.tokens_per_s_per_gpu, R.energy_j_per_token, R.throttle_risk
    best_tps, best_e = float(tps_a.max()), float(e_a.min())
    score = score_arrays(tps_a, e_a, risk_a, objective, best_tps, best_e)
    order = rank_order(score, L)
    rank_scores = score[order].tolist()
    best_tps0, best_e0 = best_tps, best_e
    # the Predictions of the rows shown (and of every row for the HTML report, on demand)
    preds = _LazyPredictions(R)
    calv = cal is not None and vz.vectorizable(cal) and rank_constants is cal.constants
    if cal is not None:  # full calibrated predictions (intervals) for the head only
        hidx = order[:max(4 * top, 20)]
        if calv:
            Rh = vz.evaluate(m, c, L.take(hidx), rank_constants)
            C = vz.Calibrated(cal, Rh)
            rows = [j for j in range(len(hidx)) if C.feasible[j]] or list(range(len(hidx)))
            head = [(L.config(int(hidx[j])), C.prediction(j)) for j in rows]
        else:
            head = cal.rescore(m, c, [(L.config(int(i)), preds[int(i)][1]) for i in hidx],
                               with_constants=rank_constants is cal.constants)
        best_tps = max(p.tokens_per_s_per_gpu for _, p in head)
        best_e = min(p.energy_j_per_token for _, p in head)
        ranked = sorted(head, key=lambda cp: (-score_prediction(cp[1], objective, best_tps, best_e), cp[0].key()))
    else:
        ranked = _LazyRanked(preds, order)
    grid: list[float] = []
    chosen: dict[str, tuple[float, CapSweep | None]] = {}
    if objective != "throughput":  # choose each head layout's cap, then rank again
        grid = cap_grid(c.gpu, power_caps)
        pick = OBJECTIVE_CAPS[objective]
        n_sweep = max(2 * top, 10)
        cfgs = [cfg for cfg, _ in ranked[:n_sweep]]
        caps = sorted(set(grid) | {float(c.power_cap_w)})
        head = []

        def sweep_caps(cfgs: list[TrainConfig]) -> None:
            at_cap = CapTable(m, c, cfgs, caps, rank_constants, cal, calv)
            for i, cfg in enumerate(cfgs):
                pts = {cap: at_cap.point(i, cap) for cap in caps}
                sweep = sweep_of([pts[v] for v in grid], pts[float(c.power_cap_w)])
                cap = getattr(sweep, pick).power_cap_w
                chosen[cfg.key()] = (cap, sweep)
                head.append((cfg, at_cap.prediction(i, cap)))

        sweep_caps(cfgs)
        # a second head: the layouts that rank best at the cap the first head's best layout chose
        # (the ones that rank best at the cluster's cap can be others: a wide space has many near
        # ties there), each with its own cap too
        bt = max(p.tokens_per_s_per_gpu for _, p in head)
        be = min(p.energy_j_per_token for _, p in head)
        best_cap = chosen[min(head, key=lambda cp: (-score_prediction(cp[1], objective, bt, be), cp[0].key()))[0].key()][0]
        if best_cap != float(c.power_cap_w):
            more = [cfg for cfg in best_at_cap(m, c, L, best_cap, objective, rank_constants, cal, calv)
                    if cfg.key() not in chosen][:n_sweep]
            if more:
                sweep_caps(more)
        best_tps = max(p.tokens_per_s_per_gpu for _, p in head)
        best_e = min(p.energy_j_per_token for _, p in head)
        ranked = sorted(head, key=lambda cp: (-score_prediction(cp[1], objective, best_tps, best_e), cp[0].key()))
    out = []
    first = ranked[0][1]
    # per-stage caps of the layouts shown with PP > 1 (models.power.stage_caps, on arrays), by cap
    shown = ranked[:top]
    per_cap: dict[float, list[int]] = {}
    for i, (cfg, _) in enumerate(shown):
        if cfg.pp > 1:
            per_cap.setdefault(chosen.get(cfg.key(), (c.power_cap_w, None))[0], []).append(i)
    scs: dict[int, Any] = {}
    for cap, idx in per_cap.items():
        got = vz.stage_caps_many(m, with_power_cap(c, cap), [shown[i][0] for i in idx],
                                 cal.power_constants if cal is not None else rank_constants, base=c)
        scs.update(zip(idx, got))
    band = memory_band.band(st.name, m.is_moe)
    for i, (cfg, p) in enumerate(shown):
        sms = stage_memory(m, cfg, rank_constants, gpu=c.gpu)  # each stage's outside and reserved-but-unallocated terms
        cap, sweep = chosen.get(cfg.key(), (c.power_cap_w, None))
        at = with_power_cap(c, cap)
        sc = scs.get(i)
        out.append(Recommendation(rank=i + 1, config=cfg, prediction=p, megatron_args=megatron_args(m, cfg),
                                  megatron_notes=megatron_notes(m),
                                  reason=explain(m, at, cfg, p, first if i else None),
                                  score=score_prediction(p, objective, best_tps, best_e), power_cap_w=cap,
                                  power_caps=sweep.to_dict() if sweep else {},
                                  stage_caps=sc.to_dict() if sc else {},
                                  memory=memory_band.memory_fit(p.memory_gib_per_gpu, p.memory_per_stage_gib,
                                                                [s.outside_gib for s in sms],
                                                                [s.reserved_free_gib for s in sms],
                                                                cfg.expandable_segments, band,
                                                                c.gpu.memory_gib, sc_margin,
                                                                memory_band.periodic_layout(m, cfg),
                                                                [s.reserved_free_off_gib for s in sms])))
    return RecommendResult(model=m, cluster=c, workload=wl, objective=objective, candidates_evaluated=evaluated,
                           feasible=feasible, elapsed_s=time.perf_counter() - t0, recommendations=out,
                           calibration=(cal.source or "calibrated") if cal is not None else None,
                           stack=st.name, profile=cal.profile if cal is not None else None,
                           rank_scores=rank_scores, rank_basis=(best_tps0, best_e0),
                           candidates=preds, calibrated_with=cal, power_caps=grid, memory_margin=sc_margin,
                           left_out=scr.left_out,
                           warnings=scale_warnings(m, c, wl, out[0].config, out[0].prediction, gbs_given=gbs is not None),
                           domain_note=domain_note(cal, m, c, out[0].config))


class _LazyPredictions(Sequence):
    """(TrainConfig, Prediction) of every ranked row of a vectorized evaluation, in enumeration
    order; each Prediction is built when first asked for (the HTML report asks for all)."""

    def __init__(self, res):
        self.res = res
        self._cache: dict[int, tuple] = {}

    def __len__(self) -> int:
        return len(self.res.layouts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i)
        if i < 0:
            i += len(self)
        hit = self._cache.get(i)
        if hit is None:
            hit = self._cache[i] = (self.res.layouts.config(i), self.res.prediction(i))
        return hit


class _LazyRanked(Sequence):
    """_LazyPredictions in ranking order."""

    def __init__(self, preds: _LazyPredictions, order):
        self.preds, self.order = preds, order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.preds[self.order[j]] for j in range(*i.indices(len(self)))]
        return self.preds[self.order[i]]


# ------------------------------------------------------------------------------------------------
# another layout next to the top-1: where it ranks and where the time goes differently
# ------------------------------------------------------------------------------------------------

# step-time categories of a Prediction's breakdown, in the order they are named
_TERMS = (("gemm_s", "GEMMs"), ("attention_s", "attention"), ("memory_bound_s", "memory-bound kernels"),
          ("recompute_s", "recompute"), ("tp_comm_s", "TP communication"), ("cp_comm_s", "CP communication"),
          ("ep_comm_s", "EP communication"), ("pp_p2p_s", "PP send/recv"), ("pipeline_bubble_s", "pipeline bubble"),
          ("dp_comm_exposed_s", "exposed DP communication"), ("optimizer_s", "optimizer"),
          ("layer_overhead_s", "per-layer overhead"))


@dataclass
class Comparison:
    config: TrainConfig
    prediction: Prediction
    ratio_to_top: float  # tokens/s of this layout / tokens/s of the top-1
    rank: int | None  # where it would rank among the feasible layouts (None: not feasible)
    of: int
    differences_s: dict[str, float]  # per step: top-1 minus this layout, by category
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "prediction": self.prediction.to_dict(),
                "ratio_to_top": self.ratio_to_top, "rank": self.rank, "of": self.of,
                "differences_s": self.differences_s, "why": self.why}


def compare(res: RecommendResult, values: Mapping[str, Any], calibration: Any = "default") -> Comparison:
    """One layout (flags as for `predict`, workload from `res`) next to `res`'s top-1: its ratio to
    the top-1's tokens/s, where it would rank, and the step-time categories that differ most."""
    v = {"seq": res.workload.seq, "gbs": res.workload.gbs, "precision": res.workload.precision,
         "fp8_recipe": res.workload.fp8_recipe, **dict(values)}
    cal = load_calibration(calibration, res.stack, res.cluster.gpu)
    cfg = layout_from_flags(res.model, res.cluster, v, res.stack)
    bad = violations(res.model, res.cluster, cfg)
    if bad:
        raise IllegalLayout(f"illegal layout to compare: {bad[0]}")
    p = (cal.predict(res.model, res.cluster, cfg, check_legal=False) if cal is not None
         else predict(res.model, res.cluster, cfg, check_legal=False))
    top = res.recommendations[0].prediction
    ratio = p.tokens_per_s_per_gpu / top.tokens_per_s_per_gpu
    rank = None
    if p.feasible and res.rank_scores:  # scored as the ranking scored every layout
        pr = predict(res.model, res.cluster, cfg, cal.constants if cal is not None else DEFAULT, check_legal=False)
        own = score_prediction(pr, res.objective, *res.rank_basis)
        rank = 1 + sum(1 for x in res.rank_scores if x > own)
    # per-step seconds in each category, scaled to the same tokens per step (same workload)
    diffs = {k: top.breakdown.get(k, 0.0) - p.breakdown.get(k, 0.0) for k, _ in _TERMS}
    slow = top.power_slowdown - p.power_slowdown
    parts = [f"{label} {diffs[k]:+.2f} s" for k, label in sorted(_TERMS, key=lambda kl: -abs(diffs[kl[0]]))
             if abs(diffs[k]) >= 0.005 * max(top.step_time_s, 1e-9)][:4]
    why = (f"#1 takes {top.step_time_s - p.step_time_s:+.2f} s per step vs this layout "
           f"({top.step_time_s:.2f} vs {p.step_time_s:.2f} s)"
           + (": " + ", ".join(parts) if parts else "")
           + (f"; power-cap slowdown {top.power_slowdown:.2f}x vs {p.power_slowdown:.2f}x" if abs(slow) > 0.005 else "")
           + ("" if p.feasible else f"; does not fit: {p.reason}"))
    return Comparison(config=cfg, prediction=p, ratio_to_top=ratio, rank=rank, of=len(res.rank_scores),
                      differences_s=diffs, why=why)


# ------------------------------------------------------------------------------------------------
# predict
# ------------------------------------------------------------------------------------------------

LAYOUT_KEYS = ("tp", "pp", "cp", "ep", "etp", "vp", "mbs", "gbs", "seq", "precision", "fp8_recipe", "recompute",
               "sequence_parallel", "distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather",
               "tp_comm_overlap", "pp_first_layers", "pp_last_layers", "account_for_embedding",
               "account_for_loss", "pipeline_layout", "moe_dispatcher", "moe_router", "moe_capacity_factor",
               "moe_pad_to_capacity", "moe_a2a_overlap", "moe_shared_expert_overlap", "moe_router_fusion",
               "moe_permute_fusion", "cpu_offload_layers", "recompute_layers", "recompute_modules", "fsdp")


def layout_from_flags(model: ModelSpec, cluster: ClusterSpec, values: Mapping[str, Any],
                      stack: str | None = None, checked: bool = False) -> TrainConfig:
    """A TrainConfig from user flags: DP derived from the cluster; unset knobs take the defaults
    recommend uses (SP when TP > 1, distributed optimizer and overlap when DP > 1, and the stack's
    own: TP communication overlap under Transformer Engine). Values are checked by
    advisor.validate.layout_values (integers, ranges, names, the uneven split)."""
    from advisor.models.profiles import apply_layout_defaults
    from advisor.validate import layout_values

    if not checked:  # (checked: the caller ran layout_values on them already)
        values = layout_values(values)
    v = {k: values[k] for k in LAYOUT_KEYS if values.get(k) is not None}
    tp, pp, cp = int(v.get("tp", 1)), int(v.get("pp", 1)), int(v.get("cp", 1))
    for name, val in (("tp", tp), ("pp", pp), ("cp", cp)):
        if val < 1:
            raise SpecError(f"{name} must be a positive integer, got {val}")
    mp = tp * pp * cp
    if cluster.world_size % mp:
        raise IllegalLayout(f"illegal layout: tp·pp·cp = {mp} does not divide the {cluster.world_size} GPUs of {cluster.name}")
    dp = cluster.world_size // mp
    if "dp" in values and values["dp"] is not None and int(values["dp"]) != dp:
        raise IllegalLayout(f"illegal layout: dp={values['dp']} but {cluster.world_size} GPUs / (tp·pp·cp) = {dp}")
    if "seq" not in v:
        v["seq"] = min(model.max_position_embeddings or 8192, 8192)
    if "gbs" not in v:
        v["gbs"] = default_workload(model, cluster, v["seq"]).gbs
    if "vp" not in v and v.get("pipeline_layout"):  # the layout's chunks / pp, as Megatron-LM derives it
        from advisor.search_spaces.layout import parse_pipeline_layout

        chunks = len(parse_pipeline_layout(str(v["pipeline_layout"])))
        if chunks % pp == 0:
            v["vp"] = chunks // pp
    # Megatron's default: expert TP = TP when not given (megatron-core 0.19 ModelParallelConfig)
    v.setdefault("etp", tp if model.is_moe else 1)
    v.setdefault("sequence_parallel", tp > 1)
    v.setdefault("distributed_optimizer", dp * cp > 1)
    v.setdefault("overlap_grad_reduce", dp * cp > 1)
    v.setdefault("overlap_param_gather", bool(v["distributed_optimizer"]) and dp * cp > 1)
    v["dp"] = dp
    explicit = {k for k in LAYOUT_KEYS if values.get(k) is not None}
    return apply_layout_defaults(TrainConfig.from_dict(v), stack, explicit, moe=model.is_moe)


def predict_layout(model: str | ModelSpec, cluster: str | ClusterSpec, values: Mapping[str, Any],
                   power_cap_w: float | None = None, constants: Constants = DEFAULT,
                   calibration: Any = DEFAULT_CALIBRATION, overrides: Iterable[str] = (),
                   stack: str | None = None, power_caps: str | Sequence[float] | None = None,
                   energy_caps: bool = False) -> tuple[TrainConfig, Prediction]:
    """One layout's prediction. `stack` / `calibration` as for `recommend`. `energy_caps`: also
    sweep the per-GPU cap over `power_caps` (cap_grid) and give, in prediction.power_caps, the cap
    with the least J/token, the least within 5% of the fastest step, and per-stage caps for the
    stages off the critical path (PP > 1)."""
    m, c, cfg, cal = _layout_to_predict(model, cluster, values, power_cap_w, calibration, overrides, stack)
    from advisor.models import vectorized as vz

    calv = cal is None or vz.vectorizable(cal)
    p = _predict_group(m, c, [cfg], constants, cal)[0] if calv else predict_at(m, c, cfg, constants, cal)
    if energy_caps:
        grid = cap_grid(c.gpu, power_caps)
        if calv:  # every cap in one array evaluation (the points cap_sweep would evaluate one by one)
            at = CapTable(m, c, [cfg], sorted(set(grid) | {float(c.power_cap_w)}),
                           cal.constants if cal is not None else constants, cal, True)
            sweep = sweep_of([at.point(0, v) for v in grid], at.point(0, float(c.power_cap_w)))
        else:
            sweep = cap_sweep(cap_evaluator(m, c, cfg, constants, cal), grid, c.power_cap_w)
        consts = cal.power_constants if cal is not None else constants
        sc = (vz.stage_caps_many(m, c, [cfg], consts)[0] if calv else stage_caps(m, c, cfg, consts)) if cfg.pp > 1 else None
        p.power_caps = {"sweep": sweep.to_dict(), "stage_caps": sc.to_dict() if sc else {}}
    return cfg, p


def _layout_to_predict(model, cluster, values, power_cap_w, calibration, overrides, stack, specs=None,
                       checked: bool = False):
    """(model, cluster, legal layout, calibration) of a predict request; bad input raises.
    `specs`: a dict that keeps the (model, cluster) of each (model, cluster, cap) named before
    (predict --batch: the same names on many lines)."""
    key = (model, cluster, power_cap_w)
    hit = specs.get(key) if specs is not None and all(isinstance(k, (str, float, int, type(None))) for k in key) else None
    if hit is None:
        hit = resolve(model, cluster, power_cap_w)
        if specs is not None and isinstance(model, str) and isinstance(cluster, str):
            specs[key] = hit
    m, c = hit
    if overrides:
        from advisor.models.overrides import apply_overrides

        m, c, values = apply_overrides(m, c, values, overrides)
    cal = load_calibration(calibration, stack, c.gpu)
    cfg = layout_from_flags(m, c, values, stack, checked=checked and not overrides)
    v = violations(m, c, cfg)
    if v:
        raise IllegalLayout(f"illegal layout: {v[0]}")
    return m, c, cfg, cal


def _predict_group(m: ModelSpec, c: ClusterSpec, cfgs: list[TrainConfig], constants: Constants, cal) -> list:
    """The predictions `predict_at` gives, of several layouts of one model on one cluster, on
    arrays (models.vectorized); a calibration with surrogates goes through its predict_many."""
    from advisor.models import vectorized as vz

    if cal is not None and not vz.vectorizable(cal):
        return cal.predict_many(m, c, cfgs, check_legal=False)
    L = vz.Layouts.of(m, cfgs)
    R = vz.evaluate(m, c, L, cal.constants if cal is not None else constants)
    if cal is None:
        return [R.prediction(i) for i in range(len(cfgs))]
    C = vz.Calibrated(cal, R)
    return [C.prediction(i) for i in range(len(cfgs))]


def load_calibration(spec: Any, stack: str | None = None, gpu=None):
    """A Calibration from None / "none" / "default" (the stack's profile for `gpu`'s generation) /
    a path / a Calibration (lazy import)."""
    if spec is None:
        return None
    from advisor.models.calibrate import resolve_calibration

    return resolve_calibration(spec, stack, gpu)


def _is_shipped(spec: Any, stack: str | None) -> bool:
    """`spec` names a shipped profile ("default" or a stack's name), chosen per GPU generation."""
    from advisor.models.profiles import STACKS

    return isinstance(spec, str) and spec.lower() in ("default", *STACKS)


# keys a predict --batch line may carry (anything else is an error naming the key)
BATCH_KEYS = ("model", "cluster", "power_cap_w", "dp", "id") + LAYOUT_KEYS


def predict_batch(lines: Iterable[str], constants: Constants = DEFAULT, calibration: Any = DEFAULT_CALIBRATION,
                  overrides: Iterable[str] = (), stack: str | None = None,
                  defaults: Mapping[str, Any] | None = None, chunk: int = 4096) -> Iterator[dict[str, Any]]:
    """One output object per input line, blank lines included: every input key echoed, plus
    `prediction` (with the derived `config`) or `error` (with the `line` number). A line carries
    `model`, `cluster`, `power_cap_w`, `id` (any value, echoed) and the layout keys (LAYOUT_KEYS);
    `stack` / `calibration` as for `recommend`;
    `defaults` (the CLI's flags) fill the keys a line does not give. An unknown key, a number
    that is not finite (NaN, Infinity), a wrong type or an illegal layout is that line's error;
    a key the `overrides` (--set) also set, with another value, too. A bad line never stops the
    batch. Output values are finite or null (advisor.validate.dumps writes strict JSON)."""
    from advisor import validate

    if not _is_shipped(calibration, stack):  # a file: load it once, not per line (the shipped
        calibration = load_calibration(calibration, stack)  # profiles are cached, one per GPU generation)
    sets = validate.parse_sets(overrides)
    set_keys = {"power_cap": "power_cap_w"}
    defaults = {k: v for k, v in (defaults or {}).items() if v is not None}
    specs: dict = {}

    def check(n: int, line: str):
        """(output object, None) for a line that is answered already (an error), or (output
        object, (model, cluster, layout, calibration)) for one to predict."""
        where = f"line {n}: "
        if not line.strip():
            return {"line": n, "error": f"{where}blank line (one JSON object per line)"}, None
        try:
            row = validate.loads_strict(line)
        except ValueError as e:
            msg = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
            return {"line": n, "error": f"{where}not JSON ({msg})"}, None
        if not isinstance(row, dict):
            return {"line": n, "error": f"{where}expected a JSON object, got {type(row).__name__}"}, None
        out = dict(row)
        try:
            for k in row:
                if k not in BATCH_KEYS:
                    raise validate.unknown_key(k, BATCH_KEYS, where)
            values = {**defaults, **row}
            for k in row:
                sk = next((s for s, rk in set_keys.items() if rk == k), k)
                if sk in sets and row[k] is not None and not validate.same_number(row[k], sets[sk]):
                    raise validate.InputError(f"{where}{k}={row[k]!r} conflicts with --set {sk}={sets[sk]}")
            for k in ("model", "cluster"):
                if not isinstance(values.get(k), str) or not values[k].strip():
                    raise SpecError(f"{where}needs {k!r} (a string), got {values.get(k)!r}")
            cap = values.get("power_cap_w")
            if cap is not None:
                cap = validate.number(f"{where}power_cap_w", cap, lo=0, lo_open=True)
            values = validate.layout_values(values, where)
            return out, _layout_to_predict(values["model"], values["cluster"], values, cap, calibration,
                                           overrides, stack, specs, checked=True)
        except (SpecError, ValueError, TypeError, ArithmeticError) as e:
            return _error(out, n, e), None

    def _error(out: dict, n: int, e: Exception) -> dict:
        where = f"line {n}: "
        msg = str(e)
        out["line"] = n
        out["error"] = msg if msg.startswith(where) else where + msg
        return out

    # lines are read `chunk` at a time (1: each line answered before the next is read, for a
    # caller that writes a line and waits for its answer) and predicted together: the layouts of
    # one model on one cluster in one array evaluation
    it = iter(enumerate(lines, 1))
    while True:
        block = [x for _, x in zip(range(max(1, chunk)), it)]
        if not block:
            return
        todo = [check(n, line) + (n,) for n, line in block]
        groups: dict[tuple, list[int]] = {}
        for j, (_, req, _) in enumerate(todo):
            if req is not None:
                m, c, cfg, cal = req
                groups.setdefault((m, c, id(cal)), []).append(j)
        for (m, c, _), js in groups.items():
            cal = todo[js[0]][1][3]
            try:
                preds = _predict_group(m, c, [todo[j][1][2] for j in js], constants, cal)
            except (SpecError, ValueError, TypeError, ArithmeticError):
                preds = None  # one line's trouble: predicted line by line below, each with its error
            for k, j in enumerate(js):
                out, (m_, c_, cfg, cal_), n = todo[j]
                try:
                    p = preds[k] if preds is not None else predict_at(m_, c_, cfg, constants, cal_)
                    out["config"] = cfg.to_dict()
                    out["prediction"] = p.to_dict(copy=False)  # made for this line alone
                except (SpecError, ValueError, TypeError, ArithmeticError) as e:
                    _error(out, n, e)
        for out, _, _ in todo:
            yield out
