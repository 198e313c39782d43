"""LockstepService (lockstep.py) on 2 gloo processes (tiny preset, fp32 CPU): requests that
each rank submits at its own moments sample exactly what one process with the whole model
samples; an abort ends its request with a prefix of those tokens; a weight update while
requests decode lands between the same two steps on every rank (partial rollouts), and
the tokens before it are the old weights' tokens."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.serving.lockstep import LockstepService
from hybridflow.engine.tensor_parallel import local_shard, tensor_parallel_model
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config

EAGER = EngineOptions(decode_backend="torch", cuda_graphs=False, steps_per_sync=2)
PROMPTS = [[5, 17, 9, 33, 2, 71], [40, 41], [100, 3, 8, 19, 23, 60, 61, 62, 63, 7], [12],
           [8, 8, 9], [70, 71, 72, 73], [1, 2, 3, 4, 5], [99]]  # fmt: skip
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)


def _model(seed: int = 1):
    """The tiny preset with peaked logits (std 0.3), the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    model = build_model(preset_config("tiny"), seed=1).eval().requires_grad_(False)
    for _, p in model.named_parameters():
        p.normal_(0, 0.3, generator=generator)
    return model


def _shards(model):
    rank, size = dist.get_rank(), dist.get_world_size()
    return [(name, local_shard(name, tensor, rank, size).clone())
            for name, tensor in model.named_parameters(remove_duplicate=False)]  # fmt: skip


def _tp_service(whole, max_seq_len: int = 64) -> LockstepService:
    shard = tensor_parallel_model(whole.config, dist.group.WORLD, torch.float32, "cpu")
    engine = Engine(shard, 16, max_seq_len, options=EAGER)
    engine.load_weights(_shards(whole))
    return LockstepService(engine, dist.new_group(backend="gloo"))


def _gathered(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _requests_at_different_moments(rank: int, world: int) -> None:
    whole = _model()
    expected = Engine(whole, 16, 64, options=EAGER).generate(PROMPTS, SAMPLED,
                                                             seeds=list(range(8)))  # fmt: skip
    service = _tp_service(whole)
    mine = range(rank * 4, rank * 4 + 4)  # rank 0: prompts 0-3, rank 1: prompts 4-7
    handles = {}
    if rank == 1:
        time.sleep(0.3)  # rank 0's requests decode by now
    for i in mine:
        handles[i] = service.submit(PROMPTS[i], SAMPLED, seed=i, stream=True)
        if rank == 0:
            next(iter(handles[i].stream(timeout=60)))  # each after the last has decoded
    # an abort: a long request ended early by its own rank, with a prefix of its tokens
    long = SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True)
    cut = service.submit(PROMPTS[1], long, seed=50 + rank, stream=True)
    next(iter(cut.stream(timeout=60)))
    cut.abort()
    got = {i: h.result(timeout=60)[0] for i, h in handles.items()}
    aborted = cut.result(timeout=60)[0]
    full = Engine(whole, 16, 64, options=EAGER).generate([PROMPTS[1]], long, seeds=[50 + rank])
    service.close()
    for i, completion in got.items():
        assert completion.token_ids == expected[i].token_ids, i
        torch.testing.assert_close(torch.tensor(completion.logprobs),
                                   torch.tensor(expected[i].logprobs), rtol=1e-4, atol=1e-5)  # fmt: skip
    assert 0 < len(aborted.token_ids) < 40
    assert aborted.token_ids == full[0].token_ids[: len(aborted.token_ids)]


@pytest.mark.slow
def test_requests_submitted_at_different_moments_sample_the_tokens_of_one_process():
    run_ranks(_requests_at_different_moments, 2)


def _update_while_decoding(rank: int, world: int) -> None:
    old, new = _model(1), _model(2)
    params = SamplingParams(temperature=1.0, max_new_tokens=30, ignore_eos=True)
    before = Engine(old, 16, 64, options=EAGER).generate(PROMPTS[:4], params,
                                                         seeds=list(range(4)))  # fmt: skip
    service = _tp_service(old)
    # both ranks submit the same requests in the same round (posted while the group is
    # paused): rank 0's and rank 1's copies are the same requests and must agree
    service.pause()
    handles = [service.submit(p, params, seed=i, stream=True) for i, p in enumerate(PROMPTS[:4])]
    service.resume()
    # rank 0 posts its update after its first token and waits for rank 1's, posted a few
    # tokens later (a count, not a sleep: a fast host could finish every request in a sleep)
    seen = 0
    for delta in handles[-1].stream(timeout=60):
        seen += len(delta.token_ids)
        if seen >= (1 if rank == 0 else 6):
            break
    first = service.policy_version
    version = service.update_weights(_shards(new))  # between two steps, on both ranks
    got = [h.result(timeout=60)[0] for h in handles]
    service.close()
    assert version == first + 1
    views = _gathered([(c.token_ids, c.version_spans) for c in got])
    assert views[0] == views[1]
    assert any(len(c.version_spans) == 2 for c in got)  # partial: decoded across the update
    assert any(c.token_ids != whole.token_ids for c, whole in zip(got, before))
    for completion, whole in zip(got, before):
        changed = (completion.version_spans + ((len(completion.token_ids), None),))[1][0]
        assert completion.token_ids[:changed] == whole.token_ids[:changed]


@pytest.mark.slow
def test_a_weight_update_lands_between_the_same_steps_on_every_rank():
    run_ranks(_update_while_decoding, 2)


class _AlwaysCalls:
    """A parser that reads one call in every turn: the random model's episodes take their
    second turn (the loop's answer to the call, "unknown tool", appended as a delta to the
    kept conversation; no tools, so no schemas lengthen the prompt)."""

    def parse(self, text: str):
        from hybridflow.agents.parsers import ParsedTurn, ToolCall

        return ParsedTurn(text, [ToolCall("t", {})])


def _two_turn_episodes(engine, episodes) -> list:
    """Each episode through the tool loop (2 turns, kept KV through sessions), then every
    kept slot given back (EngineClient.close)."""
    import asyncio

    from hybridflow.agents.client import EngineClient
    from hybridflow.agents.loop import LoopLimits, ToolCallingLoop, run_episodes
    from hybridflow.agents.templates import with_tool_template
    from hybridflow.models.tokenizer import build_char_tokenizer

    tokenizer = with_tool_template(build_char_tokenizer())
    loop = ToolCallingLoop(tokenizer, {}, SamplingParams(temperature=1.0),
                           parser=_AlwaysCalls(),
                           limits=LoopLimits(max_turns=2, max_tokens_per_turn=4))  # fmt: skip
    client = EngineClient(engine)
    try:
        return asyncio.run(run_episodes(loop, episodes, client))
    finally:
        client.close()


def _agent_episodes_with_kept_kv(rank: int, world: int) -> None:
    from hybridflow.agents.loop import Episode

    whole = _model()
    episodes = [Episode([{"role": "user", "content": f"q{i}"}], seed=10 * i) for i in range(2)]
    alone = Engine(whole, 16, 128, options=EAGER)
    expected = _two_turn_episodes(alone, episodes)
    assert all(len(t.turns) == 2 for t in expected)
    service = _tp_service(whole, max_seq_len=128)
    if rank == 1:
        time.sleep(0.3)  # its turns and its release come at other moments than rank 0's
    got = _two_turn_episodes(service.engine, episodes[rank : rank + 1])
    service.close()  # after every rank's releases: each rank's own, run on both
    for trajectory, single in zip(got, expected[rank : rank + 1]):
        assert trajectory.response_ids == single.response_ids
        assert trajectory.loss_mask == single.loss_mask
        torch.testing.assert_close(torch.tensor(trajectory.response_logprobs),
                                   torch.tensor(single.response_logprobs), rtol=1e-4,
                                   atol=1e-5)  # fmt: skip
    # the second turns continued their kept slots (on both ranks, every episode's prefill
    # as one process's), and every slot went back on both ranks
    assert service.engine.prefill_tokens == alone.prefill_tokens
    second_prompts = [len(t.prompt_ids) + len(t.response_ids) - t.turns[1].generated_tokens
                      for t in expected]  # fmt: skip
    full = sum(len(t.prompt_ids) for t in expected) + sum(second_prompts)
    assert alone.prefill_tokens < full
    assert len(service.engine.kept) == 0 and len(alone.kept) == 0


def test_agent_episodes_with_kept_kv_sample_the_tokens_of_one_process():
    run_ranks(_agent_episodes_with_kept_kv, 2)
