"""`advisor tune --batch N`: several trials per launch (one torchrun with the megatron runner), each
told from its own record; the spool keeps what a job measured when its driver dies."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import optuna
import pytest

from advisor.catalog.specs import TrainConfig
from advisor.runners import measure as M
from advisor.runners.ray_exec import InlineExecutor
from advisor.search_spaces.space import layout_key
from advisor.study import Tuner, TuneSettings, make_plan

TS = optuna.trial.TrialState
FAKE_WORKER = Path(__file__).parent / "data" / "measure" / "fake_worker.py"


class CountingExecutor(InlineExecutor):
    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def submit(self, job):
        self.sizes.append(len(job.cfgs))
        return super().submit(job)


def _settings(tmp_path, **kw) -> TuneSettings:
    base = dict(model="llama3-8b", cluster="h100x8", runner="simulate", seed=0,
                storage=str(tmp_path / "s.journal"), dataset=str(tmp_path / "d.jsonl"))
    return TuneSettings(**{**base, **kw})


def _launched(tu):
    return [t for t in tu.study.get_trials() if t.user_attrs.get("launched")]


def test_batched_study_launches_jobs_of_several_trials_each_told_from_its_own_record(tmp_path):
    ex = CountingExecutor()
    tu = Tuner(make_plan(_settings(tmp_path, trials=10, batch=4)), ex)
    res = tu.run()
    assert ex.sizes == [4, 4, 2] and res.measured == 10 and res.launched_here == 10
    launched = _launched(tu)
    assert all(t.state == TS.COMPLETE for t in launched)
    assert len({t.user_attrs["layout_key"] for t in launched}) == 10  # a batch never repeats a layout
    for t in launched:
        rec = t.user_attrs["record"]
        assert rec["id"] == t.user_attrs["record_id"] and rec["trial"] == t.number
        assert layout_key(TrainConfig.from_dict(rec["config"])) == t.user_attrs["layout_key"]
    recs = [json.loads(x) for x in open(tmp_path / "d.jsonl")]
    assert sorted(r["id"] for r in recs) == sorted(t.user_attrs["record_id"] for t in launched)
    seeds = [layout_key(c) for c in tu.plan.enqueue]
    assert [t.user_attrs["layout_key"] for t in tu.study.get_trials()[:len(seeds)]] == seeds


def test_one_crashing_trial_in_a_batch_costs_only_itself(tmp_path):
    bad = make_plan(_settings(tmp_path)).enqueue[1].key()
    tu = Tuner(make_plan(_settings(tmp_path, trials=4, batch=4, runner_options={"inject": {bad: "crash"}})),
               InlineExecutor())
    tu.run()
    status = {t.user_attrs["layout_key"]: t.user_attrs["status"] for t in _launched(tu)}
    crashed = [k for k, v in status.items() if v == "crash"]
    assert len(status) == 4 and len(crashed) == 1 and sum(v == "ok" for v in status.values()) == 3


def test_bad_batch_is_a_clear_error(tmp_path):
    from advisor.catalog.specs import SpecError

    with pytest.raises(SpecError, match="--batch"):
        make_plan(_settings(tmp_path, batch=0))


@pytest.fixture
def fake_torchrun(monkeypatch):
    launches = []

    def cmd(nproc, run_dir, start=0, python=None):
        launches.append(start)
        return [sys.executable, str(FAKE_WORKER), str(run_dir), str(start), str(nproc)]

    monkeypatch.setattr(M, "torchrun_command", cmd)
    return launches


def test_megatron_batch_is_one_torchrun_and_spools_every_record(tmp_path, fake_torchrun):
    """The real runner's launcher (a fake torchrun in place of megatron): one torchrun per job."""
    s = _settings(tmp_path, cluster="h200x2", layers=2, runner="megatron", trials=5, batch=3,
                  runner_options={"steps": 2, "warmup": 1, "telemetry_hz": 0})
    tu = Tuner(make_plan(s), InlineExecutor())
    res = tu.run()
    assert res.measured == 5 and fake_torchrun == [0, 0]  # two jobs of 3 + 2, each one torchrun from job 0
    launched = _launched(tu)
    assert [t.user_attrs["status"] for t in launched] == ["ok"] * 5
    spool = [json.loads(x) for x in open(tu.spool)]
    assert sorted(r["id"] for r in spool) == sorted(t.user_attrs["record_id"] for t in launched)
    assert all(r["steps"]["measured"] == 2 and r["config"]["dp"] * r["config"]["tp"] * r["config"]["pp"] == 2
               for r in spool)


def test_driver_dead_mid_batch_keeps_the_trials_its_job_finished(tmp_path):
    """Two trials of a job in flight when the driver died; the runner had spooled the first one's
    record. The next driver tells that trial from the spool, re-enqueues only the other, and the
    study goes on to its target without measuring the first layout again."""
    s = _settings(tmp_path, trials=4, batch=2)
    dead = Tuner(make_plan(s), InlineExecutor())
    dead._recover()
    dead._enqueue_seeds()
    (t1, c1), (t2, _) = dead._propose(), dead._propose()
    from advisor.runners.ray_exec import execute

    rec = execute("simulate", dead.plan.model, dead.plan.cluster, [c1], 60, {}, ids=[t1.user_attrs["record_id"]])[0]
    with open(dead.spool, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.write('{"id": "torn')  # a kill in the middle of the next line
    for _, hb in dead.inflight.values():
        hb.join()
    dead.lock.release()  # the kernel does this when the process dies

    ex = CountingExecutor()
    tu = Tuner(make_plan(s), ex)
    res = tu.run()
    by_number = {t.number: t for t in tu.study.get_trials()}
    assert by_number[t1.number].state == TS.COMPLETE
    assert by_number[t1.number].user_attrs["record"]["id"] == t1.user_attrs["record_id"]
    assert by_number[t2.number].state == TS.FAIL
    retried = [t for t in tu.study.get_trials() if t.user_attrs.get("retry_of") == t2.number]
    assert len(retried) == 1  # enqueued once (still waiting: the seeds come first)
    assert retried[0].system_attrs["fixed_params"] == by_number[t2.number].params
    keys = [t.user_attrs["layout_key"] for t in _launched(tu) if t.state == TS.COMPLETE]
    assert res.measured == 4 and len(keys) == len(set(keys)) == 4 and sum(ex.sizes) == 3
    recs = [json.loads(x) for x in open(tmp_path / "d.jsonl")]
    assert [r["id"] for r in recs].count(t1.user_attrs["record_id"]) == 1


def test_a_skipped_trial_is_not_a_measurement_and_is_retried_once(tmp_path):
    """A trial the runner skipped (its batch aborted after two hangs) never ran: it is failed, not
    told as a crash (that would teach the sampler the layout is infeasible and block it as a
    duplicate), and its parameters are enqueued once; a skipped retry is not enqueued again."""
    bad = make_plan(_settings(tmp_path)).enqueue[1].key()
    tu = Tuner(make_plan(_settings(tmp_path, trials=8, runner_options={"inject": {bad: "skipped"}})),
               InlineExecutor())
    res = tu.run()
    trials = tu.study.get_trials()
    skipped = [t for t in trials if t.user_attrs.get("status") == "skipped"]
    assert [t.state for t in skipped] == [TS.FAIL, TS.FAIL]
    assert skipped[1].user_attrs["retry_of"] == skipped[0].number
    assert sum(t.user_attrs.get("retry_of") == skipped[1].number for t in trials) == 0
    ok = [t for t in _launched(tu) if t.state == TS.COMPLETE]
    assert res.measured == 8 and len(ok) == 8 and all(t.user_attrs["status"] == "ok" for t in ok)
    assert bad not in {t.user_attrs["layout_key"] for t in ok}
    assert all(r["status"] != "skipped" for r in map(json.loads, open(tmp_path / "d.jsonl")))
