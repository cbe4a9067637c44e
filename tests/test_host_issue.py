"""bench/host_issue.py: the host issue costs measured from the kernel profiles (issue #22)."""
import importlib.util
from pathlib import Path

import pytest

from advisor.models import profile_fit as F

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("host_issue", ROOT / "bench/host_issue.py")
H = importlib.util.module_from_spec(spec)
spec.loader.exec_module(H)


@pytest.fixture(scope="module")
def rows():
    return H.load(H.RUNS)


def test_queue_full_on_gpu_bound_runs_only(rows):
    by = {x["id"]: x for x in rows}
    # GPU-bound llama3-8b runs without PP end their step with a full launch queue
    for i in ("te-l8b-kp-25", "te-l8b-kp-27", "te-l8b-kp-29", "te-l8b-kp-40", "te-l8b-kp-42"):
        assert by[i]["queue"], i
    # PP2 synchronises at each p2p; GPT-3 TP2 SP is host-bound: neither fills the queue
    for i in ("te-l8b-kp-38", "te-l8b-kp-39", "te-gpt3-kp-12"):
        assert not by[i]["queue"], i
    # the model's 10 TP collectives per layer-microbatch with SP, as GPT-3 TP2's profile counts them
    assert by["te-gpt3-kp-12"]["coll_per_n"] == pytest.approx(10, abs=0.5)


def test_measured_ranges_hold_the_priors_and_predict_gpt3(rows):
    costs = H.measure(rows, "llama3-8b")
    for name in F.HOST:
        lo, hi = costs[name]
        centre, sd = F.TE_PRIOR[name]
        assert 0 < lo < hi
        assert centre == pytest.approx((lo + hi) / 2, rel=0.05), name  # the prior is the measurement
        assert sd == pytest.approx((hi - lo) / 2, rel=0.05), name
    gpt3 = next(x for x in rows if x["id"] == "te-gpt3-kp-12")
    line = H.check([gpt3], costs)[0]
    pred = float(line.split("predicted ")[2].split()[0])  # the profiled step predicted at the centres
    assert pred == pytest.approx(gpt3["prof_ms"], rel=0.10)


def test_bad_path_is_one_error_line(capsys):
    assert H.main(["/nonexistent.jsonl"]) == 2
    assert capsys.readouterr().err.startswith("error:")
