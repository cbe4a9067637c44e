"""`advisor place` (JSON shape, one-line errors), `advisor launch` (never blocks or breaks a launch:
one warning line, command still runs, unchanged; only a --profile path that does not exist is an
error, before anything runs), the Python hook API, `advisor thermal-profile`
refusing without torch/CUDA."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from advisor.placement import PlacementSkipped, env_for_node, placement_env, plan, profile_from_dict
from advisor.placement import launch as launch_mod
from advisor.catalog import TrainConfig
from support import load_bench

ROOT = Path(__file__).resolve().parents[1]
BURN_PROFILE = ROOT / "data" / "profiles" / "h200x4-burn.json"
LLAMA_TP1 = ["-m", "llama3-70b", "-c", "h200x4", "--tp", "1", "--pp", "4", "--recompute", "full",
             "--gbs", "64", "--seq", "4096"]
LLAMA_TP4 = ["-m", "llama3-70b", "-c", "h200x16", "--tp", "4", "--pp", "4", "--gbs", "128", "--seq", "8192"]
SHOW_ENV = [sys.executable, "-c",
            "import os, json; print(json.dumps({k: os.environ.get(k) for k in "
            "('CUDA_VISIBLE_DEVICES', 'CUDA_DEVICE_ORDER')}))"]
CLEAN = {k: v for k, v in os.environ.items()
         if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NODE_RANK", "GROUP_RANK", "SLURM_NODEID")}


def advisor(*args, env=None):
    return subprocess.run([sys.executable, "-m", "advisor", *map(str, args)], capture_output=True, text=True,
                          env=CLEAN if env is None else env, cwd=ROOT, timeout=120)


def hgx8(uniform=False) -> dict:
    gpus = [{"index": i, "uuid": f"GPU-sim-{i}", "pci_bus_id": f"00000000:{0x18 + 0x10 * i:02X}:00.0",
             "ambient_c": 34.8 if uniform or i < 4 else 44.8, "c_per_w": 0.044 if uniform or i < 4 else 0.0556}
            for i in range(8)]
    return {"node": "hgx", "gpus": gpus}


@pytest.fixture
def hgx_file(tmp_path):
    p = tmp_path / "hgx.json"
    p.write_text(json.dumps(hgx8()))
    return p


# ------------------------------------------------------------------------------------ place
def test_place_json_shape_is_exact():
    r = advisor("place", *LLAMA_TP1, "-p", BURN_PROFILE, "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert list(j) == ["applied", "reason", "predicted_gain_pct", "predicted_max_temp_c", "stages", "nodes",
                       "slurm_gpu_bind", "stage_caps"]
    assert isinstance(j["applied"], bool) and isinstance(j["reason"], str) and j["reason"]
    assert isinstance(j["predicted_gain_pct"], float)
    assert set(j["predicted_max_temp_c"]) == {"identity", "planned"}
    assert all(isinstance(v, float) for v in j["predicted_max_temp_c"].values())
    assert [s["stage"] for s in j["stages"]] == [0, 1, 2, 3]
    for s in j["stages"]:
        assert list(s) == ["stage", "node", "gpus"] and isinstance(s["node"], str)
        assert all(isinstance(g, int) for g in s["gpus"])
    assert [list(n) for n in j["nodes"]] == [["node", "cuda_visible_devices"]]
    cvd = j["nodes"][0]["cuda_visible_devices"]
    assert sorted(cvd.split(",")) == ["0", "1", "2", "3"]
    assert j["slurm_gpu_bind"] == "map_gpu:" + cvd
    assert [s["gpus"][0] for s in j["stages"]] == [int(x) for x in cvd.split(",")]  # tp1: rank = stage
    assert j["applied"] and j["predicted_gain_pct"] > 0.5


def test_place_uneven_adds_pipeline_layout_and_human_output(hgx_file):
    r = advisor("place", *LLAMA_TP4, "-p", hgx_file, "--json", "--uneven")
    j = json.loads(r.stdout)
    assert list(j)[-1] == "pipeline_layout" and sum(j["pipeline_layout"]) == 80
    assert [n["node"] for n in j["nodes"]] == ["hgx#0", "hgx#1"]
    r = advisor("place", *LLAMA_TP4, "-p", hgx_file)
    assert r.returncode == 0 and "APPLIED" in r.stdout and "CUDA_VISIBLE_DEVICES=" in r.stdout


def _bad_profiles(tmp_path):
    good = hgx8()
    cases = {
        "missing.json": None,
        "notjson.json": "{oops",
        "nofield.json": {"node": "x", "gpus": [{k: v for k, v in good["gpus"][0].items() if k != "ambient_c"}]},
        "dup.json": {"node": "x", "gpus": [good["gpus"][0], dict(good["gpus"][1], uuid="GPU-sim-0")]},
        "negative.json": {"node": "x", "gpus": [dict(g, c_per_w=-0.01) for g in good["gpus"][:4]]},
        "type.json": {"node": "x", "gpus": [dict(g, index="0") for g in good["gpus"][:4]]},
        "count.json": {"node": "x", "gpus": good["gpus"][:2]},
    }
    out = []
    for name, data in cases.items():
        p = tmp_path / name
        if data is not None:
            p.write_text(data if isinstance(data, str) else json.dumps(data))
        out.append(p)
    return out


def test_place_bad_profiles_give_one_line_errors(tmp_path):
    expect = ["no such profile file", "not valid JSON", "missing field 'ambient_c'", "duplicate uuid",
              "is not physical", "'index' must be a non-negative integer", "has 2 GPUs but the cluster has 4"]
    for path, msg in zip(_bad_profiles(tmp_path), expect):
        r = advisor("place", *LLAMA_TP1, "-p", path, "--json")
        assert r.returncode == 2, (path, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], (path, r.stderr)
        assert r.stdout == ""


# ------------------------------------------------------------------------------------ launch
def _launched(r):
    assert r.stdout.strip(), r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["notjson", "folder", "recording", "no-profile", "bad-tp", "nvml-or-mismatch",
                                  "bad-model"])
def test_launch_never_blocks_on_failure(case, tmp_path, hgx_file):
    """A profile that exists but cannot place this launch (and no profile at all): the command runs."""
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    args = {
        "notjson": ["-p", bad, *LLAMA_TP1],
        "folder": ["-p", tmp_path, *LLAMA_TP1],
        "recording": ["-p", BURN_PROFILE, *LLAMA_TP1],           # no PCI ids: cannot match a live node
        "no-profile": [*LLAMA_TP1],
        "bad-tp": ["-p", BURN_PROFILE, *LLAMA_TP1[:-8], "--tp", "x", "--pp", "4"],
        "nvml-or-mismatch": ["-p", hgx_file, *LLAMA_TP4],         # no NVML here; on a GPU host: other PCI ids
        "bad-model": ["-p", hgx_file, "-m", "no-such-model", "-c", "h200x16", "--tp", "4", "--pp", "4"],
    }[case]
    r = advisor("launch", *args, "--", *SHOW_ENV)
    assert r.returncode == 0, r.stderr
    assert _launched(r) == {"CUDA_VISIBLE_DEVICES": None, "CUDA_DEVICE_ORDER": None}  # unchanged
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("warning: advisor launch: placement skipped (") and lines[0].endswith("launching unchanged")


def test_launch_refuses_a_profile_path_that_does_not_exist(tmp_path, hgx_file):
    """A --profile that names no file is a typo: one error line, exit 2, and nothing runs (the
    other profiles given with it exist)."""
    marker = tmp_path / "ran"
    cmd = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    for profiles in ([tmp_path / "nope.json"], [hgx_file, tmp_path / "nope.json"]):
        r = advisor("launch", *[x for p in profiles for x in ("-p", p)], *LLAMA_TP4, "--", *cmd)
        assert r.returncode == 2 and r.stdout == "", r.stderr
        lines = r.stderr.strip().splitlines()
        assert lines == [f"error: --profile {tmp_path / 'nope.json'}: no such profile file "
                         f"(leave --profile out to launch unplaced)"], r.stderr
        assert not marker.exists()


def test_launch_keeps_the_commands_exit_code_and_existing_env(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    r = advisor("launch", "-p", bad, "--", sys.executable, "-c", "import sys; sys.exit(3)")
    assert r.returncode == 3 and len(r.stderr.strip().splitlines()) == 1
    env = dict(CLEAN, CUDA_VISIBLE_DEVICES="0,1")
    r = advisor("launch", "-p", bad, "--", *SHOW_ENV, env=env)
    assert _launched(r)["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_launch_applies_the_plan(hgx_file):
    placed = json.loads(advisor("place", *LLAMA_TP4, "-p", hgx_file, "--json").stdout)
    assert placed["applied"]
    for rank in (0, 1):
        env = dict(CLEAN, NODE_RANK=str(rank))
        r = advisor("launch", "-p", hgx_file, *LLAMA_TP4, "--trust-profile", "--", *SHOW_ENV, env=env)
        assert r.returncode == 0, r.stderr
        assert _launched(r) == {"CUDA_VISIBLE_DEVICES": placed["nodes"][rank]["cuda_visible_devices"],
                                "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"advisor launch: node hgx#{rank}: CUDA_DEVICE_ORDER=PCI_BUS_ID")
    # a node restricted by the scheduler is left alone
    r = advisor("launch", "-p", hgx_file, *LLAMA_TP4, "--trust-profile", "--", *SHOW_ENV,
                env=dict(CLEAN, CUDA_VISIBLE_DEVICES="2,3"))
    assert _launched(r)["CUDA_VISIBLE_DEVICES"] == "2,3" and "already set" in r.stderr


def test_launch_identity_plan_leaves_env_alone(tmp_path):
    p = tmp_path / "uniform.json"
    p.write_text(json.dumps(hgx8(uniform=True)))
    r = advisor("launch", "-p", p, *LLAMA_TP4, "--trust-profile", "--", *SHOW_ENV)
    assert _launched(r) == {"CUDA_VISIBLE_DEVICES": None, "CUDA_DEVICE_ORDER": None}
    assert "identity placement kept" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_launch_usage_errors():
    r = advisor("launch", "-p", BURN_PROFILE)
    assert r.returncode == 2 and "command to run" in r.stderr
    r = advisor("launch", "-p", BURN_PROFILE, "--", "no-such-command-xyz")
    assert r.returncode == 127 and "cannot run 'no-such-command-xyz'" in r.stderr


# --------------------------------------------------------------------------------- Python API
def test_env_for_node_and_node_matching(monkeypatch):
    prof = profile_from_dict(hgx8())
    cfg = TrainConfig(tp=4, pp=4, dp=1, gbs=128, seq=8192, sequence_parallel=True)
    p = plan("llama3-70b", "h200x16", cfg, [prof])
    assert p.applied
    e = env_for_node(p, 1)
    assert e == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": p.cuda_visible_devices(1)}
    assert env_for_node(p, environ={"SLURM_NODEID": "1"}) == e and env_for_node(p, "hgx#1") == e
    with pytest.raises(PlacementSkipped, match="outside the plan"):
        env_for_node(p, 5)
    local = [(g.uuid, g.pci_bus_id) for g in prof.gpus]
    monkeypatch.setattr(launch_mod, "local_gpus", lambda: local)
    profs = [profile_from_dict(dict(hgx8(), node=f"hgx#{i}")) for i in range(2)]
    env, note = placement_env(p, profs, node=0, environ={})
    assert env == env_for_node(p, 0) and "matched by UUID" in note
    monkeypatch.setattr(launch_mod, "local_gpus", lambda: [("GPU-other-%d" % i, pci) for i, (_, pci) in enumerate(local)])
    assert "matched by PCI bus id" in placement_env(p, profs, node=0, environ={})[1]
    monkeypatch.setattr(launch_mod, "local_gpus", lambda: local[:4])
    with pytest.raises(PlacementSkipped, match="this node has"):
        placement_env(p, profs, node=0, environ={})


# ----------------------------------------------------------------------------- thermal-profile
@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch installed: would really burn")
def test_thermal_profile_refuses_without_torch(tmp_path):
    r = advisor("thermal-profile", "--seconds", "60", "--out", tmp_path / "p.json")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: thermal-profile needs torch")
    assert not (tmp_path / "p.json").exists()


# -------------------------------------------------------------------------- profile from a trace
def test_thermal_profile_from_a_recorded_trial_trace(tmp_path):
    """A 24 s trial of the h200x4 campaign (4 GPUs at 125-817 W) fits every slot with its real UUID
    and PCI id, and ranks the slots as the recorded 4 x H200 burn did (0 and 3 hotter)."""
    from advisor.placement import load_profile

    out = tmp_path / "p.json"
    r = advisor("thermal-profile", "--from-trace", ROOT / "data/traces/h200x4-b-00.trace.json.gz",
                "--node", "h200x4", "--out", out, "--json")
    assert r.returncode == 0, r.stderr
    prof = load_profile(out)
    assert prof.node == "h200x4" and json.loads(r.stdout)["node"] == "h200x4"
    assert [g.pci_bus_id for g in prof.cuda_order()] == [f"00000000:00:0{i}.0" for i in range(6, 10)]
    assert all(g.uuid.startswith("GPU-") and 0.02 < g.c_per_w < 0.08 for g in prof.gpus)
    t = [g.temp_c(700) for g in prof.cuda_order()]
    assert min(t[0], t[3]) > max(t[1], t[2])


def test_thermal_profile_from_a_bad_trace_is_one_line(tmp_path):
    short = advisor("thermal-profile", "--from-trace", ROOT / "data/traces/h200x4-a-23.trace.json.gz",
                    "--out", tmp_path / "p.json")  # 8.6 s of samples: too short to fit
    missing = advisor("thermal-profile", "--from-trace", tmp_path / "none.trace.json.gz")
    for r in (short, missing):
        assert r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert "at least 20 s" in short.stderr and not (tmp_path / "p.json").exists()


def test_placement_compare_reads_two_measured_runs(tmp_path):
    """bench/placement_compare.py on a campaign PP4 record and a copy of it with the last stage
    moved to the first slot and 1% faster steps."""
    import copy

    recs = {json.loads(x)["id"]: json.loads(x) for x in open(ROOT / "data/measurements/h200x4-campaign.jsonl")}
    ident = recs["h200x4-a-10"]
    placed = copy.deepcopy(ident)
    for rm in placed["rank_map"]:
        rm["stage"] = {0: 3, 3: 0}.get(rm["stage"], rm["stage"])
    for k in ("median_s", "p10_s", "p90_s"):
        placed["steps"][k] *= 0.99
    mod = load_bench("placement_compare")
    c = mod.compare(ident, placed, {"predicted_gain_pct": 2.3, "applied": True})
    assert c["stages_moved"] and abs(c["measured_gain_pct"] - 1.0) < 1e-9 and c["gain_beyond_spread"] is True
    assert c["identity"]["stages"][3]["mean_power_w"] > 600 and c["predicted_gain_pct"] == 2.3
    bad = copy.deepcopy(placed)
    bad["config"]["mbs"] = 2
    with pytest.raises(SystemExit, match="not the same layout"):
        mod.compare(ident, bad, None)
