"""RolloutService (service.py): requests submitted from threads and asyncio tasks while others
decode sample exactly what one generate() call samples; per-request settings and stop
tokens in one batch; streaming, abort, kept KV, pause and weight updates with the policy
version per token (CPU, fp32, the eager backend)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, RolloutService, SamplingParams
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config

EAGER = EngineOptions(decode_backend="torch", cuda_graphs=False, steps_per_sync=2)
PROMPTS = [[5, 17, 9, 33, 2, 71], [40, 41], [100, 3, 8, 19, 23, 60, 61, 62, 63, 7], [12],
           [8, 8, 9], [70, 71, 72, 73], [1, 2, 3, 4, 5], [99]]  # fmt: skip
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)


def _engine(model, slots=16, seq=64) -> Engine:
    return Engine(model, slots, seq, options=EAGER)


def _alone(model, prompt, params, seed):
    return _engine(model).generate([prompt], params, seeds=[seed])[0]


def test_submits_from_threads_while_others_decode_sample_as_one_generate(model):
    expected = _engine(model).generate(PROMPTS, SAMPLED, seeds=list(range(8)))
    with RolloutService(_engine(model)) as service:
        first = [service.submit(p, SAMPLED, seed=i, stream=True)
                 for i, p in enumerate(PROMPTS[:4])]  # fmt: skip
        next(iter(first[0].stream(timeout=60)))  # decoding while the rest arrive
        handles = [None] * 4

        def late(i):
            handles[i] = service.submit(PROMPTS[4 + i], SAMPLED, seed=4 + i)

        threads = [threading.Thread(target=late, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        got = [h.result(timeout=60)[0] for h in first + handles]
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):  # other batch shapes: equal up to fp32 rounding
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


def test_requests_with_different_settings_and_stops_share_a_batch(model):
    """Greedy, top-k, top-p, min-p and plain sampling in one batch, and one request that also
    stops on a token the others do not: each samples what it samples alone."""
    stop_at = _alone(model, PROMPTS[2], SAMPLED, 11).token_ids[4]
    settings = [
        SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=5, max_new_tokens=9, ignore_eos=True),
        SamplingParams(
            temperature=1.0, stop_token_ids=(stop_at,), max_new_tokens=12, ignore_eos=True
        ),  # fmt: skip
        SamplingParams(temperature=1.3, top_p=0.8, max_new_tokens=7, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=0.05, max_new_tokens=11, ignore_eos=True),
    ]
    prompts = PROMPTS[:2] + [PROMPTS[2]] + PROMPTS[3:5]
    seeds = [10, 12, 11, 13, 14]
    expected = [_alone(model, p, s, seed) for p, s, seed in zip(prompts, settings, seeds)]
    with RolloutService(_engine(model)) as service:
        service.pause()  # all queued, then admitted together: one mixed batch
        handles = [service.submit(p, s, seed=seed)
                   for p, s, seed in zip(prompts, settings, seeds)]  # fmt: skip
        service.resume()
        got = [h.result(timeout=60)[0] for h in handles]
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert got[2].finish_reason == "stop" and got[2].token_ids[-1] == stop_at
    assert len(got[2].token_ids) <= 5
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


def test_streamed_deltas_arrive_before_the_end_and_add_up_to_the_completion(model):
    params = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True)
    with RolloutService(_engine(model)) as service:
        handle = service.submit(PROMPTS[0], params, seed=3, stream=True)
        deltas = list(handle.stream(timeout=60))
    completion = handle.result()[0]
    assert len(deltas) > 3  # chunks of steps_per_sync tokens, then the finish
    assert deltas[-1].completion is completion and not deltas[0].completion
    assert sum((d.token_ids for d in deltas), []) == completion.token_ids
    assert sum((d.logprobs for d in deltas), []) == completion.logprobs


def test_abort_ends_a_request_with_its_tokens_so_far_and_frees_its_slot(model):
    engine = _engine(model, slots=4, seq=512)
    long = SamplingParams(temperature=1.0, max_new_tokens=400, ignore_eos=True)
    with RolloutService(engine) as service:
        handle = service.submit(PROMPTS[0], long, seed=1, stream=True)
        for delta in handle.stream(timeout=60):
            if len(delta.token_ids):
                break  # it is decoding
        handle.abort()
        completion = handle.result(timeout=60)[0]
        others = [service.submit(p, SAMPLED, seed=i) for i, p in enumerate(PROMPTS[:4])]
        assert all(len(h.result(timeout=60)[0].token_ids) == 12 for h in others)
        service.pause()
        assert len(engine.scheduler.free_slots) == 4 and not engine.scheduler.busy
        service.resume()
    assert completion.finish_reason == "abort"
    assert 0 < len(completion.token_ids) < 400
    alone = _alone(model, PROMPTS[0], long, 1).token_ids
    assert completion.token_ids == alone[: len(completion.token_ids)]


def test_asyncio_tasks_share_the_engine(model):
    expected = _engine(model).generate(PROMPTS, SAMPLED, seeds=list(range(8)))

    async def episodes(service):
        async def one(i):
            await asyncio.sleep(0.001 * i)  # arrive one by one
            return (await service.submit(PROMPTS[i], SAMPLED, seed=i))[0]

        return await asyncio.gather(*(one(i) for i in range(8)))

    with RolloutService(_engine(model)) as service:
        got = asyncio.run(episodes(service))
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]


def test_async_stream(model):
    async def collect(service):
        handle = service.submit(PROMPTS[1], SAMPLED, seed=5, stream=True)
        tokens = []
        async for delta in handle.astream():
            tokens += delta.token_ids
        return tokens, (await handle)[0]

    with RolloutService(_engine(model)) as service:
        tokens, completion = asyncio.run(collect(service))
    assert tokens == completion.token_ids and len(tokens) == 12


def test_kept_kv_through_the_service_continues_as_a_full_prefill(model):
    engine = _engine(model)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    delta = [7, 8, 9]
    with RolloutService(engine) as service:
        first = service.submit(PROMPTS[0], params, seed=1, keep=True).result(timeout=60)[0]
        context = PROMPTS[0] + first.token_ids + delta
        before = engine.prefill_tokens
        second = service.submit(context, params, seed=2, reuse=first.kv_handle).result(60)[0]
        assert engine.prefill_tokens - before == len(delta) + 1
    full = _alone(model, context, params, 2)
    assert second.token_ids == full.token_ids
    torch.testing.assert_close(second.logprobs, full.logprobs, rtol=0, atol=1e-5)


def test_pause_and_new_weights_start_a_new_policy_version_mid_request(model):
    """A request decoding across a weight update: its tokens before carry version 0, after
    version 1, and the first version's tokens are what the old weights sample."""
    engine = Engine(model, 4, 256, options=EAGER)
    long = SamplingParams(temperature=1.0, max_new_tokens=150, ignore_eos=True)
    old = _engine(model, seq=256).generate([PROMPTS[0]], long, seeds=[2])[0]
    with RolloutService(engine) as service:
        handle = service.submit(PROMPTS[0], long, seed=2, stream=True)
        next(iter(handle.stream(timeout=60)))  # decoding has begun
        service.pause()
        service.resume(weights_changed=True)  # same weights, new version
        completion = handle.result(timeout=60)[0]
        later = service.submit(PROMPTS[1], SAMPLED, seed=0).result(timeout=60)[0]
    assert service.policy_version == 1
    (start0, v0), (start1, v1) = completion.version_spans
    assert (start0, v0, v1) == (0, 0, 1) and 0 < start1 < 150
    versions = completion.token_versions()
    assert versions == [0] * start1 + [1] * (150 - start1)
    assert completion.token_ids == old.token_ids  # the weights did not really change
    assert later.version_spans == ((0, 1),)


def test_update_weights_between_chunks(model):
    engine = _engine(model)
    params = dict(model.named_parameters())
    name = "model.norm.weight"
    original = params[name].detach().clone()
    with RolloutService(engine) as service:
        version = service.update_weights([(name, original * 0.5)])
        got = service.submit(PROMPTS[0], SAMPLED, seed=1).result(timeout=60)[0]
        service.update_weights([(name, original)])
    assert version == 1 and got.version_spans == ((0, 1),)
    scaled = build_model(preset_config("tiny"), seed=1).eval().requires_grad_(False)
    scaled.load_state_dict(model.state_dict())
    dict(scaled.named_parameters())[name].data.mul_(0.5)
    assert got.token_ids == _alone(scaled, PROMPTS[0], SAMPLED, 1).token_ids


def test_generate_runs_through_a_running_service_and_bad_prompts_fail_at_submit(model):
    engine = _engine(model)
    expected = _engine(model).generate(PROMPTS, SAMPLED, seeds=list(range(8)))
    with RolloutService(engine) as service:
        with pytest.raises(ValueError, match="outside"):
            service.submit([1, 10**6], SAMPLED)
        with pytest.raises(ValueError, match="empty"):
            service.submit([], SAMPLED)
        got = engine.generate(PROMPTS, SAMPLED, seeds=list(range(8)))
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert engine.service is None


def test_generate_padded_goes_through_a_running_service(model):
    """The trainer's call (generate_padded) while a server's service drives the engine: it
    must be submitted, not run on the scheduler from the trainer's thread."""
    engine = _engine(model)
    expected = _engine(model).generate_padded(PROMPTS, SamplingParams(max_new_tokens=6, seed=3))
    with RolloutService(engine) as service:
        other = service.submit(PROMPTS[0], SAMPLED, seed=9)
        got = engine.generate_padded(PROMPTS, SamplingParams(max_new_tokens=6, seed=3))
        other.result(timeout=60)
    assert torch.equal(got["responses"], expected["responses"])
    assert torch.equal(got["response_lengths"], expected["response_lengths"])


def test_weights_changed_in_place_reach_a_running_service(model):
    """A colocated trainer updates the parameters the engine reads in place; after
    weights_updated() the service's next request samples from the new weights (the fused
    copies refreshed) under a new policy version."""
    import copy

    own = copy.deepcopy(model)
    engine = _engine(own)
    norm = dict(own.named_parameters())["model.norm.weight"]
    with RolloutService(engine) as service:
        before = service.submit(PROMPTS[0], SAMPLED, seed=1).result(timeout=60)[0]
        with torch.no_grad():
            norm.mul_(0.5)  # an optimizer step, in place
        assert engine.weights_updated() == 1
        after = service.submit(PROMPTS[0], SAMPLED, seed=1).result(timeout=60)[0]
    scaled = _alone(own, PROMPTS[0], SAMPLED, 1)
    assert after.token_ids == scaled.token_ids and after.version_spans == ((0, 1),)
    assert before.token_ids == _alone(model, PROMPTS[0], SAMPLED, 1).token_ids


def test_a_burst_arriving_while_nothing_decodes_shares_one_prefill_and_decodes_in_step(model):
    import time

    options = EngineOptions(decode_backend="torch", cuda_graphs=False, steps_per_sync=2,
                            admission_gather_ms=200.0)  # fmt: skip
    engine = Engine(model, 64, 64, options=options)
    with RolloutService(engine) as service:
        handles = []
        for i, prompt in enumerate(PROMPTS[:6]):  # a few ms apart, as tools return
            handles.append(service.submit(prompt, SAMPLED, seed=i))
            time.sleep(0.005)
        for handle in handles:
            handle.result(timeout=60)
        scheduler = engine.scheduler
        assert scheduler.admissions == 1
        assert scheduler.decoded_rows == 6 * scheduler.decode_steps  # all six in every step


def test_gather_window_is_validated():
    assert EngineOptions(admission_gather_ms=-1).validate()
    assert EngineOptions(admission_gather_ms=True).validate()
    assert not EngineOptions(admission_gather_ms=0).validate()


def test_pinned_choices_are_read_on_the_engine_thread_while_a_service_runs(model):
    engine = _engine(model)
    threads = []
    original = engine._record_choices

    def record():
        threads.append(threading.current_thread().name)
        original()

    engine._record_choices = record
    with RolloutService(engine):
        recorded = engine.pinned_choices()
    assert threads == ["hybridflow-engine"] and set(recorded) == {"identity", "choices"}


def test_a_cache_that_cannot_be_made_fails_the_request_instead_of_leaving_it_waiting(
    model, monkeypatch
):
    from hybridflow.engine.cache import sizing

    def refused(*args, **kwargs):  # as the allocator says it for a cache past the memory
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate")

    monkeypatch.setattr(sizing, "make_cache", refused)
    with RolloutService(_engine(model)) as service:
        handle = service.submit(PROMPTS[0], SAMPLED, seed=0)
        with pytest.raises(RuntimeError, match="can't allocate memory"):
            handle.result(timeout=30)
