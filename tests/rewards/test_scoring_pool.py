"""User scoring code runs in reward worker processes: whatever it does there (exit, print
megabytes, return what is not a number) is a counted failure of its samples, never the end
of the trainer; hybridflow's own scorers stay in the trainer."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import time

import pytest

from hybridflow.errors import UserError
from hybridflow.rewards import RewardManager
from hybridflow.rewards.managers import normalise_value
from hybridflow.rewards.scoring_pool import OUTPUT_CAP_BYTES
from hybridflow.rewards.worker_process import plain_loads

REWARD = textwrap.dedent(
    """
    import math, os

    class Thing:
        pass

    def score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "exit":
            os._exit(0)
        if solution_str == "print":
            print("x" * 1_000_000)
            return 0.5
        return {"huge": 10**400, "digits": 10**5000, "big": 1e300, "past": -1e13,
                "inf": math.inf, "thing": Thing(), "text": "y" * 2_000_000,
                "one": 1.0}[solution_str]
    """
)


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(REWARD)
    return path


def run_python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter: a scorer that ends the process it runs in must not
    end the test session (before the workers existed, it ended the trainer with status 0)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH":
                                                      os.pathsep.join(sys.path)})  # fmt: skip


def test_a_scorer_that_ends_its_process_fails_its_samples_and_a_new_worker_scores(reward_file):
    done = run_python(f"""
        from hybridflow.rewards import RewardManager
        manager = RewardManager("naive", custom_fn="{reward_file}:score")
        result = manager.score(["exit", "one"], ["x"] * 2, ["s"] * 2)
        print(result.scores, result.metrics["reward/num_errors"],
              result.metrics["reward/num_worker_deaths"])
        print(result.error_messages[0])
        print(manager.score(["one"], ["x"], ["s"]).scores)
        """)  # fmt: skip
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == 3, done.stdout + done.stderr
    assert lines[0] == "[0.0, 0.0] 2.0 1.0"  # both samples were in the dead worker's chunk
    assert lines[1].startswith(f"scorer {reward_file}:score: the reward worker process exited "
                               "with code 0 while scoring")  # fmt: skip
    assert lines[2] == "[1.0]"


def test_a_reward_file_that_ends_the_process_at_import_is_a_clear_error(tmp_path):
    reward = tmp_path / "exits.py"
    reward.write_text("import os\nos._exit(0)\n")
    done = run_python(f"""
        from hybridflow.errors import UserError
        from hybridflow.rewards import RewardManager
        try:
            RewardManager("naive", custom_fn="{reward}:score")
        except UserError as error:
            print(error)
        """)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (f"reward.custom_fn: importing {reward}:score ended the reward worker process "
            "(exited with code 0): a reward file must not exit or crash when imported"
            ) in done.stdout  # fmt: skip


def test_a_missing_function_is_named_from_the_worker(reward_file):
    with pytest.raises(UserError, match=r"has no function 'scroe'.*\['score'\]"):
        RewardManager("naive", custom_fn=f"{reward_file}:scroe")


def test_returns_that_are_no_usable_number_are_counted_errors(reward_file):
    answers = ["huge", "digits", "big", "past", "inf", "thing", "text", "one"]
    with RewardManager("naive", custom_fn=f"{reward_file}:score") as manager:
        result = manager.score(answers, ["x"] * 8, ["s"] * 8)
    assert result.scores == [0.0] * 7 + [1.0]
    assert result.metrics["reward/num_errors"] == 7.0
    named = f"scorer {reward_file}:score: returned"
    assert all(m.startswith(f"scorer {reward_file}:score") for m in result.error_messages)
    assert result.error_messages[0] == (f"{named} an int of about 401 digits; expected a finite "
                                        "number of at most 1e+12 in size, or a dict with a "
                                        "'score'")  # fmt: skip


@pytest.mark.parametrize("value", [10**400, 1e300, -1e13, float("nan")])
def test_normalise_refuses_what_a_float32_score_cannot_hold(value):
    with pytest.raises(ValueError, match="expected a finite number of at most 1e\\+12"):
        normalise_value(value)


def test_printed_output_is_captured_capped_and_counted(reward_file, capfd):
    with RewardManager("naive", custom_fn=f"{reward_file}:score") as manager:
        result = manager.score(["print"] * 4, ["x"] * 4, ["s"] * 4)
    assert result.scores == [0.5] * 4
    assert capfd.readouterr().out == ""  # nothing reached the trainer's stdout
    ((name, text),) = result.output
    assert name == f"{reward_file}:score" and text == "x" * OUTPUT_CAP_BYTES
    assert result.metrics["reward/output_bytes"] == 4 * 1_000_001
    assert result.metrics["reward/output_bytes_dropped"] == 4 * 1_000_001 - OUTPUT_CAP_BYTES


def test_answers_are_read_as_plain_data_only():
    assert plain_loads(pickle.dumps({"score": [1.0, "a", None]})) == {"score": [1.0, "a", None]}
    with pytest.raises(pickle.UnpicklingError, match="collections.OrderedDict"):
        plain_loads(pickle.dumps(__import__("collections").OrderedDict()))


def test_the_projects_own_scorers_stay_in_the_trainer():
    manager = RewardManager("naive")
    assert manager.score(["68"], ["68"], ["arithmetic"]).scores == [1.0]
    assert manager.pool._workers == {}  # no process started for them


def test_a_worker_ends_with_the_trainer_even_while_its_scorer_runs(tmp_path):
    reward = tmp_path / "sleeps.py"
    reward.write_text("import time\n\n"
                      "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    time.sleep(60)\n")  # fmt: skip
    done = run_python(f"""
        import os, threading, time
        from hybridflow.rewards import RewardManager
        manager = RewardManager("naive", custom_fn="{reward}:score", timeout_s=None)
        print(manager.pool._workers[0].process.pid, flush=True)
        # scored from a thread that ends first, as a step scored beside training may be
        threading.Thread(target=manager.score, args=(["a"], ["x"], ["s"]), daemon=True).start()
        time.sleep(0.5)
        os._exit(0)  # the trainer is gone; its worker is in the scorer's 60 s sleep
        """)  # fmt: skip
    worker = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:  # gone, or a zombie where nothing reaps orphans
            if open(f"/proc/{worker}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.1)
    os.kill(worker, 9)
    pytest.fail("the reward worker outlived the trainer")


def test_a_reward_file_that_hangs_at_import_is_named_after_the_grace(tmp_path):
    from hybridflow.rewards.scoring_pool import ScoringPool

    reward = tmp_path / "hangs.py"
    reward.write_text("while True:\n    pass\n")
    with ScoringPool(startup_grace_s=1.0) as pool:
        message, fix = pool.check_loads(f"{reward}:score")
        assert pool._workers == {}  # the hung worker was killed
    assert message == f"reward.custom_fn: importing {reward}:score took more than 1s"
    assert fix == "make the file fast to import (no work at import time)"


def test_a_stop_signal_to_every_process_does_not_fail_the_scores_of_the_step(tmp_path):
    import signal
    import threading

    reward = tmp_path / "slow.py"
    reward.write_text("import time\n\n"
                      "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    time.sleep(1.0)\n"
                      "    return 1.0\n")  # fmt: skip
    with RewardManager("naive", custom_fn=f"{reward}:score") as manager:
        worker = manager.pool._workers[0].process.pid
        # as a job scheduler's SIGTERM reaches the worker while the trainer finishes its step
        threading.Timer(0.3, os.kill, (worker, signal.SIGTERM)).start()
        result = manager.score(["a", "b"], ["x"] * 2, ["s"] * 2)
    assert result.scores == [1.0, 1.0] and result.metrics["reward/num_worker_deaths"] == 0.0
