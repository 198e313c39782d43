"""Reward failures are loud: a return that is not a number is an error, each distinct error
is printed once, a mostly failed step is flagged, an always failing reward stops the run
(exit 2), and timeouts of one step run concurrently."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from hybridflow.errors import UserError
from hybridflow.rewards import RewardManager
from hybridflow.rewards.managers import RewardResult
from hybridflow.rewards.monitor import RewardFailureMonitor

SCORERS = textwrap.dedent(
    """
    import math, time

    def returns(data_source, solution_str, ground_truth, extra_info=None):
        return {"none": None, "text": "high", "nan": math.nan, "one": 1.0}[solution_str]

    def sleeps(data_source, solution_str, ground_truth, extra_info=None):
        with open(ground_truth, "a") as log:  # when each call started
            log.write(f"{time.monotonic()}\\n")
        time.sleep(30)

    def busy(data_source, solution_str, ground_truth, extra_info=None):
        end = time.thread_time() + 0.04  # 40 ms of CPU, however long the GIL makes it
        while time.thread_time() < end:
            pass
        return 1.0

    def spins(data_source, solution_str, ground_truth, extra_info=None):
        while True:
            pass

    def numpy_score(data_source, solution_str, ground_truth, extra_info=None):
        import numpy as np
        return np.float64(0.5)  # a float subclass, as np.mean returns

    def forks(data_source, solution_str, ground_truth, extra_info=None):
        import os
        child = os.fork()
        if child == 0:
            time.sleep(60)
            os._exit(0)
        with open(ground_truth, "w") as log:
            log.write(str(child))
        return 1.0

    class Abort(BaseException):
        pass

    def exits(data_source, solution_str, ground_truth, extra_info=None):
        import os, sys
        if solution_str == "exit":
            sys.exit(3)
        if solution_str == "interrupt":
            raise KeyboardInterrupt("from the scorer")
        if solution_str == "abort":
            raise Abort("from the scorer")
        if solution_str == "signal":  # Ctrl-C reaching the trainer while the scorer runs
            import signal
            os.kill(os.getppid(), signal.SIGINT)
            time.sleep(30)
        return 1.0
    """
)


@pytest.fixture
def scorers(tmp_path):
    path = tmp_path / "scorers.py"
    path.write_text(SCORERS)
    return lambda name, **kw: RewardManager("naive", custom_fn=f"{path}:{name}", **kw)


def test_none_text_and_nan_are_errors_not_zero_scores(scorers):
    result = scorers("returns").score(["none", "text", "nan", "one"], ["x"] * 4, ["s"] * 4)
    assert result.scores == [0.0, 0.0, 0.0, 1.0]
    assert result.metrics["reward/num_errors"] == 3.0
    joined = " | ".join(result.error_messages)
    assert "returned None" in joined and "'high'" in joined and "nan" in joined


def test_timeouts_of_one_step_run_concurrently(scorers, tmp_path):
    started_log = tmp_path / "started.txt"
    manager = scorers("sleeps", timeout_s=1.0)
    begin = time.monotonic()
    result = manager.score(["a"] * 8, [str(started_log)] * 8, ["s"] * 8)
    elapsed = time.monotonic() - begin
    assert result.metrics["reward/num_timeouts"] == 8.0
    starts = [float(line) for line in started_log.read_text().split()]
    assert len(starts) == 8 and max(starts) - min(starts) < 1.0  # all running at once
    assert elapsed < 4.0  # one after another: 8 s


@pytest.fixture
def one_busy_cpu():
    """This thread (so the scorer threads it starts) on one CPU, shared with a process that
    spins there: the scorers run about half the time, and wait for the CPU the other half."""
    if not hasattr(os, "sched_setaffinity"):
        yield  # no affinity (macOS): the scorers run on an idle machine
        return
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})  # this thread's; children inherit it
    spinner = subprocess.Popen([sys.executable, "-c", "print(flush=True)\nwhile True: pass"],
                               stdout=subprocess.PIPE)  # fmt: skip
    try:
        spinner.stdout.readline()  # spinning
        yield
    finally:
        spinner.kill()
        spinner.wait()
        os.sched_setaffinity(0, allowed)


def test_cpu_bound_scorers_are_timed_by_their_own_work(scorers, one_busy_cpu):
    # 32 × 40 ms of CPU = 1.28 s in all, more than the 0.5 s timeout: run concurrently under
    # the GIL each call's wall time approaches 1.28 s (twice that beside the spinner), yet
    # none used its 0.5 s, nor waited for the CPU that long itself (the others' waits are
    # theirs: about 1.28 s in all).
    result = scorers("busy", timeout_s=0.5).score(["a"] * 32, ["x"] * 32, ["s"] * 32)
    assert result.scores == [1.0] * 32 and result.metrics["reward/num_timeouts"] == 0.0


def test_a_spinning_scorer_is_interrupted(scorers):
    before = set(threading.enumerate())  # (sleeping scorers of other tests may linger)
    result = scorers("spins", timeout_s=0.2).score(["a", "b"], ["x"] * 2, ["s"] * 2)
    assert result.metrics["reward/num_timeouts"] == 2.0
    deadline = time.monotonic() + 5
    while any(t.name == "hybridflow-scorer" for t in set(threading.enumerate()) - before):
        assert time.monotonic() < deadline, "the spinning scorer threads were not stopped"
        time.sleep(0.05)


@pytest.mark.parametrize("where", [{}, {"timeout_s": 5.0}, {"num_workers": 1}],
                         ids=["main-thread", "threads", "worker-process"])  # fmt: skip
def test_sys_exit_and_base_exceptions_of_a_scorer_are_its_errors(scorers, where, tmp_path):
    answers = ["exit", "interrupt", "abort", "fine"]
    with scorers("exits", **where) as manager:
        result = manager.score(answers, ["x"] * 4, ["s"] * 4)
    assert result.scores == [0.0, 0.0, 0.0, 1.0]
    assert result.metrics["reward/num_errors"] == 3.0
    target = f"{tmp_path / 'scorers.py'}:exits"
    assert result.error_messages[0] == (
        f"scorer {target} called sys.exit(3); a reward function must return a score (or "
        "raise an exception), not exit"
    )
    assert result.error_messages[1:] == [f"scorer {target}: KeyboardInterrupt: from the scorer",
                                         f"scorer {target}: Abort: from the scorer"]  # fmt: skip


def test_a_numpy_float_is_a_score_not_a_dead_worker(scorers):
    """np.float64 is a float subclass: it reached the trainer as a numpy class, which the
    plain-data unpickler refuses (a worker death and a 0 for every sample)."""
    with scorers("numpy_score") as manager:
        result = manager.score(["a"], ["x"], ["s"])
    assert result.scores == [0.5] and result.metrics["reward/num_worker_deaths"] == 0.0


def test_processes_a_scorer_leaves_running_end_with_its_worker(scorers, tmp_path):
    log = tmp_path / "child.txt"
    with scorers("forks") as manager:
        assert manager.score(["a"], [str(log)], ["s"]).scores == [1.0]
    child = int(log.read_text())
    deadline = time.monotonic() + 5
    while _running(child):
        assert time.monotonic() < deadline, "the scorer's child outlived the reward manager"
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for its new parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_ctrl_c_during_a_scorer_still_interrupts(scorers):
    manager = scorers("exits", timeout_s=None)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        manager.score(["signal"], ["x"], ["s"])
    assert time.monotonic() - start < 10  # not after the scorer's 30 s sleep
    start = time.monotonic()
    assert manager.score(["fine"], ["x"], ["s"]).scores == [1.0]  # the busy worker was replaced
    assert time.monotonic() - start < 10  # a new worker, not the interrupted one's answer


def test_a_reward_file_that_exits_on_import_is_named(tmp_path):
    reward = tmp_path / "exits_on_import.py"
    reward.write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(UserError, match=r"importing .*exits_on_import.py failed: it called "
                                        r"sys.exit\(0\)"):  # fmt: skip
        RewardManager("naive", custom_fn=f"{reward}:score")


def failing(size: int, failed: int, message: str = "scorer f: ValueError: bad") -> RewardResult:
    metrics = {"reward/num_errors": float(failed), "reward/num_timeouts": 0.0}
    return RewardResult([0.0] * size, metrics, error_messages=[message] if failed else [])


def test_monitor_prints_each_distinct_message_once_and_flags_mostly_failed_steps():
    lines = []
    monitor = RewardFailureMonitor(lines.append, patience=3)
    monitor.observe(failing(8, 1), step=1)
    monitor.observe(failing(8, 7), step=2)
    monitor.observe(failing(8, 7, "scorer f: KeyError: 'x'"), step=3)
    shown = [line for line in lines if line.startswith("reward error")]
    assert shown == ["reward error (shown once): scorer f: ValueError: bad",
                     "reward error (shown once): scorer f: KeyError: 'x'"]  # fmt: skip
    flagged = [line for line in lines if line.startswith("warning")]
    assert len(flagged) == 2 and "step 2: the reward failed on 7 of 8 samples" in flagged[0]


def test_monitor_shows_the_scoring_codes_output_up_to_a_cap_per_run():
    from hybridflow.rewards.monitor import MAX_OUTPUT_CHARS

    lines = []
    monitor = RewardFailureMonitor(lines.append)
    for step in (1, 2, 3):
        printed = RewardResult([1.0], {"reward/output_bytes_dropped": 5.0},
                               output=[("f.py:score", "y" * 30_000)])  # fmt: skip
        monitor.observe(printed, step=step)
    shown = "".join(lines)
    assert lines[0] == "reward output (f.py:score):\n" + "y" * 30_000
    assert "reward output: 5 more bytes dropped this step" in lines[1]
    assert MAX_OUTPUT_CHARS <= len(shown) < MAX_OUTPUT_CHARS + 1000
    assert sum("characters shown in this run" in line for line in lines) == 1
    monitor.observe(printed, step=4)
    assert "".join(lines) == shown  # nothing more once the cap is reached


def test_monitor_stops_after_consecutive_all_failed_steps_only():
    monitor = RewardFailureMonitor(lambda line: None, patience=3)
    for step in (1, 2):
        monitor.observe(failing(4, 4), step=step)
    monitor.observe(failing(4, 3), step=3)  # one sample scored: the count starts over
    monitor.observe(failing(4, 4), step=4, training=False)  # validation does not count
    for step in (4, 5):
        monitor.observe(failing(4, 4), step=step)
    with pytest.raises(UserError, match="every sample for 3 steps in a row.*ValueError: bad"):
        monitor.observe(failing(4, 4), step=6)


def test_a_reward_returning_none_stops_training_with_exit_2(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
    from trainer_helpers import TINY

    from hybridflow.cli import main

    reward = tmp_path / "none_reward.py"
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return None\n")  # fmt: skip
    status = main(["train", *TINY, f"trainer.run_dir={tmp_path / 'run'}",
                   "trainer.total_steps=5", f"reward.custom_fn={reward}:score",
                   "trainer.val_before_train=false"])  # fmt: skip
    captured = capsys.readouterr()
    output = captured.out + captured.err
    assert status == 2 and "Traceback" not in output
    assert output.count("reward error (shown once)") == 1 and "returned None" in output
    assert "every sample for 3 steps in a row (up to step 3)" in captured.err


def test_a_reward_calling_sys_exit_stops_training_with_exit_2_naming_it(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
    from trainer_helpers import TINY

    from hybridflow.cli import main

    reward = tmp_path / "exit_reward.py"
    reward.write_text("import sys\n\n"
                      "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    sys.exit(0)\n")  # fmt: skip
    status = main(["train", *TINY, f"trainer.run_dir={tmp_path / 'run'}",
                   "trainer.total_steps=5", f"reward.custom_fn={reward}:score",
                   "trainer.val_before_train=false"])  # fmt: skip
    captured = capsys.readouterr()
    assert status == 2 and "Traceback" not in captured.out + captured.err
    assert f"{reward}:score called sys.exit(0)" in captured.out
    assert "every sample for 3 steps in a row (up to step 3)" in captured.err


def test_timeouts_in_worker_processes_run_concurrently(scorers, tmp_path):
    started_log = tmp_path / "started.txt"
    with scorers("sleeps", timeout_s=1.0, num_workers=2) as manager:
        result = manager.score(["a"] * 8, [str(started_log)] * 8, ["s"] * 8)
    assert result.metrics["reward/num_timeouts"] == 8.0
    starts = sorted(float(line) for line in started_log.read_text().split())
    assert len(starts) == 8 and starts[-1] - starts[0] < 1.0  # not 4 rounds of 2


def train_with_reward(tmp_path, capsys, reward_body: str, *overrides: str):
    """``hybridflow train`` of the tiny preset scored by a reward file whose function body is
    ``reward_body``: (exit status, stdout, stderr). A reward that ends or breaks the process
    it runs in would end the test session if it ran in the trainer: there it raises instead,
    so the test fails."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
    from trainer_helpers import TINY

    from hybridflow.cli import main

    reward = tmp_path / "reward.py"
    reward.write_text(f"import os, sys\n\n"
                      "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      f"    if os.getpid() == {os.getpid()}:\n"
                      "        raise RuntimeError('scored in the trainer process')\n"
                      + textwrap.indent(textwrap.dedent(reward_body), "    "))  # fmt: skip
    status = main(["train", *TINY, f"trainer.run_dir={tmp_path / 'run'}",
                   f"reward.custom_fn={reward}:score", "trainer.val_before_train=false",
                   "trainer.total_steps=1", *overrides])  # fmt: skip
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_a_reward_ending_its_process_stops_training_with_exit_2_naming_it(tmp_path, capsys):
    status, out, err = train_with_reward(tmp_path, capsys, "os._exit(0)\n",
                                         "reward.max_failed_steps=1")  # fmt: skip
    assert status == 2 and "Traceback" not in out + err
    assert f"{tmp_path / 'reward.py'}:score: the reward worker process exited with code 0" in out
    assert "every sample for 1 steps in a row (up to step 1)" in err


def test_a_reward_closing_stdout_and_stderr_loses_only_its_own_output(tmp_path, capsys):
    status, out, err = train_with_reward(tmp_path, capsys, """
        print("before closing")
        sys.stdout.close()
        os.close(1)
        os.close(2)
        return 1.0
        """)  # fmt: skip
    assert status == 0, out + err
    assert f"reward output ({tmp_path / 'reward.py'}:score):\nbefore closing" in out
    assert "done: 1 steps" in out


def test_a_reward_printing_megabytes_is_capped_in_the_log(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
    from trainer_helpers import TINY

    from hybridflow.cli import main

    reward = tmp_path / "chatty.py"
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    print('x' * 1_000_000)\n"
                      "    return 1.0\n")  # fmt: skip
    status = main(["train", *TINY, f"trainer.run_dir={tmp_path / 'run'}",
                   "trainer.total_steps=2", f"reward.custom_fn={reward}:score",
                   "trainer.val_before_train=false"])  # fmt: skip
    captured = capsys.readouterr()
    output = captured.out + captured.err
    assert status == 0, output
    assert len(output) < 200_000  # 16 samples x 1 MB a step printed whole: 32 MB
    assert "more bytes dropped this step (counted in reward/output_bytes_dropped)" in output
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert metrics[0]["reward/output_bytes_dropped"] > 15_000_000
