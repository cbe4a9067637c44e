"""Replaying measured trials (advisor.replay, bench/tune_efficiency.py --measured): the real
study on a tiny synthetic measured grid never proposes an unmeasured layout, and "trials to within
2% of the best" is counted right. CPU only, a few seconds."""
from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from advisor.api import resolve
from advisor.catalog.specs import TrainConfig
from advisor.runners.ray_exec import Job
from advisor.replay import (Replay, ReplayExecutor, ReplayMiss, load_groups, tokens_per_gpu,
                                    trials_to_within)
from advisor.runners.simulate import new_record
from advisor.search_spaces.space import layout_key
from advisor.study import TuneSettings, make_plan

ROOT = Path(__file__).resolve().parents[1]
N = 12  # layouts in the synthetic grid
OOM_AT = 3
BEST_AT = 5  # (5 * 7) % 12 == 11: the largest factor, and the only layout within 2% of it


def _record(model, cluster, cfg, tps: float | None, status: str = "ok") -> dict:
    rec = new_record(model, cluster, cfg, status, None if status == "ok" else "CUDA out of memory", "megatron")
    if status == "ok":
        rec["throughput"] = {"tokens_per_s": tps * cluster.world_size, "tokens_per_s_per_gpu": tps}
        rec["telemetry"] = {"mean_power_w": 500.0, "peak_power_w": 600.0, "energy_per_token_j": 500.0 / tps}
        rec["memory"] = {"max_gib": 40.0}
        rec["steps"] = {"median_s": cfg.tokens_per_step / (tps * cluster.world_size)}
    return rec


@pytest.fixture(scope="module")
def grid_file(tmp_path_factory):
    """Every 11th runnable layout of llama3-8b[8L] on h200x4 (seq 4096, gbs 32) 'measured'; one OOM,
    one layout measured three times, plus lines that are no measurement (refused, simulated)."""
    m, c = resolve("llama3-8b", "h200x4")
    m = m.with_layers(8)
    plan = make_plan(TuneSettings(model=m, cluster="h200x4", seq=4096, gbs=32, runner="megatron", storage=":memory:"))
    runnable = [x for x in plan.layouts if layout_key(x) not in plan.screened]
    # every 9th: the local runner's space lost its CP > 1 layouts (search_spaces.runnable), and with
    # every 11th of the 132 left TPE (seed 0) did not reach one of them in 200 proposals
    picked = runnable[::9][:N]
    assert len(picked) == N
    values, lines = {}, []
    for i, cfg in enumerate(picked):
        if i == OOM_AT:
            lines.append(_record(m, c, cfg, None, "oom"))
            values[layout_key(cfg)] = 0.0
            continue
        v = 1000.0 * (1 + ((i * 7) % 12) / 20)
        values[layout_key(cfg)] = v
        lines.append(_record(m, c, cfg, v))
        if i == 0:  # measured three times: the median record is replayed
            lines += [_record(m, c, cfg, v * 0.5), _record(m, c, cfg, v * 3)]
    unmeasured = next(x for x in runnable if layout_key(x) not in values)
    lines.append(_record(m, c, unmeasured, None, "refused"))
    sim = _record(m, c, unmeasured, 1e6)
    sim["simulated"] = True
    lines.append(sim)
    path = tmp_path_factory.mktemp("replay") / "grid.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + "not json\n")
    return path, values, [layout_key(x) for x in picked]


def test_trials_to_within_counts_the_first_layout_within_2_percent():
    assert trials_to_within([90.0, 97.9, 98.0, 100.0], 100.0) == 3  # exactly 2% below counts
    assert trials_to_within([100.0], 100.0) == 1
    assert trials_to_within([50.0, 97.0], 100.0) is None
    assert trials_to_within([], 100.0) is None
    assert trials_to_within([90.0, 95.0], 100.0, tol=0.05) == 2
    assert tokens_per_gpu({"status": "oom", "throughput": {"tokens_per_s_per_gpu": 5.0}}) == 0.0
    assert tokens_per_gpu({"status": "ok", "throughput": {"tokens_per_s_per_gpu": 5.0}}) == 5.0


def test_groups_keep_measured_layouts_and_replay_the_median_repeat(grid_file):
    path, values, order = grid_file
    (g,) = load_groups([path], min_layouts=8)
    assert g.cluster == "h200x4" and g.model.name == "llama3-8b[8L]" and (g.seq, g.gbs) == (4096, 32)
    assert set(g.records) == set(values)  # refused and simulated lines are no measurement
    assert g.repeats[order[0]] == 3 and g.tps(order[0]) == values[order[0]]  # median of 0.5x, 1x, 3x
    assert g.records[order[OOM_AT]]["status"] == "oom" and g.tps(order[OOM_AT]) == 0.0
    assert g.best == max(values.values()) == values[order[BEST_AT]]
    assert load_groups([path], min_layouts=N + 1) == []


@pytest.mark.parametrize("sampler,top_k,seed", [("tpe", 4, 0), ("tpe", 0, 1), ("surrogate", 4, 0)])
def test_study_only_proposes_measured_layouts_and_counts_trials_right(grid_file, sampler, top_k, seed):
    path, values, order = grid_file
    rep = Replay(load_groups([path], 8)[0])
    assert rep.outside == [] and rep.order == order  # enumeration order
    full = rep.run(top_k, sampler, seed)
    # every proposal (launched or not) resolved to a measured layout; each measured at most once
    assert full.proposed and set(full.proposed) <= set(values)
    assert len(full.launched) == len(set(full.launched)) == N  # the study measures the whole grid
    assert full.stopped == "space exhausted"
    assert full.values == [values[k] for k in full.launched]
    assert full.launched[: len(full.seeds)] == full.seeds  # the analytical seeds go first
    hit = trials_to_within(full.values, rep.grid.best)
    assert hit == full.launched.index(order[BEST_AT]) + 1  # the only layout within 2%
    # ended at its first hit, the same study makes the same first `hit` trials
    early = rep.run(top_k, sampler, seed, until=0.98 * rep.grid.best)
    assert early.stopped == "found" and early.launched == full.launched[:hit]


def test_replay_executor_refuses_an_unmeasured_layout(grid_file):
    path, values, order = grid_file
    g = load_groups([path], 8)[0]
    m, c = resolve(g.model, g.cluster)
    ex = ReplayExecutor(g.records)
    cfg = TrainConfig.from_dict(g.records[order[1]]["config"])
    job = ex.submit(Job([None], "megatron", m, c, [cfg], 10.0, {}))
    assert job.results[0]["status"] == "ok" and tokens_per_gpu(job.results[0]) == values[order[1]]
    other = TrainConfig(tp=4, dp=1, gbs=32, seq=4096, mbs=8, recompute="full")
    assert layout_key(other) not in g.records
    with pytest.raises(ReplayMiss):
        ex.submit(Job([None], "megatron", m, c, [other], 10.0, {}))
    lax = ReplayExecutor(g.records, strict=False)
    assert lax.submit(Job([None], "megatron", m, c, [other], 10.0, {})).results[0]["status"] == "crash"
    assert lax.misses == [layout_key(other)]


def test_bench_measured_mode_prints_the_replay_table(grid_file, capsys):
    path, values, order = grid_file
    bench = runpy.run_path(str(ROOT / "bench" / "tune_efficiency.py"))
    assert bench["main"](["--measured", str(path), "--seeds", "2", "--random-runs", "20"]) == 0
    out = capsys.readouterr().out
    assert "replay of measured trials" in out
    rows = {line[:40].strip(): line[40:].split() for line in out.splitlines()
            if line[:40].strip() in ("grid order", "random order", "TPE, no seeds",
                                     "advisor tune (TPE + analytical top-K)", "advisor tune --sampler surrogate")}
    assert len(rows) == 5
    assert rows["grid order"] == ["1", str(BEST_AT + 1), f"{BEST_AT + 1:.1f}", str(BEST_AT + 1), "0"]
    assert rows["random order"][0] == "20"
    for name in ("TPE, no seeds", "advisor tune (TPE + analytical top-K)", "advisor tune --sampler surrogate"):
        runs, median, mean, mx, not_found = rows[name]
        assert runs == "2" and not_found == "0" and 1 <= int(median) <= int(mx) <= N
