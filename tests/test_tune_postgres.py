"""Two tuning drivers on one PostgreSQL study never run the same trial or the same layout.
Needs ADVISOR_TEST_POSTGRES_URL (set by `eval "$(bash .ci/postgres.sh)"`); skipped otherwise."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import optuna
import pytest

URL = os.environ.get("ADVISOR_TEST_POSTGRES_URL")
pytestmark = pytest.mark.skipif(not URL, reason="ADVISOR_TEST_POSTGRES_URL is not set (run .ci/postgres.sh)")
TS = optuna.trial.TrialState


def test_two_drivers_share_a_study_without_duplicates(tmp_path):
    name = f"pg-{uuid.uuid4().hex[:8]}"
    data = tmp_path / "d.jsonl"
    cmd = [sys.executable, "-m", "advisor", "tune", "-m", "llama3-8b", "-c", "h100x8", "--runner", "simulate",
           "--trials", "12", "--ray-address", "inline", "--storage", URL, "--study-name", name,
           "--dataset", str(data), "--json"]
    env = {**os.environ, "ADVISOR_SIM_DELAY_S": "0.3"}
    drivers = [subprocess.Popen(cmd + ["--seed", str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env) for i in range(2)]
    outs = [d.communicate(timeout=120) for d in drivers]
    for d, (out, err) in zip(drivers, outs):
        assert d.returncode == 0, err[-3000:]
    here = [json.loads(out)["launched_by_this_driver"] for out, _ in outs]
    assert all(n > 0 for n in here)  # both drivers measured

    from advisor.study import rdb_url

    study = optuna.load_study(study_name=name, storage=rdb_url(URL))
    trials = study.get_trials()
    launched = [t for t in trials if t.user_attrs.get("launched")]
    assert all(t.state == TS.COMPLETE for t in launched)
    assert 12 <= len(launched) <= 13  # each driver stops at 12 in the study; one may start the 13th
    assert len(launched) == sum(here)
    assert len({t.user_attrs["layout_key"] for t in launched}) == len(launched)  # no layout twice
    recs = [json.loads(x) for x in open(data)]
    assert sorted(r["trial"] for r in recs) == sorted(t.number for t in launched)  # no trial twice
    assert not [t for t in trials if t.state == TS.RUNNING]


def test_killed_driver_trial_is_failed_by_heartbeat_and_retried_once(tmp_path):
    import signal
    import time

    name = f"pg-kill-{uuid.uuid4().hex[:8]}"
    data = tmp_path / "d.jsonl"
    cmd = [sys.executable, "-m", "advisor", "tune", "-m", "llama3-8b", "-c", "h100x8", "--runner", "simulate",
           "--trials", "6", "--ray-address", "inline", "--storage", URL, "--study-name", name,
           "--dataset", str(data), "--seed", "0"]
    env = {**os.environ, "ADVISOR_TUNE_HEARTBEAT_S": "1", "ADVISOR_TUNE_GRACE_S": "3"}
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env={**env, "ADVISOR_SIM_DELAY_S": "2"})
    deadline = time.time() + 60
    while (not data.exists() or len(data.read_text().splitlines()) < 2) and time.time() < deadline:
        time.sleep(0.1)
    from advisor.study import rdb_url

    # kill while a trial is in flight (the driver may be between two trials right after a record)
    while time.time() < deadline:
        running = optuna.load_study(study_name=name, storage=rdb_url(URL)).get_trials(states=(TS.RUNNING,))
        if running:
            break
        time.sleep(0.1)
    assert running, "no trial in flight to kill"
    p.send_signal(signal.SIGKILL)
    p.wait()
    time.sleep(4)  # past the heartbeat grace (3 s): the dead driver's trial is stale for the next one
    r = subprocess.run(cmd, capture_output=True, text=True, env={**env, "ADVISOR_SIM_DELAY_S": "0.2"}, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]

    trials = optuna.load_study(study_name=name, storage=rdb_url(URL)).get_trials()
    failed = [t for t in trials if t.state == TS.FAIL]
    assert len(failed) == 1, [(t.number, t.state.name, t.user_attrs.get("status")) for t in trials]
    assert len([t for t in trials if t.user_attrs.get("retry_of") == failed[0].number]) == 1
    launched = [t for t in trials if t.user_attrs.get("launched") and t.state == TS.COMPLETE]
    assert len(launched) == 6 and len({t.user_attrs["layout_key"] for t in launched}) == 6
    recs = [json.loads(x) for x in open(data)]
    assert sorted(r["trial"] for r in recs) == sorted(t.number for t in launched)
    assert not [t for t in trials if t.state == TS.RUNNING]
