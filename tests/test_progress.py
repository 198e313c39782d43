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
        "training: done, 0 steps in 21s",
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
