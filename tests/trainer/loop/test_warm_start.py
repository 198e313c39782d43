"""The ``sft:<task>`` warm start: its learning-rate floor, its greedy accuracy check, and what
it says when the cap comes before the accuracy target."""

from __future__ import annotations

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.models import load_model, load_tokenizer
from hybridflow.trainer.loop.sft_loop import SFTTrainer
from hybridflow.trainer.loop.warm_start import greedy_accuracy, resolve_model_path


def test_the_sft_learning_rate_decays_to_its_floor_by_lr_decay_steps_then_holds():
    cfg = load_config(
        None,
        ["sft.lr=1e-2", "sft.warmup_steps=0", "sft.lr_decay_steps=10", "sft.min_lr_ratio=0.3"],
    ).sft
    trainer = SFTTrainer(load_model("tiny"), cfg, "cpu", grad_clip=1.0)
    rates = []
    for _ in range(cfg.total_steps // 100):  # well past the decay: the cap is 2000 steps
        rates.append(trainer.core.optimizer.param_groups[0]["lr"])
        trainer.core.optimizer.step()
        trainer.core.scheduler.step()
    # 1e-2 at step 0, half way (0.3 + 0.7 / 2 = 0.65) at step 5, the floor from step 10 on
    assert rates[0] == pytest.approx(1e-2)
    assert rates[5] == pytest.approx(0.65e-2)
    assert rates[10:] == pytest.approx([0.3e-2] * (len(rates) - 10))


class _AlwaysEnds(torch.nn.Module):
    """A model whose greedy choice is always token `eos` (logits [b, T, V]); counts calls."""

    def __init__(self, eos: int, vocab: int = 128):
        super().__init__()
        self.eos, self.vocab, self.calls = eos, vocab, 0
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives the model a device

    def forward(self, ids):
        self.calls += 1
        logits = torch.zeros(*ids.shape, self.vocab)
        logits[..., self.eos] = 1.0
        return logits


def test_greedy_accuracy_stops_decoding_a_batch_once_every_row_has_ended():
    tokenizer = load_tokenizer("char")
    problems = [("1+2=", "3"), ("4+5=", "9"), ("12+34=", "46")]  # two prompt lengths: 2 batches
    model = _AlwaysEnds(tokenizer.eos_token_id)
    assert greedy_accuracy(model, tokenizer, problems, max_new_tokens=8) == 0.0
    assert model.calls == 2  # one decode step per batch, not 8


def test_a_warm_start_that_reaches_its_cap_short_of_the_target_says_so(tmp_path):
    cfg = load_config(
        None,
        [
            "sft.preset=tiny",
            "sft.total_steps=2",
            "sft.builtin_size=32",
            "sft.batch_size=8",
            "sft.stop_at_accuracy=1.0",  # not after 2 steps from scratch
            "sft.eval_every=1",
            "sft.eval_size=4",
            "data.builtin_val_size=8",
            "trainer.device=cpu",
            f"trainer.cache_dir={tmp_path}",
        ],
    )
    messages = []
    resolve_model_path(cfg, log=messages.append)
    checks = [m for m in messages if "greedy accuracy" in m and "target 1.0" in m]
    assert len(checks) == 2  # each check said, with the target
    short = [m for m in messages if "short of sft.stop_at_accuracy = 1.0" in m]
    assert len(short) == 1 and "after 2 steps" in short[0] and "sft.total_steps" in short[0]
