"""SFT: response-only loss that learns, checkpoints that resume, and the cached `sft:` warm
start of the demo."""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.data.sft_examples import SFTExample
from hybridflow.trainer.loop.sft_loop import examples_to_batch, run_sft, sft_main
from hybridflow.trainer.loop.sft_tasks import builtin_sft_rows, without_carry
from hybridflow.trainer.loop.warm_start import resolve_model_path


def test_batch_layout_puts_loss_on_response_tokens_only():
    example = SFTExample(input_ids=[7, 8, 9, 10, 11], loss_mask=[0, 0, 0, 1, 1])
    batch = examples_to_batch([example, SFTExample([5, 6], [0, 1])], pad_token_id=0)
    assert batch.tensors["prompts"].tolist() == [[7], [5]]
    assert batch.tensors["responses"].tolist() == [[8, 9, 10, 11], [6, 0, 0, 0]]
    # response_mask[t] weights the prediction of responses[t] = input_ids[t + 1]
    assert batch.tensors["response_mask"].tolist() == [[0, 0, 1, 1], [1, 0, 0, 0]]
    assert batch.tensors["attention_mask"].tolist() == [[1] * 5, [1, 1, 0, 0, 0]]


def test_sft_learns_a_fixed_mapping():
    from hybridflow.models import load_model

    cfg = load_config(
        None, ["sft.lr=1e-2", "sft.total_steps=12", "sft.warmup_steps=2", "sft.batch_size=8"]
    ).sft
    # any prompt -> the response "20 21" then "eos" 4; prompt tokens are never in the loss
    examples = [SFTExample([3, p, 20, 21, 4], [0, 0, 1, 1, 1]) for p in range(10, 40)]
    losses = []
    run_sft(
        load_model("tiny"),
        examples,
        cfg,
        device="cpu",
        seed=0,
        pad_token_id=0,
        log=lambda metrics, step: losses.append(metrics["sft/loss"]),
    )
    assert len(losses) == 12
    assert losses[-1] < 0.1 * losses[0]


def test_hybridflow_sft_writes_a_model_and_resumes(tmp_path):
    transformers = __import__("transformers")
    data = tmp_path / "sft.jsonl"
    rows = [{"prompt": f"{i}+1=", "response": str(i + 1)} for i in range(40)]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    common = [
        "model.path=tiny",
        f"sft.train_files=[{data}]",
        "sft.batch_size=8",
        "trainer.save_freq=3",
        "trainer.loggers=[jsonl]",
        "trainer.device=cpu",
        f"trainer.run_dir={tmp_path / 'run'}",
    ]
    sft_main(load_config(None, [*common, "sft.total_steps=3"]))
    out = sft_main(load_config(None, [*common, "sft.total_steps=6"]))
    steps = [json.loads(line)["step"] for line in (tmp_path / "run/sft/metrics.jsonl").open()]
    assert steps[-3:] == [4, 5, 6]  # the second call continued from the step-3 checkpoint
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model(torch.tensor([[3, 4, 5]])).logits.shape[-1] == model.config.vocab_size


def test_sft_resume_falls_back_past_a_damaged_checkpoint(tmp_path, capsys):
    data = tmp_path / "sft.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{i}+1=", "response": str(i + 1)})
                              for i in range(16)))  # fmt: skip
    common = ["model.path=tiny", f"sft.train_files=[{data}]", "sft.batch_size=8",
              "trainer.save_freq=1", "trainer.keep_last_k=3", "trainer.loggers=[jsonl]",
              "trainer.device=cpu", f"trainer.run_dir={tmp_path / 'run'}"]  # fmt: skip
    sft_main(load_config(None, [*common, "sft.total_steps=2"]))
    checkpoints = tmp_path / "run" / "sft" / "checkpoints"
    with open(checkpoints / "step_2" / "actor" / "__0_0.distcp", "r+b") as shard:
        shard.seek(100)
        shard.write(bytes(256))  # same size, zeroed
    capsys.readouterr()
    sft_main(load_config(None, [*common, "sft.total_steps=3"]))
    said = capsys.readouterr().out
    assert f"checkpoint {checkpoints / 'step_2'} is damaged (actor/__0_0.distcp has other" in said
    assert f"resumed SFT from {checkpoints / 'step_1'} (step 1)" in said


def test_without_carry():
    assert without_carry("58+27=") == "75"  # 8+7=15 -> 5, 5+2=7
    assert without_carry("99+99=") == "88"
    assert without_carry("12+30=") == "42"  # no carry: the right answer
    assert without_carry("9-3=") is None


def test_builtin_sft_rows_carry_errors_and_held_out_split():
    from hybridflow.data.arithmetic import arithmetic_splits

    cfg = load_config(None, ["sft.builtin_size=500"]).sft
    held_out = {q for q, _ in arithmetic_splits(0, 50, 0)["test"]}
    clean = builtin_sft_rows("arithmetic", cfg, val_size=50)
    assert not held_out & {messages[0]["content"] for messages, _ in clean}
    assert all(str(eval(m[0]["content"][:-1])) == a for m, a in clean)  # noqa: S307
    careless = builtin_sft_rows(
        "arithmetic", load_config(None, ["sft.builtin_size=500", "sft.carry_error_rate=1"]).sft, 50
    )
    assert all(a == without_carry(m[0]["content"]) for m, a in careless)
    assert sum(a != b for (_, a), (_, b) in zip(clean, careless)) > 100


def test_warm_start_is_trained_once_then_cached(tmp_path):
    cfg = load_config(
        None,
        [
            "sft.preset=tiny",
            "sft.total_steps=2",
            "sft.builtin_size=32",
            "sft.batch_size=8",
            "data.builtin_val_size=8",
            "trainer.device=cpu",
            f"trainer.cache_dir={tmp_path}",
        ],
    )
    messages = []
    path = resolve_model_path(cfg, log=messages.append)
    assert (tmp_path / path.split("/")[-1] / "COMPLETE").is_file()
    assert any("SFT done" in m for m in messages)
    messages.clear()
    assert resolve_model_path(cfg, log=messages.append) == path
    assert any("cached" in m for m in messages) and not any("SFT done" in m for m in messages)
    # Different SFT settings: a different cache entry.
    cfg.sft.total_steps = 3
    assert resolve_model_path(cfg, log=messages.append) != path
    # The early-stop target is part of the key too.
    cfg.sft.total_steps, cfg.sft.stop_at_accuracy = 2, 0.9
    assert resolve_model_path(cfg, log=messages.append) != path


def test_sft_stops_at_the_accuracy_target_and_the_cap_still_applies():
    from hybridflow.models import load_model, load_tokenizer
    from hybridflow.trainer.loop.warm_start import accuracy_stopper, greedy_accuracy

    tokenizer = load_tokenizer("char")
    # a trivially learnable task: every question's answer is "7"
    problems = [(f"{a}+{b}=", "7") for a in range(10, 14) for b in range(10, 14)]
    examples, _ = load_sft_examples_for(problems, tokenizer)

    def train(overrides):
        cfg = load_config(
            None,
            ["sft.lr=1e-2", "sft.warmup_steps=2", "sft.batch_size=16", "sft.eval_every=5"]
            + overrides,
        ).sft
        accuracies = []

        def evaluate(model):
            accuracies.append(greedy_accuracy(model, tokenizer, problems))
            return accuracies[-1]

        trainer = run_sft(
            load_model("tiny"),
            examples,
            cfg,
            device="cpu",
            seed=0,
            pad_token_id=0,
            should_stop=accuracy_stopper(cfg, evaluate, log=lambda _: None),
        )
        return trainer.steps_done, accuracies

    steps, accuracies = train(["sft.total_steps=200", "sft.stop_at_accuracy=0.9"])
    assert steps < 200 and steps % 5 == 0  # stopped at a check, long before the cap
    assert accuracies[-1] >= 0.9 and all(a < 0.9 for a in accuracies[:-1])
    assert greedy_accuracy(load_model("tiny"), tokenizer, problems) < 0.9  # not from the start
    steps, accuracies = train(["sft.total_steps=10", "sft.stop_at_accuracy=1.01"])
    assert steps == 10 and len(accuracies) == 2  # unreachable target: the cap ends it
    steps, accuracies = train(["sft.total_steps=10", "sft.stop_at_accuracy=null"])
    assert steps == 10 and accuracies == []  # no target: no checks


def load_sft_examples_for(problems, tokenizer):
    from hybridflow.data.sft_examples import tokenize_sft_rows

    rows = [([{"role": "user", "content": q}], a) for q, a in problems]
    return tokenize_sft_rows(rows, tokenizer, tokenizer.eos_token_id, 64)


def test_a_stopped_sft_says_where_it_stopped_and_a_resumed_one_counts_its_own_steps(
    tmp_path, capsys, monkeypatch
):
    import os
    import signal

    from hybridflow.cli import main
    from hybridflow.progress import ProgressReporter
    from hybridflow.trainer.loop.sft_loop import SFTTrainer

    close_task = ProgressReporter.close_task

    def closing_said(self, task):  # as after a status line: the task says how it ended
        task.lines = max(task.lines, 1)
        close_task(self, task)

    monkeypatch.setattr(ProgressReporter, "close_task", closing_said)
    step = SFTTrainer.step

    def ctrl_c_in_step_3(self, batch):
        if self.steps_done == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return step(self, batch)

    monkeypatch.setattr(SFTTrainer, "step", ctrl_c_in_step_3)
    data = tmp_path / "sft.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{i}+1=", "response": str(i + 1)})
                              for i in range(16)))  # fmt: skip
    args = ["sft", "model.path=tiny", f"sft.train_files=[{data}]", "sft.batch_size=8",
            "trainer.save_freq=0", "trainer.loggers=[jsonl]", "trainer.device=cpu",
            f"trainer.run_dir={tmp_path / 'run'}"]  # fmt: skip
    assert main([*args, "sft.total_steps=1000"]) == 130
    out, err = capsys.readouterr()
    assert "SFT: stopped at 3 of 1000 steps after" in out and "done" not in out
    saved = tmp_path / "run" / "sft" / "checkpoints" / "step_3"
    assert err.strip() == (
        f"stopped by SIGINT after SFT step 3 of 1000: saved {saved}; run the "
        "same command again to resume"
    )  # a stop asked for, not an error
    monkeypatch.setattr(SFTTrainer, "step", step)
    assert main([*args, "sft.total_steps=5"]) == 0
    out = capsys.readouterr().out
    assert "SFT: done, 2 steps in " in out and "(this run: 4 to 5 of 5)" in out


def test_hybridflow_sft_refuses_a_bad_sft_value_before_any_step(tmp_path):
    from hybridflow.config import ConfigError

    cfg = load_config(None, ["model.path=tiny", "sft.total_steps=-1", "trainer.device=cpu",
                             f"trainer.run_dir={tmp_path / 'run'}"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"sft\.total_steps = -1 must be a whole number >= 1"):
        sft_main(cfg)
    assert not (tmp_path / "run/sft/hf").exists()
