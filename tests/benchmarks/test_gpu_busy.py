"""benchmarks/gpu_busy.py: the busy share of each GPU is the mean of the NVML samples taken
inside the timed window, and a host without a GPU samples nothing."""

from __future__ import annotations

import sys

from benchmark_run import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_busy import BusySampler, mean_busy  # noqa: E402


def test_the_busy_share_is_the_mean_of_the_samples_inside_the_window():
    samples = [(1.0, [100, 0]), (2.0, [50, 20]), (3.0, [30, 40]), (4.0, [0, 100])]
    assert mean_busy(samples, 2.0, 3.0) == [40.0, 30.0]  # the ends are inside
    assert mean_busy(samples, 0.0, 10.0) == [45.0, 40.0]
    assert mean_busy(samples, 5.0, 6.0) is None  # no sample in it: unknown, not 0


def test_without_a_gpu_nothing_is_sampled():
    with BusySampler(period_s=0.01) as sampler:
        pass
    assert sampler.samples == [] and sampler.busy(0.0, 1e12) is None
