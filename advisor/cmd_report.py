"""`advisor report`: the HTML report of a tune study or of a measurement dataset."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from advisor.cmd_recommend import CAL_HELP
from advisor.options import Stack, calibration_default


def register(app: typer.Typer) -> None:
    app.command("report")(report_cmd)


def report_cmd(
    source: str = typer.Argument(..., metavar="STUDY|DATASET",
                                 help="an 'advisor tune' study (its journal file or RDB URL) or measurement JSONL"),
    html: Optional[str] = typer.Option(None, "--html", "-o", metavar="FILE",
                                       help="the HTML file to write (default: <name>.html here; "
                                            "needs pip install 'advisor\\[report]')"),
    study_name: Optional[str] = typer.Option(None, "--study-name", help="the study, when the storage holds several"),
    calibration: Optional[str] = typer.Option(None, "--calibration", help="DATASET: predictions from " + CAL_HELP,
                                              callback=calibration_default),
    stack: Stack = None,
) -> None:
    """Write a self-contained HTML report with plots: a study's convergence, Pareto front and trials,
    or a dataset's measurements against their predictions."""
    from advisor import html_report

    html_report.require()
    kind = html_report.input_kind(source)
    if kind == "study":
        page = html_report.study_page(source, study_name)
    else:
        page = html_report.dataset_page([source], calibration, stack)
    out = html or (Path(source.split("://")[-1].split("/")[-1] if "://" in source else source).stem + ".html")
    html_report.save(out, page)
