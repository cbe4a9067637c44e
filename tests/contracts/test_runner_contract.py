"""The runner contract, written once and run against every runner (simulate, command, megatron),
called the way a study calls them (``ray_exec.prepare`` / ``execute`` / ``InlineExecutor``).

A trial goes in, a record comes out in the shared schema (``advisor.measurement/1``: identity,
config, cluster, environment, stack, steps, throughput, memory, telemetry summary, status ok /
oom / crash / timeout / refused / killed / skipped); a failed or killed trial is a record, never an
exception into the study; errors and refusal reasons are one line; records round-trip through the
records I/O module and are what the dataset loader reads. On CPU: simulate runs fully; command
runs a tiny Python script that prints Megatron-LM's log lines (tests/data/measure/fake_train.py);
megatron runs the fake worker in place of torchrun (tests/data/measure/fake_worker.py), and both
launchers' salvage is fed the files a launcher killed with SIGKILL leaves. Telemetry comes from a
FakeBackend in place of NVML. What a runner cannot do on CPU, or at all, is skipped with the reason."""
from __future__ import annotations

import dataclasses
import json
import math
import shlex
import socket
import sys
import time
from pathlib import Path

import pytest

from advisor.catalog import load_cluster
from advisor.catalog.specs import ModelSpec, TrainConfig
from advisor.models.dataset import parse_record
from advisor.runners import measure as M
from advisor.runners import ray_exec as R
from advisor.runners import telemetry
from advisor.runners.command import CommandSpec
from advisor.runners.records import SCHEMA, STATUSES, append_jsonl, read_jsonl

DATA = Path(__file__).resolve().parents[1] / "data" / "measure"
TINY = ModelSpec(name="tiny", num_layers=4, hidden_size=256, ffn_hidden_size=512,
                 num_attention_heads=8, num_query_groups=2, vocab_size=1000)
CLUSTER = load_cluster("h200x1")
BASE = TrainConfig(tp=1, pp=1, dp=1, mbs=1, gbs=4, seq=512)
# one layout per outcome; the runners' fakes pick what happens from the layout (command: mbs,
# simulate: an injected crash) or from the record id (megatron's fake worker)
LAYOUT = {"ok": BASE, "oom": BASE.replace(mbs=2, gbs=8), "crash": BASE.replace(mbs=4, gbs=8),
          "timeout": BASE.replace(mbs=3, gbs=6), "refused": BASE.replace(cp=2),
          "illegal": BASE.replace(mbs=3, gbs=4)}  # the right world size, a broken rule (gbs % mbs·dp)
RUNNERS = R.RUNNERS
REQUIRED = ("schema", "id", "timestamp", "status", "error", "model_name", "model", "layers", "config",
            "cluster", "env", "stack", "steps", "throughput", "memory", "telemetry", "runner", "simulated")
pytestmark = pytest.mark.xdist_group("runner_contract")  # one worker runs the module's trials once

# what each runner's records name as the stack: none simulated, the built-in runner's default, the
# one the user named for the command runner (not "local": its records used to say that regardless)
STACK = {"simulate": None, "megatron": "local", "command": "te"}
CANNOT = {  # (runner, outcome): why the contract cannot ask it of that runner
    ("simulate", "timeout"): "the simulated runner has no watchdog: its executor times it out (ray_exec)",
}


def one_line(text) -> bool:
    return isinstance(text, str) and bool(text.strip()) and "\n" not in text


def fake_gpus() -> telemetry.FakeBackend:
    """Two synthetic GPUs named like the ones the fake worker reports (their UUIDs match)."""
    b = telemetry.FakeBackend(2)
    b._devices = [dataclasses.replace(d, name="NVIDIA H200") for d in b._devices]
    return b


def trial_id(outcome: str, k: int) -> str:
    """The record id of trial k: its outcome, as the fake worker reads it ("hang-*" times out)."""
    return f"{'hang' if outcome == 'timeout' else outcome}-{k}"


def options(runner: str, outcomes: list[str]) -> dict:
    o = {"steps": 2, "warmup": 1, "progress_timeout_s": 1.5, "telemetry_hz": 50}
    if runner == "simulate":
        o["inject"] = {LAYOUT["crash"].key(): "crash"}
        if outcomes == ["oom"]:
            o["oom_margin"] = 1.0  # nothing fits: the layout OOMs
    if runner == "command":
        o["stack"] = STACK[runner]  # the stack the user says the command runs (tune --stack)
        o["command"] = CommandSpec(f"{shlex.quote(sys.executable)} {DATA / 'fake_train.py'} --step-s 0.02 "
                                   "{megatron_args}", exit_grace_s=1.0).to_dict()
    return o


def run_trials(runner: str, outcomes: list[str], monkeypatch) -> list[dict]:
    """execute() as a study's executor calls it, one trial per outcome, each trial's id naming it."""
    monkeypatch.setenv("FAKE_TRAIN_MODES", "mbs2=oom,mbs4=crash,mbs3=hang")
    monkeypatch.setattr(telemetry, "open_backend", lambda kind="auto": fake_gpus())
    monkeypatch.setattr(M, "torchrun_command", lambda nproc, run_dir, start=0, python=None: [
        sys.executable, str(DATA / "fake_worker.py"), str(run_dir), str(start), str(nproc)])
    monkeypatch.setattr(M, "WORKER", DATA / "fake_worker.py")
    ids = [trial_id(o, k) for k, o in enumerate(outcomes)]
    if runner == "simulate" and "oom" in outcomes and outcomes != ["oom"]:  # its OOM needs its own options
        out = []
        for o, i in zip(outcomes, ids):
            out += [dict(r, id=i) for r in run_trials(runner, [o], monkeypatch)]
        return out
    cfgs = [LAYOUT[o] for o in outcomes]
    return R.execute(runner, TINY, CLUSTER, cfgs, 5.0, options(runner, outcomes), ids=ids)


@pytest.fixture(scope="module")
def trials():
    """Each runner's records for [ok, oom, crash, refused] (what it can do), run once per module."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        for runner in RUNNERS:
            outcomes = [o for o in ("ok", "oom", "crash", "refused") if (runner, o) not in CANNOT]
            out[runner] = (outcomes, run_trials(runner, outcomes, mp))
    return out


def check_schema(rec: dict, runner: str) -> None:
    missing = [k for k in REQUIRED if k not in rec]
    assert not missing, f"{runner} record lacks {missing}"
    assert rec["schema"] == SCHEMA and rec["status"] in STATUSES and isinstance(rec["timestamp"], float)
    assert rec["runner"] == runner and rec["simulated"] is (runner == "simulate")
    assert rec["stack"] is None or isinstance(rec["stack"], str)
    assert ModelSpec.from_dict(rec["model"]).num_layers == rec["layers"] == TINY.num_layers
    cfg = TrainConfig.from_dict(rec["config"])
    assert cfg == TrainConfig.from_dict(cfg.to_dict())
    assert {"gpu", "num_nodes", "gpus_per_node"} <= set(rec["cluster"]) and isinstance(rec["env"], dict)
    json.dumps(rec, allow_nan=False)  # strict JSON
    if rec["status"] == "ok":
        assert rec["error"] is None
    else:
        assert one_line(rec["error"]), f"{runner} {rec['status']}: {rec['error']!r}"


# ------------------------------------------------------------------------------------ the trials
@pytest.mark.parametrize("runner", RUNNERS)
def test_one_record_per_trial_in_order_with_its_id_and_outcome(runner, trials):
    outcomes, recs = trials[runner]
    assert [r["id"] for r in recs] == [trial_id(o, k) for k, o in enumerate(outcomes)]
    assert [r["status"] for r in recs] == outcomes
    for r in recs:
        check_schema(r, runner)


@pytest.mark.parametrize("runner", RUNNERS)
def test_every_record_names_the_stack_the_trial_ran_on(runner, trials):
    assert [r["stack"] for r in trials[runner][1]] == [STACK[runner]] * len(trials[runner][0])


@pytest.mark.parametrize("runner", RUNNERS)
def test_an_ok_record_has_steps_throughput_and_a_telemetry_summary_the_dataset_reads(runner, trials):
    rec = trials[runner][1][0]
    st, cfg = rec["steps"], TrainConfig.from_dict(rec["config"])
    times = st["step_times_s"]
    assert st["measured"] >= 1 and times and all(t > 0 for t in times)
    assert min(times) <= st["median_s"] <= max(times) or runner == "simulate"  # simulate: run-level noise
    assert rec["throughput"]["tokens_per_s_per_gpu"] == pytest.approx(
        cfg.tokens_per_step / st["median_s"] / cfg.world_size, rel=1e-9)
    tel = rec["telemetry"]
    assert tel["peak_power_w"] >= tel["mean_power_w"] > 0 and tel["energy_per_token_j"] > 0
    assert all(0.0 <= v <= 1.0 for v in tel["throttle_fraction"].values())
    parsed = parse_record(rec, runner)
    assert not isinstance(parsed, str) and parsed.cfg == cfg


@pytest.mark.parametrize("runner", RUNNERS)
def test_failed_records_are_kept_with_a_one_line_error(runner, trials):
    outcomes, recs = trials[runner]
    for o, rec in zip(outcomes[1:], recs[1:]):
        assert rec["status"] == o and one_line(rec["error"])
        assert parse_record(rec, runner) == o  # the dataset counts it as a failed trial


@pytest.mark.parametrize("runner", RUNNERS)
def test_records_round_trip_through_the_records_io(runner, trials, tmp_path):
    recs = trials[runner][1]
    path = tmp_path / "d.jsonl"
    for r in recs:
        append_jsonl(path, r)
    assert read_jsonl(path) == [json.loads(json.dumps(r)) for r in recs]


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_trial_that_blows_up_is_a_crash_record_never_an_exception(runner):
    broken = {"steps": "not a number"} if runner != "command" else {}  # command: no --command
    job = R.Job(["t0", "t1"], runner, TINY, CLUSTER, [LAYOUT["ok"], LAYOUT["oom"]], 5.0, broken, ids=["a", "b"])
    ex = R.InlineExecutor()
    ex.submit(job)
    assert ex.wait(0) == [job]
    assert [(r["id"], r["status"]) for r in job.results] == [("a", "crash"), ("b", "crash")]
    for r in job.results:
        check_schema(r, runner)


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_layout_the_runner_cannot_run_is_refused_in_one_line(runner):
    cfg, reason = R.prepare(runner, TINY, CLUSTER, LAYOUT["refused"])
    if (runner, "refused") in CANNOT:
        assert reason is None
        pytest.skip(CANNOT[runner, "refused"])
    assert one_line(reason)
    assert R.prepare(runner, TINY, CLUSTER, LAYOUT["ok"])[1] is None


@pytest.mark.parametrize("runner", RUNNERS)
def test_an_illegal_layout_called_directly_is_a_refused_record_never_a_run(runner, monkeypatch):
    """execute() called without prepare() (as a study's executor does): the layout is not run."""
    cfg, reason = R.prepare(runner, TINY, CLUSTER, LAYOUT["illegal"])
    assert one_line(reason) and "gbs=4 is not a multiple of mbs" in reason
    (rec,) = run_trials(runner, ["illegal"], monkeypatch)
    check_schema(rec, runner)
    assert rec["status"] == "refused" and rec["id"] == trial_id("illegal", 0)
    assert rec["error"] == reason and rec["steps"] is None and rec["throughput"] is None


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_silent_trial_times_out_and_is_recorded(runner, monkeypatch):
    if (runner, "timeout") in CANNOT:
        pytest.skip(CANNOT[runner, "timeout"])
    monkeypatch.setattr(M, "dump_worker_stacks", lambda pid, run_dir, wait_s=2.0: {})  # no 2 s stack wait
    t0 = time.time()
    (rec,) = run_trials(runner, ["timeout"], monkeypatch)
    assert time.time() - t0 < 15
    check_schema(rec, runner)
    assert rec["status"] == "timeout" and rec["id"] == trial_id("timeout", 0)


# ----------------------------------------------------------------------------------- salvage
def _pending(dataset: Path, meta: dict) -> Path:
    d = M.pending_root(dataset) / "20260101-000000-1"
    d.mkdir(parents=True)
    # a launcher that is gone: pid 1 did not start at create_time 0
    (d / "entries.json").write_text(json.dumps({"pid": 1, "create_time": 0.0, "host": socket.gethostname(),
                                                "nproc": 1, **meta}))
    return d


def _megatron_leftovers(dataset: Path, entry: M.Entry, t: float) -> None:
    d = _pending(dataset, {"entries": [M.entry_to_dict(entry)]})
    evs = [{"ev": "hello", "rank": 0, "uuid": "GPU-00000000-0000-4000-8000-000000000000",
            "pci_bus_id": "00000000:18:00.0", "gpu_name": "NVIDIA H200", "hostname": "fake", "t": t},
           {"ev": "start", "cfg": 0, "allocated_gib": 0.1, "t": t},
           {"ev": "built", "cfg": 0, "stage": 0, "tp_rank": 0, "dp_rank": 0, "t": t}]
    evs += [{"ev": "step", "cfg": 0, "k": k, "tt": t + 0.1 * k, "t": t + 0.1 * k} for k in range(4)]
    (d / "rank0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))


def _command_leftovers(dataset: Path, entry: M.Entry, t: float) -> None:
    spec = CommandSpec("python train.py {megatron_args}")
    d = _pending(dataset, {"runner": "command", "command": spec.to_dict(), "node": {"nproc": 1},
                           "entries": [M.entry_to_dict(entry)]})
    (d / "trial0.json").write_text(json.dumps({"id": entry.id, "command": "python train.py", "env": {},
                                               "launched_at": t}))
    (d / "trial0.log").write_text("".join(
        f" [2026-01-01 00:00:0{k}.000000] iteration {k:8d}/      10 | consumed samples: {4 * k:12d} | "
        f"elapsed time per iteration (ms): 100.0 | throughput per GPU (TFLOP/s/GPU): 1.0 | "
        f"global batch size:     4 | lm loss: 1.0E+01 |\n" for k in range(1, 4)))


@pytest.mark.parametrize("runner", RUNNERS)
def test_what_a_sigkilled_launcher_leaves_is_salvaged_into_records_of_the_schema(runner, tmp_path):
    if runner == "simulate":
        pytest.skip("the simulated runner leaves nothing behind: its records are made in the process")
    ds = tmp_path / "d.jsonl"
    e = M.make_entry(TINY, 1, mbs=1, gbs=4, warmup=1, steps=5)
    e.id = "cut-0"
    {"megatron": _megatron_leftovers, "command": _command_leftovers}[runner](ds, e, time.time() - 10)
    (rec,) = M.salvage_runs(ds)
    check_schema(rec, runner)
    assert rec["status"] == "killed" and rec["steps"]["measured"] == 2 and rec["salvaged_from"]
    assert read_jsonl(ds) == [json.loads(json.dumps(rec))]
    assert not M.pending_root(ds).exists()
    assert math.isfinite(rec["throughput"]["tokens_per_s_per_gpu"])
