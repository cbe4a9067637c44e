"""The real trial runner on GPUs (torchrun + megatron-core): a tiny model through TP/PP/DP, an
OOM and telemetry. Skipped without CUDA; run on a GPU machine with
``python3 -m pytest -q -m gpu tests/gpu``."""
from __future__ import annotations

import pytest

from advisor.catalog.specs import ModelSpec
from advisor.runners import measure as M

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

TINY = ModelSpec(name="tiny", num_layers=4, hidden_size=512, ffn_hidden_size=1408,
                 num_attention_heads=8, num_query_groups=4, vocab_size=32000)


def test_batch_on_local_gpus(tmp_path):
    n = torch.cuda.device_count()
    layouts = [dict(mbs=1), dict(mbs=2, recompute="selective"), dict(mbs=1, recompute="full")]
    if n >= 2:
        layouts += [dict(tp=2, mbs=1), dict(pp=2, mbs=1), dict(pp=2, vp=2, mbs=1)]
    entries = [M.make_entry(TINY, n, seq=1024, gbs=8 * (n // (l.get("tp", 1) * l.get("pp", 1))),
                            warmup=1, steps=3, **l) for l in layouts]
    # an OOM: a huge micro-batch of a wide model
    entries.append(M.make_entry(ModelSpec(name="wide", num_layers=2, hidden_size=8192, ffn_hidden_size=32768,
                                          num_attention_heads=64, vocab_size=256000),
                                n, seq=8192, mbs=64, gbs=64 * n, warmup=1, steps=1))
    entries.append(M.make_entry(TINY, n, seq=1024, mbs=1, gbs=8 * n, warmup=1, steps=3))  # goes on
    ds = tmp_path / "m.jsonl"
    recs = M.run_batch(entries, ds, n, run_dir=tmp_path / "run", timeout=120)
    assert [r["status"] for r in recs] == ["ok"] * (len(entries) - 2) + ["oom", "ok"]
    assert len(M.read_jsonl(ds)) == len(entries)
    for r in recs:
        if r["status"] != "ok":
            continue
        assert r["steps"]["measured"] == 3 and r["throughput"]["tokens_per_s"] > 0
        assert len(r["rank_map"]) == n and all(rm["uuid"].startswith("GPU-") for rm in r["rank_map"])
        assert max(r["memory"]["start_allocated_gib_per_rank"]) < 1.0  # nothing left from earlier jobs
        # per-phase memory (runners/mem_probe.py): one entry per pipeline stage, peaks over static
        ph = r["memory_phases"]
        assert [p["stage"] for p in ph] == sorted({rm["stage"] for rm in r["rank_map"]})
        for p in ph:
            assert 0 < p["static_gib"] <= p["peak_gib"] <= p["reserved_peak_gib"]
            assert p["forward_backward_transient_gib"] > 0 and p["outside_allocator_gib"] > 0
        if r["telemetry"] is not None:
            assert set(r["telemetry"]["per_gpu"]) == {rm["uuid"] for rm in r["rank_map"]}
    oom = recs[-2]["memory"]["at_failure"]
    assert all(v.get("phase") in ("build", "steps") for v in oom.values())  # the phase it hit


def test_no_worker_outlives_a_sigkilled_launcher_and_torchrun(tmp_path):
    # The launcher (a Ray task, `advisor measure`) and torchrun can both be SIGKILLed (Ray
    # force-kill, the OOM killer, a driver's timeout). Each worker armed PR_SET_PDEATHSIG
    # (runners/parent_watch.py), so none is left holding GPU memory for the next job to OOM on.
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    n = torch.cuda.device_count()
    run_dir = tmp_path / "run"
    script = tmp_path / "launcher.py"
    script.write_text(f"""
from advisor.catalog.specs import ModelSpec
from advisor.runners import measure as M
tiny = ModelSpec(name="tiny", num_layers=4, hidden_size=512, ffn_hidden_size=1408,
                 num_attention_heads=8, num_query_groups=4, vocab_size=32000)
e = M.make_entry(tiny, {n}, seq=1024, mbs=1, gbs=8 * {n}, warmup=1, steps=100000)
M.run_batch([e], None, {n}, run_dir={str(run_dir)!r}, timeout=300, telemetry="off")
""")
    launcher = subprocess.Popen([sys.executable, str(script)], env=dict(os.environ))
    workers: list[psutil.Process] = []
    try:
        t0 = time.time()
        while time.time() - t0 < 180:  # until rank 0 reports steps: armed, built, training
            p = run_dir / "rank0.jsonl"
            if p.exists() and sum(1 for e in M.read_jsonl(p) if e["ev"] == "step") >= 3:
                break
            assert launcher.poll() is None, "the launcher ended before the job trained"
            time.sleep(0.5)
        else:
            raise AssertionError("no training steps within 180 s")
        tree = psutil.Process(launcher.pid).children(recursive=True)
        workers = [p for p in tree if "megatron_worker.py" in " ".join(p.cmdline())
                   and "torch.distributed.run" not in p.cmdline()]  # torchrun's own args name it
        assert len(workers) == n, f"expected {n} workers, found {len(workers)}"
        for p in [psutil.Process(launcher.pid)] + [p for p in tree if p not in workers]:
            p.send_signal(signal.SIGKILL)  # launcher and torchrun: nobody left to clean up
        gone, alive = psutil.wait_procs(workers, timeout=20)
        assert not alive, f"workers {[p.pid for p in alive]} outlived torchrun"
        pids = {p.pid for p in workers}
        t0 = time.time()
        while time.time() - t0 < 20:
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                                 capture_output=True, text=True).stdout.split()
            if not pids & {int(x) for x in out if x.isdigit()}:
                break
            time.sleep(0.5)
        else:
            raise AssertionError("the GPUs still list a killed worker")
    finally:
        launcher.kill()
        launcher.wait()
        for p in workers:
            try:
                p.kill()
            except psutil.Error:
                pass


def test_te_stack_on_local_gpus(tmp_path):
    """The te stack (Transformer Engine layer spec): BF16 and FP8 (delayed and current scaling),
    sequence parallelism and context parallelism where there are GPUs for them; every record names
    its stack and the TE version."""
    pytest.importorskip("transformer_engine.pytorch")
    n = torch.cuda.device_count()
    layouts = [dict(mbs=1), dict(mbs=1, precision="fp8"),
               dict(mbs=1, precision="fp8", fp8_recipe="tensorwise")]
    if n >= 2:
        layouts += [dict(tp=2, mbs=1, sequence_parallel=True), dict(cp=2, mbs=1)]
    entries = [M.make_entry(TINY, n, seq=1024, warmup=1, steps=3, stack="te",
                            gbs=8 * (n // (l.get("tp", 1) * l.get("cp", 1))), **l) for l in layouts]
    assert not [e.refused for e in entries if e.refused]
    recs = M.run_batch(entries, tmp_path / "te.jsonl", n, run_dir=tmp_path / "run", timeout=180)
    assert [r["status"] for r in recs] == ["ok"] * len(entries), [r.get("error") for r in recs]
    for r in recs:
        assert r["stack"] == "te" and r["env"]["transformer_engine"]
        assert r["env"]["attention"] == "te-fused"
        assert r["throughput"]["tokens_per_s"] > 0
