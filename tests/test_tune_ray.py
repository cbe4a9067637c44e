"""advisor tune on a real local Ray cluster: two raylets on this host, each with 4 fake GPUs.
Drivers run as subprocesses of the CLI, as a user would run them."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import optuna
import pytest

ray = pytest.importorskip("ray")
# one worker runs this file's tests (pyproject's --dist loadgroup): each starts a local Ray
pytestmark = pytest.mark.xdist_group("ray")
from ray.cluster_utils import Cluster  # noqa: E402

TS = optuna.trial.TrialState


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, connect=False,
                head_node_args={"num_cpus": 2, "num_gpus": 4, "include_dashboard": False})
    c.add_node(num_cpus=2, num_gpus=4)
    c.wait_for_nodes()
    yield c
    c.shutdown()


def _cmd(cluster, tmp_path, name, *extra, topo="h100x4", trials=6):
    return [sys.executable, "-m", "advisor", "tune", "-m", "llama3-8b", "-c", topo, "--runner", "simulate",
            "--trials", str(trials), "--seed", "0", "--ray-address", cluster.address, "--study-name", name,
            "--storage", str(tmp_path / "s.journal"), "--dataset", str(tmp_path / f"{name}.jsonl"), *extra]


def _env(hold_gpus=1, **kw):
    """The driver's environment. Simulated trials ask Ray for one CPU unless ADVISOR_SIM_HOLD_GPUS=1:
    the tests of GPU placement (fake GPUs) make them hold the GPUs a real trial would."""
    env = {**os.environ, **{k: str(v) for k, v in kw.items()}}
    if hold_gpus:
        env["ADVISOR_SIM_HOLD_GPUS"] = "1"
    else:
        env.pop("ADVISOR_SIM_HOLD_GPUS", None)
    return env


def _run(cmd, env=None, timeout=120):
    env = _env() if env is None else env
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _records(path):
    return [json.loads(x) for x in open(path)] if os.path.exists(path) else []


def _study(tmp_path, name):
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return optuna.load_study(study_name=name, storage=JournalStorage(JournalFileBackend(str(tmp_path / "s.journal"))))


def test_trials_run_concurrently_on_both_nodes(cluster, tmp_path):
    r = _run(_cmd(cluster, tmp_path, "conc", "--json"), env=_env(ADVISOR_SIM_DELAY_S=2))
    d = json.loads(r.stdout)
    assert d["measured"] == 6 and d["runner"] == "simulate"
    recs = _records(tmp_path / "conc.jsonl")
    assert len(recs) == 6 and all(x["simulated"] for x in recs)
    nodes = {x["placement"][0]["node_id"] for x in recs}
    assert len(nodes) == 2  # 8 fake GPUs, 4 per trial: two trials at a time, one per node
    assert all(len(x["placement"][0]["gpu_ids"]) == 4 for x in recs)
    # concurrency from the trials' own clocks, not the wall time of the whole study (which a loaded
    # machine stretches): a simulated trial sleeps 2 s and is recorded when it ends, so trials run
    # one after another end >= 2 s apart; two at a time, each pair ends within a fraction of that
    ends = sorted(x["timestamp"] for x in recs)
    together = sum(1 for a, b in zip(ends, ends[1:]) if b - a < 1.0)
    assert together >= 2, ends


def test_batched_jobs_are_ray_tasks_of_several_trials(cluster, tmp_path):
    # 1 s per trial: the two jobs overlap, so Ray runs them on the two nodes at once
    r = _run(_cmd(cluster, tmp_path, "batch", "--batch", "3", "--json"), env=_env(ADVISOR_SIM_DELAY_S=1))
    assert json.loads(r.stdout)["measured"] == 6
    recs = _records(tmp_path / "batch.jsonl")
    by_task = {}
    for x in recs:  # the trials of one job ran in one task: same node, same GPUs; the jobs in parallel
        p = x["placement"][0]
        by_task.setdefault((p["node_id"], tuple(p["gpu_ids"])), []).append(x["trial"])
    assert sorted(len(v) for v in by_task.values()) == [3, 3]
    assert len({x["id"] for x in recs}) == len({x["trial"] for x in recs}) == 6


def test_multi_node_trial_gets_one_bundle_per_node_and_a_rendezvous(cluster, tmp_path):
    _run(_cmd(cluster, tmp_path, "multi", topo="h100x4x2", trials=2))
    recs = _records(tmp_path / "multi.jsonl")
    assert len(recs) == 2
    for x in recs:
        pl = x["placement"]
        assert [p["node_rank"] for p in pl] == [0, 1]
        assert pl[0]["node_id"] != pl[1]["node_id"]
        assert pl[0]["master"] == pl[1]["master"] and pl[0]["master"][0] == pl[0]["node_ip"]


def test_crashing_and_hanging_trials_are_recorded_and_the_study_goes_on(cluster, tmp_path):
    plan = json.loads(_run(_cmd(cluster, tmp_path, "fail", "--dry-run", "--json")).stdout)
    k0, k1 = (e["key"].replace("-nodistopt", "") for e in plan["enqueued"][:2])
    # the timeout leaves a loaded 2-core machine time to start the crashing trial before it is
    # killed (at 4 s no trial was recorded as a crash in two full suites run beside a CPU-bound
    # bench, session 24), and still kills the hanging one
    r = _run(_cmd(cluster, tmp_path, "fail", "--trial-timeout", "12", "--json"),
             env=_env(ADVISOR_SIM_INJECT=f"{k0}=crash,{k1}=hang"))
    assert json.loads(r.stdout)["measured"] == 6
    by_status = {}
    for x in _records(tmp_path / "fail.jsonl"):
        by_status.setdefault(x["status"], []).append(x)
    assert len(by_status["crash"]) == 1 and "injected crash" in by_status["crash"][0]["error"]
    assert len(by_status["timeout"]) == 1
    assert sum(len(v) for v in by_status.values()) == 6
    for t in _study(tmp_path, "fail").get_trials():
        if t.user_attrs.get("status") in ("crash", "timeout"):
            assert t.state == TS.COMPLETE and t.constraints["runs"] == 1.0 and t.values[0] == 0.0


def test_driver_killed_mid_study_resumes_without_loss_or_repeats(cluster, tmp_path):
    cmd = _cmd(cluster, tmp_path, "kill", trials=10)
    data = tmp_path / "kill.jsonl"
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(ADVISOR_SIM_DELAY_S=1.5))
    deadline = time.time() + 90
    while len(_records(data)) < 3 and time.time() < deadline and p.poll() is None:
        time.sleep(0.1)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    before = _records(data)
    assert 3 <= len(before) < 10
    _run(cmd, env=_env(ADVISOR_SIM_DELAY_S=0.2))
    recs = _records(data)
    study = _study(tmp_path, "kill")
    trials = study.get_trials()
    launched = [t for t in trials if t.user_attrs.get("launched") and t.state == TS.COMPLETE]
    assert len(launched) == 10 == len(recs)  # every measurement kept ...
    assert len({x["trial"] for x in recs}) == 10 and len({x["id"] for x in recs}) == 10
    assert len({t.user_attrs["layout_key"] for t in launched}) == 10  # ... none run twice
    assert recs[: len(before)] == before
    stale = [t for t in trials if t.user_attrs.get("stale")]
    assert stale and all(t.state == TS.FAIL for t in stale)  # the in-flight ones of the dead driver
    for t in stale:  # one retry each; a trial killed before its sampler gave it a layout has none to retry
        assert len([x for x in trials if x.user_attrs.get("retry_of") == t.number]) == (1 if t.params else 0)
    assert not [t for t in trials if t.state == TS.RUNNING]


def test_multi_node_command_trial_runs_one_launcher_per_node_and_merges_their_records(cluster, tmp_path):
    """--runner command on 2 nodes: each node rank runs the command with its {node_rank}; only the
    last node prints iteration lines (as Megatron-LM does); the record has its steps and both nodes."""
    fake = os.path.join(os.path.dirname(__file__), "data", "measure", "fake_train.py")
    cmd = (f"{sys.executable} {fake} --step-s 0.05 --print-on-node 1 --node {{node_rank}} "
           f"--master {{master_addr}}:{{master_port}} {{megatron_args}}")
    tune = [a for a in _cmd(cluster, tmp_path, "cmdmulti", topo="h100x4x2", trials=2) if a != "simulate"]
    i = tune.index("--runner")
    tune[i + 1:i + 1] = ["command"]
    _run(tune + ["--command", cmd, "--steps", "3", "--warmup", "1", "--calibration", "none"])
    recs = _records(tmp_path / "cmdmulti.jsonl")
    assert len(recs) == 2
    for x in recs:
        assert x["status"] == "ok" and x["runner"] == "command" and x["steps"]["measured"] == 3
        assert [n["node_rank"] for n in x["command"]["nodes"]] == [0, 1]
        assert x["cluster"]["num_nodes"] == 2 and x["cluster"]["gpus_per_node"] == 4
        pl = x["placement"]
        assert [p["node_rank"] for p in pl] == [0, 1] and pl[0]["node_id"] != pl[1]["node_id"]
        master = f"--master {pl[0]['master'][0]}:{pl[0]['master'][1]}"
        assert master in x["command"]["line"]


def test_simulated_trials_ask_ray_for_cpus_only(tmp_path):
    """A CPU-only Ray cluster runs simulated trials (one CPU each, two at a time on 2 CPUs)."""
    c = Cluster(initialize_head=True, connect=False,
                head_node_args={"num_cpus": 2, "num_gpus": 0, "include_dashboard": False})
    try:
        c.wait_for_nodes()
        cmd = _cmd(c, tmp_path, "cpu", "--json", topo="h100x8x2", trials=4)
        d = json.loads(_run(cmd, env=_env(hold_gpus=0)).stdout)
        assert d["measured"] == 4
        recs = _records(tmp_path / "cpu.jsonl")
        assert len(recs) == 4 and all(x["status"] in ("ok", "oom") for x in recs)
        assert all(x["placement"][0]["gpu_ids"] == [] for x in recs)
        # the same cluster has no room for a trial that holds 16 GPUs, and says what to do
        r = subprocess.run(_cmd(c, tmp_path, "gpus", topo="h100x8x2", trials=1), capture_output=True, text=True,
                           env=_env(hold_gpus=1), timeout=120)
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: the Ray cluster has no room")
    finally:
        c.shutdown()


def test_default_local_ray_runs_simulated_trials_on_a_cpu_only_machine(tmp_path):
    """No --ray-address: a new local Ray, which on a machine without GPUs has CPUs only."""
    cmd = [sys.executable, "-m", "advisor", "tune", "-m", "llama3-8b", "-c", "h100x8", "--layers", "2",
           "--runner", "simulate", "--trials", "3", "--seed", "0", "--storage", str(tmp_path / "s.journal"),
           "--dataset", str(tmp_path / "d.jsonl"), "--json"]
    env = _env(hold_gpus=0)
    env.pop("RAY_ADDRESS", None)
    d = json.loads(_run(cmd, env=env, timeout=300).stdout)
    assert d["measured"] == 3 and len(_records(tmp_path / "d.jsonl")) == 3


def test_unreachable_ray_address_is_one_line_at_once(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "advisor", "tune", "-m", "llama3-8b", "-c", "h100x8", "--runner", "simulate",
        "--ray-address", f"127.0.0.1:{port}", "--storage", str(tmp_path / "s.journal"),
        "--dataset", str(tmp_path / "d.jsonl")]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and time.time() - t0 < 30
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot reach Ray at 127.0.0.1:{port}"), r.stderr
    assert "--ray-address inline" in lines[0]
    assert not (tmp_path / "d.jsonl").exists()


def test_ray_token_authentication_failure_is_one_line_with_the_fix(monkeypatch):
    from advisor.runners.ray_exec import _ray_start_message

    log = "gcs_client.cc:210: Failed to get cluster ID from GCS server: Unauthenticated: RPC error: InvalidAuthToken"
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    msg = _ray_start_message("10.0.0.1:6379", ConnectionError("Failed to connect"), log)
    assert "export RAY_AUTH_MODE=token" in msg and "~/.ray/auth_token" in msg and "\n" not in msg
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert "refused this driver's token" in _ray_start_message("10.0.0.1:6379", ConnectionError("x"), log)
