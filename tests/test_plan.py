"""advisor plan: the goodput physics (Young / Daly, failures), the sweep's properties, the CLI."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from advisor.catalog import TrainConfig, load_cluster, load_model
from advisor.models import goodput as gp
from advisor.models.flops import total_params
from advisor.plan import PlanOptions, bounded_gbs, family_days, node_ladder, plan

ROOT = Path(__file__).resolve().parents[1]
MIN = 60.0


# ------------------------------------------------------------------------------ Young / Daly
@pytest.mark.parametrize("mtbf_min,want_min", [(24 * 60, 117), (6 * 60, 57), (15, 9.1)])
def test_daly_interval_matches_the_papers_worked_examples(mtbf_min, want_min):
    """Daly 2006, Figs. 3-5: delta = 5 min, M = 24 h / 6 h / 15 min -> tau_opt = 117 / 57 / 9.1 min."""
    got = gp.daly_interval(5 * MIN, mtbf_min * MIN) / MIN
    assert got == pytest.approx(want_min, abs=0.05 * want_min if want_min < 10 else 0.5)


@pytest.mark.parametrize("c,m", [(3.0, 11_000.0), (30.0, 3_600.0), (300.0, 86_400.0), (60.0, 600.0)])
def test_daly_interval_is_the_closed_form_and_minimises_the_expected_wall_time(c, m):
    x = c / (2 * m)
    closed = math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c
    assert gp.daly_interval(c, m) == pytest.approx(closed, rel=1e-12)
    assert gp.young_interval(c, m) == pytest.approx(math.sqrt(2 * c * m), rel=1e-12)
    # the interval that minimises Daly's complete model, found numerically
    taus = np.geomspace(c / 100, 20 * m, 20001)
    walls = [gp.expected_wall_s(1e7, t, c, 600.0, m) for t in taus]
    best = taus[int(np.argmin(walls))]
    assert gp.daly_interval(c, m) == pytest.approx(best, rel=0.06)
    assert gp.expected_wall_s(1e7, gp.daly_interval(c, m), c, 600.0, m) <= min(walls) * (1 + 1e-3)
    if c / m < 1e-3:  # Young's first-order interval is Daly's as C / M -> 0
        assert gp.young_interval(c, m) == pytest.approx(gp.daly_interval(c, m), rel=0.02)


def test_daly_interval_is_the_mtbf_when_the_checkpoint_takes_longer_than_two_mtbf():
    assert gp.daly_interval(500.0, 200.0) == 200.0


def test_goodput_falls_as_the_failure_rate_rises():
    rates = np.geomspace(1e-7, 1e-3, 25)
    goodputs = [gp.run_goodput(30 * gp.DAY, 8192, 4e8, 650.0, 80.0, failures_per_gpu_hour=r).goodput for r in rates]
    assert all(b < a for a, b in zip(goodputs, goodputs[1:]))
    assert gp.run_goodput(30 * gp.DAY, 8192, 4e8, 650.0, 80.0, failures_per_gpu_hour=0.0).goodput == pytest.approx(1.0)
    assert goodputs[0] > 0.99 and goodputs[-1] < 0.5


def test_the_default_failure_rate_is_the_llama3_papers():
    assert gp.DEFAULT_FAILURES_PER_GPU_HOUR == 419 / (54 * 24 * 16384)
    g = gp.run_goodput(50 * gp.DAY, 16384, 3.5e8, 650.0, 80.0)
    assert g.mtbf_s / 3600 == pytest.approx(54 * 24 / 419)  # ~3.1 h between failures on 16K GPUs
    # the paper reports > 90% effective training time on 16K H100
    assert 0.85 < g.goodput < 0.97


def test_energy_counts_idle_waiting_and_rework():
    g = gp.run_goodput(30 * gp.DAY, 4096, 4e8, 650.0, 80.0)
    parts = g.compute_s + g.rework_s + g.checkpoint_total_s + g.restart_total_s
    assert parts == pytest.approx(g.wall_s, rel=1e-9)
    assert g.energy_j == pytest.approx((g.compute_s + g.rework_s) * 650 * 4096
                                       + (g.checkpoint_total_s + g.restart_total_s) * 80 * 4096)
    assert g.idle_energy_j > 0 and g.rework_s > 0


def test_checkpoint_bytes_per_rank_is_the_sharded_state():
    """PP=1: every rank writes 14 B (bf16 weights + fp32 master, m, v) per parameter / world
    (norms are replicated over TP, hence the small tolerance)."""
    m = load_model("llama3-70b")
    cfg = TrainConfig(tp=8, pp=1, dp=16, cp=2, gbs=256, seq=8192)
    want = 14 * total_params(m) / cfg.world_size
    assert gp.checkpoint_bytes_per_rank(m, cfg) == pytest.approx(want, rel=2e-3)
    # a pipeline: the fullest stage decides, at least the mean
    cfg = TrainConfig(tp=8, pp=4, dp=8, gbs=256, seq=8192)
    assert gp.checkpoint_bytes_per_rank(m, cfg) >= 14 * total_params(m) / cfg.world_size * 0.999


# ------------------------------------------------------------------------------ the sweep
def test_more_gpus_never_lengthen_a_layout_familys_days_until_the_batch_bound_binds():
    o = PlanOptions(tokens=15e12, max_gpus=16384, max_gbs_tokens=4 * 2 ** 20)
    nodes = [4, 8, 16, 32, 64, 128, 256, 512, 1024]
    for fam in ({"tp": 8, "pp": 4, "vp": 5, "mbs": 1}, {"tp": 8, "pp": 1, "cp": 2, "mbs": 1},
                {"tp": 4, "pp": 2, "mbs": 2, "recompute": "selective"}):
        rows = family_days("llama3-70b", fam, nodes, o)
        free = [d for _, d, bound in rows if not bound]
        assert len(free) >= 4 and any(bound for _, _, bound in rows), rows  # the bound binds in range
        assert all(b <= a for a, b in zip(free, free[1:])), (fam, rows)


def test_node_ladder_and_bounded_batch():
    assert node_ladder(64) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    assert node_ladder(20)[-1] == 20
    assert bounded_gbs(16384, 8192, 16 * 2 ** 20) == (2048, False)
    gbs, bound = bounded_gbs(16384, 8192, 4 * 2 ** 20)
    assert bound and gbs * 8192 <= 4 * 2 ** 20 and gbs == 512
    gbs, bound = bounded_gbs(3 * 512, 8192, 4 * 2 ** 20)  # odd part 3: 3·2^k
    assert bound and gbs == 384


@pytest.fixture(scope="module")
def small_plan():
    return plan("llama3-8b", PlanOptions(tokens=1e12, max_gpus=256, deadline_s=20 * gp.DAY, gpu_hour_price=2.0))


def test_the_pick_meets_the_deadline_at_least_energy_and_is_on_the_pareto_set(small_plan):
    res = small_plan
    ok = [c for c in res.candidates if c.goodput.wall_s <= 20 * gp.DAY]
    assert res.choice is not None and res.choice in ok
    assert res.choice.energy_mwh == min(c.energy_mwh for c in ok)
    assert res.choice.pareto
    assert res.choice.cost == pytest.approx(2.0 * res.choice.gpu_hours)
    # nothing on the Pareto set is dominated by another candidate
    for p in res.pareto[:20]:
        assert not any(c.days <= p.days and c.energy_mwh <= p.energy_mwh and c.gpus <= p.gpus
                       and (c.days, c.energy_mwh, c.gpus) != (p.days, p.energy_mwh, p.gpus) for c in res.candidates)
    assert res.sizes == sorted(res.sizes) and max(res.sizes) <= 256


def test_budget_without_deadline_picks_the_fewest_days_within_it(small_plan):
    budget = sorted(c.energy_mwh for c in small_plan.candidates)[len(small_plan.candidates) // 2]
    res = plan("llama3-8b", PlanOptions(tokens=1e12, max_gpus=256, budget_j=budget * 3.6e9))
    ok = [c for c in res.candidates if c.energy_mwh <= budget]
    assert res.choice.days == min(c.days for c in ok)


def test_an_impossible_deadline_says_what_is_possible():
    res = plan("llama3-8b", PlanOptions(tokens=1e12, max_gpus=64, exact=True, deadline_s=gp.DAY))
    assert res.choice is None and "the fastest takes" in res.why


def test_storage_bandwidth_from_the_cluster_yaml(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("name: c\ngpu: h100\nnodes: 8\nstorage_bw_gbs: 50\n")
    assert load_cluster(str(y)).storage_bw_gbs == 50.0
    slow = plan("llama3-8b", PlanOptions(tokens=1e12, cluster=str(y), gpu="h100", max_gpus=64, exact=True))
    fast = plan("llama3-8b", PlanOptions(tokens=1e12, gpu="h100", max_gpus=64, exact=True))
    assert slow.storage_bw_gbs == 50.0 and fast.storage_bw_gbs == gp.DEFAULT_STORAGE_BW_GBS
    assert slow.choice.goodput.checkpoint_s == pytest.approx(fast.choice.goodput.checkpoint_s * 40, rel=0.2)


# ------------------------------------------------------------------------------ the CLI
def _cli(*args):
    return subprocess.run([sys.executable, "-m", "advisor", "plan", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env={**os.environ, "COLUMNS": "80"})


def test_cli_405b_on_16k_states_the_effective_training_time_and_its_failure_rate():
    p = _cli("--model", "llama3.1-405b", "--tokens", "15.6T", "--gpus", "h100:16384")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert all(len(line) <= 80 for line in out.splitlines()), max(out.splitlines(), key=len)
    assert "effective training time" in out and "failures per GPU-hour" in out and "1.97e-05" in out
    assert "--save-interval" in out and "--train-iters" in out
    assert "note: global batch at most 16M tokens, llama3.1-405b's published batch" in " ".join(out.split())


def test_cli_json_save_interval_is_the_daly_interval_in_iterations(tmp_path):
    html = tmp_path / "plan.html"
    p = _cli("-m", "llama3-8b", "--tokens", "2e12", "--gpus", "h100:<=128", "--deadline", "1440h", "--json",
             "--html", str(html))
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    c = d["choice"]
    assert c["days"] <= 60 and c["pareto"]
    assert c["save_interval"] == max(1, round(c["goodput"]["interval_s"] / c["step_time_s"]))
    assert f"--save-interval {c['save_interval']}" in c["megatron_args"]
    assert d["assumptions"]["failures_per_gpu_hour"] == gp.DEFAULT_FAILURES_PER_GPU_HOUR
    text = html.read_text()
    assert 'data-plot="frontier"' in text and "<svg" in text and "--save-interval" in text
