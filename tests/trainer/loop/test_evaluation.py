"""Validation reports how far it is, in a log as on a terminal."""

import re

from progress_helpers import FakeClock, log_reporter
from trainer_helpers import tiny_config


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
    from hybridflow.trainer.lifecycle.run import train

    train(cfg, log=quiet, progress=reporter)
    out = buffer.getvalue()
    assert "validation at step 0: 32 prompts × 1 sample (4 batches of data.val_batch_size=8)" in out
    done = [int(m) for m in re.findall(r"^validation: (\d+)/32 prompts", out, re.M)]
    assert done[:3] == [8, 16, 24]
    assert "validation: done, 32 prompts in" in out
    assert re.search(r"^training \(\w+\): 0/1 steps", out, re.M)  # names the stage it is in


def test_the_validation_line_counts_in_the_singular_and_the_plural():
    from hybridflow.trainer.loop.evaluation import validation_header

    assert validation_header(0, 8, 4, 8) == (
        "validation at step 0: 8 prompts × 4 samples (1 batch of data.val_batch_size=8)"
    )
    assert validation_header(2, 9, 1, 8).endswith(
        "9 prompts × 1 sample (2 batches of data.val_batch_size=8)"
    )
