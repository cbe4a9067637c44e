"""What the terminal shows a user: tables that fit the terminal without cutting a cell, a step-time
breakdown that adds up, help texts that name their extras, one throttle figure."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, columns: int | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns is not None:
        env["COLUMNS"] = str(columns)
    p = subprocess.run([sys.executable, "-m", "advisor", *args], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env=env)
    assert p.returncode == 0, p.stderr
    return p


def _layout(c: dict) -> str:
    """The layout as the table spells it (advisor.report's TP·PP·DP[·CP][·EP]...[·VP])."""
    from advisor.catalog import TrainConfig
    from advisor.report import layout_text

    return layout_text(TrainConfig.from_dict(c))


@pytest.fixture(scope="module")
def recommend_80():
    args = ("recommend", "--model", "llama3-70b", "--cluster", "h100x64")
    return run_cli(*args, columns=80).stdout, json.loads(run_cli(*args, "--json").stdout)


def test_recommend_fits_80_columns_without_cutting_a_cell(recommend_80):
    out, res = recommend_80
    lines = out.splitlines()
    assert max(map(len, lines)) <= 80, max(lines, key=len)
    assert "…" not in out and "..." not in out
    table = lines[lines.index(next(ln for ln in lines if ln.startswith("#  layout"))):]
    for r in res["recommendations"]:  # every rank and every whole layout, on its own row
        row = next(ln for ln in table if ln.split()[0] == str(r["rank"]))
        assert row.split()[1] == _layout(r["config"])
    assert "left out" in out  # the columns that did not fit are named


def test_recommend_megatron_args_paste_into_a_shell(recommend_80):
    """Wrapped at 80 columns with a ' \\' on every line but the last: the same arguments."""
    out, res = recommend_80
    lines = out.splitlines()
    start = lines.index("#1 Megatron args:") + 1
    args = []
    for ln in lines[start:]:
        args.append(ln.removesuffix(" \\"))
        if not ln.endswith(" \\"):
            break
    assert " ".join(args) == res["recommendations"][0]["megatron_args"]


def test_predict_fits_80_columns():
    out = run_cli("predict", "--model", "llama3-70b", "--cluster", "h100x64", "--tp", "8", "--pp", "2",
                  "--cp", "2", columns=80).stdout
    assert max(map(len, out.splitlines())) <= 80
    assert "…" not in out and "TP8·PP2·DP2·CP2" in out


@pytest.mark.parametrize("args", [
    ("-m", "deepseek-v3", "-c", "h100x1024", "--tp", "2", "--pp", "8", "--ep", "64", "--seq", "4096", "--gbs",
     "8192", "--pipeline-layout", "Et|(tt|)*30L", "--recompute", "full"),
    ("-m", "llama3-70b", "-c", "h100x64", "--tp", "8", "--pp", "2", "--cp", "2"),
])
def test_predict_breakdown_adds_up_to_the_step(args):
    """The indented step-time terms the terminal prints sum to the printed step time (each is
    rounded to 1 ms; the per-layer overhead, 2.9 s of DeepSeek-V3's 37.6 s, included)."""
    out = run_cli("predict", *args, columns=140).stdout
    cells = [[c.strip() for c in ln[1:-1].split("│")] for ln in out.splitlines() if ln.startswith("│")]
    step = next(float(v.removesuffix(" s")) for k, v in cells if k == "step time")
    terms = [float(v.removesuffix(" s")) for k, v in cells if k and v.endswith(" s") and k != "step time"]
    assert len(terms) >= 6 and any(k == "per-layer overhead" for k, _ in cells)
    assert sum(terms) == pytest.approx(step, abs=0.0005 * (len(terms) + 1))


def _commands_with(flag: str) -> list[str]:
    import typer.main

    from advisor import cli

    cli._register_all()
    group = typer.main.get_command(cli.app)
    return sorted(n for n, c in group.commands.items() if any(flag in p.opts for p in c.params))


def test_html_help_names_the_report_extra():
    """rich markup took '[report]' for a tag: every --html help said pip install 'advisor'."""
    names = _commands_with("--html")
    assert {"recommend", "predict", "tune"} <= set(names)
    for name in names:
        out = run_cli(name, "--help", columns=250).stdout
        assert "pip install 'advisor[report]'" in out, name


@pytest.mark.parametrize("args, hint", [
    (("recommend", "-m", "llama3-70b", "-c", "h100x64", "--set", "node=16"), "did you mean 'nodes'?"),
    (("predict", "-m", "llama3-70b", "-c", "h100x64", "--tp", "8", "--set", "node=16"), "did you mean 'nodes'?"),
    (("recommend", "-m", "llama3-70b", "-c", "h100x64", "--compare", "tp=4,vpp=5"), "did you mean 'vp'?"),
])
def test_unknown_keys_suggest_the_nearest(args, hint):
    p = subprocess.run([sys.executable, "-m", "advisor", *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and hint in p.stderr, p.stderr


def test_place_spells_the_layout_as_recommend_does():
    out = run_cli("place", "-m", "llama3-8b", "-c", "h200x4", "--tp", "2", "--pp", "2", "-p",
                  str(ROOT / "data" / "profiles" / "h200x4-burn.json"), columns=200).stdout
    assert "placement of llama3-8b TP2·PP2·DP1 mbs 1 none on h200x4" in out


def test_one_throttle_figure_and_named_fit_counts(recommend_80):
    """The terminal's throttle is one quantity, the share of the time the cap holds the clock
    (the one the intervals give): no 0..1 risk score beside it; the header names both counts
    (fit in memory, ranked) and --compare's rank is 'of N ranked'."""
    out, res = recommend_80
    assert "risk" not in out
    top = res["recommendations"][0]["prediction"]
    row = next(ln for ln in out.splitlines() if ln.startswith("1  "))
    assert f"{top['throttle_fraction']:.0%}" in row.split()
    lo, hi = top["intervals"]["throttle_fraction"]
    assert f"throttled {lo:.0%}-{hi:.0%}" in " ".join(out.split())
    assert f"{res['feasible']} fit in memory, {res['ranked']} ranked" in " ".join(out.split())
    cmp = run_cli("recommend", "--model", "llama3-70b", "--cluster", "h100x64", "--compare", "tp=4,pp=2,cp=4,vp=8,mbs=2",
                  columns=200).stdout
    assert f"of {res['ranked']} ranked" in cmp
    pred = run_cli("predict", "-m", "deepseek-v3", "-c", "h100x1024", "--tp", "2", "--pp", "8", "--ep", "64", "--seq",
                   "4096", "--gbs", "8192", "--pipeline-layout", "Et|(tt|)*30L", "--recompute", "full",
                   columns=200).stdout
    assert "risk" not in pred and "throttled (power cap)" in pred
