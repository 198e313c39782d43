"""benchmarks/delta_step.py on CPU (--quick, Triton interpreted): both tables at a tiny shape,
every path's output checked against the torch op, so a GPU run cannot fail on a typo."""

from __future__ import annotations

import json

from benchmark_run import markdown_rows, number, run_benchmark


def test_quick_run_prints_the_step_paths_and_the_engine_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton kernels on the CPU
    out = run_benchmark("delta_step.py", "--device", "cpu", "--quick", "--out", str(tmp_path),
                        timeout=600)  # fmt: skip
    steps = markdown_rows(out, "| path |")
    paths = [row["path"] for row in steps]
    assert paths[:2] == ["grouped kernel alone (before)", "grouped + torch gates and norm (before)"]
    assert paths[2:] == ["two kernels, block_v 4, 2 warps", "two kernels, block_v 8, 2 warps"]
    for row in steps[1:]:  # fp32: the torch op's output within rounding
        assert float(row["rel. error"]) < 1e-5 and number(row["us"]) > 0
    engine = markdown_rows(out, "| recurrent step |")
    assert [(row["recurrent step"], row["attention step"], row["norm step"]) for row in engine] == [
        ("triton-grouped", "torch", "torch"), ("triton", "torch", "torch"),
        ("triton", "triton", "torch"), ("triton", "triton", "triton")]  # fmt: skip
    assert all(float(row["max logit diff"]) < 1e-4 for row in engine)
    result = json.loads((tmp_path / "delta_step.json").read_text())
    assert len(result["step"]) == 4 and len(result["engine"]) == 4
