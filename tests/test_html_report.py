"""The HTML reports (advisor/html_report.py): content from the same objects as the CLI, one
self-contained file, a one-line error without matplotlib; and, in headless Chromium, every plot of
every report kind drawn (tests/test_html_browser.py)."""
from __future__ import annotations

import html
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from advisor import cli

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "data/studies/llama3-8b-h200x4.journal"
DATASET = ROOT / "data/measurements/h200x4-full-depth.jsonl"
PROFILE = ROOT / "data/placement/h200x4-profile.json"

mpl = pytest.importorskip("matplotlib", reason="the HTML report needs matplotlib (pip install 'advisor[report]')")


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def external_refs(text: str) -> list[str]:
    """Anything the page would fetch: src=, href= other than #fragments, url(...) other than #ids, @import."""
    refs = re.findall(r'\bsrc\s*=\s*"[^"]*"', text)
    refs += [h for h in re.findall(r'href\s*=\s*"([^"]*)"', text) if not h.startswith("#")]
    refs += [u for u in re.findall(r"url\(([^)]*)\)", text) if not u.startswith("#")]
    refs += re.findall(r"@import", text)
    return refs


def test_pareto_front():
    from advisor.html_report import pareto_front

    cost = [700, 750, 760, 800, 820]
    gain = [500, 600, 590, 650, 640]
    assert pareto_front(cost, gain) == [0, 1, 3]  # 760/590 and 820/640 are dominated


def test_recommend_report_shows_the_cli_numbers(tmp_path):
    from advisor.api import recommend
    from advisor.html_report import recommend_page, write
    from advisor.report import recommendation_cells

    res = recommend("llama3-70b", "h100x64", top=3)
    page = recommend_page(res)
    text = write(tmp_path / "r.html", page).read_text()
    for r in res.recommendations:  # the terminal table's cells and the Megatron args, as they are
        for cell in recommendation_cells(r):
            assert f">{html.escape(cell)}<" in text
        assert html.escape(r.megatron_args) in text
    assert text.count('<figure class="plot"') == page.figures == 3
    assert external_refs(text) == []
    assert "<script>" in text and "advisorCopy" in text  # the copy button, inline


def test_cli_html_on_every_command(tmp_path, capsys):
    rec = tmp_path / "rec.html"
    code, out, err = run_cli(["recommend", "-m", "llama3-8b", "-c", "h100x8", "--top", "2", "--json",
                              "--html", str(rec)], capsys)
    assert code == 0
    assert json.loads(out)["recommendations"]  # stdout stays pure JSON; the note is on stderr
    assert f"wrote {rec}" in err and rec.stat().st_size > 10_000
    pred = tmp_path / "pred.html"
    code, out, err = run_cli(["predict", "-m", "llama3-8b", "-c", "h100x8", "--tp", "2", "--pp", "2",
                              "--html", str(pred)], capsys)
    assert code == 0 and "tokens/s/GPU" in out
    assert pred.read_text().count('<figure class="plot"') == 2
    place = tmp_path / "place.html"
    code, out, err = run_cli(["place", "-m", "llama3-8b", "-c", "h200x4", "--pp", "4", "--gbs", "32", "--seq", "4096",
                              "-p", str(PROFILE), "--html", str(place)], capsys)
    assert code == 0, err
    text = place.read_text()
    assert "identity" in text and "CUDA_VISIBLE_DEVICES=3,1,2,0" in text
    study = tmp_path / "study.html"
    code, out, err = run_cli(["report", str(STUDY), "--html", str(study)], capsys)
    assert code == 0, err
    text = study.read_text()
    assert "best feasible so far" in text and "refused by the megatron runner" in text
    assert external_refs(text) == []
    data = tmp_path / "data.html"
    code, out, err = run_cli(["report", str(DATASET), "-o", str(data)], capsys)
    assert code == 0, err
    assert "inside the 80% interval" in data.read_text()


def test_tune_and_fit_write_their_reports(tmp_path, capsys):
    out = tmp_path / "tune.html"
    code, _, err = run_cli(["tune", "-m", "llama3-8b", "-c", "h100x8", "--runner", "simulate", "--ray-address", "inline",
                            "--trials", "3", "--storage", str(tmp_path / "s.journal"),
                            "--dataset", str(tmp_path / "s.jsonl"), "--html", str(out)], capsys)
    assert code == 0, err
    text = out.read_text()
    assert text.count('<figure class="plot"') == 2 and "llama3-8b" in text
    code, _, err = run_cli(["tune", "-m", "llama3-8b", "-c", "h100x8", "--runner", "simulate", "--dry-run",
                            "--html", str(tmp_path / "dry.html")], capsys)
    assert code == 2 and "--dry-run" in err
    fit = tmp_path / "fit.html"
    code, _, err = run_cli(["fit", "--data", str(DATASET), "--no-surrogates", "--folds", "2",
                            "-o", str(tmp_path / "cal.joblib"), "--html", str(fit)], capsys)
    assert code == 0, err
    text = fit.read_text()
    assert "out of fold" in text and "constants (default -&gt; fitted)" in text


def test_study_report_pareto_is_the_tune_table(tmp_path):
    import optuna

    from advisor.report import pareto_cells
    from advisor.html_report import study_page
    from advisor.study import study_pareto
    from advisor.study_storage import open_study_storage

    text = study_page(str(STUDY)).html()
    study = optuna.load_study(study_name=None, storage=open_study_storage(str(STUDY)))
    front = study_pareto(study, "peak_power_w")
    assert front
    for r in front:
        assert "".join(f"<td{' class=l' if i in (1, 3) else ''}>{html.escape(c)}</td>"
                       for i, c in enumerate(pareto_cells(r, "power"))) in text


def test_report_bad_input_is_one_line(tmp_path, capsys):
    code, out, err = run_cli(["report", str(tmp_path / "nope.journal")], capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    junk = tmp_path / "junk.txt"
    junk.write_text("hello\n")
    code, out, err = run_cli(["report", str(junk)], capsys)
    assert code == 2 and "neither an Optuna journal" in err and err.count("\n") == 1
    code, out, err = run_cli(["predict", "-m", "llama3-8b", "-c", "h100x8", "--batch", "-",
                              "--html", str(tmp_path / "x.html")], capsys)
    assert code == 2 and err.startswith("error: ") and "--batch" in err
    code, out, err = run_cli(["recommend", "-m", "llama3-8b", "-c", "h100x8", "--html", str(tmp_path)], capsys)
    # refused by advisor.validate before the recommendation is computed
    assert code == 2 and err.startswith(f"error: --html {tmp_path}: is a folder") and err.count("\n") == 1


NO_MPL = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("blocked for the test")
sys.meta_path.insert(0, Block())
from advisor import cli
cli.main(sys.argv[1:])
"""


def test_without_matplotlib_core_answers_and_html_is_one_line(tmp_path):
    base = [sys.executable, "-c", NO_MPL, "recommend", "-m", "llama3-8b", "-c", "h100x8", "--top", "1"]
    ok = subprocess.run(base, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert ok.returncode == 0 and "TP" in ok.stdout, ok.stderr
    out = tmp_path / "r.html"
    bad = subprocess.run(base + ["--html", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr == "error: the HTML report needs matplotlib: pip install 'advisor[report]'\n"
    assert bad.stdout == "" and not out.exists()  # refused before any work
