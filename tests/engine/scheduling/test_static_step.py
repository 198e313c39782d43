"""The static mixed step's host side (static_step.py): its token buckets, and which engines
keep the eager mixed step (the torch backend's chunk passes size their work from the data):
those sample as before with graph_mixed_steps on. CPU, no Triton."""

from __future__ import annotations

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.scheduling.static_step import token_buckets


def test_token_buckets_are_the_budget_and_its_quarters():
    assert token_buckets(2048) == [128, 512, 2048]
    assert token_buckets(64) == [16, 64]
    assert token_buckets(8) == [8]


def test_the_torch_backend_keeps_the_eager_mixed_step(model):
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=6, seed=3, ignore_eos=True)
    prompts = [[5, 17, 9, 33], [40, 41], [100, 3, 8]]

    def run(graphs: bool):
        options = EngineOptions(decode_backend="torch", cuda_graphs=False, kv_block_size=16, steps_per_sync=2,
                                max_prefill_tokens_per_step=4, graph_mixed_steps=graphs)  # fmt: skip
        engine = Engine(model, 4, 32, options=options)
        return engine, engine.generate(prompts, params, max_new_tokens=[2, 2, 6, 6, 6, 6])

    engine, got = run(True)
    assert engine.scheduler.static_step is None and engine.scheduler.mixed_steps > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in run(False)[1]]


def test_graph_mixed_steps_needs_mixed_steps():
    assert EngineOptions(graph_mixed_steps=True).validate() == [
        "graph_mixed_steps=true captures mixed steps: set max_prefill_tokens_per_step > 0 too "
        "(e.g. 2048)"
    ]
    assert EngineOptions(graph_mixed_steps="yes", max_prefill_tokens_per_step=8).validate() == [
        "graph_mixed_steps='yes': must be true or false"
    ]
    assert EngineOptions(graph_mixed_steps=True, max_prefill_tokens_per_step=8).validate() == []
