"""The rollout service's stream (service_stream.py, EngineOptions.service_stream): where its
thread takes the engine over from the default stream and hands it back (CPU: the order of
the hand-overs around each call, recorded); on a GPU, a service on a high-priority stream of
its own samples what it samples on the default stream while another thread keeps the
default stream busy and rewrites the weights between pause and resume (marked gpu)."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, RolloutService, SamplingParams
from hybridflow.engine.serving.service_stream import ServiceStream
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config

EAGER = EngineOptions(decode_backend="torch", cuda_graphs=False, steps_per_sync=2)
PROMPTS = [[5, 17, 9, 33, 2, 71], [40, 41], [100, 3, 8, 19, 23, 60, 61, 62, 63, 7], [12]]
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)


class RecordedHandOvers:
    """A ServiceStream that records its hand-overs (and the engine calls between them)."""

    def __init__(self):
        self.events: list[str] = []

    def launching(self):
        return contextlib.nullcontext()

    def take_over(self) -> None:
        self.events.append("take_over")

    def hand_back(self) -> None:
        self.events.append("hand_back")


def test_the_service_hands_the_engine_over_around_every_weight_change_and_at_its_ends(model):
    engine = Engine(model, 8, 64, options=EAGER)
    streams = RecordedHandOvers()
    loads = engine.load_weights

    def recorded_load(named):
        streams.events.append("load")
        loads(named)

    engine.load_weights = recorded_load
    service = RolloutService(engine, streams=streams)
    service.generate(PROMPTS, SAMPLED, seeds=[0, 1, 2, 3])
    assert streams.events == ["take_over"]  # its thread's start; requests hand nothing over

    service.pause()
    assert streams.events[-1] == "hand_back"  # the caller may write the weights now
    service.resume(weights_changed=True)
    assert streams.events[-1] == "take_over"  # after the caller's in-place writes

    streams.events.clear()
    service.update_weights([(n, p.clone()) for n, p in model.named_parameters()])
    assert streams.events == ["hand_back", "take_over", "load", "hand_back"]

    streams.events.clear()
    engine.release()  # on the service's thread: freed memory goes back to the caller
    assert streams.events == ["hand_back"]
    service.close()
    assert streams.events == ["hand_back", "hand_back"]


def test_the_stream_option_is_checked_and_is_the_default_stream_off_cuda():
    assert EngineOptions().service_stream == "default"
    assert not EngineOptions(service_stream="priority").validate()
    (problem,) = EngineOptions(service_stream="own").validate()
    assert "service_stream='own'" in problem and "default, priority" in problem
    streams = ServiceStream(torch.device("cpu"), "priority")
    assert not streams.separate  # the host runs everything in order: nothing to hand over
    streams.take_over()
    streams.hand_back()
    with streams.launching():
        pass


def _busy_default_stream(device, stop: threading.Event) -> None:
    """Another thread's work on the default stream, as a trainer's would be."""
    a = torch.randn(2048, 2048, device=device)
    while not stop.is_set():
        for _ in range(8):
            a = torch.tanh(a @ a * 1e-3)
        torch.cuda.current_stream(device).synchronize()


@pytest.mark.gpu
def test_on_its_own_stream_beside_a_busy_default_stream_the_service_samples_the_same():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda")
    model = build_model(preset_config("tiny"), seed=1, device=device).eval()
    generator = torch.Generator(device).manual_seed(1)
    for p in model.parameters():
        p.data.normal_(0, 0.3, generator=generator)
    model.requires_grad_(False)
    seeds = list(range(len(PROMPTS)))
    # fixed kernels (no timing choices): both engines run the same arithmetic
    fixed = dict(steps_per_sync=2, decode_layer="split", decode_matmul="cublas",
                 attention_autotune=False)  # fmt: skip
    options = EngineOptions(**fixed)
    with RolloutService(Engine(model, 8, 64, options=options)) as service:
        expected = service.generate(PROMPTS, SAMPLED, seeds=seeds)
    prioritized = EngineOptions(**fixed, service_stream="priority")
    engine = Engine(model, 8, 64, options=prioritized)
    engine.warm_up(SAMPLED)  # the graphs now, not beside the other thread's work
    stop = threading.Event()
    trainer = threading.Thread(target=_busy_default_stream, args=(device, stop))
    trainer.start()
    try:
        with RolloutService(engine) as service:
            assert service.streams.separate
            got = service.generate(PROMPTS, SAMPLED, seeds=seeds)
            # in-place writes on the default stream between pause and resume: the next
            # requests sample the written weights (the negated model's tokens)
            service.pause()
            originals = [p.clone() for p in model.parameters()]
            for p in model.parameters():
                p.mul_(-1.0)
            service.resume(weights_changed=True)
            negated = service.generate(PROMPTS, SAMPLED, seeds=seeds)
            service.pause()
            for p, original in zip(model.parameters(), originals):
                p.copy_(original)
            service.resume(weights_changed=True)
            again = service.generate(PROMPTS, SAMPLED, seeds=seeds)
    finally:
        stop.set()
        trainer.join()
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert [c.token_ids for c in again] == [c.token_ids for c in expected]
    with RolloutService(Engine(model.requires_grad_(False), 8, 64, options=options)) as service:
        for p in model.parameters():
            p.mul_(-1.0)
        service.resume(weights_changed=True)
        expected_negated = service.generate(PROMPTS, SAMPLED, seeds=seeds)
    assert [c.token_ids for c in negated] == [c.token_ids for c in expected_negated]
