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

    near = next(x for x in layouts if 0.95 * 80 < predict(m, c, x, check_legal=False).memory_gib_per_gpu <= 80)
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


def _tuner(tmp_path, storage=None, executor=None, **kw):
    s = TuneSettings(model="llama3-8b", cluster="h100x8", runner="simulate", seed=0,
                     storage=str(tmp_path / "s.journal"), dataset=str(tmp_path / "d.jsonl"), **kw)
    return Tuner(make_plan(s), executor or InlineExecutor(), storage=storage)


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
