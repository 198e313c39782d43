"""dev/update_profile.py: kernel names grouped by kind, and a CPU run of one head's update."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dev"))

import update_profile  # noqa: E402


def test_kernels_are_grouped_by_kind_in_a_fixed_order():
    events = [
        ("_grad_tile_kernel", 5.0),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN", 40.0),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 10.0),
        ("flash_fwd_kernel", 7.0),
        ("triton_per_fused_add_mul_rsqrt_0", 3.0),
        ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add>", 2.0),
        ("Memcpy DtoD (Device -> Device)", 1.0),
        ("multi_tensor_apply_kernel", 4.0),
        ("some_custom_thing", 0.5),
    ]
    assert update_profile.group_times(events) == {
        "log-prob head": 5.0,
        "attention": 7.0,
        "matmul": 50.0,
        "optimizer": 4.0,
        "compiled elementwise / norm": 3.0,
        "copies": 1.0,
        "eager elementwise": 2.0,
        "other": 0.5,
    }


@pytest.mark.slow
def test_one_update_profiled_on_cpu():
    args = argparse.Namespace(preset="tiny", prompts=1, samples=2, prompt_len=6, new_tokens=5,
                              micro_tokens=64, no_compile=True)  # fmt: skip
    row = update_profile.profile_head(args, fused=True, device=torch.device("cpu"))
    assert row["head"] == "fused" and row["wall_s"] > 0
    assert row["kinds_s"]["matmul"] > 0 and row["idle_s"] is None
    lines = update_profile.table(argparse.Namespace(**vars(args), device="cpu"), [row], None)
    assert lines[1].startswith("| head | update s | % of floor | ")
