"""rollout.agent.loop=openai: the user's agent program talks to the engine through the
OpenAI API in text; its episodes train token in, token out (agents/external.py). A GRPO step
of a tiny run with a two-turn program; bad program settings are named."""

from __future__ import annotations

import pytest
from trainer.trainer_helpers import read_metrics, tiny_config

from hybridflow.trainer.lifecycle.run import train
from hybridflow.trainer.loop import evaluation, stages

pytest.importorskip("openai")
pytest.importorskip("aiohttp")

PROGRAM = '''
async def run(client, messages, *, model, extra_info):
    """Ask, answer a fake tool result, ask again; the final answer is the second reply."""
    first = await client.chat.completions.create(model=model, messages=messages)
    messages = messages + [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "RESULT 7"},
    ]
    second = await client.chat.completions.create(model=model, messages=messages)
    return "ANSWER:" + (second.choices[0].message.content or "")


async def fails(client, messages, *, model, extra_info):
    await client.chat.completions.create(model=model, messages=messages)
    raise RuntimeError("the program broke")
'''


def test_grpo_on_episodes_of_an_agent_program(tmp_path, monkeypatch):
    program = tmp_path / "my_agent.py"
    program.write_text(PROGRAM)
    batches = []
    real_score = stages.score

    def spy(run, batch, *step):
        batches.append(batch)
        return real_score(run, batch, *step)

    monkeypatch.setattr(stages, "score", spy)
    monkeypatch.setattr(evaluation, "score", spy)
    cfg = tiny_config(
        tmp_path, "rollout.agent.loop=openai", f"rollout.agent.program={program}:run",
        "data.max_response_length=48", "data.max_prompt_length=64", "trainer.total_steps=1",
        "trainer.val_before_train=false", "rollout.agent.max_tokens_per_turn=16",
    )  # fmt: skip
    train(cfg, log=lambda *a, **k: None)
    batch = batches[0]
    assert len(batch) == 16
    assert all(text.startswith("ANSWER:") for text in batch.arrays["final_text"])
    mask = batch.tensors["response_mask"]
    prompt_width = batch.tensors["prompts"].shape[1]
    attention = batch.tensors["attention_mask"][:, prompt_width:]
    # the model's two turns are trained on; the program's message between them is not
    assert ((attention == 1) & (mask == 0)).sum(-1).min() > 0
    assert (batch.tensors["rollout_logprobs"][mask == 0] == 0).all()
    assert (batch.tensors["rollout_logprobs"][mask == 1] < 0).all()
    metrics = read_metrics(cfg.trainer.run_dir)[1]
    assert metrics["rollout/agent_turns"] == 2.0 and metrics["rollout/agent_finish_error"] == 0
    # a random model rarely ends a turn itself: the last turn ran out of tokens ("length")
    finished = metrics["rollout/agent_finish_answer"] + metrics["rollout/agent_finish_length"]
    assert finished == 1.0


def test_a_failing_program_ends_its_episode_and_training_goes_on(tmp_path):
    program = tmp_path / "my_agent.py"
    program.write_text(PROGRAM)
    cfg = tiny_config(
        tmp_path, "rollout.agent.loop=openai", f"rollout.agent.program={program}:fails",
        "data.max_response_length=16", "data.max_prompt_length=64", "trainer.total_steps=1",
        "trainer.val_before_train=false",
    )  # fmt: skip
    train(cfg, log=lambda *a, **k: None)
    metrics = read_metrics(cfg.trainer.run_dir)[1]
    assert metrics["rollout/agent_finish_error"] == 1.0 and metrics["rollout/agent_turns"] == 1


def test_program_settings_are_checked():
    from hybridflow.agents.external import AgentProgramError, load_program
    from hybridflow.config import ConfigError, load_config, validate

    with pytest.raises(ConfigError, match="runs your agent program"):
        validate(load_config(None, ["rollout.agent.loop=openai"]))
    with pytest.raises(AgentProgramError, match="does not exist"):
        load_program("missing_file.py:run")
    with pytest.raises(AgentProgramError, match="path/to/file.py:function"):
        load_program("no_function_named")
