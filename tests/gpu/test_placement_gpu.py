"""Placement on real GPUs (run through the device tool; skipped elsewhere):
(a) `advisor launch` puts the rank of stage k on the planned physical GPU, checked inside a torchrun
    job by NVML UUID, in torchrun's default and --virtual-local-rank modes;
(c) `advisor thermal-profile` measures every slot and the profile matches this node's GPUs."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _gpus() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        return n
    except Exception:
        return 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch"),
    pytest.mark.skipif(_gpus() < 2, reason="needs at least 2 NVIDIA GPUs"),
]


def test_launch_places_each_stage_on_its_planned_gpu():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "placement_gpu_check.py")], capture_output=True,
                       text=True, timeout=900, cwd=ROOT)
    print(r.stdout, r.stderr[-3000:])
    assert r.returncode == 0 and r.stdout.strip().endswith("PASS")


@pytest.mark.slow
def test_thermal_profile_measures_every_slot(tmp_path):
    out = tmp_path / "profile.json"
    r = subprocess.run([sys.executable, "-m", "advisor", "thermal-profile", "--seconds", "45", "--idle", "8",
                        "--cool", "10", "--out", str(out), "--json"], capture_output=True, text=True, timeout=600,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    from advisor.placement import load_profile
    from advisor.placement.launch import check_node, local_gpus

    prof = load_profile(out)
    assert len(prof.gpus) == _gpus()
    assert check_node(prof, local_gpus()) == "matched by UUID"
    for g in prof.gpus:
        assert 0.005 < g.c_per_w < 0.2 and g.extra["gemm_tflops"] > 100
        assert 0 < g.extra["speed_at_cap"] <= 1.0
    assert (tmp_path / "profile.json.trace.json.gz").exists()
    assert json.loads(r.stdout)["node"] == prof.node
