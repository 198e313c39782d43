"""LockstepService with experts spread over the replicas (spread_rounds.py) on 2 gloo
processes, tiny-moe in fp32 on the CPU, one replica of one rank each, 4 of the 8 experts a
rank: requests that each replica admits at its own moments, agent episodes whose turns come
when each rank's episodes ask for them (one rank's callers done long before the other's), and
a partial rollout across a weight update sample exactly one process's tokens (greedy), their
routing records one process's too."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks
from test_lockstep import EAGER, PROMPTS, _two_turn_episodes

from hybridflow.engine import Engine, SamplingParams
from hybridflow.engine.expert_spread import expert_parallel_model, spread_shard
from hybridflow.engine.serving.lockstep import LockstepService
from hybridflow.engine.serving.spread_rounds import spread_rounds
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


def _model(seed: int = 2):
    """tiny-moe with std-0.3 weights: peaked logits and routers far from ties."""
    generator = torch.Generator().manual_seed(seed)
    model = build_model(preset_config("tiny-moe"), seed=2).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if not name.endswith("norm.weight"):
            p.normal_(0, 0.3, generator=generator)
    return model


def _shards(model, tp: int = 1) -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    return [(name, spread_shard(name, tensor, rank, world, rank % tp, tp).clone())
            for name, tensor in model.named_parameters(remove_duplicate=False)]  # fmt: skip


def _spread_service(whole, max_seq_len: int = 64, tp: int = 1) -> LockstepService:
    """This rank's replica of ``whole`` (``tp`` ranks), its experts spread over every rank,
    served with the expert group's rounds (its all-to-alls over a group of their own, as
    the rollout's mesh gives them for a service)."""
    world = dist.get_world_size()
    experts = dist.new_group()  # no collective of the main thread's meets the rounds
    replicas = [list(range(r, r + tp)) for r in range(0, world, tp)]
    replica = dist.new_subgroups_by_enumeration(replicas)[0] if tp > 1 else None
    lockstep = dist.new_subgroups_by_enumeration(replicas, backend="gloo")[0] if tp > 1 else None
    shard = expert_parallel_model(whole.config, experts, replica, torch.float32, "cpu")
    engine = Engine(shard, 16, max_seq_len, options=EAGER)
    engine.load_weights(_shards(whole, tp))
    rounds = spread_rounds(engine, dist.new_group(backend="gloo"))
    return LockstepService(engine, lockstep, rounds=rounds)


def _same(got, expected) -> None:
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   rtol=1e-4, atol=1e-5)  # fmt: skip
        assert np.array_equal(a.routed_experts, b.routed_experts)


def _requests_at_different_moments(rank: int, world: int, tp: int) -> None:
    whole = _model()
    share = len(PROMPTS) // world
    mine = list(range(rank * share, (rank + 1) * share))  # each rank's own prompts
    expected = Engine(whole, 16, 64, options=EAGER).generate([PROMPTS[i] for i in mine], GREEDY)
    service = _spread_service(whole, tp=tp)
    time.sleep(0.3 * rank)  # rank 0's requests decode alone first
    handles = []
    for i in mine:
        handles.append(service.submit(PROMPTS[i], GREEDY, stream=True))
        if rank == 0:
            next(iter(handles[-1].stream(timeout=60)))  # each after the last has decoded
    got = [h.result(timeout=60)[0] for h in handles]
    if rank == world - 1:
        time.sleep(0.3)  # the others close first and serve its rounds meanwhile
    service.close()
    _same(got, expected)


def test_requests_admitted_at_each_replicas_moments_sample_one_process_tokens():
    run_ranks(_requests_at_different_moments, 2, 1)


@pytest.mark.slow
def test_requests_on_tensor_parallel_replicas_sample_one_process_tokens():
    """2 replicas of 2 tensor-parallel ranks in lockstep, the experts over all 4 ranks: each
    rank's requests run on both ranks of its replica, and the replicas join each other's
    rounds."""
    run_ranks(_requests_at_different_moments, 4, 2)


def _update_while_decoding(rank: int, world: int) -> None:
    old, new = _model(2), _model(3)
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    mine = PROMPTS[rank * 4 : rank * 4 + 3]
    service = _spread_service(old)
    service.pause()  # every rank's requests go in together, and decode across the update
    handles = [service.submit(p, params, stream=True) for p in mine]
    service.resume()
    # rank 0 posts its update after its first tokens and serves rank 1's rounds until rank 1
    # posts its own, a few tokens later: it lands between the same two iterations everywhere
    _wait_for_tokens(handles[-1], 1 if rank == 0 else 6)
    version = service.update_weights(_shards(new))
    got = [h.result(timeout=60)[0] for h in handles]
    service.close()
    switched = {c.version_spans for c in got}
    assert len(switched) == 1  # admitted together: every request switched at one token
    (first, _), (at, after) = switched.pop()
    assert after == version and 6 <= at < 30 and first == 0
    _same(got, _one_process_update(old, new, mine, params, at))


def _wait_for_tokens(handle, count: int) -> None:
    seen = 0
    for delta in handle.stream(timeout=60):
        seen += len(delta.token_ids)
        if seen >= count:
            return


def _one_process_update(old, new, prompts, params, at: int) -> list:
    """The whole model on one process, its weights replaced when each request has ``at``
    tokens (the requests admitted together, stepped one scheduler step at a time)."""
    engine = Engine(old, 16, 64, options=EAGER)
    counts = [0] * len(prompts)

    def count(request, token_ids, logprobs):
        counts[request] += len(token_ids)

    sub = engine.submission(prompts, params, listener=count)
    engine.start_generation()
    engine.scheduler.add(sub)
    while min(counts) < at:
        engine.scheduler.step()
    assert counts == [at] * len(prompts)  # the update lands between the same two steps
    engine.load_weights(new.named_parameters(remove_duplicate=False))
    engine.start_generation()
    while not sub.done:
        engine.scheduler.step()
    return sub.results


def test_a_partial_rollout_across_a_weight_update_samples_one_process_tokens():
    run_ranks(_update_while_decoding, 2)


def _agent_episodes(rank: int, world: int) -> None:
    from hybridflow.agents.loop import Episode

    whole = _model()
    # rank 0 runs 3 episodes, rank 1 one, later: their turns come at different moments
    episodes = [Episode([{"role": "user", "content": f"q{i}"}], seed=10 * i) for i in range(4)]
    mine = episodes[:3] if rank == 0 else episodes[3:]
    expected = _two_turn_episodes(Engine(whole, 16, 128, options=EAGER), mine)
    assert all(len(t.turns) == 2 for t in expected)
    service = _spread_service(whole, max_seq_len=128)
    time.sleep(0.3 * rank)
    got = _two_turn_episodes(service.engine, mine)
    service.close()  # rank 0 serves rank 1's turns until both are done
    for trajectory, single in zip(got, expected, strict=True):
        assert trajectory.response_ids == single.response_ids
        assert trajectory.loss_mask == single.loss_mask
        torch.testing.assert_close(torch.tensor(trajectory.response_logprobs),
                                   torch.tensor(single.response_logprobs), rtol=1e-4,
                                   atol=1e-5)  # fmt: skip
    assert len(service.engine.kept) == 0  # every episode's kept slot went back


def test_agent_episodes_on_replicas_sample_one_process_tokens():
    run_ranks(_agent_episodes, 2)


def _idle_then_one_request(rank: int, world: int) -> None:
    from hybridflow.engine import expert_spread

    opened = []
    join_round = expert_spread.join_round

    def counted(spread, generating, device):
        opened.append(generating)
        return join_round(spread, generating, device)

    expert_spread.join_round = counted  # this process's rounds of the expert group, counted
    whole = _model()
    service = _spread_service(whole)
    assert service.engine.spread
    time.sleep(0.3)  # every rank idle: beats only, no round of the experts
    idle = len(opened)
    if rank == 1:  # one rank's request: the other joins its rounds with no tokens
        got = service.submit(PROMPTS[0], GREEDY).result(timeout=60)
        _same(got, Engine(whole, 16, 64, options=EAGER).generate([PROMPTS[0]], GREEDY))
    dist.barrier()
    service.close()
    assert idle == 0
    assert len(opened) > 12  # a round a pass, then the one that finds every rank done
    assert any(opened) == (rank == 1)


def test_an_idle_group_opens_no_round_and_a_request_on_one_replica_opens_them():
    run_ranks(_idle_then_one_request, 2)
