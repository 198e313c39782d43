"""The share of time each GPU was running a kernel, sampled from NVML while a benchmark's run
goes (nvidia-smi's "utilization.gpu": over each sample period, the fraction with a kernel
active). Inactive where pynvml or a GPU is missing: busy() is then None."""

from __future__ import annotations

import threading
import time


class BusySampler:
    """with BusySampler() as sampler: ...; sampler.busy(t0, t1) -> [mean % per GPU] between
    two time.monotonic() instants, or None."""

    def __init__(self, period_s: float = 0.5):
        self.period_s = period_s
        self.samples: list[tuple[float, list[int]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handles = []
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._nvml = pynvml
        except Exception:  # no pynvml, no driver, no GPU: nothing to sample
            self._handles = []

    def __enter__(self) -> BusySampler:
        if self._handles:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            rates = [self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles]
            self.samples.append((time.monotonic(), rates))

    def busy(self, start: float, end: float) -> list[float] | None:
        return mean_busy(self.samples, start, end)


def mean_busy(samples: list[tuple[float, list[int]]], start: float, end: float):
    """Mean of each GPU's samples taken in [start, end]; None when there are none."""
    inside = [rates for t, rates in samples if start <= t <= end]
    if not inside:
        return None
    return [sum(column) / len(inside) for column in zip(*inside)]
