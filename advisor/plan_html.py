"""The HTML page of `advisor plan --html`: the days-vs-energy frontier of every candidate (cluster
size x layout x power cap), the Pareto set and the pick, in advisor.html_report's style."""
from __future__ import annotations

from advisor.html_figures import new_figure, styled
from advisor.html_report import Page
from advisor.models import goodput as gp
from advisor.plan import PlanResult, layout_label


@styled
def fig_frontier(res: PlanResult):
    """Days against MWh (left) and against GPUs (right): every candidate, the Pareto set, the pick,
    the deadline and the budget."""
    fig, axes = new_figure(11, 4.4, 1, 2)
    o = res.options
    for ax, key, ylabel in ((axes[0][0], "mwh", "energy, MWh (GPUs)"), (axes[0][1], "gpus", "GPUs")):
        def val(c):
            return c.energy_mwh if key == "mwh" else c.gpus
        ax.scatter([c.days for c in res.candidates], [val(c) for c in res.candidates], s=9, color="#9aa0a6",
                   alpha=0.6, linewidths=0, label=f"candidates ({len(res.candidates)})")
        front = res.pareto
        ax.scatter([c.days for c in front], [val(c) for c in front], s=18, color="#e8710a",
                   label=f"Pareto set ({len(front)})", zorder=4)
        if key == "mwh":  # the frontier of days vs energy alone, as a line
            best, line = float("inf"), []
            for c in sorted(res.candidates, key=lambda c: (c.days, c.energy_mwh)):
                if c.energy_mwh < best:
                    best = c.energy_mwh
                    line.append(c)
            ax.plot([c.days for c in line], [c.energy_mwh for c in line], "-", color="#e8710a", lw=1.2,
                    drawstyle="steps-post")
        if res.choice is not None:
            c = res.choice
            ax.scatter([c.days], [val(c)], s=60, color="#1a73e8", edgecolors="white", zorder=6, label="pick")
            ax.annotate(f"{c.gpus:,} GPUs, {c.power_cap_w:.0f} W", (c.days, val(c)), textcoords="offset points",
                        xytext=(6, 5), fontsize=8, color="#1a73e8")
        if o.deadline_s:
            ax.axvline(o.deadline_s / gp.DAY, color="#b00020", ls=":", lw=1)
        if o.budget_j and key == "mwh":
            ax.axhline(o.budget_j / 3.6e9, color="#b00020", ls="--", lw=1)
        ax.set_xscale("log")
        if key == "gpus":
            ax.set_yscale("log")
        ax.set_xlabel("wall-clock days (with failures and restarts)")
        ax.set_ylabel(ylabel)
        ax.legend(loc="best")
    return fig


def plan_page(res: PlanResult, command: str | None = None) -> Page:
    o, m, b = res.options, res.model, res.base
    page = Page(f"{m.name}: plan for {o.tokens / 1e12:g}T tokens on {b.gpu.name}", "plan", command)
    page.p(f"seq {res.seq}, {o.precision}, global batch at most {res.max_gbs_tokens:,} tokens; cluster sizes "
           f"{', '.join(f'{s:,}' for s in res.sizes)} GPUs ({b.gpus_per_node} per node); "
           f"{len(res.candidates)} candidates (recommend's head layouts, each at every power cap) in "
           f"{res.elapsed_s:.1f} s.")
    c = res.choice
    page.h2("The pick")
    if c is None:
        page.p(f"No pick: {res.why}.")
    else:
        g = c.goodput
        page.p(f"{res.why}: {c.gpus:,} GPUs, {layout_label(c.config)}, DP{c.config.dp}, gbs {c.config.gbs}, cap "
               f"{c.power_cap_w:.0f} W: {c.days:.1f} days, {c.energy_mwh:,.0f} MWh, {c.gpu_hours / 1e6:.2f}M GPU-hours"
               + (f", cost {c.cost:,.0f}" if c.cost is not None else "")
               + f". Effective training time {g.goodput:.1%} at {g.failures_per_gpu_hour:.3g} failures per GPU-hour "
               f"(job MTBF {g.mtbf_s / 3600:.2f} h, {g.failures:,.0f} failures expected); checkpoint "
               f"{g.checkpoint_bytes_per_rank / 2**30:.2f} GiB per rank in {g.checkpoint_s:.1f} s, every "
               f"{g.interval_s / 60:.1f} min (Daly; Young {g.young_interval_s / 60:.1f} min), restart "
               f"{g.restart_s / 60:.1f} min.")
        page.code("Megatron arguments", c.full_args(o.tokens))
    page.h2("Days against energy and GPUs")
    page.figure(fig_frontier(res), "frontier",
                "Every candidate's expected wall-clock days (useful compute / goodput) against its GPU energy "
                "(useful and redone work at the layout's mean power, checkpoints and restarts at idle power) and "
                "against its GPU count. Orange: the Pareto set of days, energy and GPUs (the line: days against "
                "energy alone); blue: the pick; red: the deadline (dotted) and the budget (dashed).")
    page.h2("Pareto set")
    price = o.gpu_hour_price is not None
    page.table(["GPUs", ("layout", "left"), "cap W", "days", "MWh", "goodput", "GPU-h (M)"] + (["cost"] if price else []),
               [[f"{x.gpus:,}", layout_label(x.config), f"{x.power_cap_w:.0f}", f"{x.days:.1f}", f"{x.energy_mwh:,.0f}",
                 f"{x.goodput.goodput:.1%}", f"{x.gpu_hours / 1e6:.2f}"] + ([f"{x.cost:,.0f}"] if price else [])
                for x in res.pareto],
               copy=("Megatron args", [x.full_args(o.tokens) for x in res.pareto]))
    page.ul(res.notes, "assumptions and their sources")
    return page
