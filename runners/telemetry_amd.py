"""AMD SMI telemetry backend (the optional ``amdsmi`` package plus ROCm's ``libamd_smi.so``).

Same Sample shape as NVML. Each reading is validated once when the backend opens; what fails reads
None. Mapping (not verified on AMD hardware here):

- power_w: ``amdsmi_get_power_info`` ``current_socket_power`` (instantaneous, MI300) if it is a
  number, else ``average_socket_power`` (MI2xx; an average, so peaks are underestimated);
  ``field_status()`` says which.
- energy_j: ``amdsmi_get_energy_count`` accumulator × ``counter_resolution`` (µJ).
- gpu_temp_c / mem_temp_c: ``amdsmi_get_temp_metric`` HOTSPOT / VRAM, CURRENT (values above 1000
  are taken as millidegrees, since ROCm versions differ).
- clocks: ``amdsmi_get_clock_info`` GFX / MEM; utilization: ``amdsmi_get_gpu_activity`` gfx.
- throttling, MI300+: ``amdsmi_get_violation_status``: ``active_ppt_pwr`` -> bit 0x4 (power cap),
  ``active_prochot_thrm`` -> 0x20, ``active_socket/hbm/vr_thrm`` -> 0x40. The accumulators are
  counts, not time: power_violation_ns / thermal_violation_ns are built here as
  sum(Δacc_ppt_pwr / Δacc_counter × Δwall time) (resp. acc_socket_thrm, AMD's TVIOL) from the
  first reading on, so they are cumulative ns like NVML's but start at 0 when the backend opens.
- throttling, older ASICs: gpu_metrics ``indep_throttle_status`` bits 0-7 (power) -> 0x4,
  16-23 (current) -> 0x8, 32-47 (temperature) -> 0x20; violation ns are None.
- PCIe / xGMI byte counters: None (the gpu_metrics accumulators' units are not pinned down).
"""
from __future__ import annotations

import time
from typing import Any, Callable

from .telemetry_types import DeviceInfo, Sample, TelemetryUnavailable, normalize_pci_bus_id


def _num(v: Any) -> float | None:
    """amdsmi reports unsupported values as the string "N/A"."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _temp(v: Any) -> float | None:
    v = _num(v)
    return None if v is None else (v / 1000.0 if v > 1000 else v)


def _err(e: Exception) -> str:
    """One line: amdsmi's AmdSmiLibraryException prints "Error code:\\n\\t<code> | <info>" (ROCm 6.x)."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


class AmdSmiBackend:
    name = "amdsmi"

    def __init__(self):
        try:
            import amdsmi
        except Exception as e:  # ImportError, or the wrapper failing to load libamd_smi.so
            raise TelemetryUnavailable(
                f"amdsmi is not usable ({_err(e)}); needs the 'amd' extra and ROCm's libamd_smi.so") from None
        self.smi = smi = amdsmi
        self.clock: Callable[[], float] = time.time
        try:
            smi.amdsmi_init()
        except Exception as e:
            raise TelemetryUnavailable(f"amdsmi_init failed: {_err(e)}") from None
        try:
            self._handles = list(smi.amdsmi_get_processor_handles())
            if not self._handles:
                raise TelemetryUnavailable("amdsmi found no AMD GPU")
            self.driver_version = self._optional(
                lambda: smi.amdsmi_get_gpu_driver_info(self._handles[0])["driver_version"])
            self._devices = [self._info(i, h) for i, h in enumerate(self._handles)]
            self._viol_state: list[dict[str, float] | None] = [None] * len(self._handles)
            self._plans = [self._validate(i, h) for i, h in enumerate(self._handles)]
        except TelemetryUnavailable:
            smi.amdsmi_shut_down()
            raise
        except Exception as e:
            smi.amdsmi_shut_down()
            raise TelemetryUnavailable(f"amdsmi device setup failed: {_err(e)}") from None

    def _optional(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception:
            return None

    def _info(self, i: int, h) -> DeviceInfo:
        smi = self.smi
        cap_uw = self._optional(lambda: _num(smi.amdsmi_get_power_cap_info(h)["power_cap"]))
        return DeviceInfo(
            index=i, uuid=str(smi.amdsmi_get_gpu_device_uuid(h)),
            pci_bus_id=normalize_pci_bus_id(smi.amdsmi_get_gpu_device_bdf(h)),
            name=str(self._optional(lambda: smi.amdsmi_get_gpu_asic_info(h)["market_name"]) or "AMD GPU"),
            power_limit_w=cap_uw / 1e6 if cap_uw is not None else None,
            slowdown_temp_c=self._optional(lambda: _temp(smi.amdsmi_get_temp_metric(
                h, smi.AmdSmiTemperatureType.HOTSPOT, smi.AmdSmiTemperatureMetric.CRITICAL))),
            max_operating_temp_c=None, module_id=None)

    def devices(self) -> list[DeviceInfo]:
        return list(self._devices)

    # -- validation ---------------------------------------------------------------------------
    def _validate(self, i: int, h) -> dict[str, Any]:
        smi = self.smi
        T, M, C = smi.AmdSmiTemperatureType, smi.AmdSmiTemperatureMetric, smi.AmdSmiClkType
        status: dict[str, str] = {}
        calls: dict[str, Callable] = {}

        power = self._optional(lambda: smi.amdsmi_get_power_info(h)) or {}
        key = next((k for k in ("current_socket_power", "average_socket_power")
                    if _num(power.get(k)) is not None), None)
        candidates: dict[str, tuple[str, Callable]] = {
            "energy_j": ("amdsmi_get_energy_count (accumulator × resolution µJ)", self._energy),
            "gpu_temp_c": ("amdsmi_get_temp_metric HOTSPOT",
                           lambda h: _temp(smi.amdsmi_get_temp_metric(h, T.HOTSPOT, M.CURRENT))),
            "mem_temp_c": ("amdsmi_get_temp_metric VRAM",
                           lambda h: _temp(smi.amdsmi_get_temp_metric(h, T.VRAM, M.CURRENT))),
            "sm_clock_mhz": ("amdsmi_get_clock_info GFX", lambda h: _clk(smi.amdsmi_get_clock_info(h, C.GFX))),
            "mem_clock_mhz": ("amdsmi_get_clock_info MEM", lambda h: _clk(smi.amdsmi_get_clock_info(h, C.MEM))),
            "gpu_util_pct": ("amdsmi_get_gpu_activity gfx",
                             lambda h: _num(smi.amdsmi_get_gpu_activity(h)["gfx_activity"])),
        }
        if key is not None:
            how = "instantaneous" if key == "current_socket_power" else "average: peaks underestimated"
            candidates["power_w"] = (f"amdsmi_get_power_info {key} ({how})",
                                     lambda h: _num(smi.amdsmi_get_power_info(h)[key]))
        else:
            status["power_w"] = "unsupported (no numeric current/average_socket_power)"
        for name, (how, fn) in candidates.items():
            try:
                ok = fn(h) is not None
                err = "N/A"
            except Exception as e:
                ok, err = False, _err(e)
            if ok:
                calls[name] = fn
                status[name] = how
            else:
                status[name] = f"unsupported ({err})"

        viol = self._optional(lambda: smi.amdsmi_get_violation_status(h)) or {}
        metrics = self._optional(lambda: smi.amdsmi_get_gpu_metrics_info(h)) or {}
        if _num(viol.get("acc_counter")) is not None and _num(viol.get("acc_ppt_pwr")) is not None:
            throttle = "violation"
            status["clock_event_reasons"] = "amdsmi_get_violation_status active_* flags"
            for name, acc in (("power_violation_ns", "acc_ppt_pwr"), ("thermal_violation_ns", "acc_socket_thrm")):
                status[name] = f"amdsmi_get_violation_status {acc}/acc_counter × wall time (from open)"
        elif _num(metrics.get("indep_throttle_status")) is not None:
            throttle = "metrics"
            status["clock_event_reasons"] = "gpu_metrics indep_throttle_status (mapped to NVML bits)"
        else:
            throttle = None
            status["clock_event_reasons"] = "unsupported"
        for name in ("power_violation_ns", "thermal_violation_ns"):
            status.setdefault(name, "unsupported (needs amdsmi_get_violation_status, MI300+)")
        for name in ("sw_thermal_slowdown_ns", "hw_thermal_slowdown_ns", "hw_power_brake_ns",
                     "pcie_tx_bytes", "pcie_rx_bytes", "nvlink_tx_bytes", "nvlink_rx_bytes"):
            status[name] = "unsupported on the AMD backend"
        return {"calls": calls, "throttle": throttle, "status": status}

    def field_status(self) -> dict[str, dict[str, str]]:
        return {d.uuid: dict(p["status"]) for d, p in zip(self._devices, self._plans)}

    # -- sampling -----------------------------------------------------------------------------
    def _energy(self, h) -> float | None:
        e = self.smi.amdsmi_get_energy_count(h)
        acc = e.get("energy_accumulator", e.get("power"))  # the key was "power" before amdsmi 6.2.1
        acc, res = _num(acc), _num(e.get("counter_resolution"))
        return acc * res * 1e-6 if acc is not None and res is not None else None

    def read(self, i: int, counters: bool = True) -> Sample:
        """``counters=False`` skips the energy counter. The violation accumulators are read every
        time, because the throttle bits come from the same call, but the violation ns they give
        are left out of such a reading (None), as every counter is (Sample's contract)."""
        h, plan = self._handles[i], self._plans[i]
        s = Sample(t=self.clock())
        for name, fn in plan["calls"].items():
            if counters or name != "energy_j":
                setattr(s, name, fn(h))
        if plan["throttle"] == "violation":
            self._read_violation(i, h, s)
            if not counters:
                s.power_violation_ns = s.thermal_violation_ns = None
        elif plan["throttle"] == "metrics":
            bits = _num(self.smi.amdsmi_get_gpu_metrics_info(h).get("indep_throttle_status"))
            if bits is not None:
                b = int(bits)
                s.clock_event_reasons = ((0x4 if b & 0xFF else 0) | (0x8 if b & (0xFF << 16) else 0)
                                         | (0x20 if b & (0xFFFF << 32) else 0))
        return s

    def _read_violation(self, i: int, h, s: Sample) -> None:
        v = self.smi.amdsmi_get_violation_status(h)
        active = lambda k: v.get(k) is True or bool(_num(v.get(k)))  # noqa: E731  (bool, int or "N/A")
        hw_thermal = any(active(k) for k in ("active_socket_thrm", "active_hbm_thrm", "active_vr_thrm"))
        s.clock_event_reasons = ((0x4 if active("active_ppt_pwr") else 0)
                                 | (0x20 if active("active_prochot_thrm") else 0)
                                 | (0x40 if hw_thermal else 0))
        acc, ppt, thm = (_num(v.get(k)) for k in ("acc_counter", "acc_ppt_pwr", "acc_socket_thrm"))
        prev = self._viol_state[i]
        now = {"t": s.t, "acc": acc, "ppt": ppt, "thm": thm,
               "ppt_ns": 0.0 if prev is None else prev["ppt_ns"],
               "thm_ns": 0.0 if prev is None else prev["thm_ns"]}
        if prev is not None and None not in (acc, prev["acc"]) and acc > prev["acc"]:
            dt_ns = (s.t - prev["t"]) * 1e9
            for key in ("ppt", "thm"):
                if None not in (now[key], prev[key]):
                    now[key + "_ns"] += (now[key] - prev[key]) / (acc - prev["acc"]) * dt_ns
        self._viol_state[i] = now
        s.power_violation_ns = now["ppt_ns"] if ppt is not None else None
        s.thermal_violation_ns = now["thm_ns"] if thm is not None else None

    def close(self) -> None:
        if self._handles is not None:
            self._handles = None
            self.smi.amdsmi_shut_down()

    def __enter__(self) -> AmdSmiBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _clk(info: dict[str, Any]) -> float | None:
    return _num(info.get("clk", info.get("cur_clk")))
