"""Launch (kernels/launch.py) resolution and the weight-prefetch budget of gemm.launch_options
(CPU: the launch keywords only; the kernels' PDL paths are compile-checked in
test_kernel_compile.py and run bitwise against plain launches on the GPU in test_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.kernels import launch as launch_module
from hybridflow.engine.kernels.launch import PLAIN, Launch, launch_for

ON = {"PDL": True, "launch_pdl": True}


def test_cpu_engines_launch_plain_and_refuse_forced_pdl():
    cpu = torch.device("cpu")
    resolved = launch_for(cpu)
    assert resolved.keywords() == {} and resolved.pair_keywords() == {}
    assert not resolved.prefetch_weights
    with pytest.raises(ValueError, match="pdl=True"):
        launch_for(cpu, pdl=True)
    assert launch_for(cpu, pdl=False) == resolved


def test_tma_follows_the_option_else_the_device(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not launch_for(cpu).tma and launch_for(cpu, tma=True).tma
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter reads descriptors too
    assert launch_for(cpu).tma and not launch_for(cpu, tma=False).tma


def test_supported_devices_get_pdl_unless_switched_off_and_the_pair_keeps_its_link(monkeypatch):
    """On a device that supports it, pdl=None turns PDL on; the split and lean layers launch
    `without_pdl()`, which keeps the shared-prefix pair's link; pdl=False turns both off."""
    monkeypatch.setattr(launch_module, "supported", lambda device: True)
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(launch_module, "tma_default", lambda device: True)
    auto = launch_for(gpu)
    assert auto.keywords() == ON and auto.pair_keywords() == ON and auto.prefetch_weights
    plain = auto.without_pdl()
    assert plain.keywords() == {} and plain.pair_keywords() == ON and plain.tma
    off = launch_for(gpu, pdl=False)
    assert off.keywords() == {} and off.pair_keywords() == {} and not off.prefetch_weights
    assert not launch_for(gpu, prefetch_weights=False).prefetch_weights


gemm = pytest.importorskip("hybridflow.engine.kernels.gemm")
PDL_ON = Launch(pdl=True, pair_pdl=True, prefetch_weights=True)


@pytest.mark.parametrize("block_k", [32, 64, 128])
def test_small_weights_are_prefetched_whole(block_k):
    weight = torch.empty(1152, 896, dtype=torch.bfloat16)  # 2 MB, under the budget
    options = gemm.launch_options(weight, block_k, 896, PDL_ON)
    assert options["PREFETCH"] and options["PF_LINE"] == 64  # 128 bytes of bf16
    assert options["PF_K"] == 896
    assert options["PF_COLS"] * options["PF_LINE"] >= 64  # every line of a row is covered


def test_large_weights_prefetch_a_budgeted_prefix_of_each_row():
    weight = torch.empty(17920, 1536, dtype=torch.bfloat16)  # 55 MB: 1.5b gate/up
    options = gemm.launch_options(weight, 64, 1536, PDL_ON)
    step = options["PF_COLS"] * options["PF_LINE"]
    assert options["PF_K"] % step == 0 and 0 < options["PF_K"] < 1536
    prefetched = weight.shape[0] * options["PF_K"] * weight.element_size()
    budget = gemm.WEIGHT_PREFETCH_BYTES
    assert prefetched <= budget + weight.shape[0] * step * weight.element_size()


def test_a_k_split_never_prefetches_past_its_own_range():
    weight = torch.empty(896, 4864, dtype=torch.bfloat16)
    options = gemm.launch_options(weight, 64, 4864 // 4, PDL_ON)
    assert options["PF_K"] <= 4864 // 4


def test_no_prefetch_without_pdl_or_when_switched_off():
    weight = torch.empty(64, 64, dtype=torch.bfloat16)
    no_prefetch = Launch(pdl=True, pair_pdl=True, prefetch_weights=False)
    assert gemm.launch_options(weight, 64, 64, no_prefetch) == ON
    assert gemm.launch_options(weight, 64, 64, PLAIN) == {}
