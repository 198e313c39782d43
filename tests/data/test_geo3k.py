"""Geometry3K conversion (`hybridflow data geo3k`) from parquet files written here, with
figures drawn with PIL (never downloaded)."""

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from geo3k_helpers import figure, hub_row

from hybridflow.data.cli import main
from hybridflow.data.geo3k import INSTRUCTION, convert_geo3k_file, split_name
from hybridflow.data.schema import DataSchemaError, iter_prompt_records, write_rows
from hybridflow.rewards.scorer_registry import default_registry
from hybridflow.rewards.scorers import geo3k as geo3k_scorer


def test_hub_parquet_converts_to_verl_rows_the_scorer_and_data_path_take(tmp_path, capsys):
    source = write_rows([hub_row(), hub_row("<image>Find y.", "60")],
                        tmp_path / "hub" / "test-00000-of-00001.parquet")  # fmt: skip
    assert main(["geo3k", "--input", str(source), "--out", str(tmp_path / "out")]) == 0
    out = tmp_path / "out" / "test.parquet"
    assert f"wrote {out}: 2 rows, 2 images" in capsys.readouterr().out
    records = list(iter_prompt_records(out, default_registry().names(), image_key="images"))
    first = records[0]
    assert first.data_source == "hiyouga/geometry3k" == geo3k_scorer.GEO3K_DATA_SOURCE
    assert first.prompt == [{"role": "user", "content": f"<image>Find x. {INSTRUCTION}"}]
    assert first.ground_truth == r"2 \sqrt { 3 }" and records[1].ground_truth == "60"
    assert first.extra_info == {"split": "test", "index": 0, "answer": r"2 \sqrt { 3 }",
                                "question": "<image>Find x."}  # fmt: skip
    assert (first.images[0].width, first.images[0].height) == (64, 48)
    assert first.images[0].source == figure()  # embedded as it came
    right = r"<think>30-60-90 triangle</think> \boxed{2\sqrt{3}}"
    assert geo3k_scorer.compute_score(right, first.ground_truth)["score"] == 1.0


def test_verl_wording_of_the_instruction():
    assert INSTRUCTION.startswith("You FIRST think about the reasoning process as an internal ")
    assert INSTRUCTION.endswith(
        "MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}."
    )


def test_rows_verl_already_wrote_keep_their_prompt_and_take_the_scorer_data_source(tmp_path):
    """verl's preprocessing of a local copy writes data_source `local:<path>`, which no
    scorer knows; paths relative to the input file are embedded as bytes."""
    (tmp_path / "fig.png").write_bytes(figure(40, 40))
    prompt = [{"role": "user", "content": f"<image>Find z. {INSTRUCTION}"}]
    row = {"data_source": "local:/data/geometry3k", "prompt": prompt, "ability": "math",
           "images": [{"bytes": None, "path": "fig.png"}],
           "reward_model": {"style": "rule", "ground_truth": r"\frac{5}{2}"},
           "extra_info": {"split": "train", "index": 7, "question": "<image>Find z."}}  # fmt: skip
    done = convert_geo3k_file(write_rows([row], tmp_path / "train.parquet"), tmp_path / "out")
    (record,) = iter_prompt_records(done.path, image_key="images")
    assert record.data_source == "hiyouga/geometry3k" and record.prompt == prompt
    assert record.images[0].source == figure(40, 40)
    assert record.extra_info["question"] == "<image>Find z." and record.extra_info["index"] == 0


def test_a_problem_without_placeholders_gets_one_per_image(tmp_path):
    two = [{"bytes": figure(), "path": None}] * 2
    source = write_rows([hub_row("Are they similar?", "Yes", two)], tmp_path / "train.parquet")
    (record,) = iter_prompt_records(
        convert_geo3k_file(source, tmp_path / "out").path, image_key="images"
    )
    assert record.prompt[0]["content"].startswith("<image><image>Are they similar? You FIRST")


@pytest.mark.parametrize(
    "bad, message",
    [
        (hub_row(images=[]), "row 1: key 'images' holds no image"),
        (
            hub_row(images=[{"bytes": b"\x89PNG broken", "path": None}]),
            "row 1: key 'images[0]' cannot be decoded as an image",
        ),
        (
            hub_row(images=[{"bytes": None, "path": "missing.png"}]),
            "row 1: key 'images[0]' no image file",
        ),
        (hub_row(answer=""), "row 1: key 'answer' must be a non-empty string"),
        (hub_row(problem="<image><image>Find x."), "row 1: the prompt has 2 <image> placeholders"),
        (
            {"question": "q", "images": [{"bytes": figure(), "path": None}]},
            "row 1: neither a Geometry3K row",
        ),
    ],
)
def test_bad_rows_are_refused_naming_file_and_row_and_nothing_is_written(
    tmp_path, capsys, bad, message
):
    source = write_rows([hub_row(), bad], tmp_path / "train.parquet")
    out = tmp_path / "out"
    assert main(["geo3k", "--input", str(source), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{source}: {message}" in err and "Traceback" not in err
    assert not list(out.iterdir())  # no partial file left behind


def test_rows_are_written_in_batches(tmp_path, monkeypatch):
    import hybridflow.data.geo3k as geo3k

    monkeypatch.setattr(geo3k, "WRITE_BATCH_ROWS", 2)
    source = write_rows([hub_row(answer=str(i)) for i in range(5)], tmp_path / "train.parquet")
    done = convert_geo3k_file(source, tmp_path / "out")
    assert (done.rows, done.images, done.first_ground_truth) == (5, 5, "0")
    assert pq.ParquetFile(done.path).metadata.num_row_groups == 3


def test_rows_are_written_in_batches_of_image_bytes_too(tmp_path, monkeypatch):
    import hybridflow.data.geo3k as geo3k

    monkeypatch.setattr(geo3k, "WRITE_BATCH_BYTES", 2 * len(figure()))
    source = write_rows([hub_row(answer=str(i)) for i in range(5)], tmp_path / "train.parquet")
    assert (
        pq.ParquetFile(convert_geo3k_file(source, tmp_path / "out").path).metadata.num_row_groups
        == 3
    )


def test_an_image_file_over_the_byte_cap_is_refused_naming_it_and_its_row(tmp_path, capsys):
    from hybridflow.data.images import MAX_IMAGE_BYTES

    huge = tmp_path / "huge.png"
    with huge.open("wb") as file:  # a figure with trailing bytes (sparse: no disk)
        file.write(figure())
        file.truncate(MAX_IMAGE_BYTES + 1)
    source = write_rows([hub_row(), hub_row(images=[{"bytes": None, "path": "huge.png"}])],
                        tmp_path / "train.parquet")  # fmt: skip
    assert main(["geo3k", "--input", str(source), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{source}: row 1: key 'images[0]' names the image file {huge} of" in err
    assert "Traceback" not in err and not list((tmp_path / "out").iterdir())


def test_split_names():
    assert split_name(Path("d/train-00000-of-00001.parquet")) == "train"
    assert split_name(Path("d/test.parquet")) == "test"


def test_a_missing_or_empty_input_fails_before_anything_is_written(tmp_path):
    with pytest.raises(DataSchemaError, match="data file does not exist"):
        convert_geo3k_file(tmp_path / "train.parquet", tmp_path / "out")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataSchemaError, match="empty.jsonl: file holds no rows"):
        convert_geo3k_file(tmp_path / "empty.jsonl", tmp_path / "out")
    assert not (tmp_path / "out").exists()
