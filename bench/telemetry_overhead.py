"""Telemetry check and overhead bench.

    python bench/telemetry_overhead.py [--seconds 10] [--rates 20,100] [--counter-rate 1]
                                       [--load none|process|thread] [--out DIR]

On a machine with NVML (or AMD SMI) it
  1. validates: driver version, how every Sample field is read on each GPU (field_status), the raw
     nvmlReturn / valueType / value of both slowdown-counter ID sets (251-253 and 269-271), fields
     74/75 against nvmlDeviceGetViolationStatus, module ids, each batched field's latencyUsec, and
     the refresh period of POWER_INSTANT and of the energy counter (change-interval method);
  2. prints the median cost of every NVML call the backend makes (idle, and under load), then
     samples all GPUs for N seconds at each rate and prints the cost of a fast sample and of one
     with the cumulative counters (µs, all GPUs), samples achieved vs requested, missed ticks, the
     sampler thread's CPU time and the share of wall time spent in sample calls;
  3. checks the trace: counters never decrease, the energy counter agrees with the trapezoid of
     instant power, and (with --load: back-to-back bf16 GEMMs on every GPU through torch, in a child
     process or in threads of the sampling process) that the
     power-cap reason 0x4 and the power-violation counter show up.
Without a GPU it runs the same bench against FakeBackend and says so. --out DIR writes
telemetry_check.json and one trace per rate (trace_<rate>hz.json.gz).

--ab SECONDS (needs torch and GPUs): the sampler's cost in *step time*. A child process (as the
training ranks are separate from the launcher's sampler) runs fixed steps of bf16 GEMMs on every
GPU and logs when each ends; this process turns the sampler on and off every --ab-period seconds,
for SECONDS per rate. Each "on" window is compared with the mean of the "off" windows on either
side (drift from temperature and the power cap cancels), per GPU; it prints the mean change in
median step time and its standard error.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

try:
    from advisor.runners import telemetry as T
except ImportError:  # not installed: run from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from runners import telemetry as T  # type: ignore[no-redef]


def refresh_period_s(read, seconds: float = 1.0) -> float | None:
    """Median interval between changes of read() polled in a tight loop (Zeus' method)."""
    changes, last, t_end = [], read(), time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        v = read()
        if v != last:
            changes.append(time.perf_counter())
            last = v
    return statistics.median(np.diff(changes)) if len(changes) > 2 else None


def validate_nvml(backend) -> dict:
    nvml = backend.nvml
    out = {"driver_version": backend.driver_version, "devices": {}}
    ids = [74, 75, 251, 252, 253, 269, 270, 271]
    for i, d in enumerate(backend.devices()):
        h = backend._handles[i]
        raw = {}
        for fv in nvml.nvmlDeviceGetFieldValues(h, [(f, 0) for f in ids]):
            raw[fv.fieldId] = {"nvmlReturn": fv.nvmlReturn, "valueType": fv.valueType,
                               "ullVal": fv.value.ullVal, "uiVal": fv.value.uiVal}
        viol = {}
        for name, policy in (("power", 0), ("thermal", 1)):
            try:
                viol[name] = nvml.nvmlDeviceGetViolationStatus(h, policy).violationTime
            except nvml.NVMLError as e:
                viol[name] = f"error: {e}"
        out["devices"][d.uuid] = {
            "pci_bus_id": d.pci_bus_id, "name": d.name, "module_id": d.module_id,
            "power_limit_w": d.power_limit_w, "slowdown_temp_c": d.slowdown_temp_c,
            "max_operating_temp_c": d.max_operating_temp_c,
            "field_status": backend.field_status()[d.uuid],
            "raw_fields": raw, "violation_status_ns": viol,
            "field_latency_us": backend.field_latency_us(i),
        }
    h0 = backend._handles[0]
    out["power_instant_refresh_s"] = refresh_period_s(
        lambda: nvml.nvmlDeviceGetFieldValues(h0, [(186, 0)])[0].value.uiVal)
    out["energy_counter_refresh_s"] = refresh_period_s(lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(h0))
    return out


def call_costs_us(backend, i: int = 0, reps: int = 30) -> dict[str, float]:
    """Median wall time (µs) of each NVML call the backend makes for device i, singly."""
    nvml, h, plan = backend.nvml, backend._handles[i], backend._plans[i]

    def med(fn) -> float:
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return round(statistics.median(ts) * 1e6, 1)

    out = {}
    for name, entries, _ in plan["fields"]:
        out[f"field {name}"] = med(lambda: nvml.nvmlDeviceGetFieldValues(h, entries))
    out["field batch (all)"] = med(lambda: nvml.nvmlDeviceGetFieldValues(h, plan["entries"]))
    for name, fn in plan["calls"].items():
        out[f"call {name}"] = med(lambda: fn(h))
    out["read()"] = med(lambda: backend.read(i))
    return out


def start_load_process() -> "subprocess.Popen":
    import subprocess
    return subprocess.Popen([sys.executable, __file__, "--burn-forever"])


def burn_forever() -> None:
    stop = threading.Event()
    for t in start_load(stop):
        t.join()


def start_load(stop: threading.Event, gemms: int = 20, on_step=None) -> list[threading.Thread]:
    """Back-to-back bf16 8192^3 GEMMs on every GPU (a thread each) until `stop`: steps of `gemms`
    GEMMs, then synchronize and call on_step(gpu, time.time())."""
    import torch  # only with --load / --ab

    def burn(dev: int) -> None:
        torch.cuda.set_device(dev)
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        while not stop.is_set():
            for _ in range(gemms):
                a @ b
            torch.cuda.synchronize(dev)
            if on_step is not None:
                on_step(dev, time.time())

    threads = [threading.Thread(target=burn, args=(d,), daemon=True) for d in range(torch.cuda.device_count())]
    for t in threads:
        t.start()
    return threads


def step_loop(path: str, gemms: int = 24) -> None:
    """Child of --ab: fixed steps (`gemms` bf16 8192^3 GEMMs, then synchronize) on every GPU until
    SIGTERM; one line "gpu t_end" per step, flushed."""
    import signal

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    f = open(path, "a", buffering=1)
    lock = threading.Lock()

    def log_step(dev: int, t: float) -> None:
        with lock:
            f.write(f"{dev} {t}\n")

    for t in start_load(stop, gemms, log_step):
        t.join()
    f.close()


def step_time_ab(backend, rates: list[float], seconds: float, period: float, counter_rate: float,
                 workdir: Path) -> dict:
    """Step time with the sampler on vs off (see --ab). Returns per rate the paired changes."""
    import subprocess

    log = workdir / "ab_steps.txt"
    log.unlink(missing_ok=True)
    child = subprocess.Popen([sys.executable, __file__, "--step-loop", str(log)])
    try:
        time.sleep(20.0)  # torch start-up, then power up to the cap
        windows = []  # (rate or 0 for off, t0, t1)
        t0 = time.time()
        for rate in rates:
            for _ in range(max(1, int(seconds / (2 * period)))):
                w0 = time.time()
                time.sleep(period)
                windows.append((0.0, w0, time.time()))
                with T.Sampler(backend, rate_hz=rate, counter_rate_hz=counter_rate):
                    w0 = time.time()
                    time.sleep(period)
                    windows.append((rate, w0, time.time()))
            w0 = time.time()
            time.sleep(period)
            windows.append((0.0, w0, time.time()))
    finally:
        child.terminate()
        child.wait(timeout=60)
    steps: dict[int, list[float]] = {}
    for line in log.read_text().splitlines():
        d, t = line.split()
        steps.setdefault(int(d), []).append(float(t))
    out = {"period_s": period, "started": t0, "gpus": sorted(steps), "rates": {},
           "windows": [list(w) for w in windows], "steps_file": log.name}
    for rate in rates:
        changes = []
        for g, ts in steps.items():
            ts = np.array(ts)
            dt, end = np.diff(ts), ts[1:]

            def med(w):  # median step time of the steps that ended inside window w
                m = (end > w[1]) & (end <= w[2])
                return float(np.median(dt[m])) if m.sum() >= 3 else None

            for k, w in enumerate(windows):
                if w[0] != rate or k == 0 or k + 1 >= len(windows):
                    continue
                on, before, after = med(w), med(windows[k - 1]), med(windows[k + 1])
                if None not in (on, before, after):
                    off = (before + after) / 2
                    changes.append(100.0 * (on - off) / off)
        c = np.array(changes)
        out["rates"][f"{rate:g}"] = {
            "pairs": len(c), "mean_change_pct": float(c.mean()) if len(c) else None,
            "stderr_pct": float(c.std(ddof=1) / np.sqrt(len(c))) if len(c) > 1 else None,
            "median_step_s": float(np.median(np.concatenate([np.diff(v) for v in steps.values()])))}
    return out


def check_trace(trace: T.Trace) -> dict:
    out = {}
    for d in trace.devices:
        c = trace.columns[d.uuid]
        dec = {k: int(np.sum(np.diff(c[k][~np.isnan(c[k])]) < 0)) for k in T.COUNTER_FIELDS}
        s = T.summarize(trace, float(c["t"][0]), float(c["t"][-1]))["devices"][d.uuid]
        e_counter = T._counter_delta(c["t"], c["energy_j"], [(c["t"][0], c["t"][-1])])
        tmp = dict(c, energy_j=np.full_like(c["t"], np.nan))
        e_trap = T._energy(tmp, [(c["t"][0], c["t"][-1])])[0]
        out[d.uuid] = {
            "none_fraction": {k: float(np.mean(np.isnan(c[k]))) for k in T.SAMPLE_FIELDS},
            "counter_decreases": {k: v for k, v in dec.items() if v},
            "energy_counter_j": e_counter, "energy_trapezoid_j": e_trap,
            "energy_ratio_counter_over_trapezoid": e_counter / e_trap if e_counter and e_trap else None,
            "mean_power_w": s["mean_power_w"], "peak_power_w": s["peak_power_w"],
            "max_gpu_temp_c": s["max_gpu_temp_c"], "max_mem_temp_c": s["max_mem_temp_c"],
            "min_sm_clock_mhz": s["min_sm_clock_mhz"], "throttle_fractions": s["throttle_fractions"],
            "power_violation_s": s["power_violation_s"], "thermal_violation_s": s["thermal_violation_s"],
            "sw_thermal_slowdown_s": s["sw_thermal_slowdown_s"], "hw_power_brake_s": s["hw_power_brake_s"],
            "pcie_tx_bytes": s["pcie_tx_bytes"], "nvlink_tx_bytes": s["nvlink_tx_bytes"],
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rates", default="20,100")
    ap.add_argument("--counter-rate", type=float, default=1.0, help="Hz for the cumulative counters")
    ap.add_argument("--backend", default="auto", choices=["auto", "nvml", "amd", "fake"])
    ap.add_argument("--load", choices=["none", "process", "thread"], default="none",
                    help="bf16 GEMMs on every GPU (torch) in a child process, or in threads of this "
                         "process (the sampler then competes for the GIL, as inside a trainer)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--ab", type=float, default=0.0, metavar="SECONDS",
                    help="step-time A/B: sampler on vs off, SECONDS per rate (needs torch and GPUs)")
    ap.add_argument("--ab-period", type=float, default=3.0, help="seconds per on / off window")
    ap.add_argument("--step-loop", help=argparse.SUPPRESS)
    ap.add_argument("--burn-forever", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.burn_forever:
        burn_forever()
        return 0
    if args.step_loop:
        step_loop(args.step_loop)
        return 0

    backend = T.FakeBackend(8) if args.backend == "fake" else T.open_backend(args.backend)
    if backend is None:
        print("NO GPU TELEMETRY HERE: running against FakeBackend (8 synthetic GPUs); "
              "the numbers below measure this code's Python cost only, not NVML's")
        backend = T.FakeBackend(8)
    report: dict = {"backend": backend.name, "driver_version": backend.driver_version,
                    "devices": [d.__dict__ for d in backend.devices()], "runs": {}}
    print(f"backend {backend.name}, driver {backend.driver_version}, {len(backend.devices())} GPUs")
    for d in backend.devices():
        print(f"  {d.index}: {d.uuid} {d.pci_bus_id} {d.name} limit={d.power_limit_w} W "
              f"slowdown={d.slowdown_temp_c} C max_op={d.max_operating_temp_c} C module={d.module_id}")

    if backend.name == "nvml":
        v = validate_nvml(backend)
        report["validation"] = v
        print(f"\nPOWER_INSTANT refresh ≈ {v['power_instant_refresh_s']} s, "
              f"energy counter refresh ≈ {v['energy_counter_refresh_s']} s")
        for uuid, dv in v["devices"].items():
            print(f"\n{uuid}")
            for k, how in dv["field_status"].items():
                print(f"  {k:24s} {how}")
            raw = {f: (r["nvmlReturn"], r["valueType"], r["ullVal"]) for f, r in dv["raw_fields"].items()}
            print("  raw fields (nvmlReturn, valueType, value):", raw)
            print("  ViolationStatus ns:", dv["violation_status_ns"])
            print("  latencyUsec:", dv["field_latency_us"])

    costs = report["call_cost_us"] = {"idle": call_costs_us(backend)} if backend.name == "nvml" else {}
    stop = threading.Event()
    load = start_load(stop) if args.load == "thread" else []
    child = start_load_process() if args.load == "process" else None
    if args.load != "none":
        time.sleep(8.0)  # torch start-up, then let power reach the cap
        if costs:
            costs["load"] = call_costs_us(backend)
    if costs:
        print("\nNVML call cost, device 0 (median µs):")
        for k in costs["idle"]:
            print(f"  {k:32s} " + "  ".join(f"{ph} {costs[ph][k]:9.1f}" for ph in costs))
    n_dev = len(backend.devices())
    print(f"\nsampling {n_dev} GPUs; counters at {args.counter_rate:g} Hz; µs are per sample of all GPUs")
    print(f"{'rate':>6} {'requested':>9} {'achieved':>8} {'missed':>6} {'µs/fast':>9} {'µs/counter':>10} "
          f"{'µs/mean':>9} {'thread CPU s':>12} {'CPU %':>6} {'in-call %':>9}")
    for rate in [float(r) for r in args.rates.split(",")]:
        with T.Sampler(backend, rate_hz=rate, counter_rate_hz=args.counter_rate) as s:
            time.sleep(args.seconds)
        m = s.trace.meta
        wall = m["t_stop"] - m["t_start"]
        us = lambda k: m[k] * 1e6 if m[k] is not None else float("nan")  # noqa: E731
        print(f"{rate:6.0f} {rate * args.seconds:9.0f} {m['n_ticks']:8d} {m['missed_ticks']:6d} "
              f"{us('overhead_per_fast_sample_s'):9.1f} {us('overhead_per_counter_sample_s'):10.1f} "
              f"{us('overhead_per_sample_s'):9.1f} {m['thread_cpu_s']:12.3f} "
              f"{100 * m['thread_cpu_s'] / wall:6.2f} {100 * m['overhead_fraction']:9.2f}")
        report["runs"][f"{rate:g}hz"] = {"meta": m, "checks": check_trace(s.trace)}
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            s.trace.save(args.out / f"trace_{rate:g}hz.json.gz")
    stop.set()
    for t in load:
        t.join()
    if child is not None:
        child.terminate()
        child.wait()

    last = list(report["runs"].values())[-1]["checks"]
    print("\nchecks on the last run (per GPU):")
    for uuid, c in last.items():
        none = [k for k, f in c["none_fraction"].items() if f == 1.0]
        ratio = c["energy_ratio_counter_over_trapezoid"]
        print(f"  {uuid}: peak {c['peak_power_w']} W, mean {c['mean_power_w'] and round(c['mean_power_w'], 1)} W, "
              f"energy counter/trapezoid {ratio and round(ratio, 4)}, max {c['max_gpu_temp_c']} C "
              f"(HBM {c['max_mem_temp_c']}), min SM {c['min_sm_clock_mhz']} MHz, "
              f"sw_power_cap {c['throttle_fractions'] and c['throttle_fractions']['sw_power_cap']}, "
              f"power violation {c['power_violation_s']} s, nvlink tx {c['nvlink_tx_bytes']} B; "
              f"decreasing counters: {c['counter_decreases'] or 'none'}; always None: {none or 'nothing'}")
    if args.ab > 0:
        if backend.name == "fake":
            print("\n--ab needs GPUs: skipped")
        else:
            rates = [float(r) for r in args.rates.split(",")]
            ab = report["step_time_ab"] = step_time_ab(backend, rates, args.ab, args.ab_period,
                                                       args.counter_rate, args.out or Path("."))
            print(f"\nstep time, sampler on vs off ({len(ab['gpus'])} GPUs, {args.ab_period:g} s windows, "
                  f"median step {ab['rates'][f'{rates[0]:g}']['median_step_s'] * 1e3:.1f} ms):")
            for r, v in ab["rates"].items():
                m, se = v["mean_change_pct"], v["stderr_pct"]
                print(f"  {r:>5} Hz: {'n/a' if m is None else f'{m:+.3f}%'} "
                      f"± {'n/a' if se is None else f'{se:.3f}%'} (standard error, {v['pairs']} window pairs x GPUs)")
    if args.out:
        (args.out / "telemetry_check.json").write_text(json.dumps(report, indent=1, default=str))
    backend.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
