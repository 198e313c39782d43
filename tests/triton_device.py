"""Where a Triton kernel test runs: "cuda" (the test is then GPU-marked) or the CPU under
TRITON_INTERPRET=1; otherwise the calling test module is skipped (also without triton)."""

from __future__ import annotations

import os

import pytest
import torch


def triton_test_device() -> str:
    """Call at import time of a test module: returns the device or skips the module."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
