"""benchmarks/paged_kv.py: the long-tail budgets, and a CPU smoke run where a budget of a few
full-length sequences makes the slot cache decode fewer rows than the paged one."""

from __future__ import annotations

import pytest

from tests.benchmarks.benchmark_run import load_script, markdown_rows, run_benchmark


def test_budgets_have_the_asked_mean_and_stay_within_the_cap():
    budgets = load_script("paged_kv.py").request_budgets(4000, 300, 3000, seed=0)
    assert min(budgets) >= 1 and max(budgets) <= 3000
    assert 270 < sum(budgets) / len(budgets) < 330
    assert max(budgets) > 5 * 300  # a long tail


@pytest.mark.slow
def test_smoke_run_prints_both_caches_with_identical_tokens():
    out = run_benchmark(
        "paged_kv.py", "--preset", "tiny", "--device", "cpu", "--prompts", "4", "--samples",
        "2", "--prompt-len", "16", "--mean-new-tokens", "24", "--max-new-tokens", "64",
        "--kv-gib", "0.0002", "--block-size", "16",
    )  # fmt: skip
    rows = {row["cache"]: row for row in markdown_rows(out, "| cache")}
    assert set(rows) == {"paged (16)", "slot"}
    assert float(rows["paged (16)"]["mean rows / step"]) > float(rows["slot"]["mean rows / step"])
    assert "identical tokens: True" in out
