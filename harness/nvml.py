"""NVML access (nvidia-ml-py): GPU facts for provenance and a background clock/throttle sampler.

Every function degrades to None when NVML is missing (no driver, CPU machine); the guards turn None
into the status "unavailable", never into "pass".
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


def _device_index() -> int:
    """NVML index of the GPU this process uses: the first CUDA_VISIBLE_DEVICES entry when numeric."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(visible) if visible.isdigit() else 0


def _handle():
    nv = _nvml()
    if nv is None:
        return None, None
    try:
        return nv, nv.nvmlDeviceGetHandleByIndex(_device_index())
    except Exception as exc:  # noqa: BLE001
        log.info("NVML has no device %d (%s)", _device_index(), exc)
        return None, None


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _try(func, *args):
    try:
        return func(*args)
    except Exception:  # noqa: BLE001 - a field a driver does not expose is recorded as None
        return None


def gpu_info() -> dict | None:
    """Name, driver, max/current clocks, power limit and temperature of the GPU; None without NVML."""
    nv, handle = _handle()
    if handle is None:
        return None
    power_limit = _try(nv.nvmlDeviceGetEnforcedPowerLimit, handle)
    return {
        "index": _device_index(),
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


def sample() -> dict | None:
    """One NVML sample: clock-event reason bits, SM/memory clock, temperature, power; None without NVML."""
    nv, handle = _handle()
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
    """Samples NVML every `interval_s` in a daemon thread while the `with` block runs.

    `samples` is None when NVML is unavailable, else a list with at least the start and end sample.
    """

    def __init__(self, interval_s: float = 0.025):
        self.interval_s = interval_s
        self.samples: list[dict] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "ThrottleSampler":
        first = sample()
        if first is None:
            return self
        self.samples = [first]
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            current = sample()
            if current is not None:
                self.samples.append(current)

    def __exit__(self, *exc) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        last = sample()
        if last is not None:
            self.samples.append(last)
        start = self.samples[0]["t"]
        for item in self.samples:  # seconds since the window began, easier to read in records
            item["t"] = round(item["t"] - start, 4)
