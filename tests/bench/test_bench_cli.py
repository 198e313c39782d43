"""`bench rollout` and `bench ttft` end to end on CPU (tiny preset): both sides generate the
same token count, and each phase of the work is reported while it runs."""

from __future__ import annotations

import argparse
import json

from progress_helpers import recording_reporter

from hybridflow.bench.cli import main
from hybridflow.bench.common import WARM_UP
from hybridflow.bench.rollout import add_rollout_arguments, bench_rollout
from hybridflow.bench.ttft import add_ttft_arguments, bench_ttft


def test_bench_rollout_counts_equal_tokens(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["rollout", "--preset", "tiny", "--prompts", "3", "--prompt-len", "5",
            "--new-tokens", "6", "--n", "2", "--device", "cpu", "--dtype", "float32",
            "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["engine"]["tokens"] == 3 * 2 * 6 == result["hf"]["tokens"]
    assert "tok/s" in capsys.readouterr().out


def test_bench_rollout_mean_length_stops_early(tmp_path):
    out = tmp_path / "r.json"
    args = ["rollout", "--preset", "tiny", "--prompts", "8", "--prompt-len", "4",
            "--new-tokens", "40", "--mean-length", "8", "--max-batch-size", "4",
            "--device", "cpu", "--dtype", "float32", "--no-hf", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    engine = json.loads(out.read_text())["engine"]
    assert engine["stopped"] > 0 and engine["tokens"] < 8 * 40


def test_bench_rollout_passes_engine_options_and_records_them(tmp_path):
    """--engine NAME=VALUE reaches EngineOptions (literals parsed) and the JSON records the
    options the run used; the tokens are the same count."""
    out = tmp_path / "r.json"
    args = ["rollout", "--preset", "tiny", "--prompts", "2", "--prompt-len", "4",
            "--new-tokens", "3", "--n", "3", "--device", "cpu", "--dtype", "float32",
            "--no-hf", "--engine", "steps_per_sync=2", "--engine", "shared_prefix=False",
            "--engine", "sync_lag=None", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    engine = json.loads(out.read_text())["engine"]
    assert engine["options"]["steps_per_sync"] == 2
    assert engine["options"]["shared_prefix"] is False and engine["options"]["sync_lag"] is None
    assert engine["tokens"] == 2 * 3 * 3


def test_engine_settings_take_the_configs_true_false_and_null():
    from hybridflow.bench.common import parse_engine_settings

    assert parse_engine_settings(["graph_mixed_steps=true", "shared_prefix=false",
                                  "sync_lag=null", "decode_layer=split"]) == {
        "graph_mixed_steps": True, "shared_prefix": False, "sync_lag": None,
        "decode_layer": "split"}  # fmt: skip


def test_bench_rollout_runs_speculation_off_and_on_with_the_same_tokens(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["rollout", "--preset", "tiny", "--prompts", "3", "--prompt-len", "6",
            "--new-tokens", "24", "--n", "2", "--device", "cpu", "--dtype", "float32",
            "--no-hf", "--repeats", "2", "--speculative", "ngram",
            "--engine", "speculative_min_ngram=1", "--engine", "speculative_rule='always'",
            "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    spec = json.loads(out.read_text())["speculative"]
    assert spec["off"]["options"]["speculative"] == "off" and spec["off"]["speculative"] is None
    assert spec["on"]["options"]["speculative"] == "ngram"
    assert spec["on"]["options"]["speculative_min_ngram"] == 1  # the other --engine fields kept
    assert spec["on"]["speculative"]["rollout/speculative_passes"] > 0
    assert spec["same_tokens"] and spec["on"]["tokens"] == spec["off"]["tokens"]
    printed = capsys.readouterr().out
    assert "speculative decoding (ngram)" in printed and "tok/pass" in printed


def test_bench_rollout_speculates_with_a_draft_model(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["rollout", "--preset", "tiny", "--prompts", "2", "--prompt-len", "6",
            "--new-tokens", "12", "--device", "cpu", "--dtype", "float32", "--no-hf",
            "--repeats", "1", "--speculative", "draft", "--engine",
            "speculative_draft_model='tiny'", "--engine", "speculative_rule='always'",
            "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    spec = json.loads(out.read_text())["speculative"]
    assert spec["off"]["options"]["speculative"] == "off"
    assert spec["on"]["options"]["speculative_draft_model"] == "tiny"
    assert spec["on"]["speculative"]["rollout/speculative_passes"] > 0
    assert "speculative decoding (draft)" in capsys.readouterr().out


def test_bench_rollout_names_a_bad_engine_option_and_exits_2(capsys):
    args = ["rollout", "--preset", "tiny", "--device", "cpu", "--no-hf",
            "--engine", "decode_layer=fast", "--engine", "bogus=1"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "bogus" in err and "Traceback" not in err
    assert main(["rollout", "--preset", "tiny", "--device", "cpu", "--no-hf",
                 "--engine", "decode_layer=fast"]) == 2  # fmt: skip
    assert "decode_layer='fast'" in capsys.readouterr().err


def test_bench_ttft_times_arrivals_into_a_decoding_batch(tmp_path, capsys):
    out = tmp_path / "t.json"
    args = ["ttft", "--preset", "tiny", "--rows", "3", "--batch-prompt-len", "6",
            "--prompt-len", "20", "--arrivals", "2", "--device", "cpu", "--json", str(out),
            "--engine", "max_prefill_tokens_per_step=8", "--engine", "decode_backend='torch'"]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert len(result["ttfts_s"]) == 2 and result["decode_step_s"] > 0
    assert result["engine_options"]["max_prefill_tokens_per_step"] == 8
    assert "TTFT / (prefill + 2 steps)" in capsys.readouterr().out


def parsed(add_arguments, argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_bench_rollout_reports_each_phase_while_it_runs():
    args = parsed(add_rollout_arguments, ["--preset", "tiny", "--prompts", "2",
                  "--prompt-len", "4", "--new-tokens", "3", "--repeats", "2",
                  "--hf-batch-size", "1", "--device", "cpu", "--dtype", "float32"])  # fmt: skip
    reporter, log, opened = recording_reporter()
    bench_rollout(args, progress=reporter)
    assert opened == ["loading tiny", WARM_UP, "timed calls", "HF generate"]
    lines = log.getvalue()
    assert "timed calls: 1/4 calls (25%)" in lines and "timed calls: done, 4 calls" in lines
    assert "HF generate: done, 2 batches" in lines


def test_bench_ttft_reports_each_phase_while_it_runs():
    args = parsed(add_ttft_arguments, ["--preset", "tiny", "--rows", "2",
                  "--batch-prompt-len", "4", "--prompt-len", "8", "--arrivals", "2",
                  "--device", "cpu", "--engine", "decode_backend='torch'"])  # fmt: skip
    reporter, log, opened = recording_reporter()
    bench_ttft(args, progress=reporter)
    assert opened == ["loading tiny", WARM_UP, "arrivals into the full batch"]
    assert "arrivals into the full batch: done, 2 requests" in log.getvalue()


def test_the_hf_baseline_of_a_family_without_sdpa_runs_eager_attention(capsys):
    """transformers' GPT-OSS has no sdpa path: its twin runs eager attention (an H100 run
    stopped with an internal error), and the printed line says which attention ran."""
    import transformers

    from hybridflow.bench.rollout import hf_attention, print_result

    assert hf_attention(transformers.AutoConfig.for_model("gpt_oss")) == "eager"
    assert hf_attention(transformers.AutoConfig.for_model("qwen2")) == "sdpa"
    args = parsed(add_rollout_arguments, ["--preset", "tiny-gpt-oss", "--prompts", "2",
                  "--prompt-len", "4", "--new-tokens", "3", "--device", "cpu",
                  "--dtype", "float32"])  # fmt: skip
    result = bench_rollout(args)
    assert result["hf"]["attention"] == "eager" and result["hf"]["tokens"] == 6
    print_result(result)
    assert "HF generate (eager attention):" in capsys.readouterr().out
