"""Telemetry's vocabulary, shared by the sampler (``telemetry``) and the backends (``telemetry_nvml``,
``telemetry_amd``): sample fields, clock-event reasons, device info, one sample, the backend protocol."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Protocol

__all__ = [
    "CLOCK_EVENT_REASONS", "THROTTLE_MASK", "SAMPLE_FIELDS", "COUNTER_FIELDS", "COLUMNS", "TelemetryUnavailable",
    "normalize_pci_bus_id", "DeviceInfo", "Sample", "Backend",
]

# NVML clock-event-reason bits (nvmlClocksEventReason*), named as in the summaries.
CLOCK_EVENT_REASONS: dict[str, int] = {
    "idle": 0x1,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
}
# Bits that mean "clocks are held down by power or temperature" (not idle, sync boost, app clocks).
THROTTLE_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80

# Everything a Sample carries besides its timestamp, in column order.
SAMPLE_FIELDS: tuple[str, ...] = (
    "power_w",                  # instantaneous board power, W (NVML field 186, scope GPU)
    "energy_j",                 # cumulative energy counter, J
    "gpu_temp_c",
    "mem_temp_c",               # HBM temperature (NVML field 82)
    "sm_clock_mhz",
    "mem_clock_mhz",
    "clock_event_reasons",      # bitmask, see CLOCK_EVENT_REASONS
    "power_violation_ns",       # cumulative time clocks were held by the power cap
    "thermal_violation_ns",     # cumulative time clocks were held by thermal policy
    "sw_thermal_slowdown_ns",   # cumulative (driver-branch-dependent NVML fields 251/269)
    "hw_thermal_slowdown_ns",   # cumulative (252/270)
    "hw_power_brake_ns",        # cumulative (253/271)
    "gpu_util_pct",
    "pcie_tx_bytes",            # cumulative
    "pcie_rx_bytes",
    "nvlink_tx_bytes",          # cumulative, summed over links
    "nvlink_rx_bytes",
)
COLUMNS: tuple[str, ...] = ("t",) + SAMPLE_FIELDS
COUNTER_FIELDS: tuple[str, ...] = ("energy_j", "power_violation_ns", "thermal_violation_ns", "sw_thermal_slowdown_ns",
             "hw_thermal_slowdown_ns", "hw_power_brake_ns", "pcie_tx_bytes", "pcie_rx_bytes",
             "nvlink_tx_bytes", "nvlink_rx_bytes")


class TelemetryUnavailable(RuntimeError):
    """The requested telemetry backend cannot run here; the message says why (one line)."""


def normalize_pci_bus_id(bus_id: str | bytes) -> str:
    """'0000:18:00.0', '18:00.0' or NVML's '00000000:18:00.0' -> '00000000:18:00.0' (upper-case hex)."""
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode()
    m = re.fullmatch(r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])",
                     bus_id.strip())
    if m is None:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    domain, bus, dev, fn = (int(g or "0", 16) for g in m.groups())
    return f"{domain:08X}:{bus:02X}:{dev:02X}.{fn}"


@dataclass(frozen=True)
class DeviceInfo:
    index: int                           # the backend's own index (NVML / amdsmi order), not CUDA's
    uuid: str                            # NVIDIA "GPU-…"; AMD: amdsmi's UUID
    pci_bus_id: str | None               # normalized "00000000:18:00.0"; None only in old recordings
    name: str
    power_limit_w: float | None = None   # enforced limit
    slowdown_temp_c: float | None = None  # HW slowdown threshold (AMD: hotspot CRITICAL)
    max_operating_temp_c: float | None = None  # SW thermal slowdown target (NVML GPU_MAX)
    module_id: int | None = None         # baseboard module id (nvmlDeviceGetModuleId)


@dataclass(slots=True)
class Sample:
    """One reading of one device. Unsupported values are None, never zero; so are counters in a
    reading taken with ``counters=False``."""

    t: float
    power_w: float | None = None
    energy_j: float | None = None
    gpu_temp_c: float | None = None
    mem_temp_c: float | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    clock_event_reasons: int | None = None
    power_violation_ns: float | None = None
    thermal_violation_ns: float | None = None
    sw_thermal_slowdown_ns: float | None = None
    hw_thermal_slowdown_ns: float | None = None
    hw_power_brake_ns: float | None = None
    gpu_util_pct: float | None = None
    pcie_tx_bytes: float | None = None
    pcie_rx_bytes: float | None = None
    nvlink_tx_bytes: float | None = None
    nvlink_rx_bytes: float | None = None


class Backend(Protocol):
    name: str
    driver_version: str | None
    clock: Callable[[], float]           # the clock Sample.t uses (time.time for real devices)

    def devices(self) -> list[DeviceInfo]: ...
    def read(self, i: int, counters: bool = True) -> Sample: ...  # i = position in devices()
    def field_status(self) -> dict[str, dict[str, str]]: ...  # uuid -> field -> how it is read
    def close(self) -> None: ...
