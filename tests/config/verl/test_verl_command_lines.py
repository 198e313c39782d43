"""verl's example command lines start training: each runs one step at toy size, with our
keys added after it (ours win) for the model, the data and the devices of this machine."""

import json
from pathlib import Path

import pytest
from verl_command_lines import RUNS, command_line

from hybridflow.cli import main

DIGIT_REWARD = Path(__file__).resolve().parents[2] / "trainer" / "digit_reward.py"
TOY = [
    "model.path=tiny",
    "critic.path=null",
    "data.train_files=[builtin:arithmetic]",
    "data.val_files=[]",
    "data.builtin_train_size=16",
    "data.train_batch_size=4",
    "data.max_prompt_length=24",
    "data.max_response_length=6",
    "actor.ppo_mini_batch_size=4",
    "critic.ppo_mini_batch_size=4",
    "actor.micro_batch_size_per_gpu=4",
    "ref.micro_batch_size_per_gpu=4",
    "critic.micro_batch_size_per_gpu=4",
    "trainer.total_steps=1",
    "trainer.n_gpus_per_node=1",
    "rollout.tensor_parallel_size=1",  # one device here: one engine on it
    "trainer.device=cpu",
    "trainer.loggers=[jsonl]",
    "trainer.save_freq=-1",
    f"reward.custom_fn={DIGIT_REWARD}:digit_fraction",
]

# Layouts that need several devices run on as many CPU processes (trainer.backend=local).
DEVICES = {"ppo_deepseek7b_llm_sp2": ["trainer.backend=local", "trainer.n_gpus_per_node=2"]}


@pytest.mark.parametrize("name", RUNS)
def test_verl_example_command_line_starts_training(name, tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc = main(
        [
            "train",
            *command_line(name),
            *TOY,
            *DEVICES.get(name, []),
            f"trainer.run_dir={run_dir}",
            f"trainer.cache_dir={tmp_path / 'cache'}",
        ]  # fmt: skip
    )
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "verl keys translated" in err and "unknown key" not in err
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1]


def test_total_epochs_sets_the_run_length_from_the_data(tmp_path, capsys):
    toy = [item for item in TOY if not item.startswith("trainer.total_steps")]
    run_dir = tmp_path / "run"
    rc = main(["train", *toy, "trainer.total_epochs=2", f"trainer.run_dir={run_dir}"])
    out = capsys.readouterr().out
    assert rc == 0
    prompts = int(out.split("trainer.total_epochs = 2 over ")[1].split()[0])
    steps = 2 * (prompts // 4)  # the sampler drops each epoch's last partial batch
    assert f"in batches of 4: {steps} steps" in out
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["step"] for row in rows] == list(range(1, steps + 1))
