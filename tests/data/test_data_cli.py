"""`hybridflow data ...` through the real argument parser."""

from pathlib import Path

import pytest

from hybridflow.data.cli import main
from hybridflow.data.schema import load_prompt_records

GSM8K_TEST = Path("/work/shared/data/gsm8k/test.jsonl")


@pytest.mark.skipif(not GSM8K_TEST.exists(), reason="shared gsm8k copy not present")
def test_gsm8k_command(tmp_path, capsys):
    assert main(["gsm8k", "--input", str(GSM8K_TEST), "--out", str(tmp_path)]) == 0
    assert len(load_prompt_records(tmp_path / "test.parquet")) == 1319
    assert "1319 rows" in capsys.readouterr().out


def test_gsm8k_needs_exactly_one_source(tmp_path, capsys):
    assert main(["gsm8k", "--out", str(tmp_path)]) == 2
    assert "exactly one of --input" in capsys.readouterr().err


def test_arithmetic_and_check_commands(tmp_path, capsys):
    assert (
        main(
            [
                "arithmetic",
                "--out",
                str(tmp_path),
                "--train-size",
                "20",
                "--test-size",
                "5",
                "--sft-size",
                "5",
            ]
        )
        == 0
    )
    assert main(["check", str(tmp_path / "train.parquet"), "--known-sources"]) == 0
    assert "20 rows OK" in capsys.readouterr().out


def test_check_reports_schema_error_without_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"data_source": "x"}\n')
    assert main(["check", str(bad)]) == 2
    assert "bad.jsonl: line 1: missing key 'prompt'" in capsys.readouterr().err


def test_registered_on_the_top_level_parser():
    from hybridflow.cli import build_parser

    args = build_parser().parse_args(["data", "countdown", "--out", "x"])
    assert args.data_command == "countdown" and callable(args.func)


def test_check_takes_builtin_tasks_as_train_does(capsys):
    from hybridflow.cli import main as hybridflow

    assert hybridflow(["data", "check", "builtin:arithmetic", "--known-sources"]) == 0
    out = capsys.readouterr().out
    assert "builtin:arithmetic (training split, the default sizes): 4000 rows OK" in out
    assert "builtin:arithmetic (validation split, the default sizes): 200 rows OK" in out


def test_check_names_an_unknown_builtin_task(capsys):
    from hybridflow.cli import main as hybridflow

    assert hybridflow(["data", "check", "builtin:algebra"]) == 2
    err = capsys.readouterr().err
    assert "unknown built-in task 'algebra'" in err and "Traceback" not in err


@pytest.mark.parametrize("action", ["arithmetic", "countdown", "geo3k"])
@pytest.mark.parametrize("below", [False, True])
def test_out_that_is_a_file_is_named_before_any_work(tmp_path, capsys, action, below):
    taken = tmp_path / "taken"
    taken.write_text("a file")
    out = taken / "sub" if below else taken
    extra = ["--input", str(tmp_path / "in.parquet")] if action == "geo3k" else []
    assert main([action, "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: {taken} is a file, not a directory" in err
    assert taken.read_text() == "a file"


def test_out_the_file_system_refuses_is_named(tmp_path, capsys):
    out = "/proc/hybridflow-out"  # procfs makes no directories, even for root
    assert main(["arithmetic", "--out", out]) == 2
    assert f"--out {out}: the directory cannot be made" in capsys.readouterr().err
