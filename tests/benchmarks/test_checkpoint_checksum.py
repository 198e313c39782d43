"""benchmarks/checkpoint_checksum.py on a small buffer: a row per hash, consistent with the JSON."""

from __future__ import annotations

import json

import pytest
from benchmark_run import markdown_rows, number, run_benchmark


def test_prints_a_row_per_hash_and_the_files_row(tmp_path):
    out_json = tmp_path / "rows.json"
    out = run_benchmark("checkpoint_checksum.py", "--gib", "0.01", "--repeats", "1",
                        "--params", "1e9", "--json", str(out_json))  # fmt: skip
    rows = markdown_rows(out, "| what |")
    assert [r["what"].split(",")[0] for r in rows[:5]] == [
        "zlib.crc32", "sha256", "blake2b", "sha1", "md5"]  # fmt: skip
    assert rows[5]["what"] == "checksums() of 4 files (page cache, threads)"
    for row, result in zip(rows, json.loads(out_json.read_text())):
        assert number(row["GB/s (wall)"]) == pytest.approx(result["wall"], abs=0.01)
        assert number(row["GB/s of CPU time"]) == pytest.approx(result["cpu"], abs=0.01)
        assert result["checkpoint_cpu_s"] == pytest.approx(12 / result["cpu"])  # 12 GB
