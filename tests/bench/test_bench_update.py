"""`bench update` on the CPU (tiny preset): one table of bf16 against FP8 (torchao's
emulation here), and a bad variant named with exit status 2."""

from __future__ import annotations

import importlib.util
import json

import pytest

from hybridflow.bench.cli import main
from hybridflow.bench.update import variants

TINY = ["update", "--preset", "tiny", "--rows", "2", "--prompt-len", "4", "--response-len", "4",
        "--warmup", "0", "--steps", "1", "--device", "cpu"]  # fmt: skip


def test_variants_expand_fp8_over_the_recipes_in_order():
    assert variants("bf16,fp8", "rowwise,tensorwise") == [
        ("bf16", None), ("fp8", "rowwise"), ("fp8", "tensorwise")]  # fmt: skip
    with pytest.raises(ValueError, match="--fp8-recipe 'blockwise'"):
        variants("fp8", "blockwise")


def test_a_bad_precision_is_named_and_exits_2(capsys):
    assert main([*TINY, "--precision", "fp16"]) == 2
    err = capsys.readouterr().err
    assert "--precision 'fp16'" in err and "Traceback" not in err


def test_bf16_alone_is_its_own_baseline(tmp_path, capsys):
    out = tmp_path / "u.json"
    assert main([*TINY, "--precision", "bf16", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["variants"]
    assert row["precision"] == "bf16" and row["speedup_vs_bf16"] == 1.0
    assert row["fp8_linears"] == 0 and row["update_s"] > 0
    assert "vs bf16" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")
def test_fp8_rows_are_emulated_on_the_cpu_and_compared_with_bf16(tmp_path, capsys):
    out = tmp_path / "u.json"
    assert main([*TINY, "--fp8-recipe", "tensorwise", "--json", str(out)]) == 0
    bf16, fp8 = json.loads(out.read_text())["variants"]
    assert (bf16["precision"], fp8["precision"], fp8["fp8_recipe"]) == ("bf16", "fp8", "tensorwise")
    assert fp8["emulated"] and fp8["fp8_linears"] == 14  # 2 layers x 7 projections
    assert fp8["speedup_vs_bf16"] == pytest.approx(bf16["update_s"] / fp8["update_s"])
    assert "fp8 tensorwise (emulated)" in capsys.readouterr().out
