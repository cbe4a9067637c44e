"""`advisor fit`: calibrate the analytical model and fit residual surrogates on measurements."""
from __future__ import annotations

import glob
import json
import sys
from typing import List, Optional

import typer

from advisor.options import Html

SHOW_REJECTED = 20


def register(app: typer.Typer) -> None:
    app.command("fit")(fit_cmd)


def _expand(paths: list[str]) -> list[str]:
    out = []
    for p in paths:
        hits = sorted(glob.glob(p)) if any(ch in p for ch in "*?[") else []
        out.extend(hits or [p])
    return list(dict.fromkeys(out))


def fit_cmd(
    data: Optional[List[str]] = typer.Option(None, "--data", "-d", help="measurement JSONL (repeatable; globs allowed)"),
    more: Optional[List[str]] = typer.Argument(None, help="more measurement files (so that --data dir/*.jsonl works)"),
    study: Optional[List[str]] = typer.Option(
        None, "--study", help="an 'advisor tune' study: its Optuna journal file or RDB URL (repeatable); the "
                              "measurement record of every measured trial is used (duplicate trials once)"),
    study_name: Optional[str] = typer.Option(None, "--study-name",
                                             help="only this study of the --study storage (default: every study in it)"),
    output: str = typer.Option(..., "--output", "-o", help="calibration file to write (.joblib; a .json summary lands next to it)"),
    folds: int = typer.Option(5, "--folds", help="grouped cross-validation folds (by model shape)"),
    seed: int = typer.Option(0, "--seed"),
    no_surrogates: bool = typer.Option(False, "--no-surrogates", help="calibrate the constants only"),
    as_json: bool = typer.Option(False, "--json", help="the CV summary as JSON on stdout"),
    profile_name: str = typer.Option("custom", "--profile-name",
                                     help="the profile name the file records (the shipped local profile: local)"),
    stack: Optional[str] = typer.Option(None, "--stack", help="fit only the records of this runner stack (local or te); needed when the files mix stacks"),
    html: Html = None,
) -> None:
    """Fit the analytical model's constants and residual surrogates to measurements (JSONL files
    and/or the trials of 'advisor tune' studies); print grouped cross-validation (analytical vs
    calibrated vs surrogate) and write a calibration file."""
    from collections import Counter

    from advisor.catalog.specs import SpecError
    from advisor.models import calibrate
    from advisor.study import load_dataset

    if html:
        from advisor import html_report

        html_report.require()
    if folds < 2:
        raise SpecError("--folds must be at least 2")
    files = _expand(list(data or []) + list(more or []))
    if not files and not study:
        raise SpecError("give measurements: --data FILE.jsonl and/or --study JOURNAL_OR_URL")
    if study_name is not None and not study:
        raise SpecError("--study-name needs --study")
    ds = load_dataset(files, studies=study or (), study_name=study_name)
    err = sys.stderr
    for line in ds.rejected[:SHOW_REJECTED]:
        print(line, file=err)
    if len(ds.rejected) > SHOW_REJECTED:
        print(f"... and {len(ds.rejected) - SHOW_REJECTED} more rejected rows", file=err)
    print(f"data: {ds.summary()}", file=err)
    stacks = Counter(r.stack for r in ds.records)
    if stack is not None:
        if stack not in stacks:
            raise SpecError(f"--stack {stack}: no record of that stack (the data has "
                            + ", ".join(f"{k}: {n}" for k, n in sorted(stacks.items())) + ")")
        ds.records = [r for r in ds.records if r.stack == stack]
        print(f"fitting the {len(ds.records)} records of stack {stack}", file=err)
    elif len(stacks) > 1:  # one profile is one stack's physics (TE's fused layers are not the local ones)
        raise SpecError("the measurements come from several runner stacks ("
                        + ", ".join(f"{k}: {n}" for k, n in sorted(stacks.items()))
                        + "): fit one at a time with --stack local or --stack te")
    cal = calibrate.fit(ds, folds=folds, seed=seed, surrogates=not no_surrogates,
                        log=lambda s: print(s, file=err))
    cal.profile = profile_name.strip() or "custom"
    cal.save(output)
    if html:
        html_report.save(html, html_report.fit_page(cal, ds))
    if as_json:
        json.dump({"output": output, "profile": cal.profile, "data": ds.summary(), "rejected": ds.rejected,
                   "cv": cal.cv, "constants": cal.to_payload()["fitted_constants"]}, sys.stdout, indent=1,
                  default=calibrate.json_default)
        sys.stdout.write("\n")
        return
    from advisor.report import format_fit_report

    print(format_fit_report(cal))
    print(f"wrote {output} (and {output.rsplit('.', 1)[0]}.json): profile {cal.profile}")
