"""`bench update` on the CPU (tiny preset): one table of bf16 against FP8 (torchao's
emulation here), and a bad variant named with exit status 2."""

from __future__ import annotations

import importlib.util
import json

import pytest

from hybridflow.bench.cli import main
from hybridflow.bench.update import show_update, update_floor_s, variants

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
    assert row["floor_s"] is None and row["at_floor"] is None  # no peak known for the CPU
    assert "vs bf16" in capsys.readouterr().out


def test_the_fp8_rows_floor_is_the_fp8_one_and_each_row_is_printed_against_its_own(capsys):
    """update_floor_s on an H100 (989 bf16, 1,979 FP8 TFLOP/s): the FP8 floor, with the
    float8 linears' matmuls at twice the rate, is below bf16's; on the CPU there is none."""
    from argparse import Namespace

    args = Namespace(preset="qwen2.5-0.5b", rows=64, prompt_len=256, response_len=768,
                     gradient_checkpointing=False)  # fmt: skip
    h100 = "NVIDIA H100 80GB HBM3"
    projections = 24 * 14_909_440  # q/k/v/o and gate/up/down weights of 24 layers
    bf16, fp8 = update_floor_s(args, h100, 0), update_floor_s(args, h100, projections)
    assert 0.5 * bf16 < fp8 < bf16
    assert update_floor_s(args, "cpu", 0) is None
    assert update_floor_s(args, "NVIDIA A100-SXM4-80GB", projections) is None  # no FP8 peak
    rows = [dict(precision="bf16", fp8_recipe=None, emulated=False, update_s=2.74, floor_s=1.2,
                 at_floor=1.2 / 2.74, tokens_per_s=1.0, speedup_vs_bf16=1.0, fp8_linears=0,
                 peak_gib=None),
            dict(precision="fp8", fp8_recipe="rowwise", emulated=False, update_s=2.0,
                 floor_s=0.8, at_floor=0.4, tokens_per_s=1.0, speedup_vs_bf16=1.37,
                 fp8_linears=168, peak_gib=None)]  # fmt: skip
    show_update({"device": h100, "preset": "qwen2.5-0.5b", "rows": 64, "tokens": 65536,
                 "torch": "2", "torchao": "0.18", "variants": rows})  # fmt: skip
    out = capsys.readouterr().out
    assert "floor s" in out and "at floor" in out
    assert "fp8 rowwise" in out and "0.800      40%" in out and "1.200      44%" in out


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")
def test_fp8_rows_are_emulated_on_the_cpu_and_compared_with_bf16(tmp_path, capsys):
    out = tmp_path / "u.json"
    assert main([*TINY, "--fp8-recipe", "tensorwise", "--json", str(out)]) == 0
    bf16, fp8 = json.loads(out.read_text())["variants"]
    assert (bf16["precision"], fp8["precision"], fp8["fp8_recipe"]) == ("bf16", "fp8", "tensorwise")
    assert fp8["emulated"] and fp8["fp8_linears"] == 14  # 2 layers x 7 projections
    assert fp8["speedup_vs_bf16"] == pytest.approx(bf16["update_s"] / fp8["update_s"])
    assert "fp8 tensorwise (emulated)" in capsys.readouterr().out
