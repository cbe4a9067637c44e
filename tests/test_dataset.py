"""Loading and validating measurement JSONL: usable rows, skipped failed trials, rejected rows."""
from __future__ import annotations

import copy
import json
import math

import pytest

from advisor.catalog import TrainConfig, load_cluster, load_model
from advisor.models import dataset as D
from advisor.models.constants import DEFAULT


@pytest.fixture(scope="module")
def good() -> dict:
    m, c = load_model("llama3-8b").with_layers(4), load_cluster("h200x4")
    return D.simulate_records([(m, c, TrainConfig(tp=2, dp=2, mbs=1, gbs=16, seq=2048))], DEFAULT)[0]


def write(tmp_path, rows, name="m.jsonl") -> str:
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(p)


def broken(rec: dict, path: str, value=KeyError) -> dict:
    r = copy.deepcopy(rec)
    *parents, last = path.split(".")
    cur = r
    for k in parents:
        cur = cur[k]
    if value is KeyError:
        del cur[last]
    else:
        cur[last] = value
    return r


def test_good_record_is_usable(tmp_path, good):
    ds = D.load([write(tmp_path, [good])])
    assert len(ds) == 1 and not ds.rejected
    r = ds.records[0]
    assert r.cluster.world_size == 4 and r.cfg.tp == 2 and r.model.num_layers == 4
    assert set(r.y) == set(D.TARGETS) and all(math.isfinite(v) for v in r.y.values())
    assert ds.files[0]["sha256"] and ds.files[0]["lines"] == 1


@pytest.mark.parametrize("path,value,needle", [
    ("throughput.tokens_per_s_per_gpu", KeyError, "missing field 'throughput.tokens_per_s_per_gpu'"),
    ("throughput.tokens_per_s_per_gpu", "fast", "is str, expected number"),
    ("throughput.tokens_per_s_per_gpu", -5.0, "out of range"),
    ("throughput", None, "missing field 'throughput.tokens_per_s_per_gpu'"),
    ("memory", {"peak_gib_per_stage": [1.0]}, "missing field 'memory.max_gib'"),
    ("memory.max_reserved_gib", 1e6, "out of range"),
    ("steps.median_s", KeyError, "missing field 'steps.median_s'"),
    ("telemetry.mean_power_w", "hot", "is str"),
    ("telemetry.throttle_fraction", {"any_throttle": 3.0}, "is not a fraction"),
    ("config.tp", 0, "config: tp must be a positive integer"),
    ("config.bogus", 1, "unknown layout key"),
    ("config.dp", 4, "config uses 8 GPUs but the cluster has 4"),
    ("model.hidden_size", -1, "model:"),
    ("model", KeyError, "missing field 'model'"),
    ("layers", 99, "layers = 99 but the model has 4"),
    ("cluster.gpu", "tpu9", "cluster:"),
    ("cluster.num_nodes", "one", "is str"),
    ("schema", "advisor.measurement/0", "schema is"),
    ("status", "great", "unknown status"),
])
def test_corrupt_rows_are_rejected_with_a_reason(tmp_path, good, path, value, needle):
    ds = D.load([write(tmp_path, [good, broken(good, path, value)])])
    assert len(ds) == 1, ds.rejected
    assert len(ds.rejected) == 1
    assert needle in ds.rejected[0], ds.rejected[0]
    assert ds.rejected[0].startswith("m.jsonl:2: rejected")


def test_rejections_are_counted_and_failed_trials_skipped(tmp_path, good):
    oom = dict(good, status="oom", throughput=None)
    rows = [good, "not json {", "[1, 2]", oom, broken(good, "steps", KeyError), "", dict(good, id="b"), good]
    ds = D.load([write(tmp_path, rows)])
    assert len(ds) == 2
    assert len(ds.rejected) == 3
    assert ds.skipped == {"oom": 1}
    assert ds.duplicates == 1  # the same record (id and content) twice counts once
    s = ds.summary()
    assert "2 usable" in s and "3 rejected" in s and "oom 1" in s and "1 duplicate(s)" in s
    assert any("not JSON" in r for r in ds.rejected) and any("not a JSON object" in r for r in ds.rejected)


def test_missing_telemetry_keeps_the_row_without_power_targets(tmp_path, good):
    ds = D.load([write(tmp_path, [dict(good, telemetry=None)])])
    assert len(ds) == 1
    y = ds.records[0].y
    assert math.isnan(y["mean_power_w"]) and math.isnan(y["throttle_fraction"])
    assert math.isfinite(y["tokens_per_s_per_gpu"])
    assert "usable without power telemetry 1, without memory 0" in ds.summary()


def test_missing_memory_keeps_the_row_without_the_memory_target(tmp_path, good):
    ds = D.load([write(tmp_path, [dict(good, memory=None), broken(good, "memory", KeyError)])])
    assert len(ds) == 2 and all(math.isnan(r.y["memory_gib_per_gpu"]) for r in ds.records)
    assert "without memory 2" in ds.summary()


def test_throttle_fraction_falls_back_to_the_largest_reason(tmp_path, good):
    r = broken(good, "telemetry.throttle_fraction", {"idle": 0.9, "sw_power_cap": 0.4, "hw_slowdown": 0.1})
    assert D.load([write(tmp_path, [r])]).records[0].y["throttle_fraction"] == pytest.approx(0.4)


def test_memory_prefers_reserved_then_allocated(tmp_path, good):
    r = broken(good, "memory", {"max_gib": 10.0, "max_reserved_gib": 12.0})
    assert D.load([write(tmp_path, [r])]).records[0].y["memory_gib_per_gpu"] == 12.0
    r = broken(good, "memory", {"max_gib": 10.0})
    assert D.load([write(tmp_path, [r])]).records[0].y["memory_gib_per_gpu"] == 10.0


def test_missing_file_and_no_file_are_one_line_errors(tmp_path):
    with pytest.raises(D.DatasetError, match="no such file"):
        D.load([str(tmp_path / "nope.jsonl")])
    with pytest.raises(D.DatasetError, match="no measurement file"):
        D.load([])


def test_shape_groups_ignore_name_and_depth():
    a = load_model("llama3-8b")
    assert D.shape_key(a.with_layers(4)) == D.shape_key(a.with_layers(8))
    assert D.shape_key(a.with_layers(4), True) != D.shape_key(a.with_layers(8), True)
    assert D.shape_key(a) != D.shape_key(load_model("llama3-70b"))


# ---- absurd throughput ------------------------------------------------------------------------------

def _consistent(rec: dict, tps: float) -> dict:
    """The record with tokens/s per GPU set to `tps` and the step time that goes with it."""
    r = copy.deepcopy(rec)
    cfg = r["config"]
    r["throughput"]["tokens_per_s_per_gpu"] = tps
    r["steps"]["median_s"] = cfg["gbs"] * cfg["seq"] / (tps * 4)
    return r


def test_throughput_above_the_gpu_peak_is_rejected(tmp_path, good):
    absurd = broken(good, "throughput.tokens_per_s_per_gpu", 1e12)
    # also with a step time that agrees with it: MFU > 1 alone is enough
    ds = D.load([write(tmp_path, [good, absurd, _consistent(good, 1e12)])])
    assert len(ds) == 1 and len(ds.rejected) == 2
    assert all("MFU" in r and "> 1" in r and "H200".lower() in r.lower() for r in ds.rejected), ds.rejected
    # the record's own flops_per_token is used when present
    fpt = copy.deepcopy(good)
    fpt["throughput"]["flops_per_token"] = 1e15
    ds = D.load([write(tmp_path, [fpt])])
    assert len(ds.rejected) == 1 and "MFU" in ds.rejected[0]


def test_throughput_that_disagrees_with_the_step_time_is_rejected(tmp_path, good):
    tps = good["throughput"]["tokens_per_s_per_gpu"]
    off = broken(good, "throughput.tokens_per_s_per_gpu", tps * 1.2)  # plausible MFU, wrong step time
    near = broken(good, "throughput.tokens_per_s_per_gpu", tps * 1.01)  # within the tolerance
    ds = D.load([write(tmp_path, [good, off, near])])
    assert len(ds) == 2 and len(ds.rejected) == 1
    assert "disagrees with steps.median_s" in ds.rejected[0] and "+20.0%" in ds.rejected[0]
    assert ds.rejected[0].startswith("m.jsonl:2: rejected")
    assert "1 rejected" in ds.summary()
