"""Bad data or a bad reward function fail before anything is trained (here: before the
SFT warm start of the default `model.path=sft:arithmetic` would begin), with a message
naming the file, the row and the key."""

from __future__ import annotations

import json

import pytest
from trainer_helpers import tiny_config

from hybridflow.trainer.lifecycle.run import train

GOOD_ROW = {
    "data_source": "arithmetic",
    "prompt": [{"role": "user", "content": "1+2="}],
    "reward_model": {"ground_truth": "3"},
}


def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def run_expecting_error(tmp_path, *overrides):
    cfg = tiny_config(tmp_path, "model.path=sft:arithmetic", *overrides)
    with pytest.raises(ValueError) as info:
        train(cfg, log=lambda *a, **k: None)
    assert not (tmp_path / "cache").exists(), "the warm start began before the error"
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    return str(info.value)


def test_malformed_row_names_file_and_line(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", [GOOD_ROW, "{not json", GOOD_ROW])
    message = run_expecting_error(tmp_path, f"data.train_files=[{data}]")
    assert str(data) in message and "line 2" in message


def test_missing_column_names_file_and_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "train.parquet"
    rows = [{k: v for k, v in GOOD_ROW.items() if k != "reward_model"}] * 3
    pq.write_table(pa.Table.from_pylist(rows), data)
    message = run_expecting_error(tmp_path, f"data.train_files=[{data}]")
    assert str(data) in message and "reward_model" in message


def test_unknown_data_source_names_row_and_value(tmp_path):
    odd = dict(GOOD_ROW, data_source="mystery_task")
    data = write_jsonl(tmp_path / "val.jsonl", [GOOD_ROW, GOOD_ROW, odd])
    message = run_expecting_error(tmp_path, f"data.val_files=[{data}]", "reward.custom_fn=null")
    assert str(data) in message and "line 3" in message and "mystery_task" in message


def test_missing_custom_reward_file_is_named(tmp_path):
    missing = tmp_path / "no_such_reward.py"
    message = run_expecting_error(tmp_path, f"reward.custom_fn={missing}:score")
    assert "no_such_reward.py" in message and "does not exist" in message


def test_missing_custom_reward_function_is_named(tmp_path):
    module = tmp_path / "my_reward.py"
    module.write_text("def other(*args):\n    return 0.0\n")
    message = run_expecting_error(tmp_path, f"reward.custom_fn={module}:score")
    assert "score" in message and "my_reward.py" in message
