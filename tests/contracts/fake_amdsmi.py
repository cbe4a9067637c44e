"""A stand-in for the ``amdsmi`` module (ROCm's AMD SMI Python interface) in front of synthetic
GPUs, for the telemetry contract on CPU.

The GPUs are a ``FakeBackend`` (its docstring is their physics); this module speaks AMD SMI to
them as the ROCm 6.x interface does (amdsmi_interface.py / amdsmi_exception.py / amd_smi.h):

- errors are ``AmdSmiLibraryException(err_code)`` with ``err_code`` / ``err_info`` and the 6.x
  two-line ``str`` ("Error code:\\n\\t2 | AMDSMI_STATUS_NOT_SUPPORTED - ..."); status codes as in
  amd_smi.h (NOT_SUPPORTED 2, INIT_ERROR 18);
- dict results, with ``"N/A"`` for a value the ASIC does not report;
- units: socket power in W (MI300 ``current_socket_power``), the power cap in µW, temperatures
  in °C, clocks in MHz, activity in %, energy as an accumulator of ``counter_resolution`` µJ
  ticks (15.259 µJ on MI300), violation status as firmware-sample accumulators (``acc_counter``
  one per ms here, ``acc_ppt_pwr`` the samples spent at the power limit) and ``active_*`` flags;
- a field the synthetic GPU lacks answers NOT_SUPPORTED (or "N/A" where the interface does);
- ``lost=True`` makes every device call raise (the device is gone).
"""
from __future__ import annotations

import types

AMDSMI_STATUS_NOT_SUPPORTED = 2
AMDSMI_STATUS_INIT_ERROR = 18
ERR_INFO = {AMDSMI_STATUS_NOT_SUPPORTED: "AMDSMI_STATUS_NOT_SUPPORTED - Feature not supported",
            AMDSMI_STATUS_INIT_ERROR: "AMDSMI_STATUS_INIT_ERROR - Initialization error"}
ENERGY_RESOLUTION_UJ = 15.259
FIRMWARE_SAMPLE_S = 1e-3
NA = "N/A"


class AmdSmiException(Exception):
    """Base smi exception class"""


class AmdSmiLibraryException(AmdSmiException):
    def __init__(self, err_code):
        err_code = abs(err_code)
        super().__init__(err_code)
        self.err_code = err_code
        self.err_info = ERR_INFO.get(err_code, "AMDSMI_STATUS_UNKNOWN_ERROR - An unknown error occurred")

    def __str__(self):
        return "Error code:\n\t{err_code} | {err_info}".format(err_code=self.err_code, err_info=self.err_info)


class FakeAmdSmi:
    """The library state: init count, the synthetic GPUs, and whether the devices are gone."""

    def __init__(self, gpus, market_name: str = "AMD Instinct MI300X"):
        self.gpus, self.market_name = gpus, market_name
        self.inits = self.shutdowns = 0
        self.lost = False
        self.init_error: int | None = None

    def _sample(self, h: int):
        if self.lost:
            raise AmdSmiLibraryException(AMDSMI_STATUS_INIT_ERROR)
        return self.gpus.read(h)

    def _value(self, h: int, field: str, na: bool = False):
        v = getattr(self._sample(h), field)
        if v is None:
            if na:
                return NA
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        return int(round(v))

    def module(self) -> types.ModuleType:
        """A module object to put in ``sys.modules["amdsmi"]``."""
        m = types.ModuleType("amdsmi")
        m.AmdSmiException, m.AmdSmiLibraryException = AmdSmiException, AmdSmiLibraryException
        m.AmdSmiTemperatureType = types.SimpleNamespace(EDGE=0, HOTSPOT=1, VRAM=2)
        m.AmdSmiTemperatureMetric = types.SimpleNamespace(CURRENT=0, CRITICAL=5)
        m.AmdSmiClkType = types.SimpleNamespace(GFX=0, MEM=2)
        info = self.gpus.devices

        def init(flags=None):
            if self.init_error is not None:
                raise AmdSmiLibraryException(self.init_error)
            self.inits += 1

        def shut_down():
            self.shutdowns += 1

        def temp(h, sensor, metric):
            if metric == m.AmdSmiTemperatureMetric.CRITICAL:
                return int(info()[h].slowdown_temp_c)
            field = {m.AmdSmiTemperatureType.HOTSPOT: "gpu_temp_c", m.AmdSmiTemperatureType.VRAM: "mem_temp_c"}
            return self._value(h, field[sensor])

        def power(h):
            w = self._value(h, "power_w", na=True)
            return {"current_socket_power": w, "average_socket_power": NA, "gfx_voltage": NA,
                    "soc_voltage": NA, "mem_voltage": NA, "power_limit": int(info()[h].power_limit_w)}

        def energy(h):
            s = self._sample(h)
            if s.energy_j is None:
                raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
            return {"energy_accumulator": int(s.energy_j / (ENERGY_RESOLUTION_UJ * 1e-6)),
                    "counter_resolution": ENERGY_RESOLUTION_UJ, "timestamp": int(s.t * 1e9)}

        def clock(h, kind):
            v = self._value(h, "sm_clock_mhz" if kind == m.AmdSmiClkType.GFX else "mem_clock_mhz")
            return {"clk": v, "min_clk": 500, "max_clk": 2100, "clk_locked": NA, "clk_deep_sleep": NA}

        def violation(h):
            s = self._sample(h)
            if s.power_violation_ns is None or s.clock_event_reasons is None:
                raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
            tau = max(0.0, s.t - self.gpus.t_start)
            return {"reference_timestamp": int(s.t * 1e6), "violation_timestamp": int(s.t * 1e6),
                    "acc_counter": int(tau / FIRMWARE_SAMPLE_S),
                    "acc_ppt_pwr": int(s.power_violation_ns * 1e-9 / FIRMWARE_SAMPLE_S),
                    "acc_socket_thrm": int((s.thermal_violation_ns or 0.0) * 1e-9 / FIRMWARE_SAMPLE_S),
                    "acc_prochot_thrm": 0, "acc_vr_thrm": 0, "acc_hbm_thrm": 0,
                    "active_ppt_pwr": bool(s.clock_event_reasons & 0x4), "active_socket_thrm": False,
                    "active_prochot_thrm": False, "active_vr_thrm": False, "active_hbm_thrm": False,
                    "per_ppt_pwr": NA, "per_socket_thrm": NA}

        m.amdsmi_init, m.amdsmi_shut_down = init, shut_down
        m.amdsmi_get_processor_handles = lambda: list(range(len(info())))
        m.amdsmi_get_gpu_driver_info = lambda h: {"driver_name": "amdgpu", "driver_version": "6.10.5",
                                                  "driver_date": "2025/01/01 00:00"}
        m.amdsmi_get_gpu_device_uuid = lambda h: info()[h].uuid.removeprefix("GPU-")
        m.amdsmi_get_gpu_device_bdf = lambda h: info()[h].pci_bus_id[4:].lower()  # "0000:18:00.0"
        m.amdsmi_get_gpu_asic_info = lambda h: {"market_name": self.market_name, "vendor_id": "0x1002"}
        m.amdsmi_get_power_cap_info = lambda h: {"power_cap": int(info()[h].power_limit_w * 1e6)}
        m.amdsmi_get_temp_metric = temp
        m.amdsmi_get_power_info = power
        m.amdsmi_get_energy_count = energy
        m.amdsmi_get_clock_info = clock
        m.amdsmi_get_gpu_activity = lambda h: {"gfx_activity": self._value(h, "gpu_util_pct", na=True),
                                               "umc_activity": NA, "mm_activity": NA}
        m.amdsmi_get_violation_status = violation
        m.amdsmi_get_gpu_metrics_info = lambda h: {"indep_throttle_status": NA, "throttle_status": NA}
        return m
