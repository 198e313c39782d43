"""benchmarks/moe_decode_step.py: the quick run on CPU (Triton interpreted) prints both
tables for the tiny presets, every step variant's logits within fp32 noise of the torch
step's; the byte count at moonlight-16b-a3b's real shape (meta tensors) reads each routed
expert once on the triton step, in the grouped kernels' launches."""

from __future__ import annotations

import json

from benchmark_run import load_script, markdown_rows, number, run_benchmark


def test_quick_run_prints_the_byte_tables_and_the_step_times(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton kernels on the CPU
    out = run_benchmark("moe_decode_step.py", "--device", "cpu", "--quick", "--out",
                        str(tmp_path), timeout=600)  # fmt: skip
    totals = markdown_rows(out, "| step | launches |")  # tiny-deepseek-v3's
    launches = {row["step"]: number(row["launches"]) for row in totals}
    assert launches["triton"] < launches["triton, experts as before"] < launches["before"]
    assert launches["before"] < launches["torch"]
    gpt_oss = markdown_rows(out[out.index("### tiny-gpt-oss") :], "| step | launches |")
    launches = {row["step"]: number(row["launches"]) for row in gpt_oss}
    assert launches["triton"] < launches["triton, biased experts on torch._grouped_mm"]
    timing = markdown_rows(out, "| preset | step |")
    assert [(row["preset"], row["step"]) for row in timing] == [
        (preset, step) for preset in ("tiny-deepseek-v3", "tiny-gpt-oss")
        for step in ("torch", "before", "triton, experts as before",
                     "triton, biased experts on torch._grouped_mm", "triton")
    ]  # fmt: skip
    assert all(float(row["max logit diff"]) < 1e-4 for row in timing)
    result = json.loads((tmp_path / "moe_decode_step.json").read_text())
    assert set(result["account"]) == {"tiny-deepseek-v3", "tiny-gpt-oss"}


def test_moonlight_routed_experts_read_each_expert_once_on_the_triton_step():
    script = load_script("moe_decode_step.py")
    counted = script.account("moonlight-16b-a3b", 256, 256)
    sparse = "mla + grouped_experts_shared"
    assert counted["layers"] == {"mla + dense": 1, sparse: 26}
    experts_bytes = 64 * 3 * 1408 * 2048 * 2  # gate, up and down of 64 experts, bf16

    def routed(step: str) -> tuple[float, float]:
        rows = [value for (kind, part, _), value in counted["steps"][step].items()
                if kind == sparse and part == "routed experts"]  # fmt: skip
        return sum(r[0] for r in rows) / 26, sum(r[1] for r in rows) / 26

    launches, read = routed("triton")
    assert launches == 5  # align (2), gate/up + silu, down, combine
    assert experts_bytes <= read < 1.02 * experts_bytes
    torch_launches, torch_read = routed("torch")
    assert torch_launches > 3 * launches and torch_read > read
