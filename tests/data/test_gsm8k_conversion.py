"""GSM8K conversion from the original release in /work/shared/data/gsm8k (never downloaded)."""

import json
from pathlib import Path

import pytest

from hybridflow.data.gsm8k import convert_gsm8k_file, convert_gsm8k_from_hub, extract_gsm8k_answer
from hybridflow.data.schema import DataSchemaError, load_prompt_records
from hybridflow.rewards.scorers import gsm8k as gsm8k_scorer

GSM8K_TEST = Path("/work/shared/data/gsm8k/test.jsonl")


def test_extract_answer_strips_commas():
    assert extract_gsm8k_answer("so 1,000 + 200\n#### 1,200") == "1200"
    with pytest.raises(ValueError):
        extract_gsm8k_answer("no marker")


@pytest.mark.skipif(not GSM8K_TEST.exists(), reason="shared gsm8k copy not present")
def test_convert_original_test_split(tmp_path):
    out = convert_gsm8k_file(GSM8K_TEST, tmp_path)
    assert out == tmp_path / "test.parquet"
    records = load_prompt_records(out)
    assert len(records) == 1319
    first = records[0]
    assert first.data_source == "openai/gsm8k" and first.ground_truth == "18"
    assert first.prompt[0]["content"].startswith("Janet’s ducks lay 16 eggs")
    assert first.prompt[0]["content"].endswith('output the final answer after "####".')
    assert first.extra_info["split"] == "test" and first.extra_info["index"] == 0
    # every converted ground truth is a plain number the scorer accepts for itself
    for record in records:
        assert "," not in record.ground_truth
        assert gsm8k_scorer.compute_score(f"#### {record.ground_truth}", record.ground_truth) == 1.0


def test_bad_source_row_is_named(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(
        json.dumps({"question": "q", "answer": "#### 1"})
        + "\n"
        + json.dumps({"question": "q"})
        + "\n"
    )
    with pytest.raises(
        DataSchemaError, match=r"train\.jsonl: line 2: missing or non-string key 'answer'"
    ):
        convert_gsm8k_file(path, tmp_path / "out")


def test_from_hub_without_datasets_is_a_clear_error(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(RuntimeError, match="needs the `datasets` package"):
        convert_gsm8k_from_hub(tmp_path)


def test_convert_hub_style_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = tmp_path / "test-00000-of-00001.parquet"
    rows = [
        {"question": "2+2?", "answer": "2+2=4\n#### 4"},
        {"question": "big?", "answer": "#### 12,345"},
    ]
    pq.write_table(pa.Table.from_pylist(rows), source)
    out = convert_gsm8k_file(source, tmp_path / "out", split="test")
    assert [r.ground_truth for r in load_prompt_records(out)] == ["4", "12345"]
