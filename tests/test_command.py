"""The command runner on CPU: placeholders, the log parsers (Megatron-LM's own line formats, NeMo,
regex, the JSON step file), and whole trials of a fake training script that prints Megatron-LM
lines, runs out of memory, crashes, hangs, ignores its iteration bound or leaves a child behind."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from advisor.catalog import load_model
from advisor.catalog.specs import ModelSpec, SpecError, TrainConfig
from advisor.runners import command as C
from advisor.runners import measure as M
from support import ROOT, assert_dies_with_parent, pid_alive, wait_gone

FAKE = ROOT / "tests" / "data" / "measure" / "fake_train.py"
TINY = ModelSpec(name="tiny", num_layers=4, hidden_size=256, ffn_hidden_size=512,
                 num_attention_heads=8, num_query_groups=2, vocab_size=1000)
LLAMA = load_model("llama3-8b").with_layers(2)


def _spec(extra: str = "", **kw) -> C.CommandSpec:
    return C.CommandSpec(f"{shlex.quote(sys.executable)} {FAKE} --step-s 0.02 {extra} {{megatron_args}}", **kw)


def _entry(id: str, world: int = 1, steps: int = 3, warmup: int = 2, **lay) -> M.Entry:
    e = M.make_entry(TINY, world, steps=steps, warmup=warmup, **{"mbs": 1, "gbs": 4 * world, "seq": 512, **lay})
    e.id = id
    return e


def _run(entries, spec, tmp_path, nproc=1, **kw):
    kw = {"timeout": 5.0, "telemetry": "off", **kw}
    return C.run_batch(entries, tmp_path / "out.jsonl", nproc, spec=spec, **kw)


# ---------------------------------------------------------------------------------- templates
def test_placeholders_render_the_layout_and_unknown_ones_are_refused(tmp_path):
    cfg = TrainConfig(tp=2, pp=2, vp=2, dp=2, mbs=2, gbs=64, seq=4096, recompute="full")
    spec = C.CommandSpec("cd /x && {env} torchrun --nproc-per-node {nproc_per_node} --nnodes {nnodes} "
                         "pretrain_gpt.py {megatron_args} ${HOME} '{{literal}}' --tp {tp}",
                         env={"MY_TP": "{tp}"})
    line, env = C.build_command(spec, LLAMA, cfg, 7, C.NodeInfo(8, master_port=1234), "t1", tmp_path, tmp_path / "s")
    a = shlex.split(line.split("pretrain_gpt.py", 1)[1])
    assert a[a.index("--tensor-model-parallel-size") + 1] == "2"
    assert a[a.index("--num-virtual-stages-per-pipeline-rank") + 1] == "2"
    assert a[a.index("--train-iters") + 1] == "7" and a[a.index("--log-interval") + 1] == "1"
    assert a[a.index("--recompute-granularity") + 1] == "full" and "--eval-iters" in a
    assert "--num-layers" not in a  # the user's script keeps its model ({megatron_model_args} adds it)
    assert "${HOME}" in line and "'{literal}'" in line and line.endswith("--tp 2")
    assert "--nproc-per-node 8 --nnodes 1" in line
    assert env["MY_TP"] == "2" and env["ADVISOR_PP"] == "2" and env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert line.startswith("cd /x && ADVISOR_TP=2 ")
    with pytest.raises(SpecError, match=r"unknown placeholder.*\{megatron_arg\}"):
        C.CommandSpec("python x.py {megatron_arg}")
    with pytest.raises(SpecError, match="named group"):
        C.CommandSpec("x", step_regex=r"took (\d+)")
    with pytest.raises(SpecError, match="--parser"):
        C.CommandSpec("x", parser="tensorboard")
    with pytest.raises(SpecError, match="NAME=VALUE"):
        C.spec_options("x", env=["NOVALUE"])


def test_nemo_and_bridge_overrides():
    cfg = TrainConfig(tp=4, pp=2, vp=1, dp=1, mbs=1, gbs=128, seq=8192, recompute="selective",
                      sequence_parallel=True)
    nemo = C.nemo_overrides(cfg, 10)
    assert "trainer.strategy.tensor_model_parallel_size=4" in nemo
    assert "trainer.strategy.virtual_pipeline_model_parallel_size=None" in nemo
    assert "trainer.strategy.sequence_parallel=True" in nemo and "trainer.max_steps=10" in nemo
    assert "data.micro_batch_size=1" in nemo and "model.config.recompute_granularity=selective" in nemo
    bridge = C.bridge_overrides(cfg, 10)
    assert "model.tensor_model_parallel_size=4" in bridge and "train.train_iters=10" in bridge
    assert "model.sequence_parallel=true" in bridge and "model.virtual_pipeline_model_parallel_size=null" in bridge


# ----------------------------------------------------------------------------------- parsers
# Megatron-LM's lines as megatron/training/training.py (training_log) and report_memory print them
# in megatron-core 0.19.2, with --log-throughput
MEGATRON_LOG = """\
 [2026-11-24 10:00:01.000000] iteration        1/      10 | consumed samples:           16 | elapsed time per iteration (ms): 5321.7 | throughput per GPU (TFLOP/s/GPU): 41.2 | learning rate: 1.000000E-04 | global batch size:    16 | lm loss: 1.193850E+01 | loss scale: 1.0 | grad norm: 6.103 | number of skipped iterations:   0 | number of nan iterations:   0 |
[Rank 0] (after 1 iterations) memory (MB) | allocated: 30412.17 | max allocated: 45123.90 | reserved: 47000.00 | max reserved: 47000.00
 [2026-11-24 10:00:02.300000] iteration        2/      10 | consumed samples:           32 | elapsed time per iteration (ms): 1301.2 | throughput per GPU (TFLOP/s/GPU): 395.0 | learning rate: 1.000000E-04 | global batch size:    16 | lm loss: 1.180000E+01 | loss scale: 1.0 | grad norm: 5.000 | number of skipped iterations:   0 | number of nan iterations:   0 |
[Rank 0] (after 2 iterations) memory (MB) | allocated: 30412.17 | max allocated: 46080.00 | reserved: 48128.00 | max reserved: 49152.00
 [2026-11-24 10:00:05.000000] iteration        4/      10 | consumed samples:           64 | elapsed time per iteration (ms): 1290.0 | throughput per GPU (TFLOP/s/GPU): 398.1 | learning rate: 1.000000E-04 | global batch size:    16 | lm loss: 1.170000E+01 | loss scale: 1.0 | number of skipped iterations:   0 | number of nan iterations:   0 |
"""


def test_megatron_parser_reads_iterations_throughput_and_memory():
    p = C.parse_text(MEGATRON_LOG)
    assert [round(s.seconds, 4) for s in p.steps] == [5.3217, 1.3012, 1.29, 1.29]  # iteration 4 covers 3 and 4
    assert [s.iteration for s in p.steps] == [1, 2, 4, 4] and p.steps[1].tflops == 395.0
    assert p.memory[0]["peak_allocated_gib"] == pytest.approx(45.0) and p.memory[0]["peak_reserved_gib"] == 48.0
    assert C.parse_text(MEGATRON_LOG, kind="nemo").steps == []


def test_nemo_regex_and_step_file_parsers():
    nemo = ("Training epoch 0, iteration 0/9 | lr: 1e-06 | global_batch_size: 8 | global_step: 0 | "
            "reduced_train_loss: 1.3 | train_step_timing in s: 7.126\r"
            "Epoch 0: : 20%| 2/10 [00:09<00:36, reduced_train_loss=1.2, global_step=1.000, train_step_timing in s=2.505]\r"
            "Epoch 0: : 20%| 2/10 [00:09<00:36, reduced_train_loss=1.2, global_step=1.000, train_step_timing in s=2.505]\n")
    assert [s.seconds for s in C.parse_text(nemo).steps] == [7.126, 2.505]  # a redrawn bar counts once
    rx = C.parse_text("step 1 took 12 ms\nnoise\nstep 2 took 10 ms\n", "regex",
                      r"step (?P<iter>\d+) took (?P<ms>[\d.]+) ms")
    assert [s.seconds for s in rx.steps] == [0.012, 0.010]
    p = C.LogParser("json")
    for obj in ({"t": 100.0}, {"t": 101.5, "step": 1}, {"step_time_ms": 900, "step": 2},
                {"rank": 3, "peak_allocated_gib": 20.0}):
        p.feed_json(obj, 0.0)
    assert [s.seconds for s in p.steps] == [1.5, 0.9] and p.memory[3]["peak_allocated_gib"] == 20.0
    b = C.bounds_from_steps(p.steps)
    assert [round(y - x, 6) for x, y in zip(b, b[1:])] == [1.5, 0.9]


# ------------------------------------------------------------------------------ whole trials
def test_trials_ok_oom_crash_segv_hang_noexit_and_silent(tmp_path, monkeypatch):
    from advisor.runners.telemetry import FakeBackend

    monkeypatch.setenv("FAKE_TRAIN_MODES", "mbs2=oom,mbs3=crash,mbs5=segv,mbs6=hang,mbs7=noexit,mbs8=silent")
    es = [_entry(f"t{m}", mbs=m, gbs=8 * m) for m in (1, 2, 3, 5, 6, 7, 8, 4)]
    t0 = time.time()
    recs = _run(es, _spec(exit_grace_s=1.0), tmp_path, timeout=2.0, telemetry=FakeBackend(1), telemetry_hz=50,
                run_dir=tmp_path / "run")
    assert time.time() - t0 < 60
    by = {r["id"]: r for r in M.read_jsonl(tmp_path / "out.jsonl")}
    assert [by[e.id]["status"] for e in es] == ["ok", "oom", "crash", "crash", "timeout", "ok", "crash", "ok"]
    assert len(recs) == len(es) == len(by)
    ok = by["t1"]
    assert ok["runner"] == "command" and ok["schema"] == M.SCHEMA and not ok["simulated"]
    assert ok["steps"]["warmup"] == 2 and ok["steps"]["measured"] == 3
    assert ok["throughput"]["tokens_per_s"] == pytest.approx(8 * 512 / ok["steps"]["median_s"])
    assert ok["throughput"]["reported_tflops_per_gpu"] == 123.4
    assert ok["memory"]["max_gib"] == pytest.approx(12.0) and ok["memory"]["source"] == "log"
    assert ok["telemetry"]["mean_power_w"] > 0  # the sampler covered the measured iterations
    cmd = ok["command"]
    assert cmd["exit_status"] == 0 and cmd["stopped_by_runner"] is None and "--micro-batch-size 1" in cmd["line"]
    assert "iteration        5/       5" in cmd["log_tail"] and cmd["env"]["ADVISOR_MBS"] == "1"
    assert "out of memory" in by["t2"]["error"] and by["t2"]["steps"]["step_times_s"]
    assert "AssertionError: num_query_groups" in by["t3"]["error"]
    assert "segmentation" in by["t5"]["error"].lower() and by["t5"]["command"]["exit_status"] == 139
    assert "no new step for 2 s" in by["t6"]["error"] and by["t6"]["command"]["stopped_by_runner"] == "timeout"
    # noexit: it ignores --train-iters; stopped once its measured iterations are in (after its grace)
    assert by["t7"]["command"]["stopped_by_runner"] == "done" and by["t7"]["steps"]["measured"] >= 3
    assert "match the parser 'auto'" in by["t8"]["error"]


@pytest.mark.parametrize("mode,parser,regex", [("nemo", "auto", None), ("json", "json", None),
                                               ("regex", "regex", r"step (?P<iter>\d+) took (?P<s>[\d.]+) s")])
def test_other_log_formats(tmp_path, mode, parser, regex):
    rec = _run([_entry(mode)], _spec(f"--mode {mode}", parser=parser, step_regex=regex), tmp_path)[0]
    assert rec["status"] == "ok" and rec["steps"]["measured"] == 3, rec.get("error")
    assert 0.015 < rec["steps"]["median_s"] < 0.5


def test_nothing_the_command_starts_outlives_its_trial(tmp_path, monkeypatch):
    child = tmp_path / "child.pid"
    monkeypatch.setenv("FAKE_TRAIN_CHILD_PID", str(child))
    rec = _run([_entry("s")], _spec("--mode spawn"), tmp_path)[0]
    assert rec["status"] == "ok"
    assert wait_gone(int(child.read_text()), 15), "the job's background child survived the trial"


def test_a_sigkilled_launcher_takes_the_job_along_and_salvage_keeps_its_steps(tmp_path):
    """SIGKILL the launcher in the middle of a trial: the guard stops the job (and its child), and the
    next batch on the dataset (or `advisor measure --salvage`) records the iterations its log shows."""
    ds, pids, child = tmp_path / "out.jsonl", tmp_path / "pids", tmp_path / "child.pid"
    code = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from advisor.runners import command as C, measure as M
from advisor.catalog.specs import ModelSpec
tiny = ModelSpec(name="tiny", num_layers=4, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8,
                 num_query_groups=2, vocab_size=1000)
es = [M.make_entry(tiny, 1, mbs=1, gbs=4, seq=512, warmup=1, steps=s) for s in (2, 400)]
es[0].id, es[1].id = "first", "long"
spec = C.CommandSpec({str(sys.executable)!r} + " {FAKE} --mode spawn --step-s 0.05 {{megatron_args}}")
C.run_batch(es, {str(ds)!r}, 1, spec=spec, timeout=600, telemetry="off")
"""
    env = {**__import__("os").environ, "FAKE_TRAIN_PID": str(pids), "FAKE_TRAIN_CHILD_PID": str(child)}
    launcher = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    def job_pid():
        t0 = time.time()
        while time.time() - t0 < 60:
            logs = list(M.pending_root(ds).glob("*/trial1.log"))
            if logs and logs[0].read_text().count("elapsed time per iteration") >= 5:
                return int(pids.read_text().split()[-1])
            time.sleep(0.1)
        raise AssertionError("the second trial did not get going")

    assert_dies_with_parent(launcher, job_pid, "the job is not running", "the job outlived its launcher")
    assert wait_gone(int(child.read_text()), 15), "the job's child outlived the launcher"
    assert [r["id"] for r in M.read_jsonl(ds)] == ["first"]
    recs = M.salvage_runs(ds)
    assert [(r["id"], r["status"]) for r in recs] == [("long", "killed")]
    rec = recs[0]
    assert rec["runner"] == "command" and rec["steps"]["measured"] >= 4 and rec["throughput"]["tokens_per_s"] > 0
    assert "SIGKILL" in rec["error"] and rec["salvaged_from"] and "--mode spawn" in rec["command"]["line"]
    assert [r["id"] for r in M.read_jsonl(ds)] == ["first", "long"] and not M.pending_root(ds).exists()


def test_refusals_are_the_layout_rules_only():
    # the user's stack may have Transformer Engine: fp8, CP and sequence parallelism are runnable
    ok = TrainConfig(tp=2, cp=2, dp=1, mbs=1, gbs=8, precision="fp8", sequence_parallel=True)
    assert C.refusal_reason(LLAMA, ok, 4) is None
    assert "world size" in C.refusal_reason(LLAMA, ok, 8)
    assert "illegal layout" in C.refusal_reason(LLAMA, TrainConfig(tp=3, dp=1, mbs=1, gbs=8), 3)


def test_merge_node_records_takes_steps_from_the_node_that_printed_them():
    def rec(node, measured, status="ok", mem=None, tel=None):
        r = {"id": "x", "status": status, "error": None, "node_rank": node, "config": {"gbs": 8, "seq": 512},
             "steps": {"measured": measured, "median_s": 1.0} if measured else None,
             "throughput": {"tokens_per_s": 4096.0} if measured else None,
             "memory": mem, "telemetry": tel, "rank_map": [{"rank": 4 * node + i} for i in range(4)],
             "command": {"exit_status": 0, "log_tail": f"node {node}"}}
        return r

    mem0 = {"peak_allocated_gib_per_rank": [10.0, 11.0, None, None, None, None, None, None], "max_gib": 11.0}
    tel = lambda u, w: {"per_gpu": {u: {"mean_power_w": w, "peak_power_w": w + 50, "energy_j": 10.0 * w}},  # noqa: E731
                        "per_stage": [], "mean_power_w": w}
    merged = C.merge_node_records([(1, [rec(1, 5, tel=tel("GPU-b", 600.0))]),
                                   (0, [rec(0, 0, mem=mem0, tel=tel("GPU-a", 500.0))])])[0]
    assert merged["status"] == "ok" and merged["steps"]["measured"] == 5 and "node_rank" not in merged
    assert [rm["rank"] for rm in merged["rank_map"]] == list(range(8))
    assert merged["memory"]["max_gib"] == 11.0
    t = merged["telemetry"]
    assert set(t["per_gpu"]) == {"GPU-a", "GPU-b"} and t["mean_power_w"] == 550.0 and t["peak_power_w"] == 650.0
    assert t["energy_per_token_j"] == pytest.approx(11000.0 / (8 * 512 * 5))
    assert [n["node_rank"] for n in merged["command"]["nodes"]] == [0, 1]
    failed = C.merge_node_records([(0, [rec(0, 0, "oom")]), (1, [rec(1, 0)])])[0]
    assert failed["status"] == "oom" and failed["error"].startswith("node 0")


# ------------------------------------------------------------------------------------- CLI
def _cli(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "advisor", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=timeout)


def test_cli_measure_with_a_command(tmp_path):
    cmd = f"{sys.executable} {FAKE} --step-s 0.02 {{megatron_args}}"
    r = _cli("measure", "--runner", "command", "--command", cmd, "--model", "llama3-8b", "--layers", "2",
             "--gpus", "1", "--seq", "512", "--mbs", "2", "--steps", "3", "--warmup", "1",
             "--telemetry-hz", "0", "--out", str(tmp_path / "r.json"))
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads((tmp_path / "r.json").read_text())
    assert rec["status"] == "ok" and rec["runner"] == "command" and rec["steps"]["measured"] == 3
    dry = _cli("measure", "--runner", "command", "--command", "torchrun x.py {megatron_args}", "--model",
               "llama3-8b", "--tp", "2", "--gpus", "2", "--precision", "fp8", "--dry-run")
    line = json.loads(dry.stdout.splitlines()[0])
    assert dry.returncode == 0 and line["refused"] is None and "--fp8-format hybrid" in line["command"]
    for args, msg in ((["--runner", "command"], "needs --command"),
                      (["--command", "x"], "needs --runner command"),
                      (["--runner", "command", "--command", "x {nope}"], "unknown placeholder")):
        bad = _cli("measure", "--model", "llama3-8b", "--gpus", "1", *args)
        assert bad.returncode == 2 and msg in bad.stderr and "Traceback" not in bad.stderr


def test_killed_tune_driver_resumes_a_command_study_with_nothing_lost_or_repeated(tmp_path):
    """`advisor tune --runner command` (inline, batches of 3), SIGKILLed while a job runs; the second
    driver finishes the study: every spooled trial is kept, the rest retried once, no layout twice."""
    import optuna

    journal, data = tmp_path / "s.journal", tmp_path / "d.jsonl"
    cmd = [sys.executable, "-m", "advisor", "tune", "-m", "llama3-8b", "-c", "h100x2", "--layers", "2",
           "--seq", "512", "--gbs", "16", "--runner", "command", "--command",
           f"{sys.executable} {FAKE} --step-s 0.15 {{megatron_args}}", "--trials", "7", "--batch", "3",
           "--steps", "3", "--warmup", "1", "--ray-address", "inline", "--calibration", "none", "--seed", "0",
           "--storage", str(journal), "--dataset", str(data), "--study-name", "cmd", "--stack", "te"]
    spool = Path(f"{journal}.cmd.spool.jsonl")
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t0 = time.time()
        while time.time() - t0 < 90 and p.poll() is None:
            if spool.exists() and len(M.read_jsonl(spool)) >= 2:
                break
            time.sleep(0.1)
        assert p.poll() is None, "the study ended before it could be killed"
    finally:
        p.kill()
        p.wait()
    spooled = {r["id"] for r in M.read_jsonl(spool)}
    assert len(spooled) >= 2
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    study = optuna.load_study(study_name="cmd", storage=JournalStorage(JournalFileBackend(str(journal))))
    TS = optuna.trial.TrialState
    trials = study.get_trials()
    done = [t for t in trials if t.user_attrs.get("launched") and t.state == TS.COMPLETE]
    recs = M.read_jsonl(data)
    assert len(done) == 7 == len(recs) and len({x["id"] for x in recs}) == 7  # nothing lost
    assert len({t.user_attrs["layout_key"] for t in done}) == 7  # nothing measured twice
    assert spooled <= {t.user_attrs["record"]["id"] for t in done}  # what the dead job measured is kept
    assert all(x["runner"] == "command" and x["status"] == "ok" for x in recs)
    assert {x["stack"] for x in recs} == {"te"}  # the stack the user named (--stack), spooled and salvaged too
    stale = [t for t in trials if t.user_attrs.get("stale")]
    assert all(t.state == TS.FAIL for t in stale)
    for t in stale:
        assert len([x for x in trials if x.user_attrs.get("retry_of") == t.number]) == (1 if t.params else 0)
    assert not [t for t in trials if t.state == TS.RUNNING]
