"""GRPO steps on agent episodes (rollout.agent.loop=tools), CPU, tiny model: the episodes'
tokens reach the update with the loss mask (tool output masked, but attended), the reward
reads the model's final message, and the agent metrics are logged.

The random tiny model never writes a tool call by itself, so the engine client is scripted:
the first turn calls the calculator, the second answers with what the tool returned. The
built-in char tokenizer's template renders tool results as turns of their own (t)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from trainer.trainer_helpers import read_metrics, tiny_config

from hybridflow.agents import client as client_module
from hybridflow.trainer.lifecycle.run import train
from hybridflow.trainer.loop import evaluation, stages

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


@pytest.fixture
def scripted_turns(monkeypatch):
    """EngineClient.generate answers from a script (and records the prompts it saw)."""
    from hybridflow.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    seen = []

    async def generate(self, prompt_ids, params, session=None):
        text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        seen.append(text)
        reply = "42" if "<|im_start|>t" in text else f"Let me compute.{CALL}"
        ids = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        ids = ids[: params.max_new_tokens]
        return SimpleNamespace(token_ids=ids, logprobs=[-0.25] * len(ids), finish_reason="stop")

    monkeypatch.setattr(client_module.EngineClient, "generate", generate)
    return seen


def test_grpo_on_tool_episodes_masks_tool_output_and_logs_agent_metrics(
    tmp_path, scripted_turns, monkeypatch
):
    batches = []
    real_score = stages.score

    def spy_score(run, batch, *step):
        batches.append(batch)
        return real_score(run, batch, *step)

    monkeypatch.setattr(stages, "score", spy_score)
    monkeypatch.setattr(evaluation, "score", spy_score)  # validation's own binding of it
    cfg = tiny_config(
        tmp_path, "rollout.agent.loop=tools", "rollout.agent.tools=[calculator]",
        "rollout.agent.max_turns=3", "data.max_response_length=160",
        "data.max_prompt_length=64", "trainer.total_steps=1", "reward.custom_fn=null",
    )  # fmt: skip
    train(cfg, log=lambda *a, **k: None)
    # validation (8 prompts, one sample each) runs episodes too, before and after the
    # training step of 4 prompts x 4 samples
    assert [len(b) for b in batches] == [8, 16, 8]
    batch = batches[1]
    assert list(batch.arrays["final_text"]) == ["42"] * 16
    assert all(score == 0.0 or score == 1.0 for score in batch.arrays["scores"])
    mask, attention = batch.tensors["response_mask"], batch.tensors["attention_mask"]
    prompt_width = batch.tensors["prompts"].shape[1]
    response_attention = attention[:, prompt_width:]
    # tool output and template glue: attended (1) but out of the loss (0)
    masked = (response_attention == 1) & (mask == 0)
    assert masked.sum(-1).min() > 0
    assert (mask <= response_attention).all()
    # the model's tokens are the two turns: the call with its end token, then "42" + end
    tokens_per_row = mask.sum(-1)
    assert (tokens_per_row == len(f"Let me compute.{CALL}") + 1 + 3).all()
    # the second turn read the calculator's result as a tool turn
    assert any(text.endswith("<|im_start|>t42<|im_end|><|im_start|>a") for text in scripted_turns)
    metrics = read_metrics(cfg.trainer.run_dir)[1]
    assert metrics["rollout/agent_turns"] == 2.0
    assert metrics["rollout/agent_tool_calls"] == 1.0 and metrics["rollout/agent_tool_errors"] == 0
    assert 0 < metrics["rollout/agent_masked_token_fraction"] < 1
    assert metrics["rollout/agent_finish_answer"] == 1.0


def test_the_tools_example_config_validates():
    from trainer.trainer_helpers import REPO

    from hybridflow.config import load_config, validate

    cfg = load_config(REPO / "examples" / "gsm8k_tools.yaml")
    validate(cfg)
    agent = cfg.rollout.agent
    assert (agent.loop, agent.tools, agent.max_turns) == ("tools", ["calculator", "python"], 4)


def test_bad_agent_settings_are_named_before_anything_loads():
    from hybridflow.config import ConfigError, load_config, validate

    with pytest.raises(ConfigError) as error:
        validate(load_config(None, ["rollout.agent.loop=react", "rollout.agent.max_turns=0"]))
    text = str(error.value)
    assert "rollout.agent.loop='react'" in text and "rollout.agent.max_turns=0" in text
    with pytest.raises(ConfigError, match="a tool loop needs tools"):
        validate(load_config(None, ["rollout.agent.loop=tools"]))


@pytest.mark.slow
def test_the_calc_task_runs_end_to_end_from_its_tool_use_warm_start(tmp_path):
    """sft:calc (a few SFT steps on tool-use traces) then a GRPO step of real two-turn
    episodes with the calculator: the pipeline of examples/calc_tools.yaml at toy size (the
    learning itself is measured by running the example: docs/agents.md)."""
    from trainer.trainer_helpers import REPO

    from hybridflow.config import load_config

    cfg = load_config(REPO / "examples" / "calc_tools.yaml", [
        f"trainer.run_dir={tmp_path / 'run'}", f"trainer.cache_dir={tmp_path / 'cache'}",
        "trainer.device=cpu", "trainer.loggers=[jsonl]", "trainer.total_steps=1",
        "trainer.test_freq=0", "sft.total_steps=8", "sft.stop_at_accuracy=null",
        "sft.builtin_size=256", "data.builtin_train_size=32", "data.builtin_val_size=8",
        "data.train_batch_size=4", "data.val_batch_size=8", "rollout.n=2", "rollout.val_n=1",
        "actor.ppo_mini_batch_size=4", "rollout.agent.max_tokens_per_turn=48",
    ])  # fmt: skip
    train(cfg, log=lambda *a, **k: None)
    metrics = read_metrics(cfg.trainer.run_dir)
    assert "val/calc/mean@1" in metrics[0] and "rollout/agent_turns" in metrics[1]
    assert 1 <= metrics[1]["rollout/agent_turns"] <= 2
