"""pdl.py's switches and the weight-prefetch budget of gemm.launch_options (CPU: the launch
keywords only; the kernels' PDL paths are compile-checked in test_kernel_compile.py and run
bitwise against plain launches on the GPU in test_kernels.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from hybridflow.engine.kernels import (
    gemm,  # noqa: E402
    pdl,
)


def test_pdl_is_off_for_cpu_tensors_and_inside_suspended():
    cpu = torch.empty(1)
    assert pdl.options(cpu) == {} and not pdl.enabled(cpu)
    with pdl.suspended():
        with pdl.suspended():
            assert pdl._suspended == 2
        assert pdl._suspended == 1
    assert pdl._suspended == 0


def test_pair_options_ignore_suspended_but_not_the_switch(monkeypatch):
    """shared_prefix's kernel pair links by PDL inside the paths that suspend it for the
    rest; ENABLED = False (A/B runs) still turns it off, and CPU tensors never get it."""
    from types import SimpleNamespace

    monkeypatch.setattr(pdl, "SUPPORTED", True)
    monkeypatch.setattr(pdl, "_device_supports", lambda index: True)
    gpu = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))
    on = {"PDL": True, "launch_pdl": True}
    with pdl.suspended():
        assert pdl.options(gpu) == {} and pdl.pair_options(gpu) == on
    assert pdl.options(gpu) == on
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.pair_options(gpu) == {} and pdl.options(gpu) == {}
    assert pdl.pair_options(torch.empty(1)) == {}


def test_suspended_restores_after_an_error():
    with pytest.raises(RuntimeError):
        with pdl.suspended():
            raise RuntimeError("boom")
    assert pdl._suspended == 0


@pytest.fixture
def pdl_on(monkeypatch):
    monkeypatch.setattr(pdl, "options", lambda tensor: {"PDL": True, "launch_pdl": True})
    monkeypatch.setattr(pdl, "PREFETCH_WEIGHTS", True)


@pytest.mark.parametrize("block_k", [32, 64, 128])
def test_small_weights_are_prefetched_whole(pdl_on, block_k):
    weight = torch.empty(1152, 896, dtype=torch.bfloat16)  # 2 MB, under the budget
    options = gemm.launch_options(torch.empty(4, 896), weight, block_k, k_split=896)
    assert options["PREFETCH"] and options["PF_LINE"] == 64  # 128 bytes of bf16
    assert options["PF_K"] == 896
    assert options["PF_COLS"] * options["PF_LINE"] >= 64  # every line of a row is covered


def test_large_weights_prefetch_a_budgeted_prefix_of_each_row(pdl_on, monkeypatch):
    monkeypatch.setattr(pdl, "WEIGHT_PREFETCH_BYTES", 24 << 20)
    weight = torch.empty(17920, 1536, dtype=torch.bfloat16)  # 55 MB: 1.5b gate/up
    options = gemm.launch_options(torch.empty(4, 1536), weight, 64, k_split=1536)
    step = options["PF_COLS"] * options["PF_LINE"]
    assert options["PF_K"] % step == 0 and 0 < options["PF_K"] < 1536
    prefetched = weight.shape[0] * options["PF_K"] * weight.element_size()
    assert prefetched <= (24 << 20) + weight.shape[0] * step * weight.element_size()


def test_a_k_split_never_prefetches_past_its_own_range(pdl_on):
    weight = torch.empty(896, 4864, dtype=torch.bfloat16)
    options = gemm.launch_options(torch.empty(4, 4864), weight, 64, k_split=4864 // 4)
    assert options["PF_K"] <= 4864 // 4


def test_no_prefetch_without_pdl_or_when_switched_off(pdl_on, monkeypatch):
    weight = torch.empty(64, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(pdl, "PREFETCH_WEIGHTS", False)
    assert "PREFETCH" not in gemm.launch_options(torch.empty(4, 64), weight, 64, k_split=64)
    monkeypatch.setattr(pdl, "options", lambda tensor: {})
    monkeypatch.setattr(pdl, "PREFETCH_WEIGHTS", True)
    assert gemm.launch_options(torch.empty(4, 64), weight, 64, k_split=64) == {}
