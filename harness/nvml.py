"""NVML access (nvidia-ml-py): GPU facts for provenance and a background clock/throttle sampler.

Every function degrades to None when NVML is missing (no driver, CPU machine); the guards turn None
into the status "unavailable", never into "pass". A device is named the way CUDA_VISIBLE_DEVICES
names it (an NVML index, or a "GPU-..." UUID); `engine_devices(tp)` lists the ones a TP engine uses.
"""

from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger(__name__)

_lock = threading.Lock()
_initialized: bool | None = None


def _nvml():
    """The pynvml module with NVML initialized, or None when unavailable (checked once per process)."""
    global _initialized
    with _lock:
        if _initialized is False:
            return None
        try:
            import pynvml

            if not _initialized:
                pynvml.nvmlInit()
                _initialized = True
            return pynvml
        except Exception as exc:  # noqa: BLE001 - any NVML failure means "unavailable"
            log.info("NVML unavailable (%s); throttle guard will be recorded as unavailable", exc)
            _initialized = False
            return None


def engine_devices(tensor_parallel_size: int = 1) -> list[int | str]:
    """NVML names of the GPUs a TP engine uses: rank r runs on CUDA device r, the r-th visible entry.

    Entries of CUDA_VISIBLE_DEVICES are NVML indices or UUIDs; without the variable, CUDA device r is
    taken to be NVML index r (vLLM's and NVML's PCI-bus order agree on a host of identical GPUs).
    """
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = [item.strip() for item in raw.split(",") if item.strip()] if raw is not None else []
    if raw is None or not entries:
        return list(range(tensor_parallel_size))
    return [int(item) if item.isdigit() else item for item in entries[:tensor_parallel_size]]


def _device_index() -> int | str:
    """The GPU a single-GPU engine uses (the first visible device)."""
    devices = engine_devices(1)
    return devices[0] if devices else 0


def _handle(device: int | str | None = None):
    nv = _nvml()
    if nv is None:
        return None, None
    device = _device_index() if device is None else device
    try:
        if isinstance(device, str):
            return nv, nv.nvmlDeviceGetHandleByUUID(device)
        return nv, nv.nvmlDeviceGetHandleByIndex(device)
    except Exception as exc:  # noqa: BLE001
        log.info("NVML has no device %s (%s)", device, exc)
        return None, None


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _try(func, *args):
    try:
        return func(*args)
    except Exception:  # noqa: BLE001 - a field a driver does not expose is recorded as None
        return None


def gpu_info(device: int | str | None = None) -> dict | None:
    """Name, driver, max/current clocks, power limit and temperature of a GPU; None without NVML."""
    nv, handle = _handle(device)
    if handle is None:
        return None
    power_limit = _try(nv.nvmlDeviceGetEnforcedPowerLimit, handle)
    return {
        "index": _device_index() if device is None else device,
        "uuid": _text(_try(nv.nvmlDeviceGetUUID, handle)),
        "name": _text(_try(nv.nvmlDeviceGetName, handle)),
        "driver": _text(_try(nv.nvmlSystemGetDriverVersion)),
        "cuda_driver": _try(nv.nvmlSystemGetCudaDriverVersion_v2),
        "sm_clock_max_mhz": _try(nv.nvmlDeviceGetMaxClockInfo, handle, nv.NVML_CLOCK_SM),
        "mem_clock_max_mhz": _try(nv.nvmlDeviceGetMaxClockInfo, handle, nv.NVML_CLOCK_MEM),
        "sm_clock_mhz": _try(nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_SM),
        "mem_clock_mhz": _try(nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_MEM),
        "power_limit_w": None if power_limit is None else power_limit / 1000.0,
        "temperature_c": _try(nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU),
        "persistence_mode": _try(nv.nvmlDeviceGetPersistenceMode, handle),
    }


def _event_reasons(nv, handle) -> int | None:
    getter = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        nv, "nvmlDeviceGetCurrentClocksThrottleReasons"
    )
    return _try(getter, handle)


def gpu_infos(devices: list[int | str]) -> dict[str, dict | None]:
    """gpu_info of each device, keyed by str(device) (JSON keys)."""
    return {str(device): gpu_info(device) for device in devices}


def sample(device: int | str | None = None) -> dict | None:
    """One NVML sample: clock-event reason bits, SM/memory clock, temperature, power; None without NVML."""
    nv, handle = _handle(device)
    if handle is None:
        return None
    power = _try(nv.nvmlDeviceGetPowerUsage, handle)
    return {
        "t": time.monotonic(),
        "reasons": _event_reasons(nv, handle),
        "sm_mhz": _try(nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_SM),
        "mem_mhz": _try(nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_MEM),
        "temp_c": _try(nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU),
        "power_w": None if power is None else power / 1000.0,
    }


class ThrottleSampler:
    """Samples NVML on every device in `devices` each `interval_s` in a daemon thread during the `with` block.

    `by_device` maps str(device) to its samples (at least the start and end sample), or is None when
    NVML is unavailable; a device NVML cannot read maps to None. `samples` is the first device's list.
    `devices=None` samples the process's own GPU (one engine rank in this process).
    """

    def __init__(self, interval_s: float = 0.025, devices: list[int | str] | None = None):
        self.interval_s = interval_s
        self._targets = [(str(d), d) for d in devices] if devices else [(str(_device_index()), None)]
        self.by_device: dict[str, list[dict] | None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def samples(self) -> list[dict] | None:
        return None if self.by_device is None else self.by_device[self._targets[0][0]]

    @staticmethod
    def _sample(device):
        return sample() if device is None else sample(device)

    def _take(self) -> None:
        for key, device in self._targets:
            series, current = self.by_device[key], self._sample(device)
            if series is not None and current is not None:
                series.append(current)

    def __enter__(self) -> "ThrottleSampler":
        first = {key: self._sample(device) for key, device in self._targets}
        if all(item is None for item in first.values()):
            return self
        self.by_device = {key: None if item is None else [item] for key, item in first.items()}
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._take()

    def __exit__(self, *exc) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._take()
        for series in self.by_device.values():
            if not series:
                continue
            start = series[0]["t"]
            for item in series:  # seconds since the window began, easier to read in records
                item["t"] = round(item["t"] - start, 4)
