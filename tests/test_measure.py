"""The measurement launcher on CPU: failure classification from logs, JSONL durability, entries
and refusals, record assembly from a recorded GPU run, and the batch runner driven by a fake
worker (OOM, hang -> watchdog, segfault, interrupt -> partial record)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from advisor.catalog.specs import ModelSpec, SpecError
from advisor.runners import measure as M
from support import assert_dies_with_parent

DATA = Path(__file__).parent / "data" / "measure"
TINY = ModelSpec(name="tiny", num_layers=4, hidden_size=256, ffn_hidden_size=512,
                 num_attention_heads=8, num_query_groups=2, vocab_size=1000)


# ----------------------------------------------------------------------------- classification
LOGS = {
    "torch_oom": ("""[rank2]: Traceback (most recent call last):
[rank2]:   File "/tmp/adv/advisor/runners/megatron_worker.py", line 233, in run_job
[rank2]:     train_step(job, config, model, optimizer, iters)
[rank2]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB. GPU 2 has a total capacity of 139.81 GiB of which 1.02 GiB is free. Including non-PyTorch memory, this process has 138.78 GiB memory in use.
E1121 15:40:01.123000 1234 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 1) local_rank: 2 (pid: 4321) of binary: /usr/bin/python3
""", 1, "oom"),
    "nccl_watchdog": ("""[rank1]:[E1121 15:41:12.000000000 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600012 milliseconds before timing out.
[rank1]:[E1121 15:41:12.000000000 ProcessGroupNCCL.cpp:2168] [PG ID 0 PG GUID 0(default_pg) Rank 1] Process group watchdog thread terminated with exception
terminate called after throwing an instance of 'c10::DistBackendError'
""", -6, "timeout"),
    "segfault": ("""Fatal Python error: Segmentation fault

Thread 0x00007f (most recent call first):
  File "/usr/lib/python3/dist-packages/torch/cuda/__init__.py", line 1011 in synchronize
[W1121 torch/distributed/elastic/multiprocessing/api.py:900] Sending process 77 closing signal SIGTERM
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
/tmp/adv/advisor/runners/megatron_worker.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-21_15:42:00
  rank      : 0 (local_rank: 0)
  exitcode  : -11 (pid: 76)
  error_file: <N/A>
  traceback : Signal 11 (SIGSEGV) received by PID 76
""", 1, "crash"),
    "illegal": ("""[rank0]: RuntimeError: CUDA error: an illegal memory access was encountered
[rank0]: CUDA kernel errors might be asynchronously reported at some other API call
""", 1, "crash"),
    "nccl_error": ("""[rank3]: torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.28.9
[rank3]: ncclUnhandledCudaError: Call to CUDA function failed.
""", 1, "crash"),
    "nccl_oom": ("""NCCL WARN Cuda failure 'out of memory'
[rank0]: torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:77, unhandled cuda error
""", 1, "oom"),
    "python_error": ("""[rank0]: Traceback (most recent call last):
[rank0]:   File "megatron_worker.py", line 120, in build
[rank0]: AssertionError: vp_stage must be passed if virtual pipeline is enabled
[rank0]: ValueError: num_query_groups (8) must be a multiple or divisor of tensor_model_parallel_size (3).
""", 1, "crash"),
    "sigkill": ("Killed\n", -9, "crash"),
    # torchrun itself got SIGTERM from outside the launcher (the launcher's own kills are known
    # to it and never classified from the log)
    "signal_exception": ("""[rank0]: step 3
Traceback (most recent call last):
  File "/usr/lib/python3/dist-packages/torch/distributed/elastic/agent/server/api.py", line 867, in _invoke_run
    time.sleep(monitor_interval)
torch.distributed.elastic.multiprocessing.api.SignalException: Process 437 got signal: 15
""", 1, "killed"),
    "clean": ("step 1\nstep 2\n", 0, "ok"),
}


@pytest.mark.parametrize("name", sorted(LOGS))
def test_classify_failure(name):
    text, rc, want = LOGS[name]
    status, reason = M.classify_failure(text, rc)
    assert status == want
    assert "\n" not in reason
    if want != "ok":
        assert reason


def test_classify_failure_reasons_are_telling():
    assert "illegal memory access" in M.classify_failure(LOGS["illegal"][0], 1)[1]
    assert "segmentation" in M.classify_failure(LOGS["segfault"][0], 1)[1].lower()
    assert "ValueError: num_query_groups" in M.classify_failure(LOGS["python_error"][0], 1)[1]
    assert M.classify_failure("", -11) == ("crash", "segmentation fault (signal 11)")
    assert M.classify_failure("no error text", 2)[0] == "crash"


# ------------------------------------------------------------------------------------- JSONL
def test_jsonl_append_survives_partial_write(tmp_path):
    p = tmp_path / "d.jsonl"
    M.append_jsonl(p, {"a": 1})
    with open(p, "a") as f:
        f.write('{"b": 2, "cut off')  # a writer killed mid-line
    M.append_jsonl(p, {"c": 3})
    assert M.read_jsonl(p) == [{"a": 1}, {"c": 3}]
    assert p.read_text().endswith("\n")


def test_jsonl_strict_json(tmp_path):
    p = tmp_path / "d.jsonl"
    M.append_jsonl(p, M.finite({"x": float("nan"), "y": [1.0, float("inf")]}))
    assert M.read_jsonl(p) == [{"x": None, "y": [1.0, None]}]


# ----------------------------------------------------------------------------------- entries
def test_make_entry_derives_dp_and_gbs():
    e = M.make_entry(TINY, 4, tp=2, mbs=2)
    assert e.config.dp == 2 and e.config.gbs == 2 * 2 * 8 and e.refused is None
    assert M.make_entry(TINY, 4, layers=2).model.num_layers == 2


def test_make_entry_refusals():
    assert "world size 4" in M.make_entry(TINY, 4, tp=3).refused
    assert "2 layers do not split evenly over pp=4" in M.make_entry(TINY, 4, tp=1, pp=4, layers=2).refused
    assert "gbs" in M.make_entry(TINY, 4, mbs=2, gbs=6).refused
    assert "sequence_parallel" in M.make_entry(TINY, 4, tp=2, sequence_parallel=True).refused
    e = M.make_entry(TINY, 4, distributed_optimizer=False)
    assert e.config.overlap_param_gather is False  # only exists with the distributed optimizer
    with pytest.raises(SpecError):
        M.make_entry(TINY, 4, steps=0)
    with pytest.raises(SpecError):
        M.make_entry(TINY, 4, bogus=1)


def test_batch_file(tmp_path):
    p = tmp_path / "b.jsonl"
    p.write_text(json.dumps({"model": TINY.to_dict(), "layers": 2, "tp": 2, "mbs": 1, "steps": 3}) + "\n"
                 + "# a comment\n\n" + json.dumps({"model": "llama3-8b", "layers": 4, "pp": 2}) + "\n")
    es = M.load_batch(p, 4)
    assert [e.model.num_layers for e in es] == [2, 4] and es[0].steps == 3
    assert es[1].model.name == "llama3-8b[4L]" and es[1].config.dp == 2
    p.write_text('{"model": "llama3-8b", "tp": 2, "nonsense": 1}\n')
    with pytest.raises(SpecError, match="b.jsonl:1"):
        M.load_batch(p, 4)


def test_job_is_json_and_complete():
    e = M.make_entry(TINY, 4, tp=2, pp=2, vp=2, mbs=1, gbs=8, recompute="selective")
    job = json.loads(json.dumps(M.job_for(e, 5)))
    assert job["index"] == 5 and job["num_microbatches"] == 8
    assert job["tc"]["virtual_pipeline_model_parallel_size"] == 2
    assert job["tc"]["recompute_granularity"] == "selective"
    assert job["model_kw"]["vocab_size"] % (128 * 2) == 0


# ----------------------------------------------------------------------- record from a GPU run
def _fixture():
    d = json.loads((DATA / "gpu_run_fixture.json").read_text())
    return d


@pytest.mark.skipif(not (DATA / "gpu_run_fixture.json").exists(), reason="no recorded GPU run")
def test_record_from_recorded_gpu_run():
    from advisor.runners.telemetry import Trace

    fx = _fixture()
    trace = Trace.load(DATA / fx["trace_file"])
    entry = M.entry_from_line(fx["entry"], fx["world"])
    entry.id = fx["record"]["id"]
    ranks = {int(r): v for r, v in fx["ranks"].items()}
    rec = M.assemble_record(entry, "ok", None, ranks, fx["bounds"], trace, fx["env"],
                            gpus_per_node=fx["world"], timestamp=fx["record"]["timestamp"])
    want = fx["record"]
    assert rec["schema"] == "advisor.measurement/1" and rec["status"] == "ok"
    assert rec["steps"]["step_times_s"] == pytest.approx(want["steps"]["step_times_s"])
    assert rec["throughput"]["tokens_per_s"] == pytest.approx(want["throughput"]["tokens_per_s"])
    assert rec["memory"] == want["memory"]
    assert rec["rank_map"] == want["rank_map"]
    # telemetry aligned on the measured steps: same GPUs, same numbers as on the device
    t, tw = rec["telemetry"], want["telemetry"]
    assert set(t["per_gpu"]) == {rm["uuid"] for rm in rec["rank_map"]}
    assert t["mean_power_w"] == pytest.approx(tw["mean_power_w"], rel=1e-6)
    assert t["energy_per_token_j"] == pytest.approx(tw["energy_per_token_j"], rel=1e-6)
    assert t["interval_s"] == pytest.approx(rec["steps"]["measured"] * 0 + sum(
        rec["steps"]["step_times_s"][rec["steps"]["warmup"]:]), rel=1e-9)
    assert [s["stage"] for s in t["per_stage"]] == sorted({rm["stage"] for rm in rec["rank_map"]})
    # the measured interval sits inside the trace and is sampled densely
    for s in t["per_gpu"].values():
        assert s["n_samples"] >= 0.5 * t["interval_s"] * t["rate_hz"]


def test_record_without_telemetry_or_steps():
    e = M.make_entry(TINY, 2, mbs=1, gbs=2)
    rec = M.assemble_record(e, "crash", "boom", {}, None)
    assert rec["status"] == "crash" and rec["steps"] is None and rec["throughput"] is None
    json.dumps(rec, allow_nan=False)
    ranks = {r: {"hello": {"uuid": f"GPU-{r}", "pci_bus_id": None, "gpu_name": "NVIDIA H200"},
                 "built": {"stage": 0, "tp_rank": 0, "dp_rank": r},
                 "done": {"peak_allocated_gib": 5.0 + r, "peak_reserved_gib": 6.0 + r}} for r in range(2)}
    rec = M.assemble_record(e, "killed", "interrupted", ranks, [0.0, 1.0, 2.0, 2.5], None)
    assert rec["steps"]["step_times_s"] == [1.0, 1.0, 0.5]
    assert rec["steps"]["warmup"] == 3 and rec["steps"]["measured"] == 0 and rec["throughput"] is None
    assert rec["memory"]["peak_gib_per_stage"] == [6.0] and rec["memory"]["max_gib"] == 6.0
    assert rec["cluster"]["gpu"] == "h200"
    e2 = M.make_entry(TINY, 2, mbs=1, gbs=2, warmup=1)
    rec = M.assemble_record(e2, "ok", None, ranks, [0.0, 1.0, 2.0, 2.5, 3.5], None)
    assert rec["steps"]["median_s"] == 1.0 and rec["throughput"]["tokens_per_s"] == 2 * 4096 / 1.0
    assert rec["throughput"]["mfu"] > 0


# ------------------------------------------------------------------------- batch, fake worker
@pytest.fixture
def fake_torchrun(monkeypatch):
    def cmd(nproc, run_dir, start=0, python=None):
        return [sys.executable, str(DATA / "fake_worker.py"), str(run_dir), str(start), str(nproc)]
    monkeypatch.setattr(M, "torchrun_command", cmd)
    monkeypatch.setattr(M, "WORKER", DATA / "fake_worker.py")  # the process the watchdog asks for stacks


def _entries(kinds, world=2, steps=2):
    out = []
    for k in kinds:
        e = M.make_entry(TINY, world, mbs=1, gbs=2 * world, warmup=1, steps=steps)
        e.id = f"{k}-{len(out)}"
        out.append(e)
    return out


def test_batch_ok_oom_hang_segv_refused(tmp_path, fake_torchrun):
    from advisor.runners.telemetry import FakeBackend

    es = _entries(["ok", "oom", "ok", "hang", "ok", "segv", "ok"])
    es.insert(1, M.make_entry(TINY, 2, tp=2, sequence_parallel=True))
    ds = tmp_path / "out.jsonl"
    t0 = time.time()
    recs = M.run_batch(es, ds, 2, run_dir=tmp_path / "run", timeout=2.0, telemetry=FakeBackend(2),
                       telemetry_hz=50)
    assert time.time() - t0 < 60
    by_id = {r["id"]: r for r in M.read_jsonl(ds)}
    assert len(by_id) == len(es) == len(recs)
    status = [by_id[e.id]["status"] for e in es]
    assert status == ["ok", "refused", "oom", "ok", "timeout", "ok", "crash", "ok"]
    oom = by_id[es[2].id]
    assert "out of memory" in oom["error"] and oom["memory"]["at_failure"]["1"]["allocated_gib"] == 130.0
    assert "segmentation" in by_id[es[6].id]["error"].lower()
    hang = by_id[es[4].id]
    assert hang["steps"] is None or hang["steps"]["measured"] == 0
    # the watchdog asked the worker where it was before killing it
    assert hang["hang_stacks"]["0"][0].startswith("wait_in_collective (fake_worker.py:")
    assert "rank 0 in wait_in_collective (fake_worker.py:" in hang["error"]
    ok = by_id[es[0].id]
    assert ok["steps"]["measured"] == 2 and ok["throughput"]["tokens_per_s"] > 0
    tel = ok["telemetry"]
    assert set(tel["per_gpu"]) == {rm["uuid"] for rm in ok["rank_map"]}
    assert tel["mean_power_w"] > 0 and tel["energy_per_token_j"] > 0
    assert tel["sampler_overhead_pct"] is not None
    assert [rm["pci_bus_id"] for rm in ok["rank_map"]] == ["00000000:18:00.0", "00000000:19:00.0"]
    # where the wall time went: start-up only for the first job of each torchrun (the batch starts
    # one, the OOM, hang and segfault each end theirs and the next job starts a new one)
    tm = {e.id: by_id[e.id].get("timing") for e in es}
    assert tm[es[1].id] is None  # refused: never ran
    firsts = [e.id for e in es if tm[e.id] and tm[e.id]["first_in_torchrun"]]
    assert firsts == [es[0].id, es[3].id, es[5].id, es[7].id]
    for i in firsts:
        assert 0 <= tm[i]["startup_s"] < 30
    assert tm[es[2].id]["startup_s"] is None and not tm[es[2].id]["first_in_torchrun"]
    for e in (es[0], es[3], es[5], es[7]):
        t = tm[e.id]
        assert 0 <= t["build_s"] < 5 and 0.2 < t["run_s"] < 10  # 3 steps of 0.1 s after the first boundary


def test_batch_workers_that_never_start(tmp_path, monkeypatch):
    monkeypatch.setattr(M, "torchrun_command", lambda n, d, s=0, python=None: [
        sys.executable, "-c", "import sys; print('ModuleNotFoundError: No module named megatron'); sys.exit(1)"])
    es = _entries(["ok", "ok", "ok"])
    recs = M.run_batch(es, None, 2, run_dir=tmp_path / "run", timeout=5, telemetry="off")
    assert [r["status"] for r in recs] == ["crash"] * 3
    assert "did not start" in recs[0]["error"] and "megatron" in recs[0]["error"]


def _interrupted_batch(tmp_path, kinds: list[str]) -> list[dict]:
    """Run a batch, Ctrl-C it after 2 s, and return what reached its dataset."""
    ds = tmp_path / "out.jsonl"
    threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        M.run_batch(_entries(kinds), ds, 2, run_dir=tmp_path / "run", timeout=60, telemetry="off")
    return M.read_jsonl(ds)


def test_batch_interrupt_keeps_partial_record(tmp_path, fake_torchrun):
    recs = _interrupted_batch(tmp_path, ["ok", "hang", "ok"])
    assert [r["status"] for r in recs] == ["ok", "killed"]
    assert recs[1]["steps"] is None or recs[1]["steps"]["measured"] == 0


def test_classify_signal_exception_names_the_signal():
    status, reason = M.classify_failure(LOGS["signal_exception"][0], 1)
    assert status == "killed" and "signal 15 (SIGTERM)" in reason and "outside" in reason


# ------------------------------------------- one GPU: in-process recovery, budget, our own kills
def test_single_gpu_failure_in_the_last_job_is_recorded(tmp_path, fake_torchrun):
    # 1xH100 campaign: the 1-GPU worker survived the OOM of the last job, said batch_done and
    # exited 0, and the launcher returned without recording that job.
    es = _entries(["ok", "oom"], world=1)
    recs = M.run_batch(es, tmp_path / "out.jsonl", 1, run_dir=tmp_path / "run", timeout=10,
                       telemetry="off")
    assert [(r["id"], r["status"]) for r in recs] == [(es[0].id, "ok"), (es[1].id, "oom")]
    assert recs[1]["memory"]["at_failure"]["0"]["allocated_gib"] == 130.0
    assert M.read_jsonl(tmp_path / "out.jsonl") == recs


def test_single_gpu_batch_replays_the_h100_campaign(tmp_path, fake_torchrun):
    # ok, ok, OOM recovered in-process, a job running longer than the failure grace, OOM in the
    # last job: the launcher used to kill torchrun <grace> s after the first OOM (job 3 became a
    # `crash` from the SIGTERM it sent itself) and lost the last job's OOM.
    es = _entries(["ok", "ok", "oom", "slow", "crash", "oom"], world=1, steps=3)
    recs = M.run_batch(es, tmp_path / "out.jsonl", 1, run_dir=tmp_path / "run", timeout=10,
                       telemetry="off", failure_grace_s=1.0)
    assert [r["id"] for r in recs] == [e.id for e in es]  # every job exactly once, in order
    assert [r["status"] for r in recs] == ["ok", "ok", "oom", "ok", "crash", "oom"]
    assert recs[3]["steps"]["measured"] == 3 and "SignalException" not in str(recs)
    assert "ValueError: boom" in recs[4]["error"]
    assert len(list((tmp_path / "run").glob("attempt*.log"))) == 1  # one torchrun for it all


def test_single_gpu_death_is_classified_from_its_own_output(tmp_path, fake_torchrun):
    # the torchrun log also holds the OOM message of the job before, which the worker survived
    es = _entries(["oom", "segv"], world=1)
    recs = M.run_batch(es, None, 1, run_dir=tmp_path / "run", timeout=10, telemetry="off")
    assert [r["status"] for r in recs] == ["oom", "crash"]
    assert "segmentation" in recs[1]["error"].lower()


def test_budget_applies_inside_a_single_gpu_torchrun(tmp_path, fake_torchrun, capfd):
    # One torchrun runs the whole batch on one GPU, so a budget checked only between torchruns
    # never applied. Jobs take ~1.2 s; with 1.8 s the second job is in flight when the budget
    # runs out and finishes; the third begins after it: stopped at once, no record unless it
    # measured a step (then `killed`, steps kept); the fourth never starts.
    es = _entries(["slow"] * 4, world=1, steps=3)
    recs = M.run_batch(es, tmp_path / "out.jsonl", 1, run_dir=tmp_path / "run", timeout=10,
                       telemetry="off", max_seconds=1.8)
    by_id = {r["id"]: r for r in M.read_jsonl(tmp_path / "out.jsonl")}
    assert len(by_id) == len(recs)
    assert by_id[es[0].id]["status"] == by_id[es[1].id]["status"] == "ok"
    assert by_id[es[1].id]["steps"]["measured"] == 3
    if es[2].id in by_id:
        cut = by_id[es[2].id]
        assert cut["status"] == "killed" and "time budget" in cut["error"]
        assert cut["steps"]["step_times_s"]
    assert es[3].id not in by_id
    err = capfd.readouterr().err
    assert "time budget" in err and "not started" in err


def test_budget_between_torchruns_skips_without_records(tmp_path, fake_torchrun, capfd):
    es = _entries(["oom", "ok", "ok"])  # 2 GPUs: the OOM ends the torchrun
    slow_sink = lambda rec: time.sleep(1.2)  # the budget runs out while job 0 is recorded
    recs = M.run_batch(es, None, 2, run_dir=tmp_path / "run", timeout=10, telemetry="off",
                       max_seconds=1.0, on_record=slow_sink)
    assert [r["status"] for r in recs] == ["oom"]
    assert len(list((tmp_path / "run").glob("attempt*.log"))) == 1
    assert f"2 job(s) not started, not recorded: {es[1].id}, {es[2].id}" in capfd.readouterr().err


def test_oom_then_hang_is_oom_after_the_launcher_kills(tmp_path, fake_torchrun):
    # rank 1 reports an OOM, the others hang in a collective: killed after the grace, recorded
    # as the OOM it was (not timeout, not crash), and the batch goes on.
    es = _entries(["ok", "oomhang", "ok"])
    recs = M.run_batch(es, None, 2, run_dir=tmp_path / "run", timeout=10, telemetry="off",
                       failure_grace_s=0.5)
    assert [r["status"] for r in recs] == ["ok", "oom", "ok"]
    assert "out of memory" in recs[1]["error"]


def test_interrupt_after_a_reported_oom_keeps_the_oom(tmp_path, fake_torchrun):
    assert [r["status"] for r in _interrupted_batch(tmp_path, ["ok", "oomhang", "ok"])] == ["ok", "oom"]


def _fake_launcher(tmp_path: Path, body: str) -> subprocess.Popen:
    """A launcher process of its own (so it can be SIGKILLed) running `body` with the fake
    torchrun in place and `M` / `tiny` (a 4-layer ModelSpec) defined."""
    script = tmp_path / "launcher.py"
    script.write_text(f"""
import sys
from advisor.catalog.specs import ModelSpec
from advisor.runners import measure as M
M.torchrun_command = lambda n, d, s=0, python=None: [sys.executable, {str(DATA / "fake_worker.py")!r}, str(d), str(s), str(n)]
tiny = ModelSpec(name="tiny", num_layers=4, hidden_size=256, ffn_hidden_size=512,
                 num_attention_heads=8, num_query_groups=2, vocab_size=1000)
""" + body)
    return subprocess.Popen([sys.executable, str(script)])


def _wait_for_worker_pid(run_dir: Path, timeout_s: float = 20.0) -> int:
    """The fake worker's pid, once its first job is running."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        p = run_dir / "rank0.jsonl"
        evts = M.read_jsonl(p) if p.exists() else []  # skips a line being written
        if any(e["ev"] == "step" for e in evts):
            return next(e["pid"] for e in evts if e["ev"] == "hello")
        time.sleep(0.05)
    raise AssertionError("the fake worker did not start")


def test_torchrun_killed_from_outside_is_killed_not_crash(tmp_path, fake_torchrun):
    es = _entries(["hang"], world=1)
    run_dir = tmp_path / "run"
    out = {}
    th = threading.Thread(target=lambda: out.update(recs=M.run_batch(
        es, None, 1, run_dir=run_dir, timeout=60, telemetry="off")))
    th.start()
    os.kill(_wait_for_worker_pid(run_dir), signal.SIGTERM)  # not the launcher's doing
    th.join(30)
    assert not th.is_alive()
    (rec,) = out["recs"]
    assert rec["status"] == "killed" and "SIGTERM" in rec["error"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_torchrun_does_not_outlive_a_launcher_killed_with_sigkill(tmp_path):
    # The launcher starts torchrun in a session of its own (its process group is killed without
    # the launcher; a terminal's Ctrl-C reaches the launcher only). If the launcher is SIGKILLed
    # (Ray force-kill, OOM killer), torchrun must still go: PR_SET_PDEATHSIG sends it SIGTERM.
    run_dir = tmp_path / "run"
    launcher = _fake_launcher(tmp_path, f"""
e = M.make_entry(tiny, 1, mbs=1, gbs=1)
e.id = "hang-0"
M.run_batch([e], None, 1, run_dir={str(run_dir)!r}, timeout=600, telemetry="off")
""")
    assert_dies_with_parent(launcher, lambda: _wait_for_worker_pid(run_dir),
                            gone_msg="torchrun outlived the launcher")


def test_world_size_mismatch_is_refused(tmp_path):
    e = M.make_entry(TINY, 4, mbs=1)
    recs = M.run_batch([e], None, 2, run_dir=tmp_path, telemetry="off")
    assert recs[0]["status"] == "refused" and "world size 2" in recs[0]["error"]


# ------------------------------------------------------------------------------------- CLI
def test_cli_refuses_before_launch(tmp_path, capsys):
    from advisor.cli import main

    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as ex:
        main(["measure", "--model", "llama3-8b", "--layers", "4", "--tp", "2", "--sequence-parallel",
              "--gpus", "4", "--out", str(out)])
    assert ex.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: refused: sequence_parallel") and "\n" not in err
    assert json.loads(out.read_text())["status"] == "refused"


def test_cli_dry_run(capsys):
    from advisor.cli import main

    with pytest.raises(SystemExit) as ex:
        main(["measure", "--model", "llama3-8b", "--layers", "4", "--tp", "2", "--pp", "2",
              "--gpus", "4", "--dry-run"])
    assert ex.value.code == 0
    out = capsys.readouterr().out
    assert "--tensor-model-parallel-size 2" in out and "--nproc-per-node 4" in out


def test_cli_needs_model_or_batch(capsys):
    from advisor.cli import main

    with pytest.raises(SystemExit) as ex:
        main(["measure", "--gpus", "1"])
    assert ex.value.code == 2
    assert capsys.readouterr().err.startswith("error: give either --model or --batch")


def test_parse_stack_dump_keeps_the_main_thread_innermost_first():
    dump = """Thread 0x00007f2a3bfff640 (most recent call first):
  File "/usr/lib/python3.12/threading.py", line 355 in wait
  File "/tmp/site/torch/utils/data/_utils/pin_memory.py", line 51 in _pin_memory_loop

Current thread 0x00007f2b8e5c4740 (most recent call first):
  File "/tmp/site/megatron/core/pipeline_parallel/p2p_communication.py", line 233 in _batched_p2p_ops
  File "/tmp/site/megatron/core/pipeline_parallel/p2p_communication.py", line 412 in _communicate
  File "/tmp/site/megatron/core/pipeline_parallel/schedules.py", line 1201 in forward_backward_pipelining_with_interleaving
  File "/work/runners/megatron_worker.py", line 204 in train_step
"""
    frames = M.parse_stack_dump(dump)
    assert frames[0] == "_batched_p2p_ops (p2p_communication.py:233)"
    assert frames[-1] == "train_step (megatron_worker.py:204)" and len(frames) == 4
    assert M.stack_summary(frames, 2) == "_batched_p2p_ops (p2p_communication.py:233) < _communicate (p2p_communication.py:412)"
    assert M.parse_stack_dump("") == [] and M.parse_stack_dump("torchrun noise\n") == []


def test_saved_trace_lines_up_with_the_record_steps(tmp_path, fake_torchrun):
    from advisor.runners.telemetry import FakeBackend, Trace

    es = _entries(["ok"], steps=3)
    es[0].save_trace = True
    rec = M.run_batch(es, None, 2, run_dir=tmp_path / "run", timeout=10, telemetry=FakeBackend(2),
                      telemetry_hz=50, trace_dir=tmp_path / "traces")[0]
    bounds = rec["steps"]["bounds_unix"]
    assert len(bounds) == 1 + 1 + 3  # start, 1 warmup, 3 measured
    assert [b - a for a, b in zip(bounds, bounds[1:])] == pytest.approx(rec["steps"]["step_times_s"])
    tr = Trace.load(rec["telemetry"]["trace_path"])
    steps = [w for w in tr.windows if w[0].startswith(("warmup", "step"))]
    assert [w[0] for w in steps] == ["warmup 1", "step 1", "step 2", "step 3"]
    assert [w[1] for w in steps] == pytest.approx(bounds[:-1]) and steps[-1][2] == pytest.approx(bounds[-1])


def test_every_committed_trace_path_points_into_the_repo():
    root = Path(__file__).resolve().parents[1]
    paths = []
    for f in sorted((root / "data" / "measurements").glob("*.jsonl")):
        for r in M.read_jsonl(f):
            p = (r.get("telemetry") or {}).get("trace_path")
            if p:
                paths.append(p)
                assert not Path(p).is_absolute() and (root / p).is_file(), f"{f.name}: {p}"
    assert len(paths) >= 11


def test_a_sigkilled_launcher_leaves_records_the_next_batch_salvages(tmp_path):
    # Nothing measured is lost even to SIGKILL: the worker files wait beside the dataset
    # (<dataset>.runs/) until the batch is settled; the next run on that dataset (or
    # `advisor measure --salvage`) turns what the workers wrote into records.
    ds = tmp_path / "out.jsonl"
    launcher = _fake_launcher(tmp_path, f"""
es = [M.make_entry(tiny, 2, mbs=1, gbs=4, warmup=1, steps=s) for s in (2, 200)]
es[0].id, es[1].id = "ok-0", "slow-1"
M.run_batch(es, {str(ds)!r}, 2, timeout=600, telemetry="off")
""")
    try:
        t0 = time.time()
        rank0 = None
        while time.time() - t0 < 30:  # until the second job has measured a few steps
            runs = list(M.pending_root(ds).glob("*/rank0.jsonl"))
            if runs and sum('"cfg": 1' in line and '"step"' in line for line in runs[0].read_text().splitlines()) >= 5:
                rank0 = runs[0]
                break
            time.sleep(0.1)
        assert rank0 is not None, "the fake batch did not get going"
        launcher.kill()  # SIGKILL: the launcher cannot write anything
        launcher.wait(10)
    finally:
        launcher.kill()
        launcher.wait()
    assert [r["id"] for r in M.read_jsonl(ds)] == ["ok-0"]  # the in-flight job has no record yet
    time.sleep(1.0)  # the fake torchrun goes with its launcher (PR_SET_PDEATHSIG)
    recs = M.salvage_runs(ds)
    assert [(r["id"], r["status"]) for r in recs] == [("slow-1", "killed")]
    rec = recs[0]
    assert rec["steps"]["measured"] >= 3 and rec["throughput"]["tokens_per_s"] > 0
    assert rec["telemetry"] is None and "SIGKILL" in rec["error"] and rec["salvaged_from"]
    assert [r["id"] for r in M.read_jsonl(ds)] == ["ok-0", "slow-1"]
    assert not M.pending_root(ds).exists() and M.salvage_runs(ds) == []


def test_salvage_leaves_the_batch_of_a_live_launcher_alone(tmp_path):
    import psutil

    ds = tmp_path / "out.jsonl"
    d = M.pending_root(ds) / "live"
    d.mkdir(parents=True)
    me = psutil.Process()
    e = M.make_entry(TINY, 2, mbs=1, gbs=4)
    (d / "entries.json").write_text(json.dumps({"pid": me.pid, "create_time": me.create_time(),
                                                "nproc": 2, "entries": [M.entry_to_dict(e)]}))
    (d / "rank0.jsonl").write_text(json.dumps({"ev": "start", "cfg": 0, "t": 1.0}) + "\n")
    assert M.salvage_runs(ds) == [] and d.is_dir()
    assert M.entry_from_dict(M.entry_to_dict(e)).config == e.config
    # a batch written by a launcher on another host (shared file system) cannot be checked: kept
    (d / "entries.json").write_text(json.dumps({"pid": 1, "create_time": 0.0, "host": "elsewhere",
                                                "nproc": 2, "entries": [M.entry_to_dict(e)]}))
    assert M.salvage_runs(ds) == [] and d.is_dir()


def test_two_hangs_in_a_row_skip_the_rest_of_the_batch(tmp_path, fake_torchrun):
    recs = M.run_batch(_entries(["hang", "hang", "ok"]), None, 2, run_dir=tmp_path / "run", timeout=1.5,
                       telemetry="off")
    assert [r["status"] for r in recs] == ["timeout", "timeout", "skipped"]
    assert recs[2]["error"].startswith("not run") and recs[2]["steps"] is None


def test_cli_without_torch_is_one_line_naming_the_gpu_extra(tmp_path, capsys, monkeypatch):
    """No torch (the `gpu` extra): one line naming the install, exit 2, before anything runs (no
    crash record in the dataset, no exit 1)."""
    from advisor import validate
    from advisor.cli import main

    monkeypatch.setattr(validate, "installed", lambda mod: mod.split(".")[0] not in ("torch", "megatron"))
    dataset = tmp_path / "m.jsonl"
    with pytest.raises(SystemExit) as ex:
        main(["measure", "--model", "llama3-8b", "--layers", "2", "--gpus", "1", "--dataset", str(dataset)])
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "pip install 'advisor[gpu]'" in err
    assert not dataset.exists() or dataset.read_text() == ""
