"""What the caching allocator gives back under pressure (issue #27): the pressure bench's brackets and
cap, the band's under-pressure line, and the committed pressure records against the band."""
import sys
from pathlib import Path

import numpy as np
import pytest

from advisor.models import memory_band as MB

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import allocator_pressure as AP  # noqa: E402


def _rec(i, head, ran, expandable=True, model="llama3-8b", mbs=1):
    cfg = {"tp": 1, "pp": 4, "vp": 2, "cp": 1, "ep": 1, "etp": 1, "dp": 1, "mbs": mbs, "gbs": 16, "seq": 4096,
           "precision": "bf16", "expandable_segments": expandable}
    r = {"id": f"p-{i}", "status": "ok" if ran else "oom", "model_name": model, "layers": 8, "config": cfg,
         "pressure": {"0": {"headroom_gib": head, "ballast_gib": 10.0, "total_gib": 79.0,
                            **({"retries": 3} if ran else {})}}}
    if ran:
        r["throughput"] = {"tokens_per_s_per_gpu": 1000.0}
    else:
        r["memory"] = {"at_failure": {"0": {"num_alloc_retries": 7}}}
    return r


def test_cap_is_the_smallest_headroom_every_layout_ran_at():
    recs = [_rec(1, 1.0, False), _rec(2, 2.5, True), _rec(3, 1.0, True, mbs=2), _rec(4, 1.0, False, expandable=False)]
    b = AP.brackets(AP.pressed(recs))
    assert sorted((v["oom_at"], v["ran_at"]) for v in b.values() if v["expandable"]) == [(0.0, 1.0), (1.0, 2.5)]
    cap = AP.pressure_cap(recs, expandable=True)
    assert cap["cap_gib"] == 2.5 and cap["layouts"] == 2 and cap["runs"] == ["p-1", "p-2", "p-3"]
    assert AP.pressure_cap(recs, expandable=False) is None  # the off layout never ran: no bound
    rows = {x["id"]: x for x in AP.pressed(recs)}
    assert rows["p-1"]["retries"] == 7 and rows["p-2"]["retries"] == 3 and rows["p-2"]["tok_s_gpu"] == 1000.0


def test_band_under_pressure_caps_only_expandable_segments():
    b = MB.Band(lo=1.0, hi=1.0, stack="te", kind="dense", source="test", rf_lo_scale=1.0, rf_lo_gib=-1.0, rf_hi_scale=1.0, rf_hi_gib=7.0,
                rf_lo_expandable_gib=0.0, rf_hi_expandable_gib=0.5, rf_pressure_expandable_gib=2.5)
    R, R_off = 0.44, 2.4
    on = b.reserved_free_interval(R, True, False, R_off)
    on_p = b.reserved_free_interval(R, True, False, R_off, under_pressure=True)
    off = b.reserved_free_interval(R_off, False, False, R_off)
    assert on[1] == pytest.approx(R_off + 7.0) and on_p[1] == pytest.approx(2.5) and on_p[0] <= on_p[1]
    assert b.reserved_free_interval(R_off, False, False, R_off, under_pressure=True) == off  # off: stranded
    x = np.array([True, False])
    hi = b.reserved_free_interval(np.array([R, R_off]), x, False, np.array([R_off, R_off]), under_pressure=True)[1]
    assert hi.tolist() == pytest.approx([2.5, R_off + 7.0])
    nocap = MB.Band(lo=1.0, hi=1.0, stack="te", kind="dense", source="test", rf_hi_gib=7.0)
    assert nocap.reserved_free_interval(R, True, False, R_off, under_pressure=True) == \
        nocap.reserved_free_interval(R, True, False, R_off)


def test_memory_fit_verdict_counts_only_what_the_allocator_cannot_give_back():
    b = MB.Band(lo=1.0, hi=1.0, stack="te", kind="dense", source="test", rf_hi_gib=7.0, rf_pressure_expandable_gib=2.5)
    # 70 GiB allocated + 2.4 R_off + 7 line + 3 outside = 82.4 > 76; pressed 70 + 2.5 + 3 = 75.5 <= 76
    mf = MB.memory_fit(70.44, [70.44], [3.0], [0.44], True, b, 80.0, 0.05, False, [2.4])
    assert mf["fits"] and not mf["fits_without_retries"]
    assert mf["upper_under_pressure_gib"] == pytest.approx(75.5) and mf["headroom_gib"] == pytest.approx(0.5)
    roomy = MB.memory_fit(60.44, [60.44], [3.0], [0.44], True, b, 80.0, 0.05, False, [2.4])  # 72.4 unpressed
    assert roomy["fits_without_retries"] and roomy["headroom_gib"] == pytest.approx(76.0 - 72.4)
    assert "giving back" not in MB.fit_line(roomy)
    assert mf["interval_gib"][1] == pytest.approx(82.4)
    assert "counts on the allocator giving back up to 6.9 GiB" in MB.fit_line(mf)
    assert MB.fits(70.44, 3.0, 0.44, True, b, 80.0, 0.05, False, 2.4)
    assert not MB.fits(70.44, 3.0, 0.44, True, b, 80.0, 0.05, False, 2.4, under_pressure=False)
    off = MB.memory_fit(72.4, [72.4], [3.0], [2.4], False, b, 80.0, 0.05, False, [2.4])  # off: stranded
    assert not off["fits"] and not off["fits_without_retries"] and "giving back" not in MB.fit_line(off)


def test_committed_pressure_records_against_the_band():
    """No pressed job that ran out of memory is predicted to run by the band (no margin)."""
    if not AP.PRESSURE:
        pytest.skip("no pressure records")
    checks = AP.band_check(AP.PRESSURE)
    assert checks and any(c["status"] == "oom" for c in checks)
    assert not [c["id"] for c in checks if c["status"] == "oom" and c["upper"] <= c["had"]]
    cap = AP.pressure_cap(AP.load(), expandable=True)
    assert cap is not None and MB.band("te", False).rf_pressure_expandable_gib == cap["cap_gib"]


def test_cli_prints_the_table_and_rejects_missing_files(capsys, tmp_path):
    if AP.PRESSURE:
        assert AP.main([]) == 0
        assert "every pressed layout ran with" in capsys.readouterr().out
    assert AP.main([str(tmp_path / "missing.jsonl")]) == 2
