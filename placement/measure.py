"""``advisor thermal-profile``: measure every GPU slot of this node under the same load.

Idle for ``idle_s`` (first power level), then one GEMM burn process per GPU, all at once, for
``seconds`` (second power level), then ``cool_s`` of cool-down, while the telemetry Sampler
records. Each GPU's two-time-constant thermal model is fitted on the whole trace
(profile.fit_thermal); the delivered TFLOP/s and the power/thermal throttle fractions are kept.
"""
from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from advisor.placement.profile import NodeProfile, ProfileError, profile_from_dict, profile_from_trace


def _open_nvml():
    try:
        from advisor.runners.telemetry import TelemetryUnavailable, open_backend
    except ImportError as e:
        raise ProfileError(f"thermal-profile needs advisor.runners.telemetry ({e})") from None
    try:
        return open_backend("nvml")
    except TelemetryUnavailable as e:
        raise ProfileError(f"thermal-profile needs NVML on an NVIDIA GPU node: {e}") from None


def _preflight() -> None:
    if importlib.util.find_spec("torch") is None:
        raise ProfileError("thermal-profile needs torch with CUDA for the GEMM burn (pip install 'advisor[gpu]')")
    r = subprocess.run([sys.executable, "-c", "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 3)"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode:
        raise ProfileError("thermal-profile needs torch with CUDA: torch.cuda.is_available() is False here")


def measure_profile(seconds: float = 300.0, node: str | None = None, idle_s: float = 15.0, cool_s: float = 30.0,
                    rate_hz: float = 2.0, trace_out: str | Path | None = None) -> NodeProfile:
    if seconds < 30:
        raise ProfileError(f"--seconds must be at least 30 (temperatures settle in ~60 s), got {seconds:g}")
    _preflight()
    from advisor.runners.telemetry import Sampler

    backend = _open_nvml()
    devices = backend.devices()
    node = node or socket.gethostname()
    procs = []
    try:
        with Sampler(backend, rate_hz=rate_hz) as sampler:
            time.sleep(idle_s)
            t_burn = backend.clock()
            for d in devices:
                env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=d.uuid)
                procs.append(subprocess.Popen([sys.executable, "-m", "advisor.placement.burn", str(seconds)],
                                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            outs = [p.communicate(timeout=seconds + 300) for p in procs]
            t_done = backend.clock()
            time.sleep(cool_s)
        trace = sampler.trace
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        backend.close()
    results = {}
    for d, p, (out, err) in zip(devices, procs, outs):
        if p.returncode:
            last = (err.strip().splitlines() or ["no output"])[-1]
            raise ProfileError(f"burn on GPU {d.index} ({d.uuid}) failed: {last}")
        results[d.uuid] = json.loads(out.strip().splitlines()[-1])
    trace.meta["hostname"] = node
    if trace_out:
        trace.save(trace_out)
    prof = profile_from_trace(trace, node)
    best = max(r["tflops"] for r in results.values())
    from advisor.runners.telemetry import summarize

    during = summarize(trace, t_burn, t_done)["devices"]  # throttle counters over the burn
    gpus = []
    for g in prof.gpus:
        d = g.to_dict()
        d["gemm_tflops"] = round(results[g.uuid]["tflops"], 1)
        d["speed_at_cap"] = round(results[g.uuid]["tflops"] / best, 4)
        s = during.get(g.uuid, {})
        for k in ("power_violation_s", "thermal_violation_s", "sw_thermal_slowdown_s", "hw_thermal_slowdown_s",
                  "median_sm_clock_mhz", "mean_power_w", "max_gpu_temp_c"):
            if s.get(k) is not None:
                d["burn_" + k] = round(float(s[k]), 2)
        gpus.append(d)
    meta = dict(prof.meta, date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                driver_version=backend.driver_version, burn_seconds=seconds, idle_s=idle_s, cool_s=cool_s,
                rate_hz=rate_hz, gpu_name=devices[0].name if devices else None,
                source=f"advisor thermal-profile on {node}")
    return profile_from_dict({"node": node, "gpus": gpus, **meta}, f"profile of {node}")
