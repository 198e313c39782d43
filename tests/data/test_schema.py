"""Schema validation: every error names the file, the row and the key."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.data.schema import DataSchemaError, load_prompt_records, write_records

GOOD = {
    "data_source": "arithmetic",
    "prompt": [{"role": "user", "content": "1+2="}],
    "ability": "arithmetic",
    "reward_model": {"style": "rule", "ground_truth": "3"},
    "extra_info": {"index": 0},
}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_round_trip_parquet_and_jsonl(tmp_path):
    countdown = dict(GOOD, data_source="countdown")
    countdown["reward_model"] = {"style": "rule", "ground_truth": {"target": 3, "numbers": [1, 2]}}
    for suffix in ("parquet", "jsonl"):
        path = tmp_path / f"d.{suffix}"
        pq.write_table(pa.Table.from_pylist([GOOD]), path) if suffix == "parquet" else write_jsonl(
            path, [GOOD]
        )
        (record,) = load_prompt_records(path)
        assert record.prompt == GOOD["prompt"] and record.ground_truth == "3"
        assert record.where == f"{path}: " + ("row 0" if suffix == "parquet" else "line 1")
        out = write_records([record], tmp_path / f"again.{suffix}")
        assert load_prompt_records(out) == [record]
        write_records(
            load_prompt_records(write_jsonl(tmp_path / "c.jsonl", [countdown])),
            tmp_path / f"c.{suffix}",
        )
        assert load_prompt_records(tmp_path / f"c.{suffix}")[0].ground_truth == {
            "target": 3,
            "numbers": [1, 2],
        }


def test_plain_string_prompt_is_one_user_turn(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [dict(GOOD, prompt="1+2=")])
    assert load_prompt_records(path)[0].prompt == [{"role": "user", "content": "1+2="}]


def test_missing_parquet_column_names_file_and_column(tmp_path):
    row = {k: v for k, v in GOOD.items() if k != "reward_model"}
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    with pytest.raises(
        DataSchemaError, match=r"train\.parquet: missing column\(s\) \['reward_model'\]"
    ):
        load_prompt_records(path)


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ({k: v for k, v in GOOD.items() if k != "data_source"}, "missing key 'data_source'"),
        (dict(GOOD, prompt=[{"role": "user"}]), r"key 'prompt\[0\]\.content' must be a string"),
        (
            dict(GOOD, prompt=[{"role": "robot", "content": "x"}]),
            r"key 'prompt\[0\]\.role' is 'robot'",
        ),
        (dict(GOOD, prompt=[]), "key 'prompt' must be a non-empty list"),
        (dict(GOOD, reward_model={"style": "rule"}), "missing key 'reward_model.ground_truth'"),
        (dict(GOOD, extra_info=[1]), "key 'extra_info' must be a dict"),
        (
            dict(
                GOOD,
                prompt=[
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": "1+\ud800"},
                ],
            ),  # json writes \ud800
            r"key 'prompt\[1\]\.content' holds a lone UTF-16 surrogate \(\\ud800 at character 2",
        ),  # fmt: skip
    ],
)
def test_malformed_row_names_file_line_and_key(tmp_path, bad_row, message):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD, GOOD, bad_row])
    with pytest.raises(DataSchemaError, match=rf"data\.jsonl: line 3: {message}"):
        load_prompt_records(path)


def test_malformed_parquet_row_is_0_based(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD, dict(GOOD, data_source="")]), path)
    with pytest.raises(DataSchemaError, match=r"d\.parquet: row 1: key 'data_source'"):
        load_prompt_records(path)


def test_a_parquet_file_is_read_batch_by_batch_with_its_row_numbers(tmp_path):
    from hybridflow.data.schema import PARQUET_BATCH_ROWS, iter_prompt_records

    rows = [dict(GOOD, extra_info={"index": i}) for i in range(PARQUET_BATCH_ROWS + 3)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=500)
    records = list(iter_prompt_records(path))
    assert [r.extra_info["index"] for r in records] == list(range(len(rows)))
    assert records[-1].where == f"{path}: row {len(rows) - 1}"
    rows[-1] = dict(rows[-1], data_source="")
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=500)
    with pytest.raises(DataSchemaError, match=rf"d\.parquet: row {len(rows) - 1}: key 'data"):
        load_prompt_records(path)


def test_invalid_json_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD) + "\n{oops\n")
    with pytest.raises(DataSchemaError, match=r"d\.jsonl: line 2: not valid JSON"):
        load_prompt_records(path)


@pytest.mark.parametrize(
    "line, words",
    [
        ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", "JSON nested too deeply"),
        ('{"prompt": "1+2=", "n": 1' + "0" * 5000 + "}", "holds a number of thousands of digits"),
    ],
    ids=["nested", "long-number"],
)
def test_json_the_parser_refuses_past_its_limits_names_the_line(tmp_path, line, words):
    """A RecursionError and the int-digits ValueError were tracebacks in train and validate."""
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + line + "\n")
    with pytest.raises(DataSchemaError, match=rf"d\.jsonl: line 2: {words}"):
        load_prompt_records(path)


def test_a_line_over_the_row_cap_is_named_before_more_than_the_cap_is_read(tmp_path, monkeypatch):
    """A row is parsed whole (about six times its line at peak), so without a cap on the line
    one huge row took memory without bound; the cap is read, not the line."""
    import tracemalloc

    from hybridflow.data import schema

    row = json.dumps(GOOD)
    path = tmp_path / "d.jsonl"
    huge = json.dumps(dict(GOOD, extra="x" * (40 << 20)))
    path.write_text(row + "\n" + huge + "\n" + row + "\n")
    del huge
    monkeypatch.setattr(schema, "MAX_ROW_BYTES", 1 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(DataSchemaError, match=r"d\.jsonl: line 2: longer than 1 MiB"):
            load_prompt_records(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak  # the cap and one byte were read, never the 40 MB line
    monkeypatch.setattr(schema, "MAX_ROW_BYTES", len(row) + 1)  # a line of exactly the cap
    path.write_text(row + "\n" + row + "\n")
    assert len(load_prompt_records(path)) == 2


def test_unknown_data_source_with_registry(tmp_path):
    from hybridflow.rewards import default_registry

    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, dict(GOOD, data_source="my_task")])
    with pytest.raises(DataSchemaError, match=r"line 2: unknown data_source 'my_task'.*custom_fn"):
        load_prompt_records(path, known_data_sources=default_registry().names())
    assert len(load_prompt_records(path)) == 2  # no registry: any data source is fine


def test_missing_file_and_bad_suffix(tmp_path):
    with pytest.raises(DataSchemaError, match="does not exist"):
        load_prompt_records(tmp_path / "nope.parquet")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataSchemaError, match="unsupported file type '.csv'"):
        load_prompt_records(tmp_path / "d.csv")
