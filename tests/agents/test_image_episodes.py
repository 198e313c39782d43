"""Agent episodes whose first prompt carries images (tiny-vl, fp32, CPU): two turns with a tool
between them through kept K/V sample what re-prefilling every turn samples, the vision encoder
runs once an episode, the trainer's log-probs over the whole sequence (the images, both
turns, the tool's result) equal the engine's, a tool returning an image is refused, and GRPO
trains on such episodes on the shapes task."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from hybridflow.agents.client import EngineClient
from hybridflow.agents.images import ToolImageError
from hybridflow.agents.loop import Episode, LoopLimits, ToolCallingLoop
from hybridflow.agents.parsers import ParsedTurn, ToolCall
from hybridflow.agents.rollout import pack_trajectories
from hybridflow.agents.templates import with_tool_template
from hybridflow.data.image_batch import MROPE_POSITIONS, extend_positions, prompt_image_fields
from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.images import PromptImages
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config
from hybridflow.models.tokenizer import build_char_tokenizer
from hybridflow.protocol import Batch

CONFIG = preset_config("tiny-vl")
SPEC = CONFIG.vision
TOKENIZER = with_tool_template(build_char_tokenizer(vision=True))
GRIDS = [torch.tensor([[1, 4, 6]]), torch.tensor([[1, 4, 4], [1, 2, 8]])]  # 6; 4 + 4 tokens
MESSAGES = [[{"role": "user", "content": "<image>How many?"}],
            [{"role": "user", "content": "<image>Same as <image>?"}]]  # fmt: skip


class Look:
    """A tool that describes the picture in text."""

    name = "look"
    description = "Describe the picture."
    parameters = {"type": "object", "properties": {}}

    def __init__(self, result="two red squares"):
        self.result = result

    async def __call__(self, arguments: dict):
        return self.result


class EveryTurnLooks:
    """A parser that reads a call of `look` in every turn (the random model writes none)."""

    def parse(self, text: str) -> ParsedTurn:
        return ParsedTurn(text, [ToolCall("look", {})])


class Prefilling:
    """A client without sessions: every turn prefills its whole prompt, images included."""

    def __init__(self, client: EngineClient):
        self.client = client

    async def generate(self, prompt_ids, params, images=None):
        return await self.client.generate(prompt_ids, params, images=images)


@pytest.fixture(scope="module")
def model():
    """Peaked language-model weights (std 0.3), encoder weights that move the logits."""
    generator = torch.Generator().manual_seed(1)
    model = build_model(CONFIG, seed=1).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if not name.endswith("bias"):
            p.normal_(0, 0.1 if name.startswith("visual.") else 0.3, generator=generator)
    return model


def _episodes():
    generator = torch.Generator().manual_seed(0)
    images = [PromptImages(torch.randn(int(g.prod(-1).sum()), SPEC.patch_elements,
                                       generator=generator), g) for g in GRIDS]  # fmt: skip
    return [Episode(m, seed=10 + i, images=p) for i, (m, p) in enumerate(zip(MESSAGES, images))]


def _loop(tool=None) -> ToolCallingLoop:
    return ToolCallingLoop(TOKENIZER, {"look": tool or Look()},
                           SamplingParams(temperature=1.0, ignore_eos=True),
                           parser=EveryTurnLooks(),
                           limits=LoopLimits(max_turns=2, max_tokens=128, max_tokens_per_turn=6),
                           image_merge_size=SPEC.spatial_merge_size)  # fmt: skip


def _run(model, kept: bool):
    """Both episodes, concurrently -> (trajectories, images encoded, prefilled tokens)."""
    engine = Engine(model, max_batch_size=4, max_seq_len=512,
                    options=EngineOptions(decode_backend="torch", cuda_graphs=False))  # fmt: skip
    calls = []
    # the images of each encoder call (one call a prefill pass, for all its prompts')
    hook = model.visual.register_forward_hook(lambda _, args, out: calls.append(len(args[1])))
    client = EngineClient(engine)
    loop = _loop()

    async def both():
        talker = client if kept else Prefilling(client)
        return await asyncio.gather(*(loop.run(e, talker) for e in _episodes()))

    try:
        trajectories = asyncio.run(both())
    finally:
        hook.remove()
        client.close()
    return trajectories, sum(calls), engine.prefill_tokens


def test_two_turns_with_a_tool_continue_the_kept_kv_as_re_prefilled_turns_sample(model):
    kept, kept_images, kept_prefilled = _run(model, kept=True)
    full, full_images, full_prefilled = _run(model, kept=False)
    for a, b in zip(kept, full):
        assert [t.generated_tokens for t in a.turns] == [6, 6] and a.finish_reason == "max_turns"
        assert a.prompt_ids == b.prompt_ids and a.response_ids == b.response_ids
        torch.testing.assert_close(a.response_logprobs, b.response_logprobs, rtol=0, atol=1e-5)
        assert a.messages[2] == {"role": "tool", "name": "look", "content": "two red squares"}
    # the prompt's image tokens, one a merged patch, and its mRoPE rows
    assert kept[1].prompt_ids.count(SPEC.image_token_id) == 8
    assert kept[1].prompt_positions.shape == (3, len(kept[1].prompt_ids))
    # each episode's images (1 and 2) encoded once (its first prefill); re-prefilling encodes
    # them every turn
    assert (kept_images, full_images) == (3, 6)
    assert kept_prefilled < full_prefilled - sum(len(t.prompt_ids) for t in kept)


def test_the_trainers_logprobs_over_the_episode_equal_the_engines(model):
    """The packed episodes (prompt with images, both turns, the tool's result between) through
    the trainer's log-prob pass: the engine's log-probs on every model token (fp32)."""
    from hybridflow.config import ActorConfig
    from hybridflow.learners import ActorLearner

    trajectories, _, _ = _run(model, kept=True)
    width = 128
    packed = pack_trajectories(trajectories, width, pad_token_id=0)
    tensors = packed["tensors"]
    prompts, prompt_mask = tensors["agent_prompts"], tensors["agent_prompt_mask"]
    episodes = _episodes()
    fields, arrays = prompt_image_fields(
        [t.prompt_positions for t in trajectories], [e.images.pixel_values for e in episodes],
        [e.images.image_grid_thw for e in episodes], prompts.shape[1],
    )  # fmt: skip
    assert torch.equal(fields[MROPE_POSITIONS], tensors["agent_mrope_positions"])
    attention = tensors["response_attention_mask"]
    batch = {
        MROPE_POSITIONS: extend_positions(tensors["agent_mrope_positions"], attention),
        "prompts": prompts, "responses": tensors["responses"],
        "attention_mask": torch.cat([prompt_mask, attention.long()], dim=1),
        "response_mask": tensors["response_mask"],
    }  # fmt: skip
    trained = copy.deepcopy(model).requires_grad_(True)
    actor = ActorLearner(trained, ActorConfig(ppo_mini_batch_size=2), total_steps=1, device="cpu")
    trainer = actor.compute_logprobs(Batch(batch, arrays))["old_logprobs"]
    model_tokens = tensors["response_mask"].bool()
    assert model_tokens.sum() == 24 and (~model_tokens & attention.bool()).any()
    gap = (trainer - tensors["rollout_logprobs"])[model_tokens].abs().max()
    assert gap <= 1e-5


def test_a_tool_returning_an_image_is_refused_naming_it(model):
    engine = Engine(model, max_batch_size=2, max_seq_len=512,
                    options=EngineOptions(decode_backend="torch", cuda_graphs=False))  # fmt: skip
    client = EngineClient(engine)
    image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    try:
        with pytest.raises(ToolImageError, match="tool 'look' returned an image part"):
            asyncio.run(_loop(Look(image)).run(_episodes()[0], client))
    finally:
        client.close()


def test_placeholders_that_do_not_match_the_images_are_refused():
    episode = _episodes()[1]
    episode.messages = MESSAGES[0]  # one <image> for two images
    with pytest.raises(ValueError, match="renders 1 <\\|image_pad\\|> tokens for 2 images"):
        asyncio.run(_loop().run(episode, None))


def test_grpo_trains_on_tool_episodes_with_images_on_the_shapes_task(tmp_path, monkeypatch):
    """examples/vision.yaml shortened (tiny-vl without its warm start), episodes of two turns
    (every turn calls the calculator: the random model writes no calls): 2 steps, the
    trainer's log-probs over prompt images, turns and tool results equal the engine's."""
    from trainer.trainer_helpers import read_metrics, tiny_config

    from hybridflow.agents import parsers
    from hybridflow.trainer.lifecycle.run import train

    class EveryTurnCalculates:
        def parse(self, text: str) -> ParsedTurn:
            return ParsedTurn(text, [ToolCall("calculator", {"expression": "2+2"})])

    monkeypatch.setattr(parsers, "make_parser", lambda name: EveryTurnCalculates())
    cfg = tiny_config(
        tmp_path, "model.path=tiny-vl", "data.max_prompt_length=40",
        "data.max_response_length=48", "rollout.agent.loop=tools",
        "rollout.agent.tools=[calculator]", "rollout.agent.max_turns=2",
        "rollout.agent.max_tokens_per_turn=6", "reward.custom_fn=null",
        "actor.ppo_mini_batch_size=2", example="vision",  # 2 mini-batches: old log-probs
    )  # fmt: skip
    train(cfg, log=lambda *a, **k: None)
    rows = read_metrics(cfg.trainer.run_dir)
    assert {1, 2} <= set(rows)
    for step in (1, 2):
        assert rows[step]["rollout/agent_turns"] == 2.0
        assert rows[step]["rollout/agent_tool_calls"] == 2.0  # the last turn's: not run
        assert 0 < rows[step]["rollout/agent_masked_token_fraction"] < 1
        assert rows[step]["rollout_gap/abs_logprob_diff_max"] < 1e-4  # fp32 on the CPU
