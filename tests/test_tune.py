"""advisor tune without Ray: the Optuna space, the simulated runner, the study loop (inline
executor), the journal resume rule and the CLI."""
from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys

import optuna
import pytest

from advisor.api import default_workload, resolve
from advisor.catalog.specs import SpecError, TrainConfig
from advisor.runners.ray_exec import InlineExecutor, execute, prepare
from advisor.runners.simulate import options_from_env, run_trial
from advisor.search_spaces.space import (layout_key, layout_choices, layout_params, optuna_space,
                                         optuna_suggest, resolve_params)
from advisor.study import Tuner, TuneSettings, make_plan

TS = optuna.trial.TrialState


@pytest.fixture(scope="module")
def small():
    m, c = resolve("llama3-8b", "h100x8")
    wl = default_workload(m, c)
    return m, c, wl, layout_choices(m, c, wl)


def test_space_has_free_knobs_only_and_selects_every_layout(small):
    m, c, wl, layouts = small
    space = optuna_space(layouts)
    assert set(space) == {"tp", "pp", "cp", "vp", "mbs", "recompute"}  # dp, ep, dist-opt are derived
    assert len({layout_key(x) for x in layouts}) == len(layouts)
    for cfg in layouts:
        assert resolve_params(layout_params(cfg, space), layouts, space) == cfg


def test_suggest_resolves_illegal_combinations_to_a_legal_layout(small):
    m, c, wl, layouts = small
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(30):
        t = study.ask()
        cfg = optuna_suggest(t, layouts)
        assert cfg in layouts and t.user_attrs["layout_key"] == layout_key(cfg)
        study.tell(t, [1.0, 1.0])


def test_simulated_runner_is_the_model_plus_small_noise(small):
    m, c, wl, layouts = small
    from advisor.models.predict import predict

    ok = [x for x in layouts if predict(m, c, x, check_legal=False).memory_gib_per_gpu < 0.8 * 80][:40]
    ratios = []
    for cfg in ok:
        rec = run_trial(m, c, cfg, options={"seed": 1})
        assert rec == {**run_trial(m, c, cfg, options={"seed": 1}), "id": rec["id"], "timestamp": rec["timestamp"]}
        assert rec["simulated"] is True and rec["runner"] == "simulate" and rec["status"] == "ok"
        p = predict(m, c, cfg, check_legal=False)
        ratios.append(math.log(rec["throughput"]["tokens_per_s_per_gpu"] / p.tokens_per_s_per_gpu))
        assert rec["telemetry"]["energy_per_token_j"] > 0 and rec["steps"]["median_s"] > 0
    assert 0.01 < statistics.pstdev(ratios) < 0.06  # sigma 3%


def test_simulated_oom_near_capacity_and_injected_failures(small):
    m, c, wl, layouts = small
    from advisor.models.predict import predict

    cap = c.gpu.memory_gib  # the simulated GPU's real capacity
    near = next(x for x in layouts if 0.95 * cap < predict(m, c, x, check_legal=False).memory_gib_per_gpu <= cap)
    assert run_trial(m, c, near)["status"] == "oom"
    assert run_trial(m, c, near, options={"oom_margin": None})["status"] == "ok"
    with pytest.raises(RuntimeError, match="injected crash"):
        run_trial(m, c, layouts[0], options={"inject": {layouts[0].key(): "crash"}})
    assert options_from_env({"ADVISOR_SIM_INJECT": "tp2-pp1=crash,tp4=hang", "ADVISOR_SIM_DELAY_S": "0.5"}) == {
        "inject": {"tp2-pp1": "crash", "tp4": "hang"}, "delay_s": 0.5}
    recs = execute("simulate", m, c, layouts[:2], 10, {}, ids=["a", "b"])
    assert [r["schema"] for r in recs] == ["advisor.measurement/1"] * 2 and [r["id"] for r in recs] == ["a", "b"]
    assert [r["config"] for r in recs] == [layouts[0].to_dict(), layouts[1].to_dict()]


def test_megatron_runner_screen_turns_off_sp_and_refuses_multinode():
    m, c = resolve("llama3-8b", "h200x4")
    cfg, why = prepare("megatron", m, c, TrainConfig(tp=2, dp=2, sequence_parallel=True, gbs=16))
    assert cfg.sequence_parallel is False and why is None
    m2, c2 = resolve("llama3-8b", "h100x4x2")
    assert "one node" in prepare("megatron", m2, c2, TrainConfig(tp=2, dp=4, gbs=16))[1]


def _tuner(tmp_path, storage=None, executor=None, stop=None, **kw):
    s = TuneSettings(model="llama3-8b", cluster="h100x8", runner="simulate", seed=0,
                     storage=str(tmp_path / "s.journal"), dataset=str(tmp_path / "d.jsonl"), **kw)
    return Tuner(make_plan(s), executor or InlineExecutor(), storage=storage, stop=stop)


def test_study_runs_seeds_first_and_never_launches_infeasible(tmp_path):
    tu = _tuner(tmp_path, trials=15)
    res = tu.run()
    trials = tu.study.get_trials()
    seeds = [layout_key(c) for c in tu.plan.enqueue]
    assert [t.user_attrs["layout_key"] for t in trials[: len(seeds)]] == seeds
    launched = [t for t in trials if t.user_attrs.get("launched")]
    assert len(launched) == res.measured == 15
    assert len({t.user_attrs["layout_key"] for t in launched}) == 15  # nothing measured twice
    for t in trials:
        assert t.state in (TS.COMPLETE, TS.PRUNED)
        if t.user_attrs.get("status") == "infeasible":
            assert not t.user_attrs.get("launched") and t.constraints["memory"] > 0
            assert t.values[0] == 0.0
        if t.user_attrs.get("status") == "ok":
            assert all(v <= 0 for v in t.constraints.values())
    recs = [json.loads(x) for x in open(tmp_path / "d.jsonl")]
    assert len(recs) == 15 and all(r["simulated"] for r in recs)
    assert {r["trial"] for r in recs} == {t.number for t in launched}
    assert res.pareto and res.pareto[0]["tokens_per_s_per_gpu"] == max(r["tokens_per_s_per_gpu"] for r in res.pareto)


def test_crashes_are_recorded_with_violated_constraint_and_study_goes_on(tmp_path):
    m, c = resolve("llama3-8b", "h100x8")
    plan = make_plan(TuneSettings(model="llama3-8b", cluster="h100x8", runner="simulate"))
    bad = plan.enqueue[0].key()
    tu = _tuner(tmp_path, trials=6, runner_options={"inject": {bad: "crash"}})
    res = tu.run()
    crashed = [t for t in tu.study.get_trials() if t.user_attrs.get("status") == "crash"]
    assert len(crashed) == 1 and crashed[0].constraints["runs"] == 1.0
    assert "injected crash" in crashed[0].user_attrs["error"]
    assert res.measured == 6


def test_journal_resume_fails_orphans_and_reenqueues_once(tmp_path):
    tu = _tuner(tmp_path, trials=3)
    tu.run()
    # a driver that died with one trial in flight (launched, no record) ...
    study = optuna.load_study(study_name=tu.plan.study_name, storage=tu.storage)
    t = study.ask()
    optuna_suggest(t, tu.plan.layouts, tu.plan.space)
    t.set_user_attr("launched", True)
    # ... and one whose record reached the storage before it died
    t2 = study.ask({k: optuna.distributions.CategoricalDistribution(v) for k, v in tu.plan.space.items()})
    cfg2 = optuna_suggest(t2, tu.plan.layouts, tu.plan.space)
    t2.set_user_attr("launched", True)
    m, c = resolve("llama3-8b", "h100x8")
    t2.set_user_attr("record", run_trial(m, c, cfg2, options={"oom_margin": None}))
    tu2 = _tuner(tmp_path, trials=6)
    tu2.run()
    trials = tu2.study.get_trials()
    assert trials[t.number].state == TS.FAIL and trials[t.number].user_attrs["stale"]
    retries = [x for x in trials if x.user_attrs.get("retry_of") == t.number]
    assert len(retries) == 1 and retries[0].params == trials[t.number].params
    assert trials[t2.number].state == TS.COMPLETE and not any(x.user_attrs.get("retry_of") == t2.number for x in trials)
    launched = [x for x in trials if x.user_attrs.get("launched") and x.state == TS.COMPLETE]
    assert len(launched) == 6 and len({x.user_attrs["layout_key"] for x in launched}) == 6
    recs = [json.loads(x) for x in open(tmp_path / "d.jsonl")]
    assert sorted(r["trial"] for r in recs) == sorted(x.number for x in launched)


def test_one_driver_per_journal_study(tmp_path):
    tu = _tuner(tmp_path, trials=1)
    with pytest.raises(SpecError, match="another driver"):
        _tuner(tmp_path, trials=1)
    tu.lock.release()


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "advisor", "tune", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_cli_dry_run_json_and_errors(tmp_path):
    r = _cli("-m", "llama3-8b", "-c", "h100x8", "--runner", "simulate", "--dry-run", "--json",
             "--storage", str(tmp_path / "x.journal"))
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["runner"] == "simulate" and d["simulated"] is True and d["dry_run"] is True
    assert d["space"]["pruned_by_memory"] > 0 and d["space"]["layouts"] == 648 and len(d["enqueued"]) == 6
    assert not (tmp_path / "x.journal").exists()
    r = _cli("-m", "llama3-8b", "-c", "h100x8", "--objective", "speed", "--dry-run")
    assert r.returncode == 2 and r.stderr.startswith("error: objective must be") and r.stderr.count("\n") == 1


def test_cli_inline_study_is_labelled_simulated(tmp_path):
    args = ("-m", "llama3-8b", "-c", "h100x8", "--runner", "simulate", "--trials", "5", "--ray-address", "inline",
            "--storage", str(tmp_path / "s.journal"), "--dataset", str(tmp_path / "d.jsonl"))
    r = _cli(*args)
    assert r.returncode == 0, r.stderr
    assert "Pareto front (simulated)" in r.stdout
    r = _cli(*args, "--json")
    d = json.loads(r.stdout)
    assert d["runner"] == "simulate" and d["measured"] == 5 and d["launched_by_this_driver"] == 0
    assert all(json.loads(x)["simulated"] is True for x in open(tmp_path / "d.jsonl"))


def test_surrogate_sampler_study_measures_distinct_layouts(tmp_path):
    """Active learning: the GP expected-improvement sampler drives a study end to end."""
    tu = _tuner(tmp_path, trials=8, sampler="surrogate")
    res = tu.run()
    launched = [t for t in tu.study.get_trials() if t.user_attrs.get("launched")]
    assert res.measured == len(launched) == 8
    assert len({t.user_attrs["layout_key"] for t in launched}) == 8
    assert type(tu.study.sampler).__name__ == "SurrogateSampler"


def test_unknown_sampler_is_a_clear_error(tmp_path):
    import pytest

    from advisor.catalog.specs import SpecError

    with pytest.raises(SpecError, match="--sampler"):
        make_plan(TuneSettings(model="llama3-8b", cluster="h100x8", runner="simulate", sampler="bogus",
                               storage=str(tmp_path / "s.journal")))


class _HoldingExecutor(InlineExecutor):
    """Runs nothing: every job stays in flight; `stop` is set once `n` trials are launched."""

    def __init__(self, stop, n: int) -> None:
        super().__init__()
        self.stop, self.n, self.launched = stop, n, 0

    def slots(self, cluster, cpu_only=False):
        return 4

    def submit(self, job):
        self.launched += len(job.cfgs)
        if self.launched >= self.n:
            self.stop.set()
        return job


def test_stop_marks_in_flight_trials_interrupted_and_resume_reruns_them(tmp_path):
    """A stop (SIGINT / SIGTERM) with trials in flight: they are 'interrupted' (not failures of
    the layout), their parameters enqueued once, the lock file gone; the next driver runs them."""
    import threading

    from advisor.study import INTERRUPTED

    stop = threading.Event()
    tu = _tuner(tmp_path, trials=6, executor=_HoldingExecutor(stop, 3), stop=stop)
    res = tu.run()
    assert res.stopped == INTERRUPTED and res.measured == 0
    cut = [t for t in tu.study.get_trials() if t.user_attrs.get("status") == INTERRUPTED]
    assert len(cut) == 3 and all(t.state == TS.FAIL for t in cut)
    assert res.counts.get(INTERRUPTED) == 3 and not {"fail", "crash"} & set(res.counts)
    assert not list(tmp_path.glob("*.lock"))
    again = _tuner(tmp_path, trials=6)
    res2 = again.run()
    assert res2.measured == 6 and not list(tmp_path.glob("*.lock"))
    measured = {t.user_attrs["layout_key"] for t in again.study.get_trials()
                if t.state == TS.COMPLETE and t.user_attrs.get("launched")}
    assert {t.user_attrs["layout_key"] for t in cut} <= measured


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_cli_signal_saves_says_how_to_resume_and_resumes(tmp_path, sig):
    """SIGINT / SIGTERM on `advisor tune`: exit 130, one line with the trials saved (= the records
    written = the progress bar's count) and the command that resumes; no lock file left."""
    import os
    import re
    import shlex
    import signal
    import time

    cmd = ["tune", "-m", "llama3-8b", "-c", "h100x8", "--layers", "2", "--runner", "simulate", "--ray-address",
           "inline", "--trials", "12", "--seed", "0", "--storage", str(tmp_path / "s.journal"),
           "--dataset", str(tmp_path / "d.jsonl")]
    data = tmp_path / "d.jsonl"
    p = subprocess.Popen([sys.executable, "-m", "advisor", *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**os.environ, "ADVISOR_SIM_DELAY_S": "0.5"})
    try:
        t0 = time.time()
        while (not data.exists() or len(data.read_text().splitlines()) < 2) and time.time() - t0 < 60:
            time.sleep(0.05)
        p.send_signal(getattr(signal, sig))
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 130, err
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    m = re.match(r"interrupted: (\d+) of 12 trials saved .*; resume with: (advisor tune .*)$", last)
    assert m, last
    saved = int(m[1])
    assert 2 <= saved < 12 and saved == len(data.read_text().splitlines())
    assert re.findall(r"(\d+)/12", err)[-1] == str(saved)  # the bar's last count: the records written
    assert not list(tmp_path.glob("*.lock"))
    if sig == "SIGINT":
        args = shlex.split(m[2])[1:]
        assert args == cmd
        r = subprocess.run([sys.executable, "-m", "advisor", *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        recs = [json.loads(x) for x in data.read_text().splitlines()]
        assert len(recs) == 12 and len({json.dumps(x["config"], sort_keys=True) for x in recs}) == 12


def test_progress_never_shows_more_done_than_its_total(tmp_path):
    """--trials 3 on a study that holds 6 already: the bar says 6/6, not 6/3."""
    _tuner(tmp_path, trials=6).run()
    seen = []
    s = TuneSettings(model="llama3-8b", cluster="h100x8", runner="simulate", seed=0,
                     storage=str(tmp_path / "s.journal"), dataset=str(tmp_path / "d.jsonl"), trials=3)
    Tuner(make_plan(s), InlineExecutor(), progress=seen.append).run()
    assert seen and all(e["measured"] <= e["target"] for e in seen) and seen[-1]["measured"] == 6
