"""Reward managers: registry dispatch, custom functions, batch mode, DAPO shaping, and
parallel scoring where a timeout, an exception or a crashed worker is counted, not raised."""

import textwrap
import time

import pytest

from hybridflow.rewards import CustomRewardError, RewardManager, UnknownDataSource

SCORERS_FILE = textwrap.dedent(
    """
    import os
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "sleep":
            time.sleep(30)
        if solution_str == "sleep-swallow":
            try:
                time.sleep(30)
            except Exception:  # must not swallow the timeout
                return 1.0
        if solution_str == "raise":
            raise RuntimeError("scorer bug")
        if solution_str == "crash":
            os._exit(3)
        if solution_str == "text":
            return "not a number"
        return {"score": float(solution_str == ground_truth), "acc": solution_str == ground_truth}

    def batch_score(data_sources, solution_strs, ground_truths, extra_infos):
        if "raise" in solution_strs:
            raise ValueError("batch bug")
        return [float(s == g) for s, g in zip(solution_strs, ground_truths)]
    """
)


@pytest.fixture()
def scorer_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(SCORERS_FILE)
    return path


def test_naive_manager_dispatches_on_data_source():
    manager = RewardManager("naive")
    scores, metrics = manager.score(
        ["#### 18", r"\boxed{\frac12}", "68", "<answer>2*3*4</answer>", "#### 3"],
        ["18", "0.5", "68", {"target": 24, "numbers": [2, 3, 4]}, "4"],
        ["openai/gsm8k", "math", "arithmetic", "countdown", "gsm8k"],
    )
    assert scores == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert metrics["reward/gsm8k/score_mean"] == 0.0
    assert metrics["reward/openai/gsm8k/score_mean"] == 1.0
    assert metrics["reward/num_errors"] == 0.0


def test_unknown_data_source_is_reported_before_scoring():
    manager = RewardManager("naive")
    with pytest.raises(UnknownDataSource, match="'my_task'.*known"):
        manager.check_data_sources(["arithmetic", "my_task"])


def test_custom_fn_file_missing_names_the_file(tmp_path):
    with pytest.raises(CustomRewardError, match="nope.py.*does not exist"):
        RewardManager("naive", custom_fn=str(tmp_path / "nope.py") + ":compute_score")


def test_custom_fn_function_missing_lists_defined_functions(scorer_file):
    with pytest.raises(CustomRewardError, match="no function 'score_it'.*batch_score"):
        RewardManager("naive", custom_fn=f"{scorer_file}:score_it")


def test_custom_fn_import_error_is_reported(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import not_a_real_module_xyz\n")
    with pytest.raises(CustomRewardError, match="importing .*bad.py failed"):
        RewardManager("naive", custom_fn=f"{bad}:f")


def test_in_process_scoring_counts_timeout_error_and_bad_value(scorer_file):
    manager = RewardManager("naive", custom_fn=f"{scorer_file}:compute_score", timeout_s=0.3)
    result = manager.score(
        ["a", "sleep-swallow", "raise", "text", "b"],
        ["a", "x", "x", "x", "a"],
        ["anything"] * 5,
    )
    assert result.scores == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert result.metrics["reward/num_timeouts"] == 1.0
    assert result.metrics["reward/num_errors"] == 2.0  # the exception and the string
    assert result.metrics["reward/failure_rate"] == pytest.approx(3 / 5)
    assert any("scorer bug" in message for message in result.error_messages)
    # extras of dict returns are kept per sample and averaged (2 valid dict returns)
    assert result.metrics["reward/extra/acc"] == 0.5


def test_parallel_scoring_with_timeout_exception_and_crash(scorer_file):
    manager = RewardManager(
        "naive", custom_fn=f"{scorer_file}:compute_score", num_workers=2, timeout_s=1.0
    )
    with manager:
        responses = ["a", "sleep", "raise", "a", "b", "a"]
        start = time.monotonic()
        result = manager.score(responses, ["a"] * 6, ["x"] * 6)
        assert time.monotonic() - start < 25, "the 30 s sleep was not cut by the timeout"
        assert result.scores == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
        assert result.metrics["reward/num_timeouts"] == 1.0
        assert result.metrics["reward/num_errors"] == 1.0
        # A worker that dies takes its chunk with it; the pool is rebuilt for the next call.
        crashed = manager.score(["crash"], ["a"], ["x"])
        assert crashed.scores == [0.0] and crashed.metrics["reward/num_errors"] == 1.0
        again = manager.score(["a", "b"], ["a", "a"], ["x", "x"])
        assert again.scores == [1.0, 0.0] and again.metrics["reward/num_errors"] == 0.0


def test_batch_manager_gets_lists_and_a_failed_chunk_scores_zero(scorer_file):
    manager = RewardManager("batch", custom_fn=f"{scorer_file}:batch_score")
    scores, metrics = manager.score(["a", "b", "a"], ["a", "a", "a"], ["x"] * 3)
    assert scores == [1.0, 0.0, 1.0]
    scores, metrics = manager.score(["a", "raise"], ["a", "a"], ["x"] * 2)
    assert scores == [0.0, 0.0] and metrics["reward/num_errors"] == 2.0


def test_batch_manager_requires_custom_fn():
    with pytest.raises(ValueError, match="custom_fn"):
        RewardManager("batch")


def test_dapo_manager_adds_overlong_penalty():
    # L_max = 16, buffer 4: no penalty up to 12 tokens, then -(L - 12) / 4 * 0.5.
    manager = RewardManager(
        "dapo", overlong_buffer_len=4, overlong_penalty_factor=0.5, max_response_length=16
    )
    result = manager.score(
        ["68", "68", "68", "1"], ["68"] * 4, ["arithmetic"] * 4, response_lengths=[3, 12, 14, 16]
    )
    assert result.scores == pytest.approx([1.0, 1.0, 0.75, -0.5])
    assert result.per_sample["raw_score"] == [1.0, 1.0, 1.0, 0.0]
    assert result.metrics["reward/overlong_ratio"] == 0.5
    with pytest.raises(ValueError, match="response_lengths"):
        manager.score(["68"], ["68"], ["arithmetic"])


def test_build_from_reward_config(scorer_file):
    from hybridflow.config import RewardConfig
    from hybridflow.rewards import build_reward_manager

    config = RewardConfig(
        manager="dapo", overlong_buffer_len=2, custom_fn=f"{scorer_file}:compute_score"
    )
    manager = build_reward_manager(config, max_response_length=8)
    assert manager.known_data_sources() is None  # a custom_fn scores every data source
    result = manager.score(["a"], ["a"], ["anything"], response_lengths=[8])
    assert result.scores == [0.0]  # 1.0 correct, -1.0 at the full length


@pytest.mark.slow
def test_worker_stuck_in_c_code_is_killed_and_pool_rebuilt(tmp_path):
    # `sum(range(...))` runs inside one C call, so the in-worker alarm cannot interrupt
    # it; the parent's deadline must kill the worker.
    path = tmp_path / "stuck.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str == 'stuck':\n"
        "        return float(sum(range(10**12)))\n"
        "    return 1.0\n"
    )
    manager = RewardManager(
        "naive", custom_fn=f"{path}:compute_score", num_workers=1, timeout_s=0.5
    )
    with manager:
        manager.pool.startup_grace_s = 3.0
        stuck = manager.pool._workers[0].process  # the worker that imported the file
        start = time.monotonic()
        result = manager.score(["stuck"], ["x"], ["x"])
        assert time.monotonic() - start < 20
        assert result.scores == [0.0] and result.metrics["reward/num_timeouts"] == 1.0
        assert stuck.poll() is not None  # the stuck worker was killed
        manager.pool.startup_grace_s = 60.0
        assert manager.score(["ok"], ["x"], ["x"]).scores == [1.0]


def test_unknown_data_source_at_scoring_time_scores_zero_and_is_counted():
    manager = RewardManager("naive")
    result = manager.score(["68", "68"], ["68", "68"], ["arithmetic", "mystery"])
    assert result.scores == [1.0, 0.0] and result.metrics["reward/num_errors"] == 1.0
    assert "mystery" in result.error_messages[0]


def test_no_timeout_means_no_deadline(scorer_file):
    manager = RewardManager(
        "naive", custom_fn=f"{scorer_file}:compute_score", num_workers=1, timeout_s=None
    )
    with manager:
        manager.pool.startup_grace_s = 0.0  # would kill at once if a deadline were applied
        assert manager.score(["a"], ["a"], ["x"]).scores == [1.0]
