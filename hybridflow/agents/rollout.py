"""Agent rollouts for training: a batch of prompts (chat messages) -> n episodes each through
the configured loop -> the padded tensors the RL loop trains on.

The response of a row is the episode after its prompt: the model's turns and the tool deltas
between them. `response_mask` is the loss mask (1 on the model's tokens only), while
`response_attention_mask` marks every real token, tool output included, since the policy
reads the tool results it is trained to use. The prompt is the agent's own rendering (the
chat template with the tools' schemas), so it replaces the dataset's prompt ids; with images
(agents/images.py), its mRoPE rows replace the dataset's too (`agent_mrope_positions`), the
row's pixel_values and grids stay the dataset's.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import torch

from hybridflow.agents.loop import (
    ChatRenderer,
    Episode,
    LoopLimits,
    ToolCallingLoop,
    Trajectory,
    run_episodes,
)
from hybridflow.agents.options import AgentOptions

# Episode k of a batch samples with seed + EPISODE_SEED_STRIDE * k (+ its turn index).
EPISODE_SEED_STRIDE = 7919


def build_loop(options: AgentOptions, tokenizer, sampling, max_response_length: int,
               image_merge_size: int | None = None):  # fmt: skip
    """The configured AgentLoop (options.loop == "tools": the built-in ToolCallingLoop).
    image_merge_size: a vision-language model's (episodes with images)."""
    from hybridflow.agents.parsers import make_parser
    from hybridflow.agents.sandbox import SandboxLimits
    from hybridflow.agents.tools import load_tools

    sandbox = SandboxLimits(timeout_s=options.python_timeout_s, isolation=options.sandbox_isolation)
    tools = load_tools(list(options.tools), sandbox=sandbox)
    limits = LoopLimits(
        max_turns=options.max_turns,
        max_tokens=max_response_length,
        max_tokens_per_turn=options.max_tokens_per_turn or max_response_length,
        tool_timeout_s=options.tool_timeout_s,
    )
    return ToolCallingLoop(tokenizer, tools, sampling, parser=make_parser(options.parser),
                           limits=limits, image_merge_size=image_merge_size)  # fmt: skip


def run_agent_batch(loop, client, raw_prompts: list, n: int, seed: int | None,
                    concurrency: int, images: list | None = None) -> list[Trajectory]:  # fmt: skip
    """n episodes per prompt, prompt-major (row i * n + j is sample j of prompt i).
    images: per prompt its engine.images.PromptImages (or None)."""
    episodes = []
    for i, messages in enumerate(raw_prompts):
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        for j in range(n):
            k = i * n + j
            episode_seed = None if seed is None else seed + EPISODE_SEED_STRIDE * k
            episodes.append(Episode([dict(m) for m in messages], seed=episode_seed,
                                    images=None if images is None else images[i]))  # fmt: skip
    try:
        return asyncio.run(run_episodes(loop, episodes, client, concurrency))
    finally:
        if hasattr(client, "close"):
            client.close()  # no episode continues past the batch: its kept slots go back


def prompt_width(loop, max_prompt_length: int) -> int:
    """The agent prompts' padded width: data.max_prompt_length plus what the tools' block adds
    to a rendered prompt. The same on every rollout rank (same tokenizer and tools), so the
    ranks' rows concatenate."""
    plain = ChatRenderer(loop.tokenizer)
    with_tools = loop._renderer(Episode([]))
    probe = [{"role": "user", "content": "x"}]
    return max_prompt_length + max(
        0, len(with_tools.prompt_ids(probe)) - len(plain.prompt_ids(probe))
    )


def pack_trajectories(trajectories: list[Trajectory], width: int, pad_token_id: int,
                      prompt_width: int | None = None) -> dict:  # fmt: skip
    """Right-padded response tensors [N, width] and left-padded prompts [N, prompt_width]
    (default: the longest agent prompt), plus arrays for the reward and the metrics."""
    rows = len(trajectories)
    responses = torch.full((rows, width), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros(rows, width)
    attention = torch.zeros(rows, width)
    logprobs = torch.zeros(rows, width)
    longest = max(len(t.prompt_ids) for t in trajectories)
    if prompt_width is None:
        prompt_width = longest
    elif longest > prompt_width:
        raise ValueError(
            f"an agent prompt has {longest} tokens, more than data.max_prompt_length plus the "
            f"tools' block ({prompt_width}): raise data.max_prompt_length"
        )
    prompts = torch.full((rows, prompt_width), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(rows, prompt_width, dtype=torch.long)
    for row, trajectory in enumerate(trajectories):
        length = min(width, len(trajectory.response_ids))  # the loop keeps it within width
        responses[row, :length] = torch.tensor(trajectory.response_ids[:length], dtype=torch.long)
        loss_mask[row, :length] = torch.tensor(trajectory.loss_mask[:length], dtype=torch.float)
        attention[row, :length] = 1.0
        logprobs[row, :length] = torch.tensor(trajectory.response_logprobs[:length])
        prompt = trajectory.prompt_ids
        prompts[row, prompt_width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        prompt_mask[row, prompt_width - len(prompt) :] = 1
    metrics = [t.metrics() for t in trajectories]
    tensors = {
        "responses": responses, "response_mask": loss_mask,
        "response_attention_mask": attention, "rollout_logprobs": logprobs,
        "agent_prompts": prompts, "agent_prompt_mask": prompt_mask,
    }  # fmt: skip
    if any(t.prompt_positions is not None for t in trajectories):
        tensors["agent_mrope_positions"] = _prompt_positions(trajectories, prompt_width)
    return {
        "tensors": tensors,
        "arrays": {
            "final_text": np.asarray([t.final_text for t in trajectories], dtype=object),
            "agent_finish": np.asarray([t.finish_reason for t in trajectories], dtype=object),
            **{f"agent_{name}": np.asarray([m[name] for m in metrics], dtype=np.float64)
               for name in ("turns", "tool_calls", "tool_errors", "tool_timeouts",
                            "masked_token_fraction")},
        },
    }  # fmt: skip


def _prompt_positions(trajectories: list[Trajectory], width: int) -> torch.Tensor:
    """[N, 3, width]: each agent prompt's mRoPE rows, left-padded as its ids are (0 on
    padding; a text prompt's rows are its token indices), data/image_batch.py's layout."""
    from hybridflow.data.image_batch import MROPE_POSITIONS, prompt_image_fields

    rows = [t.prompt_positions if t.prompt_positions is not None
            else torch.arange(len(t.prompt_ids)).expand(3, -1) for t in trajectories]  # fmt: skip
    nothing = [None] * len(trajectories)
    tensors, _ = prompt_image_fields(rows, nothing, nothing, width)
    return tensors[MROPE_POSITIONS]


def agent_metrics(arrays: dict) -> dict[str, float]:
    """Per-episode means of the agent arrays of a batch (rollout/agent_*)."""
    out = {}
    for name in ("turns", "tool_calls", "tool_errors", "tool_timeouts", "masked_token_fraction"):
        values = arrays.get(f"agent_{name}")
        if values is not None and len(values):
            out[f"rollout/agent_{name}"] = float(np.mean(values))
    finish = arrays.get("agent_finish")
    if finish is not None and len(finish):
        for reason in ("answer", "max_turns", "max_tokens", "length", "error"):
            out[f"rollout/agent_finish_{reason}"] = float(np.mean(finish == reason))
    return out


def sampling_for_agents(sampling):
    """Turns sample one completion each (n is spread over episodes, not samples)."""
    return dataclasses.replace(sampling, n=1)
