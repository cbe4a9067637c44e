"""`advisor plan`: a whole training run for a token budget. For each cluster size (whole nodes of
one GPU), the layouts and power caps `recommend` gives (objective energy: each head layout with its
whole cap curve), then the run's goodput (models.goodput: failures, checkpoints, restarts), wall
days, GPU-hours, energy and cost; the Pareto set of days vs energy vs GPUs; and the pick:
  * --deadline: the least energy that finishes in time;
  * --budget (no deadline): the fewest days within the energy budget;
  * neither: the fewest days.
Every constraint given (--gpus limit, --deadline, --budget) must hold for the pick.

    from advisor.plan import PlanOptions, plan
    res = plan("llama3.1-405b", PlanOptions(tokens=15.6e12, gpu="h100", max_gpus=16384, exact=True))
"""
from __future__ import annotations

import dataclasses
import math
import textwrap
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from advisor.catalog import ClusterSpec, ModelSpec, SpecError, TrainConfig, load_cluster, load_model
from advisor.catalog.specs import check_precision
from advisor.models import goodput as gp

# the largest cluster a plan sweeps when no --gpus / --cluster bounds it: Llama 3 405B's 16,384
# H100 (the largest published pre-training run of the catalog's models: Llama 3 paper §3.3.1)
DEFAULT_MAX_GPUS = 16384


@dataclass(frozen=True)
class PlanOptions:
    tokens: float                       # training tokens
    gpu: str = "h100"                   # catalog GPU name (the cluster's, when a cluster is given)
    max_gpus: int = 0                   # 0: DEFAULT_MAX_GPUS or the cluster's size
    exact: bool = False                 # only max_gpus, no sweep
    cluster: str | None = None          # node type: catalog cluster, YAML (storage_bw_gbs) or <gpu>x<n>
    deadline_s: float | None = None
    budget_j: float | None = None
    max_gbs_tokens: int | None = None   # None: the model's published recipe, else api's 16M
    seq: int | None = None
    precision: str = "bf16"
    failures_per_gpu_hour: float = gp.DEFAULT_FAILURES_PER_GPU_HOUR
    restart_s: float = gp.DEFAULT_RESTART_S
    storage_bw_gbs: float | None = None  # None: the cluster YAML's, else gp.DEFAULT_STORAGE_BW_GBS
    gpu_hour_price: float | None = None
    power_caps: str | None = None
    calibration: Any = "default"
    stack: str | None = None
    layouts_per_size: int = 3


@dataclass
class Candidate:
    gpus: int
    nodes: int
    layout_rank: int            # the layout's rank in recommend's energy ranking at this size
    config: TrainConfig
    power_cap_w: float
    step_time_s: float
    tokens_per_s_per_gpu: float
    mean_power_w: float
    goodput: gp.Goodput
    megatron_args: str
    batch_bound: bool           # the global batch was cut to --max-gbs-tokens
    cost: float | None = None
    pareto: bool = False

    @property
    def days(self) -> float:
        return self.goodput.days

    @property
    def energy_mwh(self) -> float:
        return self.goodput.energy_j / 3.6e9

    @property
    def gpu_hours(self) -> float:
        return self.goodput.wall_s * self.gpus / 3600.0

    def save_interval(self) -> int:
        """Megatron's --save-interval (iterations) from the Daly interval."""
        return max(1, int(round(self.goodput.interval_s / self.step_time_s)))

    def train_iters(self, tokens: float) -> int:
        return int(math.ceil(tokens / self.config.tokens_per_step))

    def full_args(self, tokens: float) -> str:
        return f"{self.megatron_args} --train-iters {self.train_iters(tokens)} --save-interval {self.save_interval()}"

    def to_dict(self, tokens: float) -> dict:
        return {"gpus": self.gpus, "nodes": self.nodes, "layout_rank": self.layout_rank,
                "config": self.config.to_dict(), "power_cap_w": self.power_cap_w, "step_time_s": self.step_time_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mean_power_w": self.mean_power_w,
                "days": self.days, "gpu_hours": self.gpu_hours, "energy_mwh": self.energy_mwh, "cost": self.cost,
                "batch_bound": self.batch_bound, "pareto": self.pareto, "goodput": self.goodput.to_dict(),
                "save_interval": self.save_interval(), "train_iters": self.train_iters(tokens),
                "megatron_args": self.full_args(tokens)}


@dataclass
class PlanResult:
    model: ModelSpec
    base: ClusterSpec            # the node type (its num_nodes is the sweep's upper end)
    options: PlanOptions
    seq: int
    max_gbs_tokens: int
    storage_bw_gbs: float
    candidates: list[Candidate]
    choice: Candidate | None
    why: str                     # how the choice was made, or why there is none
    notes: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)     # GPU counts evaluated
    unfit: list[int] = field(default_factory=list)     # GPU counts where the model fits nowhere
    elapsed_s: float = 0.0

    @property
    def pareto(self) -> list[Candidate]:
        return sorted((c for c in self.candidates if c.pareto), key=lambda c: (c.days, c.energy_mwh, c.gpus))

    def to_dict(self) -> dict:
        o = self.options
        t = o.tokens
        return {"model": self.model.name, "gpu": self.base.gpu.name, "gpus_per_node": self.base.gpus_per_node,
                "tokens": t, "seq": self.seq, "precision": o.precision, "max_gbs_tokens": self.max_gbs_tokens,
                "deadline_days": o.deadline_s / gp.DAY if o.deadline_s else None,
                "budget_mwh": o.budget_j / 3.6e9 if o.budget_j else None,
                "assumptions": {"failures_per_gpu_hour": o.failures_per_gpu_hour,
                                "failure_source": (gp.FAILURE_SOURCE if o.failures_per_gpu_hour
                                                   == gp.DEFAULT_FAILURES_PER_GPU_HOUR else "--failures-per-gpu-hour"),
                                "restart_fixed_s": o.restart_s,
                                "restart_source": gp.RESTART_SOURCE if o.restart_s == gp.DEFAULT_RESTART_S
                                else "--restart-min",
                                "storage_bw_gbs": self.storage_bw_gbs, "idle_power_w": self.base.gpu.idle_w,
                                "gpu_hour_price": o.gpu_hour_price},
                "sizes": self.sizes, "unfit_sizes": self.unfit, "elapsed_s": self.elapsed_s,
                "choice": self.choice.to_dict(t) if self.choice else None, "why": self.why,
                "pareto": [c.to_dict(t) for c in self.pareto], "candidates": len(self.candidates),
                "notes": list(self.notes)}


# ------------------------------------------------------------------------------------------------
# sizes and batches
# ------------------------------------------------------------------------------------------------

def node_ladder(max_nodes: int) -> list[int]:
    """Node counts swept: 1, 2, 3, 4, 6, 8, 12, ... (powers of two and 1.5x between them) up to and
    including max_nodes."""
    out = {max_nodes}
    k = 1
    while k <= max_nodes:
        out.add(k)
        if 3 * k // 2 <= max_nodes and k >= 2:
            out.add(3 * k // 2)
        k *= 2
    return sorted(out)


def bounded_gbs(world: int, seq: int, max_tokens: int) -> tuple[int, bool]:
    """recommend's default global batch (advisor.api.default_gbs) for `world` GPUs, cut to at most
    `max_tokens` tokens (the largest odd(world)·2^k that fits); (gbs, whether the bound cut it)."""
    from advisor.api import default_gbs

    g = default_gbs(world, seq)
    if g * seq <= max_tokens:
        return g, False
    cap = max(1, max_tokens // seq)
    odd = world // (world & -world)
    if odd > cap:
        return cap, True
    g = odd
    while g * 2 <= cap:
        g *= 2
    return g, True


def base_cluster(o: PlanOptions) -> ClusterSpec:
    """The node type and the sweep's upper end (num_nodes), from --cluster and --gpus."""
    from advisor.catalog import load_gpu

    if o.cluster:
        base = load_cluster(o.cluster)
    else:
        gpu = load_gpu(o.gpu)
        base = load_cluster(f"{gpu.name}x{gpu.gpus_per_node}")
    gpn = base.gpus_per_node
    limit = o.max_gpus or (base.world_size if o.cluster else DEFAULT_MAX_GPUS)
    return dataclasses.replace(base, num_nodes=max(1, limit // gpn), gpus_per_node=min(gpn, limit))


def sized(base: ClusterSpec, nodes: int) -> ClusterSpec:
    return dataclasses.replace(base, num_nodes=nodes, name=f"{base.gpu.name}x{base.gpus_per_node}x{nodes}")


# ------------------------------------------------------------------------------------------------
# the sweep
# ------------------------------------------------------------------------------------------------

def candidates_at(m: ModelSpec, c: ClusterSpec, o: PlanOptions, seq: int, max_tokens: int,
                  storage_bw: float) -> list[Candidate]:
    """Every (head layout, power cap) recommend gives on cluster `c`, as a run of o.tokens."""
    from advisor.api import recommend

    world = c.world_size
    gbs, bound = bounded_gbs(world, seq, max_tokens)
    res = recommend(m, c, seq=seq, gbs=gbs, precision=o.precision, top=o.layouts_per_size, objective="energy",
                    power_caps=o.power_caps, calibration=o.calibration, stack=o.stack)
    out = []
    for r in res.recommendations:
        ckpt = gp.checkpoint_bytes_per_rank(m, r.config)
        seen = set()
        for pt in r.power_caps.get("curve", []):
            step = pt["step_time_s"]
            if (step, pt["mean_power_w"]) in seen:  # caps below the lowest clock: the same point
                continue
            seen.add((step, pt["mean_power_w"]))
            tps = r.config.tokens_per_step / step / world
            g = gp.run_goodput(o.tokens / (tps * world), world, ckpt, pt["mean_power_w"], c.gpu.idle_w,
                               o.failures_per_gpu_hour, storage_bw, o.restart_s)
            out.append(Candidate(gpus=world, nodes=c.num_nodes, layout_rank=r.rank, config=r.config,
                                 power_cap_w=pt["power_cap_w"], step_time_s=step, tokens_per_s_per_gpu=tps,
                                 mean_power_w=pt["mean_power_w"], goodput=g, megatron_args=r.megatron_args,
                                 batch_bound=bound,
                                 cost=None if o.gpu_hour_price is None else o.gpu_hour_price * g.wall_s * world / 3600))
    return out


def mark_pareto(cands: list[Candidate]) -> None:
    """Candidates no other beats on days, energy and GPUs at once (all <=, one <)."""
    if not cands:
        return
    a = np.array([[c.days, c.energy_mwh, c.gpus] for c in cands], float)
    le = (a[None, :, :] <= a[:, None, :]).all(2)   # [i, j]: j is no worse than i everywhere
    lt = (a[None, :, :] < a[:, None, :]).any(2)    # [i, j]: j is better than i somewhere
    dominated = (le & lt).any(1)
    for c, d in zip(cands, dominated):
        c.pareto = not bool(d)


def choose(cands: list[Candidate], o: PlanOptions) -> tuple[Candidate | None, str]:
    ok = [c for c in cands if (o.deadline_s is None or c.goodput.wall_s <= o.deadline_s)
          and (o.budget_j is None or c.goodput.energy_j <= o.budget_j)]
    want = []
    if o.deadline_s is not None:
        want.append(f"finishes within {o.deadline_s / gp.DAY:g} days")
    if o.budget_j is not None:
        want.append(f"stays within {o.budget_j / 3.6e9:,.0f} MWh")
    if not cands:
        return None, "no cluster size fits the model"
    if not ok:
        fastest = min(cands, key=lambda c: c.days)
        least = min(cands, key=lambda c: c.energy_mwh)
        return None, (f"no plan {' and '.join(want)}: the fastest takes {fastest.days:.1f} days "
                      f"({fastest.gpus:,} GPUs), the least energy is {least.energy_mwh:,.0f} MWh "
                      f"({least.gpus:,} GPUs)")
    if o.deadline_s is not None:
        pick = min(ok, key=lambda c: (c.energy_mwh, c.days, c.gpus))
        return pick, f"the least energy that {' and '.join(want)}"
    pick = min(ok, key=lambda c: (c.days, c.energy_mwh, c.gpus))
    return pick, "the fewest days" + (f" that {' and '.join(want)}" if want else "")


def batch_rule(m: ModelSpec, o: PlanOptions) -> tuple[int, int, str]:
    """(seq, the most tokens per global batch, a note saying where the bound comes from): --seq /
    --max-gbs-tokens, else the model's published recipe, else advisor.api's 16M tokens."""
    from advisor.api import DEFAULT_MAX_BATCH_TOKENS
    from advisor.catalog.loaders import model_recipe

    recipe = model_recipe(m)
    seq = o.seq or (recipe or {}).get("seq") or min(m.max_position_embeddings or 8192, 8192)
    if o.max_gbs_tokens:
        return seq, int(o.max_gbs_tokens), ""
    if recipe:
        return seq, int(recipe["batch_tokens"]), (
            f"global batch at most {recipe['batch_tokens'] / 2**20:.3g}M tokens, {m.name}'s published batch "
            f"({recipe['source']}); --max-gbs-tokens sets another")
    return seq, DEFAULT_MAX_BATCH_TOKENS, (
        f"no published batch for {m.name} in the catalog: global batch at most "
        f"{DEFAULT_MAX_BATCH_TOKENS / 2**20:.0f}M tokens (Llama 3 405B's, Llama 3 paper Table 4); "
        f"--max-gbs-tokens sets another")


def plan(model: str | ModelSpec, o: PlanOptions) -> PlanResult:
    """The sweep over cluster sizes (whole nodes), each with recommend's head layouts and caps."""
    from advisor.api import NoFeasibleLayout

    t0 = time.perf_counter()
    m = model if isinstance(model, ModelSpec) else load_model(model)
    base = base_cluster(o)
    check_precision(base.gpu, o.precision)
    seq, max_tokens, note = batch_rule(m, o)
    notes = [note] if note else []
    if max_tokens < seq:
        raise SpecError(f"--max-gbs-tokens {max_tokens} is less than one sequence of {seq} tokens")
    storage = o.storage_bw_gbs or base.storage_bw_gbs or gp.DEFAULT_STORAGE_BW_GBS
    if not (o.storage_bw_gbs or base.storage_bw_gbs):
        notes.append(f"checkpoint storage {storage:,.0f} GB/s aggregate ({gp.STORAGE_SOURCE}); "
                     f"storage_bw_gbs in the cluster YAML or --storage-bw sets another")
    if o.restart_s == gp.DEFAULT_RESTART_S:
        notes.append(f"restart {o.restart_s / 60:g} min + reading the checkpoint back: {gp.RESTART_SOURCE}")
    if not o.max_gpus and not o.cluster:
        notes.append(f"up to {DEFAULT_MAX_GPUS:,} GPUs (Llama 3 405B's run); --gpus {base.gpu.name}:<=N sets another")
    nodes = [base.num_nodes] if o.exact else node_ladder(base.num_nodes)
    cands: list[Candidate] = []
    sizes, unfit = [], []
    for n in nodes:
        c = sized(base, n)
        try:
            got = candidates_at(m, c, o, seq, max_tokens, storage)
        except NoFeasibleLayout:
            unfit.append(c.world_size)
            continue
        sizes.append(c.world_size)
        cands.extend(got)
    mark_pareto(cands)
    choice, why = choose(cands, o)
    if not cands:
        raise SpecError(f"{m.name} fits on no cluster size tried ({', '.join(map(str, unfit))} {base.gpu.name} "
                        f"GPUs) with seq {seq} and at most {max_tokens:,} tokens per batch")
    return PlanResult(model=m, base=base, options=o, seq=seq, max_gbs_tokens=max_tokens, storage_bw_gbs=storage,
                      candidates=cands, choice=choice, why=why, notes=notes, sizes=sizes, unfit=unfit,
                      elapsed_s=time.perf_counter() - t0)


def family_days(model: str | ModelSpec, family: dict, nodes: list[int], o: PlanOptions) -> list[tuple[int, float, bool]]:
    """Predicted wall days of one layout family (tp, pp, cp, vp, mbs, recompute ...; DP follows the
    GPUs) on each node count, with the plan's batch rule and goodput: (GPUs, days, batch bound);
    days NaN where the cut batch makes the family illegal."""
    from advisor.api import predict_layout
    from advisor.search_spaces.layout import IllegalLayout

    m = model if isinstance(model, ModelSpec) else load_model(model)
    base = base_cluster(o)
    seq, max_tokens, _ = batch_rule(m, o)
    out = []
    for n in nodes:
        c = sized(base, n)
        gbs, bound = bounded_gbs(c.world_size, seq, max_tokens)
        try:
            cfg, p = predict_layout(m, c, {**family, "gbs": gbs, "seq": seq, "precision": o.precision},
                                    calibration=o.calibration, stack=o.stack)
        except IllegalLayout:  # (the bound cut the batch below what the family needs)
            out.append((c.world_size, math.nan, bound))
            continue
        tps = p.tokens_per_s_per_gpu * c.world_size
        g = gp.run_goodput(o.tokens / tps, c.world_size, gp.checkpoint_bytes_per_rank(m, cfg), p.mean_power_w,
                           c.gpu.idle_w, o.failures_per_gpu_hour, o.storage_bw_gbs or gp.DEFAULT_STORAGE_BW_GBS,
                           o.restart_s)
        out.append((c.world_size, g.days, bound))
    return out


# ------------------------------------------------------------------------------------------------
# text (80 columns)
# ------------------------------------------------------------------------------------------------

def layout_label(cfg: TrainConfig) -> str:
    s = f"TP{cfg.tp} PP{cfg.pp}"
    for k, v in (("CP", cfg.cp), ("EP", cfg.ep), ("VP", cfg.vp)):
        if v > 1:
            s += f" {k}{v}"
    s += f" mbs{cfg.mbs}" + (" FSDP" if cfg.fsdp else "")
    return s + ("" if cfg.recompute == "none" else f" {cfg.recompute[:3]}")


def _hours(s: float) -> str:
    return f"{s / 60:.1f} min" if s < 3600 else f"{s / 3600:.2f} h"


def text_lines(res: PlanResult, max_rows: int = 12) -> list[str]:
    o, m, b = res.options, res.model, res.base
    out = [f"plan: {m.name}, {o.tokens / 1e12:g}T tokens, seq {res.seq}, {o.precision}, {b.gpu.name} "
           f"({b.gpus_per_node}/node)"]
    out += textwrap.wrap(f"sizes: {', '.join(f'{s:,}' for s in res.sizes)} GPUs"
                         + (f" (fits nowhere on {', '.join(f'{s:,}' for s in res.unfit)})" if res.unfit else "")
                         + f"; {len(res.candidates)} candidates in {res.elapsed_s:.1f} s", 80,
                         subsequent_indent="  ")
    price = o.gpu_hour_price is not None
    out.append("")
    out.append("Pareto set (days vs energy vs GPUs):")
    out.append(f"{'GPUs':>6} {'layout':<22} {'cap':>4} {'days':>7} {'MWh':>7} {'goodput':>7} "
               + (f"{'cost':>10}" if price else f"{'GPU-h':>10}"))
    rows = res.pareto
    if len(rows) > max_rows:  # evenly spread along the days axis, the choice kept
        keep = {int(round(i)) for i in np.linspace(0, len(rows) - 1, max_rows)}
        rows = [r for i, r in enumerate(rows) if i in keep or r is res.choice]
    for c in rows:
        mark = "*" if c is res.choice else " "
        last = f"{c.cost:>10,.0f}" if price else f"{c.gpu_hours / 1e6:>9.2f}M"
        out.append(f"{c.gpus:>6,}{mark}{layout_label(c.config)[:22]:<22} {c.power_cap_w:>4.0f} {c.days:>7.1f} "
                   f"{c.energy_mwh:>7,.0f} {c.goodput.goodput:>6.1%} {last}")
    if len(res.pareto) > len(rows):
        out.append(f"({len(rows)} of {len(res.pareto)} shown; --json lists all)")
    out.append("")
    c = res.choice
    if c is None:
        out.append(f"no choice: {res.why}")
    else:
        g = c.goodput
        out.append(f"choice (*): {res.why}")
        out.append(f"  {c.gpus:,} {b.gpu.name} ({c.nodes} nodes), {layout_label(c.config)}, DP{c.config.dp}, "
                   f"gbs {c.config.gbs}, cap {c.power_cap_w:.0f} W")
        out.append(f"  {c.days:.1f} days, {c.gpu_hours / 1e6:.2f}M GPU-hours, {c.energy_mwh:,.0f} MWh"
                   + (f", cost {c.cost:,.0f}" if c.cost is not None else "")
                   + f" ({g.idle_energy_j / g.energy_j:.1%} of it idle)")
        out.append(f"  {c.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {c.mean_power_w:.0f} W mean per GPU, "
                   f"step {c.step_time_s:.2f} s")
        out.append(f"  effective training time {g.goodput:.1%} at {g.failures_per_gpu_hour:.3g} failures per "
                   f"GPU-hour")
        out.append(f"    (job MTBF {_hours(g.mtbf_s)} on {c.gpus:,} GPUs; {g.failures:,.0f} failures expected)")
        out.append(f"  checkpoint {g.checkpoint_bytes_per_rank / 2**30:.2f} GiB per rank, written in "
                   f"{g.checkpoint_s:.1f} s at {res.storage_bw_gbs:,.0f} GB/s; restart {_hours(g.restart_s)}")
        out.append(f"  checkpoint every {_hours(g.interval_s)} (Daly; Young {_hours(g.young_interval_s)})"
                   f" = --save-interval {c.save_interval()}")
        out.append(f"  lost: rework {g.rework_s / gp.DAY:.2f} d, restarts {g.restart_total_s / gp.DAY:.2f} d, "
                   f"checkpoints {g.checkpoint_total_s / gp.DAY:.2f} d")
        out.append("")
        out.append("Megatron arguments:")
        out.extend(_wrap(c.full_args(o.tokens), 78))
        out.append(f"power cap: nvidia-smi -pl {c.power_cap_w:.0f}")
    for n in res.notes:
        out += textwrap.wrap(f"note: {n}", 80, subsequent_indent="  ")
    return out


def _wrap(text: str, width: int) -> list[str]:
    """Argument pairs on lines of at most `width` columns, continued with a backslash."""
    words = text.split(" ")
    pairs, i = [], 0
    while i < len(words):
        if i + 1 < len(words) and not words[i + 1].startswith("--"):
            pairs.append(f"{words[i]} {words[i + 1]}")
            i += 2
        else:
            pairs.append(words[i])
            i += 1
    lines, cur = [], ""
    for p in pairs:
        if cur and len(cur) + 1 + len(p) > width - 2:
            lines.append(cur + " \\")
            cur = "  " + p
        else:
            cur = f"{cur} {p}" if cur else p
    return lines + [cur]
