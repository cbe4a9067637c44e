"""`advisor tune --calibration`: the seeds' ranking, each trial's `predicted` and the surrogate
sampler's prior come from the calibration; the simulated runner stays the analytical model; the
calibration is recorded (plan, study user attribute, summary); a study made before the option
still resumes. CPU only."""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from advisor.api import recommend
from advisor.catalog.specs import SpecError
from advisor.models.calibrate import DEFAULT_FILE, Calibration, CalibrationError
from advisor.models.constants import DEFAULT
from advisor.models.dataset import TARGETS
from advisor.models.predict import predict
from advisor.runners.ray_exec import InlineExecutor
from advisor.search_spaces.space import layout_key, layout_params
from advisor.study import Tuner, TuneSettings, make_plan

ROOT = Path(__file__).resolve().parents[1]
TS = optuna.trial.TrialState


def _calibration(**constants) -> Calibration:
    """A calibration whose every target is the model with these constants (no surrogate)."""
    targets = {t: {"mode": "calibrated", "kind": "additive" if t == "throttle_fraction" else "log_ratio",
                   "interval": {"type": "quantiles", "lo": 0.0, "hi": 0.0}} for t in TARGETS}
    return Calibration(constants=dataclasses.replace(DEFAULT, **constants), targets=targets,
                       surrogates={t: None for t in TARGETS}, source="")


# intra-node links at 5% of their speed: layouts with tensor parallelism fall down the ranking
SLOW_NVLINK = dict(nvlink_efficiency=0.05)


def _settings(tmp_path, **kw) -> TuneSettings:
    kw = {"model": "llama3-8b", "cluster": "h100x8", "runner": "simulate", "seed": 0,
          "storage": str(tmp_path / "s.journal"), "dataset": str(tmp_path / "d.jsonl"), **kw}
    return TuneSettings(**kw)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "advisor", "tune", *args], capture_output=True, text=True,
                          timeout=180, cwd=ROOT)


def test_cli_calibration_flag_is_parsed_and_recorded_in_the_plan(tmp_path):
    base = ("-m", "llama3-8b", "-c", "h200x4", "--seq", "4096", "--gbs", "32", "--layers", "8", "--dry-run",
            "--storage", str(tmp_path / "x.journal"))
    r = _cli(*base, "--json")  # no flag: the packaged default, as recommend
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)["calibration"]
    assert d["spec"] == "default"
    if DEFAULT_FILE.is_file():
        assert Path(d["file"]).resolve() == DEFAULT_FILE.resolve() and len(d["sha256"]) == 64
        assert d["levels"]["tokens_per_s_per_gpu"] in ("analytical", "calibrated", "surrogate")
    r = _cli(*base, "--json", "--calibration", "none")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["calibration"] == {"spec": "none", "file": None, "sha256": None, "levels": None, "trained_on": None}
    r = _cli(*base, "--calibration", "none", "--runner", "simulate")
    assert r.returncode == 0, r.stderr
    assert "analytical model" in r.stdout and "enqueued first (analytical top-6)" in r.stdout
    assert "simulated measurements: the analytical model + noise" in r.stdout
    assert not (tmp_path / "x.journal").exists()


@pytest.mark.parametrize("dry", [True, False])
def test_cli_unknown_calibration_file_is_a_one_line_error(tmp_path, dry):
    args = ["-m", "llama3-8b", "-c", "h100x8", "--runner", "simulate", "--ray-address", "inline", "--trials", "2",
            "--storage", str(tmp_path / "s.journal")] + (["--dry-run"] if dry else [])
    bad = tmp_path / "nope.joblib"
    r = _cli(*args, "--calibration", str(bad))
    assert r.returncode == 2 and r.stderr == f"error: {bad}: no such calibration file\n"
    junk = tmp_path / "junk.joblib"
    junk.write_text("not a calibration\n")
    r = _cli(*args, "--calibration", str(junk))
    assert r.returncode == 2 and r.stderr.startswith(f"error: {junk}: not a") and r.stderr.count("\n") == 1
    assert not (tmp_path / "s.journal").exists()  # refused before a study is opened


def test_unknown_calibration_file_is_a_spec_error_in_the_api(tmp_path):
    with pytest.raises(CalibrationError, match="no such calibration file") as e:
        make_plan(_settings(tmp_path, calibration=str(tmp_path / "nope.joblib")))
    assert isinstance(e.value, SpecError)


def test_seeds_follow_the_calibrated_ranking(tmp_path):
    """A calibration that changes the ranking changes the seeds and their order; the study
    measures them first and records the calibration."""
    cal = _calibration(**SLOW_NVLINK)
    plain = make_plan(_settings(tmp_path, calibration=None))  # the analytical model
    calibrated = make_plan(_settings(tmp_path, calibration=cal))
    a = [layout_key(c) for c in plain.enqueue]
    b = [layout_key(c) for c in calibrated.enqueue]
    assert a != b and len(a) == len(b) == 6
    assert any(c.tp > 1 for c in plain.enqueue[:4]) and all(c.tp == 1 for c in calibrated.enqueue[:4])
    # the throughput seeds are the calibrated top by throughput, in its order
    top = [layout_key(r.config) for r in recommend("llama3-8b", "h100x8", seq=calibrated.workload.seq,
                                                   gbs=calibrated.workload.gbs, top=4, calibration=cal,
                                                   stack="local").recommendations]
    assert b[:4] == top
    tps = [cal.predict(calibrated.model, calibrated.cluster, c, check_legal=False).tokens_per_s_per_gpu
           for c in calibrated.enqueue[:4]]
    assert tps == sorted(tps, reverse=True)
    assert calibrated.to_dict()["calibration"]["spec"] == "in memory"

    tu = Tuner(calibrated, InlineExecutor())
    res = tu.run()
    trials = tu.study.get_trials()
    assert [t.user_attrs["layout_key"] for t in trials[:6]] == b
    assert all(t.user_attrs.get("seed") == "calibrated top-K" for t in trials[:6])
    assert tu.study.user_attrs["calibration"] == calibrated.calibration_info
    assert res.study_calibration == calibrated.calibration_info == res.to_dict()["calibration"]


def test_predicted_and_prior_are_calibrated_but_simulation_stays_analytical(tmp_path):
    cal = _calibration(gemm_efficiency_max=DEFAULT.gemm_efficiency_max / 2, **SLOW_NVLINK)
    tu = Tuner(make_plan(_settings(tmp_path, calibration=cal, sampler="surrogate", trials=8)), InlineExecutor())
    res = tu.run()
    m, c = tu.plan.model, tu.plan.cluster
    launched = [t for t in tu.study.get_trials() if t.user_attrs.get("launched")]
    assert res.measured == len(launched) == 8
    for t in launched:
        cfg = tu.by_key[t.user_attrs["layout_key"]]
        want = cal.predict(m, c, cfg, check_legal=False)
        got = t.user_attrs["predicted"]
        assert got["tokens_per_s_per_gpu"] == pytest.approx(want.tokens_per_s_per_gpu)
        assert got["peak_power_w"] == pytest.approx(want.peak_power_w)
        assert got["calibration"] is None  # an in-memory calibration has no file
        # the simulated measurement is the analytical model + 3% noise, not the calibration
        rec = t.user_attrs["record"]
        assert rec["simulated"] is True
        analytical = predict(m, c, cfg, check_legal=False).tokens_per_s_per_gpu
        measured = rec["throughput"]["tokens_per_s_per_gpu"]
        assert abs(math.log(measured / analytical)) < 0.15
        assert abs(math.log(measured / want.tokens_per_s_per_gpu)) > 0.3
    # the surrogate sampler's prior is the calibrated prediction
    sampler = tu.study.sampler
    assert type(sampler).__name__ == "SurrogateSampler"
    cfg = tu.plan.layouts[0]
    p = cal.predict(m, c, cfg, check_legal=False)
    assert sampler.prior(layout_params(cfg, tu.plan.space)) == pytest.approx([p.tokens_per_s_per_gpu, p.peak_power_w])


def test_resumed_study_without_the_attribute_loads(tmp_path):
    from advisor.runners.simulate import run_trial
    from advisor.search_spaces.space import optuna_suggest
    from advisor.study import open_storage

    plan = make_plan(_settings(tmp_path))
    st = open_storage(plan.storage)
    study = optuna.create_study(study_name=plan.study_name, storage=st, directions=["maximize", "minimize"])
    for k, v in {"model": plan.model.name, "cluster": plan.cluster.name, "seq": plan.workload.seq,
                 "gbs": plan.workload.gbs, "precision": plan.workload.precision,
                 "objective": plan.settings.objective, "runner": plan.settings.runner}.items():
        study.set_user_attr(k, v)
    # one trial measured by a driver of the days before --calibration (no `calibration` anywhere)
    study.enqueue_trial(layout_params(plan.enqueue[0], plan.space), user_attrs={"seed": "analytical top-K"})
    t = study.ask()
    cfg = optuna_suggest(t, plan.layouts, plan.space)
    rec = run_trial(plan.model, plan.cluster, cfg)
    t.set_user_attr("launched", True)
    t.set_user_attr("record", rec)
    t.set_user_attr("status", "ok")
    t.set_user_attr("predicted", {"tokens_per_s_per_gpu": 1.0})
    for k in ("memory", "power", "runs"):
        t.set_constraint(k, -0.1)
    study.tell(t, [rec["throughput"]["tokens_per_s_per_gpu"], rec["telemetry"]["peak_power_w"]])
    del study, st

    tu = Tuner(make_plan(_settings(tmp_path, calibration=_calibration(**SLOW_NVLINK), trials=4,
                                   sampler="surrogate")), InlineExecutor())
    res = tu.run()
    assert res.measured == 4 and res.launched_here == 3
    assert "calibration" not in tu.study.user_attrs  # not claimed afterwards for seeds it did not rank
    assert res.study_calibration is None and res.to_dict()["study_calibration"] is None
    assert res.to_dict()["calibration"]["spec"] == "in memory"
    trials = tu.study.get_trials()
    assert trials[0].user_attrs["predicted"] == {"tokens_per_s_per_gpu": 1.0}  # old trials are kept as they were
    assert all("calibration" in t.user_attrs["predicted"] for t in trials[1:] if t.user_attrs.get("launched"))


def test_committed_study_made_before_the_option_resumes(tmp_path):
    """The 4 x H200 study in data/studies (made before --calibration) reopens with the default
    calibration and the surrogate sampler, and measures one more trial (replayed)."""
    from advisor.replay import ReplayExecutor, load_groups

    src = ROOT / "data" / "studies" / "llama3-8b-h200x4.journal"
    data = [ROOT / "data" / "measurements" / f for f in ("h200x4-campaign.jsonl", "tune-llama3-8b-h200x4.jsonl")]
    if not src.is_file() or not all(p.is_file() for p in data) or not DEFAULT_FILE.is_file():
        pytest.skip("the committed study, its records or the default calibration are not in this checkout")
    journal = tmp_path / "study.journal"
    shutil.copy(src, journal)
    s = TuneSettings(model="llama3-8b", cluster="h200x4", seq=4096, gbs=32, layers=8, runner="megatron",
                     storage=str(journal), dataset=str(tmp_path / "d.jsonl"), calibration="default",
                     sampler="surrogate", seed=0)
    plan = make_plan(s)
    from advisor.study import open_storage

    before = optuna.load_study(study_name=plan.study_name, storage=open_storage(str(journal)))
    assert "calibration" not in before.user_attrs
    old = before.get_trials()
    measured = sum(1 for t in old if t.user_attrs.get("launched") and t.state == TS.COMPLETE)
    plan.settings.trials = measured + 1
    group = next(g for g in load_groups(data) if g.model.name == "llama3-8b[8L]" and (g.seq, g.gbs) == (4096, 32))
    tu = Tuner(plan, ReplayExecutor(group.records, strict=False))
    res = tu.run()
    assert res.measured == measured + 1 and res.launched_here == 1
    assert res.study_calibration is None and Path(res.to_dict()["calibration"]["file"]).name == DEFAULT_FILE.name
    new = [t for t in tu.study.get_trials() if t.number >= len(old) and t.user_attrs.get("launched")]
    assert len(new) == 1 and Path(new[0].user_attrs["predicted"]["calibration"]).name == DEFAULT_FILE.name
    assert src.stat().st_size < journal.stat().st_size  # the copy was written, not the committed journal


def test_bench_passes_the_calibration_to_the_studies(tmp_path, capsys):
    from support import load_bench

    bench = load_bench("tune_efficiency")
    assert bench.main(["--calibration", str(tmp_path / "nope.joblib"), "--simulated"]) == 2
    assert "no such calibration file" in capsys.readouterr().err
    from advisor.replay import Replay, load_groups

    grid = ROOT / "data" / "measurements" / "h200x4-campaign.jsonl"
    if not grid.is_file():
        pytest.skip("no campaign records in this checkout")
    g = next(g for g in load_groups([grid], 8) if g.model.name == "llama3-8b[8L]")
    cal = _calibration(**SLOW_NVLINK)
    rep = Replay(g, calibration=cal)
    assert rep.full_plan(4).calibration is cal and rep.plan(4, "surrogate").calibration is cal
    assert rep.plan(4).calibration_info["spec"] == "in memory"
    assert bench.study_names(True)[0] == "advisor tune (TPE + calibrated top-K)"
    assert "NOT held out" in bench.held_out_note(dataclasses.replace(cal, trained_on={"files": [str(grid)]}),
                                                 {str(grid)})
