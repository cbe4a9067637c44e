"""Telemetry: fake backend, sampler, windows, summaries, trace I/O, NVML/AMD SMI plumbing through
fake bindings, and the real 4 × H200 burn trace (expected numbers computed by hand from the file)."""
from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

from advisor.runners import telemetry as T
from advisor.runners.telemetry import (FakeBackend, Sample, Sampler, Trace, TelemetryUnavailable,
                                       normalize_pci_bus_id, summarize, summarize_steps,
                                       trace_from_burn_json)

BURN = Path(__file__).parent / "data" / "telemetry" / "h200x4_burn_trace.json"


class ManualClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def no_nan(obj) -> None:
    """Summaries must never carry NaN: None instead."""
    if isinstance(obj, float):
        assert not math.isnan(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            no_nan(v)
    elif isinstance(obj, list):
        for v in obj:
            no_nan(v)


# ---------------------------------------------------------------------------------------------
# identity

@pytest.mark.parametrize("raw, norm", [
    ("00000000:18:00.0", "00000000:18:00.0"),
    ("0000:18:00.0", "00000000:18:00.0"),
    ("18:00.0", "00000000:18:00.0"),
    ("0000:c1:00.0", "00000000:C1:00.0"),
    (b"00000000:9A:00.1", "00000000:9A:00.1"),
])
def test_normalize_pci_bus_id(raw, norm):
    assert normalize_pci_bus_id(raw) == norm


def test_normalize_pci_bus_id_rejects_garbage():
    with pytest.raises(ValueError):
        normalize_pci_bus_id("GPU-1234")


def test_sampler_selects_devices_by_uuid_or_pci_never_index():
    fake = FakeBackend(3)
    d0, d1, d2 = fake.devices()
    s = Sampler(fake, devices=[d2.uuid, "0000:19:00.0", d2.uuid[4:]])  # duplicate d2 dropped
    assert [d.uuid for d in s.devices] == [d2.uuid, d1.uuid]
    with pytest.raises(TypeError):
        Sampler(fake, devices=[0])
    with pytest.raises(ValueError, match="no GPU"):
        Sampler(fake, devices=["GPU-does-not-exist"])


# ---------------------------------------------------------------------------------------------
# fake backend

def test_fake_backend_is_exact():
    clock = ManualClock(0.0)
    fake = FakeBackend(2, clock=clock)
    clock.t = 2.0
    s0, s1 = fake.read(0), fake.read(1)
    assert (s0.power_w, s0.energy_j, s0.clock_event_reasons, s0.sm_clock_mhz) == (280.0, 360.0, 0, 1980.0)
    assert (s1.power_w, s1.energy_j) == (290.0, 380.0)
    clock.t = 10.0  # device 0 capped since t = (700-80)/100 = 6.2 s
    s = fake.read(0)
    assert s.power_w == 700.0 and s.clock_event_reasons == 0x4 and s.sm_clock_mhz == 1515.0
    assert s.energy_j == pytest.approx(80 * 6.2 + 50 * 6.2**2 + 700 * 3.8)  # 5078 J
    assert s.power_violation_ns == pytest.approx(3.8e9)
    assert s.gpu_temp_c == 65.0


def test_fake_backend_fast_read_skips_counters():
    s = FakeBackend(1).read(0, counters=False)
    assert all(getattr(s, k) is None for k in T.COUNTER_FIELDS)
    assert s.power_w is not None and s.clock_event_reasons is not None and s.gpu_temp_c is not None


def test_fake_backend_unsupported_fields_are_none_not_zero():
    fake = FakeBackend(1, unsupported=["mem_temp_c", "nvlink_tx_bytes"])
    s = fake.read(0)
    assert s.mem_temp_c is None and s.nvlink_tx_bytes is None and s.nvlink_rx_bytes is not None
    with pytest.raises(ValueError):
        FakeBackend(1, unsupported=["bogus"])


# ---------------------------------------------------------------------------------------------
# deterministic sampler + summaries (manual clock, samples every 0.25 s from t=0 to t=10,
# cumulative counters read every 4th sample, i.e. on whole seconds, as a 1 Hz counter rate does)

def run_manual(unsupported=(), windows=False):
    clock = ManualClock(0.0)
    fake = FakeBackend(2, clock=clock, unsupported=unsupported)
    s = Sampler(fake, rate_hz=4)
    result = None
    for k in range(41):
        clock.t = k * 0.25
        if windows and clock.t == 2.0:
            s.begin_window("load")
        elif windows and clock.t == 10.0:
            result = s.end_window("load")
        else:
            s.sample_once(counters=k % 4 == 0)
    return fake, s, s.stop(), result


def test_summarize_counter_and_samples_exact():
    fake, _, trace, _ = run_manual(unsupported=["mem_temp_c"])
    u0 = fake.devices()[0].uuid
    out = summarize(trace, 2.0, 10.0, tokens=1000)
    no_nan(out)
    d = out["devices"][u0]
    assert d["n_samples"] == 33
    # 17 ramp samples (2.0..6.0: 80 + 100 t) + 16 capped ones (6.25..10.0: 700 W)
    assert d["mean_power_w"] == pytest.approx((17 * 80 + 100 * 68 + 16 * 700) / 33)
    assert d["peak_power_w"] == 700.0 and d["p99_power_w"] == 700.0
    assert d["energy_source"] == "counter"
    assert d["energy_j"] == pytest.approx(5078.0 - 360.0)
    assert d["throttle_fractions"]["sw_power_cap"] == pytest.approx(16 / 33)
    assert d["throttle_fractions"]["any_throttle"] == pytest.approx(16 / 33)
    assert d["throttle_fractions"]["hw_thermal"] == 0.0
    assert d["median_sm_clock_mhz"] == 1980.0 and d["min_sm_clock_mhz"] == 1515.0
    assert d["mean_sm_clock_mhz"] == pytest.approx((17 * 1980 + 16 * 1515) / 33)
    assert d["max_gpu_temp_c"] == 65.0
    assert d["max_mem_temp_c"] is None                       # unsupported -> None
    assert d["power_violation_s"] == pytest.approx(10.0 - 6.2)
    assert d["thermal_violation_s"] == 0.0
    assert d["pcie_tx_bytes"] == pytest.approx(8e9) and d["pcie_rx_bytes"] == pytest.approx(16e9)
    assert d["nvlink_tx_bytes"] == pytest.approx(8e10)
    e1 = out["devices"][fake.devices()[1].uuid]["energy_j"]  # idle 90 W, capped from t=6.1
    assert e1 == pytest.approx((90 * 6.1 + 50 * 6.1**2 + 700 * 3.9) - (90 * 2 + 50 * 4))
    assert out["energy_j"] == pytest.approx(d["energy_j"] + e1)
    assert out["energy_per_token_j"] == pytest.approx(out["energy_j"] / 1000)


def test_summarize_falls_back_to_trapezoid_without_energy_counter():
    fake, _, trace, _ = run_manual(unsupported=["energy_j"])
    d = summarize(trace, 2.0, 10.0)["devices"][fake.devices()[0].uuid]
    assert d["energy_source"] == "power_trapezoid"
    # exact 4718 J, less 0.5 J of trapezoid error on the segment 6.0-6.25 s that holds the cap kink
    assert d["energy_j"] == pytest.approx(4717.5)


def test_counter_deltas_interpolate_between_samples():
    fake, _, trace, _ = run_manual()
    d = summarize(trace, 2.1, 2.4)["devices"][fake.devices()[0].uuid]
    assert d["n_samples"] == 1                              # only the sample at 2.25
    assert d["pcie_tx_bytes"] == pytest.approx(0.3e9)       # linear counter: exact


def test_empty_interval_gives_none_not_nan():
    fake, _, trace, _ = run_manual()
    out = summarize(trace, 50.0, 60.0, tokens=10)
    no_nan(out)
    d = out["devices"][fake.devices()[0].uuid]
    assert d["n_samples"] == 0
    assert all(d[k] is None for k in d if k != "n_samples")
    assert out["energy_j"] is None and out["energy_per_token_j"] is None


def test_bad_intervals_and_tokens_raise():
    _, _, trace, _ = run_manual()
    with pytest.raises(ValueError):
        summarize(trace, 5.0, 5.0)
    with pytest.raises(ValueError):
        summarize(trace, 6.0, 5.0)
    with pytest.raises(ValueError):
        summarize(trace, 1.0, 5.0, tokens=0)
    with pytest.raises(ValueError):
        summarize_steps(trace, [])


def test_summarize_steps_union_and_per_step_peaks():
    fake, _, trace, _ = run_manual()
    u0 = fake.devices()[0].uuid
    steps = [(2.0, 4.0), (3.0, 5.0), (8.0, 10.0)]       # the first two overlap: union [2,5] + [8,10]
    out = summarize_steps(trace, steps, tokens=500)
    d = out["devices"][u0]
    assert out["n_steps"] == 3 and out["duration_s"] == 5.0
    assert d["n_samples"] == 13 + 9
    e = lambda t: 80 * t + 50 * t**2 if t < 6.2 else 80 * 6.2 + 50 * 6.2**2 + 700 * (t - 6.2)  # noqa: E731
    assert d["energy_j"] == pytest.approx((e(5) - e(2)) + (e(10) - e(8)))
    assert d["step_peak_power_w"] == [480.0, 580.0, 700.0]
    assert d["step_energy_j"] == pytest.approx([e(4) - e(2), e(5) - e(3), e(10) - e(8)])
    assert out["energy_per_token_j"] == pytest.approx(out["energy_j"] / 500)


def test_windows_recorded_and_summarized():
    fake, s, trace, w = run_manual(windows=True)
    assert (w.name, w.t0, w.t1) == ("load", 2.0, 10.0)
    assert trace.windows == [("load", 2.0, 10.0)]
    u0 = fake.devices()[0].uuid
    assert w.devices[u0]["energy_j"] == pytest.approx(5078.0 - 360.0)
    assert w.devices[u0]["n_samples"] == 33
    assert w.energy_j == pytest.approx(summarize(trace, 2.0, 10.0)["energy_j"])
    assert trace.meta["n_boundary_samples"] == 2 and trace.meta["n_ticks"] == 0
    with pytest.raises(ValueError, match="not begun"):
        s.end_window("load")
    s.begin_window("x")
    with pytest.raises(ValueError, match="already open"):
        s.begin_window("x")


# ---------------------------------------------------------------------------------------------
# trace I/O

@pytest.mark.parametrize("name", ["t.json", "t.json.gz"])
def test_trace_roundtrip(tmp_path, name):
    fake, _, trace, _ = run_manual(unsupported=["mem_temp_c"], windows=True)
    path = tmp_path / name
    trace.save(path)
    back = Trace.load(path)
    assert back.devices == trace.devices and back.windows == trace.windows
    assert back.meta["backend"] == "fake"
    for u, cols in trace.columns.items():
        for k, v in cols.items():
            np.testing.assert_array_equal(back.columns[u][k], v)
    if name.endswith(".json"):
        raw = json.loads(path.read_text())
        assert raw["columns"][fake.devices()[0].uuid]["mem_temp_c"][0] is None  # null, not NaN
        assert raw["columns"][fake.devices()[0].uuid]["sm_clock_mhz"][0] == 1980  # ints stay ints


def test_trace_load_rejects_other_json(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="not a telemetry trace"):
        Trace.load(p)


def test_trace_slice():
    fake, _, trace, _ = run_manual(windows=True)
    part = trace.slice(2.0, 3.0)
    u0 = fake.devices()[0].uuid
    assert part.columns[u0]["t"].tolist() == [2.0, 2.25, 2.5, 2.75, 3.0]
    assert part.windows == [("load", 2.0, 10.0)]
    assert trace.slice(20.0, 30.0).windows == [] and trace.slice(20.0, 30.0).n_samples(u0) == 0


# ---------------------------------------------------------------------------------------------
# threaded sampler

class SlowFake(FakeBackend):
    def __init__(self, delay_s: float, fail_every: int = 0, **kw):
        super().__init__(1, **kw)
        self.delay_s, self.fail_every, self.calls = delay_s, fail_every, 0

    def read(self, i: int, counters: bool = True) -> Sample:
        self.calls += 1
        if self.fail_every and self.calls % self.fail_every == 0:
            raise RuntimeError("GPU is lost")
        time.sleep(self.delay_s)
        return super().read(i, counters)


def test_sampler_thread_holds_100hz_by_deadline():
    # a 4 ms read in a 10 ms period: sleep(period) would give ~70 Hz; deadlines keep 100 Hz
    with Sampler(SlowFake(0.004), rate_hz=100) as s:
        time.sleep(1.0)
    m = s.trace.meta
    assert 90 <= m["n_ticks"] <= 102
    assert m["missed_ticks"] <= 3
    assert 0.004 <= m["overhead_per_sample_s"] < 0.008
    assert 0.3 < m["overhead_fraction"] < 0.7
    assert m["thread_cpu_s"] >= 0.0
    t = s.trace.columns[s.devices[0].uuid]["t"]
    assert len(t) == m["n_ticks"] + 1 and np.all(np.diff(t) > 0)


def test_sampler_skips_ticks_it_cannot_meet():
    with Sampler(SlowFake(0.025), rate_hz=100) as s:  # a read takes 2.5 periods
        time.sleep(0.5)
    m = s.trace.meta
    assert m["missed_ticks"] > 0
    assert m["n_ticks"] <= 0.5 / 0.025 + 2


def test_sampler_survives_read_errors():
    with Sampler(SlowFake(0.0, fail_every=3), rate_hz=200) as s:
        time.sleep(0.2)
    m = s.trace.meta
    assert m["errors"] > 0 and "GPU is lost" in m["last_error"]
    assert s.trace.n_samples(s.devices[0].uuid) == m["n_ticks"] + 1 - m["errors"]


def test_sampler_reads_counters_at_counter_rate_and_boundaries():
    with Sampler(FakeBackend(1), rate_hz=100, counter_rate_hz=10) as s:
        time.sleep(0.3)
    c = s.trace.columns[s.devices[0].uuid]
    n = len(c["t"])
    have = set(np.flatnonzero(~np.isnan(c["energy_j"])).tolist())
    assert have == set(range(0, n - 1, 10)) | {n - 1}          # every 10th tick + the stop read
    assert np.isnan(c["pcie_tx_bytes"][1]) and not np.isnan(c["power_w"]).any()
    m = s.trace.meta
    assert m["n_counter_reads"] == len(have) and m["counter_rate_hz"] == 10.0
    assert m["overhead_per_counter_sample_s"] > 0 and m["overhead_per_fast_sample_s"] > 0


def test_sampler_default_rate_and_validation():
    s = Sampler(FakeBackend(1))
    assert s.rate_hz == 20.0 and s.counter_rate_hz == 1.0
    assert Sampler(FakeBackend(1), rate_hz=0.5).counter_rate_hz == 0.5   # never above rate_hz
    with pytest.raises(ValueError):
        Sampler(FakeBackend(1), rate_hz=0)
    with pytest.raises(ValueError):
        Sampler(FakeBackend(1), counter_rate_hz=0)


# ---------------------------------------------------------------------------------------------
# open_backend

class FailingPynvml(types.SimpleNamespace):
    class NVMLError(Exception):
        pass

    def nvmlDeviceGetFieldValues(self, *a):
        raise AssertionError("not reached")

    def nvmlInit(self):
        raise self.NVMLError("NVML Shared Library Not Found")


def test_open_backend_auto_disables_with_one_warning(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", FailingPynvml())
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # import amdsmi -> ImportError
    with caplog.at_level(logging.WARNING, logger="advisor.runners.telemetry"):
        assert T.open_backend() is None
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1
    assert "telemetry disabled" in msgs[0] and "nvmlInit failed" in msgs[0] and "amdsmi" in msgs[0]
    with pytest.raises(TelemetryUnavailable, match="nvmlInit failed"):
        T.open_backend("nvml")
    with pytest.raises(TelemetryUnavailable, match="amdsmi"):
        T.open_backend("amd")
    with pytest.raises(ValueError, match="unknown telemetry backend"):
        T.open_backend("dcgm")


def test_import_needs_no_torch_nor_nvml():
    code = ("import sys, advisor.runners.telemetry as t; "
            "assert 'torch' not in sys.modules and 'pynvml' not in sys.modules and 'amdsmi' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------
# NVML backend through a fake pynvml (field validation, driver-branch IDs, fallbacks, units)

UINT_MAX = 0xFFFFFFFF


class FakeNVMLError(Exception):
    def __init__(self, value):
        self.value = value

    def __str__(self):
        return {3: "Not Supported", 13: "Function Not Found"}.get(self.value, f"error {self.value}")


class FakePynvml:
    """Enough of nvidia-ml-py for NvmlBackend. Fields: {(id, scope): (valueType, value)}; anything
    else returns NVML_ERROR_NOT_SUPPORTED (3) in its entry, as the real call does."""

    NVMLError = FakeNVMLError

    def __init__(self, driver="580.159.04", fields=None, violation=None, n=2):
        self.driver, self.n = driver, n
        self.fields = dict(fields if fields is not None else DEFAULT_FIELDS)
        self.violation = dict(violation if violation is not None else {0: 5e9, 1: 7e9})
        self.field_calls = []
        self.energy_calls = 0
        self.shutdown = 0

    def nvmlInit(self): pass
    def nvmlShutdown(self): self.shutdown += 1
    def nvmlSystemGetDriverVersion(self): return self.driver
    def nvmlDeviceGetCount(self): return self.n
    def nvmlDeviceGetHandleByIndex(self, i): return i
    def nvmlDeviceGetUUID(self, h): return f"GPU-{h:08x}-aaaa-bbbb-cccc-dddddddddddd"
    def nvmlDeviceGetPciInfo(self, h): return types.SimpleNamespace(busId=f"00000000:{0x1A + h:02X}:00.0".encode())
    def nvmlDeviceGetName(self, h): return "NVIDIA H200"
    def nvmlDeviceGetEnforcedPowerLimit(self, h): return 700000
    def nvmlDeviceGetModuleId(self, h): return h + 1

    def nvmlDeviceGetTemperatureThreshold(self, h, t):
        if t not in (1, 3):
            raise FakeNVMLError(3)
        return {1: 89, 3: 87}[t]

    def nvmlDeviceGetTemperatureV(self, h, sensor):
        raise FakeNVMLError(13)  # older driver: the V call is missing -> fall back

    def nvmlDeviceGetTemperature(self, h, sensor): return 60 + h
    def nvmlDeviceGetClockInfo(self, h, kind): return {1: 1515, 2: 3201}[kind]
    def nvmlDeviceGetCurrentClocksEventReasons(self, h): return 0x4
    def nvmlDeviceGetUtilizationRates(self, h): return types.SimpleNamespace(gpu=97, memory=40)
    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        self.energy_calls += 1
        return 123_456_789 + h

    def nvmlDeviceGetViolationStatus(self, h, policy):
        if policy not in self.violation:
            raise FakeNVMLError(3)
        return types.SimpleNamespace(referenceTime=1, violationTime=self.violation[policy])

    def nvmlDeviceGetFieldValues(self, h, entries):
        self.field_calls.append((h, list(entries)))
        out = []
        for e in entries:
            fid, scope = e if isinstance(e, tuple) else (e, 0)
            vt_val = self.fields.get((fid, scope))
            names = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
            value = types.SimpleNamespace(**{n: 0 for n in names.values()})
            if vt_val is None:
                out.append(types.SimpleNamespace(fieldId=fid, scopeId=scope, nvmlReturn=3, valueType=3,
                                                 value=value, latencyUsec=1))
            else:
                vt, v = vt_val(h) if callable(vt_val) else vt_val
                setattr(value, names[vt], v)
                out.append(types.SimpleNamespace(fieldId=fid, scopeId=scope, nvmlReturn=0, valueType=vt,
                                                 value=value, latencyUsec=2))
        return out


DEFAULT_FIELDS = {
    (186, 0): (1, 654321),              # mW
    (74, 0): (3, 5_000_000_000),        # ns, agrees with ViolationStatus(POWER) = 5e9
    (251, 0): (3, 1_000_000_000), (252, 0): (3, 2_000_000_000), (253, 0): (3, 3_000_000_000),
    (269, 0): (1, 0), (270, 0): (1, 0), (271, 0): (1, 0),  # success-with-0 trap on R580 (FACTS.md)
    (197, 0): (3, 10_000), (198, 0): (3, 20_000),
    (91, 0): (1, 18),
    **{(138, link): (3, 10 * (link + 1)) for link in range(18)},  # KiB per link
    **{(139, link): (3, 20 * (link + 1)) for link in range(18)},
    # no (82, 0): HBM temperature unsupported; no (75, 0): thermal field missing; no UINT_MAX scope
}


def nvml_backend(monkeypatch, **kw):
    fake = FakePynvml(**kw)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    from advisor.runners.telemetry_nvml import NvmlBackend
    return fake, NvmlBackend()


def test_nvml_devices_identity(monkeypatch):
    _, b = nvml_backend(monkeypatch)
    d = b.devices()[1]
    assert d.uuid == "GPU-00000001-aaaa-bbbb-cccc-dddddddddddd" and d.pci_bus_id == "00000000:1B:00.0"
    assert (d.name, d.power_limit_w, d.slowdown_temp_c, d.max_operating_temp_c, d.module_id) == \
        ("NVIDIA H200", 700.0, 89, 87, 2)
    assert b.driver_version == "580.159.04"


def test_nvml_read_units_validation_and_one_batched_call(monkeypatch):
    fake, b = nvml_backend(monkeypatch)
    fake.field_calls.clear()
    s = b.read(0)
    assert len(fake.field_calls) == 1                           # one batched call per device
    entries = fake.field_calls[0][1]
    assert all(isinstance(e, tuple) for e in entries)           # scopeId always explicit
    assert {e[0] for e in entries}.isdisjoint({269, 270, 271, 82, 75})
    assert s.power_w == pytest.approx(654.321)
    assert s.energy_j == pytest.approx(123_456.789)
    assert s.gpu_temp_c == 60.0 and s.sm_clock_mhz == 1515.0 and s.mem_clock_mhz == 3201.0
    assert s.clock_event_reasons == 0x4 and s.gpu_util_pct == 97.0
    assert s.mem_temp_c is None                                 # NOT_SUPPORTED -> None, not 0
    assert s.power_violation_ns == 5e9                          # field 74
    assert s.thermal_violation_ns == 7e9                        # field 75 missing -> ViolationStatus
    assert (s.sw_thermal_slowdown_ns, s.hw_thermal_slowdown_ns, s.hw_power_brake_ns) == (1e9, 2e9, 3e9)
    assert (s.pcie_tx_bytes, s.pcie_rx_bytes) == (10_000, 20_000)
    assert s.nvlink_tx_bytes == 1024 * 10 * sum(range(1, 19))  # per-link KiB summed
    assert s.nvlink_rx_bytes == 1024 * 20 * sum(range(1, 19))
    st = b.field_status()[b.devices()[0].uuid]
    assert st["mem_temp_c"].startswith("unsupported")
    assert "ViolationStatus" in st["thermal_violation_ns"]
    assert st["sw_thermal_slowdown_ns"].startswith("field 251")
    assert st["gpu_temp_c"] == "nvmlDeviceGetTemperature"
    assert "18 link" in st["nvlink_tx_bytes"]


def test_nvml_fast_read_skips_expensive_counters(monkeypatch):
    fake, b = nvml_backend(monkeypatch)
    fake.field_calls.clear()
    fake.energy_calls = 0
    s = b.read(0, counters=False)
    assert fake.field_calls == [(0, [(186, 0)])]                # power only; 82 is unsupported
    assert fake.energy_calls == 0
    assert s.power_w == pytest.approx(654.321) and s.clock_event_reasons == 0x4 and s.gpu_temp_c == 60.0
    assert all(getattr(s, k) is None for k in T.COUNTER_FIELDS)


def test_nvml_slowdown_ids_follow_driver_branch(monkeypatch):
    from advisor.runners.telemetry_nvml import slowdown_field_ids
    assert slowdown_field_ids("580.159.04") == (251, 252, 253)
    assert slowdown_field_ids("575.51.03") == (251, 252, 253)
    assert slowdown_field_ids("590.44.01") == (269, 270, 271)
    assert slowdown_field_ids("570.86.15") is None
    assert slowdown_field_ids("garbage") is None
    fields = {**DEFAULT_FIELDS, (269, 0): (3, 4_000_000_000)}
    _, b = nvml_backend(monkeypatch, driver="590.44.01", fields=fields)
    s = b.read(0)
    assert s.sw_thermal_slowdown_ns == 4e9
    assert s.hw_thermal_slowdown_ns == 0.0  # 270 succeeds with 0 in this fake
    _, b = nvml_backend(monkeypatch, driver="570.86.15")
    s = b.read(0)
    assert s.sw_thermal_slowdown_ns is None and s.hw_power_brake_ns is None


def test_nvml_violation_field_disagreeing_is_not_trusted(monkeypatch):
    fields = {**DEFAULT_FIELDS, (74, 0): (3, 0)}             # success, but 0 while ViolationStatus says 5 s
    _, b = nvml_backend(monkeypatch, fields=fields)
    assert b.read(0).power_violation_ns == 5e9
    assert "disagrees" in b.field_status()[b.devices()[0].uuid]["power_violation_ns"]


def test_nvml_aggregate_nvlink_scope_preferred(monkeypatch):
    fields = {**DEFAULT_FIELDS, (138, UINT_MAX): (3, 1000), (139, UINT_MAX): (3, 3000)}
    fake, b = nvml_backend(monkeypatch, fields=fields)
    fake.field_calls.clear()
    s = b.read(0)
    assert (s.nvlink_tx_bytes, s.nvlink_rx_bytes) == (1000 * 1024, 3000 * 1024)
    assert sum(1 for e in fake.field_calls[0][1] if e[0] in (138, 139)) == 2


def test_nvml_field_failing_at_runtime_reads_none(monkeypatch):
    fake, b = nvml_backend(monkeypatch)
    del fake.fields[(186, 0)]
    s = b.read(0)
    assert s.power_w is None and s.pcie_tx_bytes == 10_000


def test_nvml_no_gpu_is_unavailable(monkeypatch):
    fake = FakePynvml(n=0)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    from advisor.runners.telemetry_nvml import NvmlBackend
    with pytest.raises(TelemetryUnavailable, match="no NVIDIA GPU"):
        NvmlBackend()
    assert fake.shutdown == 1


def test_nvml_backend_drives_sampler(monkeypatch):
    _, b = nvml_backend(monkeypatch)
    with Sampler(b, devices=["0000:1b:00.0"], rate_hz=50) as s:
        time.sleep(0.1)
    tr = s.trace
    assert [d.uuid for d in tr.devices] == [b.devices()[1].uuid]
    assert tr.meta["backend"] == "nvml" and tr.meta["driver_version"] == "580.159.04"
    assert tr.meta["fields"][b.devices()[1].uuid]["power_w"].startswith("field 186")
    assert np.all(tr.columns[b.devices()[1].uuid]["power_w"] == 654.321)


# ---------------------------------------------------------------------------------------------
# AMD SMI backend through a fake amdsmi

class FakeAmdSmi:
    AmdSmiTemperatureType = types.SimpleNamespace(EDGE="edge", HOTSPOT="hotspot", VRAM="vram")
    AmdSmiTemperatureMetric = types.SimpleNamespace(CURRENT="current", CRITICAL="critical")
    AmdSmiClkType = types.SimpleNamespace(GFX="gfx", MEM="mem")

    def __init__(self, mi300=True):
        self.mi300 = mi300
        self.acc = {"acc_counter": 0, "acc_ppt_pwr": 0, "acc_socket_thrm": 0}

    def amdsmi_init(self): pass
    def amdsmi_shut_down(self): pass
    def amdsmi_get_processor_handles(self): return ["h0"]
    def amdsmi_get_gpu_driver_info(self, h): return {"driver_version": "6.10.5"}
    def amdsmi_get_gpu_device_uuid(self, h): return "35ff74a1-0000-1000-80a4-b8a8b8a8b8a8"
    def amdsmi_get_gpu_device_bdf(self, h): return "0000:c1:00.0"
    def amdsmi_get_gpu_asic_info(self, h): return {"market_name": "AMD Instinct MI300X"}
    def amdsmi_get_power_cap_info(self, h): return {"power_cap": 750_000_000}

    def amdsmi_get_temp_metric(self, h, sensor, metric):
        temps = {("hotspot", "current"): 71, ("vram", "current"): 64000, ("hotspot", "critical"): 110}
        return temps[(sensor, metric)]

    def amdsmi_get_power_info(self, h):
        if self.mi300:
            return {"current_socket_power": 612, "average_socket_power": "N/A"}
        return {"current_socket_power": "N/A", "average_socket_power": 301}

    def amdsmi_get_energy_count(self, h):
        return {"energy_accumulator": 1_000_000, "counter_resolution": 15.259, "timestamp": 0}

    def amdsmi_get_clock_info(self, h, kind): return {"clk": {"gfx": 2100, "mem": 1300}[kind]}
    def amdsmi_get_gpu_activity(self, h): return {"gfx_activity": 88}

    def amdsmi_get_violation_status(self, h):
        if not self.mi300:
            raise RuntimeError("AMDSMI_STATUS_NOT_SUPPORTED")
        self.acc["acc_counter"] += 100
        self.acc["acc_ppt_pwr"] += 50       # half of the firmware samples power-limited
        return {**self.acc, "active_ppt_pwr": True, "active_prochot_thrm": False,
                "active_socket_thrm": False, "active_hbm_thrm": False, "active_vr_thrm": "N/A"}

    def amdsmi_get_gpu_metrics_info(self, h):
        return {"throttle_status": "N/A", "indep_throttle_status": (1 << 2) | (1 << 33)}


def amd_backend(monkeypatch, **kw):
    fake = FakeAmdSmi(**kw)
    monkeypatch.setitem(sys.modules, "amdsmi", fake)
    from advisor.runners.telemetry_amd import AmdSmiBackend
    return fake, AmdSmiBackend()


def test_amd_mi300_like(monkeypatch):
    _, b = amd_backend(monkeypatch)
    d = b.devices()[0]
    assert d.pci_bus_id == "00000000:C1:00.0" and d.power_limit_w == 750.0 and d.slowdown_temp_c == 110
    s1 = b.read(0)
    time.sleep(0.02)
    s2 = b.read(0)
    assert s2.power_w == 612.0 and s2.gpu_temp_c == 71.0 and s2.mem_temp_c == 64.0  # millidegrees fixed
    assert s2.energy_j == pytest.approx(1_000_000 * 15.259e-6)
    assert (s2.sm_clock_mhz, s2.mem_clock_mhz, s2.gpu_util_pct) == (2100.0, 1300.0, 88.0)
    assert s2.clock_event_reasons == 0x4
    assert s1.power_violation_ns == 0.0
    assert s2.power_violation_ns == pytest.approx(0.5 * (s2.t - s1.t) * 1e9)
    assert s2.thermal_violation_ns == 0.0
    assert s2.pcie_tx_bytes is None and s2.nvlink_rx_bytes is None
    assert "instantaneous" in b.field_status()[d.uuid]["power_w"]


def test_amd_mi200_like(monkeypatch):
    _, b = amd_backend(monkeypatch, mi300=False)
    s = b.read(0)
    assert s.power_w == 301.0
    assert "average" in b.field_status()[b.devices()[0].uuid]["power_w"]
    assert s.clock_event_reasons == 0x4 | 0x20                  # power bit 2, temperature bit 33
    assert s.power_violation_ns is None and s.thermal_violation_ns is None


# ---------------------------------------------------------------------------------------------
# the real 4 × H200 burn trace (0.5 s NVML samples); expected values computed by hand from the file

@pytest.fixture(scope="module")
def burn() -> Trace:
    return trace_from_burn_json(BURN)


def test_burn_trace_shape(burn):
    assert len(burn.devices) == 4
    assert all(d.pci_bus_id is None and d.name == "NVIDIA H200" for d in burn.devices)
    u = burn.devices[3].uuid
    assert u == "h200x4_burn_trace/nvml-index-3"
    assert burn.n_samples(u) == 648 and burn.columns[u]["t"][-1] == 323.7
    assert np.isnan(burn.columns[u]["energy_j"]).all()


def test_burn_trace_summary_under_load(burn):
    out = summarize(burn, 30.0, 300.0, tokens=10**9)
    no_nan(out)
    devs = [out["devices"][d.uuid] for d in burn.devices]
    assert [d["n_samples"] for d in devs] == [540] * 4
    assert [d["mean_power_w"] for d in devs] == pytest.approx(
        [691.8962962962963, 689.9851851851852, 692.2925925925925, 689.8055555555555])
    assert [d["peak_power_w"] for d in devs] == [746.0, 753.0, 749.0, 743.0]
    assert [d["p99_power_w"] for d in devs] == pytest.approx([740.0, 744.83, 736.61, 736.05])
    assert [d["max_gpu_temp_c"] for d in devs] == [70.0, 63.0, 63.0, 70.0]
    assert [d["median_sm_clock_mhz"] for d in devs] == [1470.0, 1470.0, 1470.0, 1440.0]
    assert [d["min_sm_clock_mhz"] for d in devs] == [1440.0, 1425.0, 1425.0, 1425.0]
    assert devs[3]["mean_sm_clock_mhz"] == pytest.approx(1443.9722222222222)
    for d in devs:
        assert d["throttle_fractions"]["sw_power_cap"] == 1.0   # reasons 0x4 throughout the load
        assert d["throttle_fractions"]["idle"] == 0.0
        assert d["throttle_fractions"]["hw_thermal"] == d["throttle_fractions"]["sw_thermal"] == 0.0
        assert d["energy_source"] == "power_trapezoid"           # the file has no energy counter
        assert d["max_mem_temp_c"] is None and d["power_violation_s"] is None
    # trapezoid over [30, 300] with power interpolated at the ends (29.6/30.1 and 299.7/300.2 s)
    assert [d["energy_j"] for d in devs] == pytest.approx([186805.79, 186292.13, 186914.18, 186253.81])
    assert out["energy_j"] == pytest.approx(186805.79 + 186292.13 + 186914.18 + 186253.81)
    assert out["energy_per_token_j"] == pytest.approx(out["energy_j"] / 1e9)


def test_burn_trace_idle_and_whole_run(burn):
    idle = summarize(burn, 0.0, 6.5)
    for d in burn.devices:
        s = idle["devices"][d.uuid]
        assert s["throttle_fractions"]["idle"] == 1.0 and s["min_sm_clock_mhz"] == 345.0
        assert s["peak_power_w"] < 90
    whole = summarize(burn, 0.0, 323.7)
    assert [whole["devices"][d.uuid]["peak_power_w"] for d in burn.devices] == [746.0, 753.0, 749.0, 758.0]
    hot = burn.slice(299.0, 301.0)
    assert hot.columns[burn.devices[3].uuid]["gpu_temp_c"].tolist() == [69.0, 69.0, 69.0, 70.0]


def test_burn_trace_steps(burn):
    steps = [(30.0 + 10 * k, 35.0 + 10 * k) for k in range(27)]
    out = summarize_steps(burn, steps)
    d = out["devices"][burn.devices[0].uuid]
    assert out["duration_s"] == 135.0 and len(d["step_peak_power_w"]) == 27
    assert max(d["step_peak_power_w"]) <= 746.0 and min(d["step_peak_power_w"]) > 690.0
    assert sum(d["step_energy_j"]) == pytest.approx(d["energy_j"])


# ---------------------------------------------------------------------------------------------
# snapshot: what the measurement launcher reads while the sampler runs

class SlowSecondDevice(FakeBackend):
    """Reading device 1 takes 2 ms: a snapshot taken between the two reads of one tick would
    show device 0 one sample ahead of device 1."""

    def read(self, i: int, counters: bool = True) -> Sample:
        if i == 1:
            time.sleep(0.002)
        return super().read(i, counters)


def test_sampler_snapshot_is_a_thread_safe_copy_optionally_sliced():
    clock = ManualClock(0.0)
    s = Sampler(FakeBackend(2, clock=clock), rate_hz=4)
    for k in range(9):
        clock.t = k * 0.5
        s.sample_once()
    u = s.devices[0].uuid
    full = s.snapshot()
    assert full.columns[u]["t"].tolist() == [0.5 * k for k in range(9)]
    assert set(full.columns) == {d.uuid for d in s.devices} and full.meta["backend"] == "fake"
    # sliced: [t0, t1] plus one sample either side; either end may be open
    assert s.snapshot(1.2, 2.6).columns[u]["t"].tolist() == [1.0, 1.5, 2.0, 2.5, 3.0]
    assert s.snapshot(1.0, 2.5).columns[u]["t"].tolist() == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
    assert s.snapshot(t1=0.9).columns[u]["t"].tolist() == [0.0, 0.5, 1.0]
    assert s.snapshot(t0=3.6).columns[u]["t"].tolist() == [3.5, 4.0]
    assert s.snapshot(10.0, 11.0).columns[u]["t"].tolist() == [4.0]
    part = s.snapshot(1.2, 2.6)
    assert summarize(part, 1.2, 2.6)["devices"][u]["mean_power_w"] == pytest.approx(
        np.mean([80 + 100 * t for t in (1.5, 2.0, 2.5)]))
    with pytest.raises(ValueError):
        s.snapshot(2.0, 1.0)
    # a copy: later samples and edits of the snapshot change neither side
    clock.t = 5.0
    s.sample_once()
    full.columns[u]["power_w"][:] = -1.0
    assert full.n_samples(u) == 9 and s.snapshot().n_samples(u) == 10
    assert s.snapshot().columns[u]["power_w"][0] == 80.0
    # while the thread samples: every snapshot is consistent (all devices, all columns)
    with Sampler(SlowSecondDevice(2), rate_hz=200) as live:
        sizes = []
        for _ in range(40):
            snap = live.snapshot()
            n = {d: snap.n_samples(d) for d in snap.columns}
            assert len(set(n.values())) == 1, n
            for c in snap.columns.values():
                assert {len(v) for v in c.values()} == {len(c["t"])}
            sizes.append(next(iter(n.values())))
            time.sleep(0.003)
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0]
    assert live.trace.n_samples(live.devices[0].uuid) >= sizes[-1]


def test_pcie_counter_wraps_at_32_bits_are_unwrapped():
    from advisor.runners.telemetry import PCIE_COUNTER_WRAP, unwrap_counter
    # h100x1-01: rx went 4,287,487,836 -> 22,386,032 between two 1 Hz reads (~29.8 MB moved)
    v = np.array([4_200_000_000.0, np.nan, 4_287_487_836.0, 22_386_032.0, 52_000_000.0])
    u = unwrap_counter(v, PCIE_COUNTER_WRAP)
    assert np.isnan(u[1])
    assert u[3] - u[2] == 2 ** 32 - 4_287_487_836 + 22_386_032
    assert list(np.diff(u[~np.isnan(u)]) >= 0) == [True] * 3
    # a counter wider than 32 bits is left alone
    w = np.array([5e9, 4e9])
    assert list(unwrap_counter(w, PCIE_COUNTER_WRAP)) == [5e9, 4e9]


def test_recorded_traces_give_pcie_bytes_after_a_wrap():
    from advisor.runners.telemetry import Trace, summarize
    tr = Trace.load(Path(__file__).resolve().parents[1] / "data" / "traces" / "h100x1-01.trace.json.gz")
    d = tr.devices[0]
    c = tr.columns[d.uuid]
    s = summarize(tr, float(c["t"][0]), float(c["t"][-1]))["devices"][d.uuid]
    rx = s["pcie_rx_bytes"]
    assert rx is not None and 0 < rx < 2 ** 32  # was None: the raw counter decreases once
