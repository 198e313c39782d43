"""Progress status lines: what they say, and that they come only after a silence."""

from progress_helpers import FakeClock, log_reporter

from hybridflow.progress import TaskProgress, progress_line


def test_progress_line_counts_elapsed_and_estimates_what_is_left():
    task = TaskProgress("validation", total=1319, unit="prompts", started=0.0, done=512)
    # 70 s for 512 prompts: the other 807 take 70 * 807 / 512 = 110.3 s
    assert progress_line(task, now=70.0) == (
        "validation: 512/1319 prompts (39%), 1m10s elapsed, ~1m50s left"
    )
    phase = TaskProgress("saving checkpoint step_4", total=None, unit="", started=5.0)
    assert progress_line(phase, now=3605.0) == "saving checkpoint step_4: 1h00m elapsed"


def test_a_status_line_only_after_the_interval_of_silence():
    clock = FakeClock()
    reporter, buffer = log_reporter(clock)
    with reporter.task("training", total=10, unit="steps"):
        clock.now = 9.0
        reporter.tick()  # 9 s of silence: nothing yet
        assert buffer.getvalue() == ""
        clock.now = 10.5
        reporter.tick()
        reporter.print("a table row")  # output resets the silence
        clock.now = 15.0
        reporter.tick()
        clock.now = 21.0
        reporter.tick()
    lines = buffer.getvalue().splitlines()
    assert lines == [
        "training: 0/10 steps (0%), 10s elapsed",
        "a table row",
        "training: 0/10 steps (0%), 21s elapsed",
        "training: stopped at 0 of 10 steps after 21s",
    ]


def test_a_terminal_gets_bars_and_the_printed_lines_no_status_lines():
    import io

    from rich.console import Console

    from hybridflow.progress import ProgressReporter

    buffer = io.StringIO()
    terminal = Console(file=buffer, force_terminal=True, width=100)
    reporter = ProgressReporter(terminal, interval_s=0.0, tick_s=None)
    assert reporter.live
    with reporter.task("validation", total=4, unit="prompts") as task:
        reporter.print("a table row")
        task.advance(2)
        reporter.tick()  # a bar, not a status line, even after the interval
    reporter.close()
    out = buffer.getvalue()
    assert "a table row" in out and "elapsed" not in out


def test_steps_longer_than_the_interval_get_no_line_between_their_rows():
    clock = FakeClock()
    reporter, buffer = log_reporter(clock)
    with reporter.task("training", total=10, unit="steps", rows=True) as task:
        for step in range(1, 4):  # steps of 15 s, each ending with its table row
            for second in range(1, 16):
                clock.now = 15.0 * (step - 1) + second
                reporter.tick()
            task.update(step)
            reporter.print(f"row {step}")
        clock.now = 45.0 + 31.0  # a step twice as long as the last one: now a line
        reporter.tick()
    lines = buffer.getvalue().splitlines()
    # the first step's length is not known yet: one line at 10 s, then only the rows
    assert lines[:4] == ["training: 0/10 steps (0%), 10s elapsed", "row 1", "row 2", "row 3"]
    assert lines[4].startswith("training: 3/10 steps (30%), 1m16s elapsed")


def test_a_task_opened_after_a_long_silence_waits_its_own_interval():
    clock = FakeClock()
    reporter, buffer = log_reporter(clock)
    clock.now = 60.0  # a minute of setup printed nothing
    with reporter.task("training", total=2, unit="steps"):
        reporter.tick()  # the task is 0 s old: no "0s elapsed" line
        clock.now = 69.0
        reporter.tick()
    assert buffer.getvalue() == ""  # and no "done" line for a task that said nothing


def _closing(clock, reporter, buffer):
    clock.now += 60.0
    reporter.tick()  # a status line: the task will say how it ended
    return buffer


def test_a_task_that_reaches_its_total_says_done():
    clock = FakeClock()
    reporter, buffer = log_reporter(clock)
    with reporter.task("SFT", total=2000, unit="steps") as task:
        task.update(2000)
        _closing(clock, reporter, buffer)
    assert buffer.getvalue().splitlines()[-1] == "SFT: done, 2000 steps in 1m00s"


def test_a_task_left_short_of_its_total_says_where_it_stopped_not_done():
    # an SFT stopped by SIGINT after step 221 of 2000 said "SFT: done, 221 steps"
    clock = FakeClock()
    reporter, buffer = log_reporter(clock)
    with reporter.task("SFT", total=2000, unit="steps") as task:
        task.update(221)
        _closing(clock, reporter, buffer)
    assert buffer.getvalue().splitlines()[-1] == "SFT: stopped at 221 of 2000 steps after 1m00s"


def test_a_task_without_a_total_stopped_by_its_owner_or_an_error_says_stopped():
    import pytest

    clock = FakeClock()
    reporter, buffer = log_reporter(clock)
    with reporter.task("warm start SFT", unit="steps") as task:
        task.update(221)
        task.stopped = True  # the owner knows: a stop request, not the accuracy target
        _closing(clock, reporter, buffer)
    assert buffer.getvalue().splitlines()[-1] == "warm start SFT: stopped at 221 steps after 1m00s"
    with pytest.raises(KeyboardInterrupt), reporter.task("validation", unit="prompts") as task:
        task.update(5)
        _closing(clock, reporter, buffer)
        raise KeyboardInterrupt
    assert buffer.getvalue().splitlines()[-1] == "validation: stopped at 5 prompts after 1m00s"


def test_a_resumed_task_counts_this_runs_units_and_says_where_it_started():
    # a run resumed at step 6 of 20 said "done, 20 steps" after doing 14
    clock = FakeClock()
    reporter, buffer = log_reporter(clock)
    with reporter.task("training", total=20, unit="steps", done=6) as task:
        task.update(20)
        _closing(clock, reporter, buffer)
    assert buffer.getvalue().splitlines()[-1] == (
        "training: done, 14 steps in 1m00s (this run: 7 to 20 of 20)"
    )
