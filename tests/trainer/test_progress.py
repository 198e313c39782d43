"""Progress reporting: status lines in logs, the fixed-width step table, collected warnings."""

import io
import re
import warnings

from rich.console import Console
from trainer_helpers import tiny_config

from hybridflow.trainer.loggers import CELL_WIDTH, STEP_WIDTH, ConsoleLogger
from hybridflow.trainer.progress import ProgressReporter, TaskProgress, progress_line


class FakeClock:
    """Seconds that move only when told (or by ``step`` on every read)."""

    def __init__(self, step: float = 0.0):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def log_reporter(clock, interval_s=10.0):
    """A reporter writing to a non-terminal buffer, as in a log file (no bars)."""
    buffer = io.StringIO()
    console = Console(file=buffer, width=60, force_terminal=False)
    return ProgressReporter(console, interval_s=interval_s, tick_s=None, clock=clock), buffer


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


def test_long_validation_reports_progress_in_a_log(tmp_path, quiet):
    # 32 validation prompts in 4 batches; each clock read moves 11 s, more than the 10 s
    # interval, so every batch done is a status line.
    reporter, buffer = log_reporter(FakeClock(step=11.0))
    cfg = tiny_config(
        tmp_path,
        "data.builtin_val_size=32",
        "data.val_batch_size=8",
        "trainer.total_steps=1",
        "trainer.save_freq=-1",
        "trainer.loggers=[console]",
    )
    from hybridflow.trainer.run import train

    train(cfg, log=quiet, progress=reporter)
    out = buffer.getvalue()
    assert "validation at step 0: 32 prompts × 1 sample (4 batches of data.val_batch_size=8)" in out
    done = [int(m) for m in re.findall(r"^validation: (\d+)/32 prompts", out, re.M)]
    assert done[:3] == [8, 16, 24]
    assert "validation: done, 32 prompts in" in out
    assert re.search(r"^training \(\w+\): 0/1 steps", out, re.M)  # names the stage it is in


def test_table_lines_have_one_width_whatever_the_values_and_terminal():
    buffer = io.StringIO()
    logger = ConsoleLogger(console=Console(file=buffer, width=40, force_terminal=False))
    first = {"score/mean": 0.5, "actor/pg_loss": -2.484e-09, "actor/grad_norm": 12345678.9}
    logger.log({**first, "timing_s/step": 1.5, "perf/tokens_per_s_per_gpu": 123456789012}, 1)
    logger.log({"score/mean": None, "actor/pg_loss": 1e300, "timing_s/step": 0.001}, 2)
    logger.close()
    lines = buffer.getvalue().splitlines()
    width = STEP_WIDTH + 5 * (CELL_WIDTH + 1)  # step, then score, pg_loss, grad, tok/s, step_s
    assert len(lines) == 3  # header and two rows: nothing wrapped at the 40 columns
    assert [len(line) for line in lines] == [width] * 3
    assert lines[2].split() == ["2", "-", "1e+300", "-", "-", "0.001"]


def test_warnings_print_once_above_a_fresh_header_never_between_rows():
    reporter, buffer = log_reporter(FakeClock())
    logger = ConsoleLogger(progress=reporter)
    with reporter.collecting_warnings():
        logger.log({"score/mean": 0.1}, 1)
        for _ in range(3):
            warnings.warn("a library says so", UserWarning, stacklevel=1)
        logger.log({"score/mean": 0.2}, 2)
        logger.log({"score/mean": 0.3}, 3)
    lines = [line.strip() for line in buffer.getvalue().splitlines()]
    assert len(lines) == 6, lines
    assert lines[0].split() == ["step", "score"] and lines[1].split() == ["1", "0.1"]
    assert lines[2].startswith("warning: UserWarning: a library says so (trainer/test_progress")
    assert lines[3].split() == ["step", "score"]
    assert [line.split()[0] for line in lines[4:]] == ["2", "3"]
