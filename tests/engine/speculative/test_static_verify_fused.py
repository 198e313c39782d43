"""Verify passes with static shapes (speculative/static_verify.py, EngineOptions.
graph_verify_steps) on the fused path: rows padded to their batch bucket, their drafts
packed as chunks padded to speculative_draft_tokens a row, the drafts' attention through the
block table. Run eagerly here (the code a CUDA graph captures), they emit the tokens and
log-probs the eager verify passes emit (fp32: equal tokens), greedy and sampled, over many
passes that accept some drafts and reject others, with preemption and a kept slot's next
turn; the uploaded inputs put every padding token on the scratch entry; a new scheduler
drops the graphs captured over the last one's buffers; over an FP8 K/V cache, as the eager
passes over one. fp32 tiny model, on CPU under TRITON_INTERPRET=1 (tests/engine/
test_verify_graphs_gpu.py checks the captured graphs)."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device

DEVICE = triton_test_device()
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.engine import Engine, EngineOptions, SamplingParams  # noqa: E402
from hybridflow.models import build_model  # noqa: E402
from hybridflow.models.presets import preset_config  # noqa: E402

PROMPTS = [[5, 17, 9, 33, 2, 71] * 3, [40, 41, 42, 40, 41], [12, 13]]
# verify every tail step with a draft (what the measured rule decides: test_rule.py)
SPECULATIVE = dict(speculative="ngram", speculative_draft_tokens=3, speculative_max_rows=64,
                   speculative_min_ngram=1, speculative_rule="always", steps_per_sync=4)  # fmt: skip


@pytest.fixture(scope="module")
def model():
    model = build_model(preset_config("tiny"), seed=1, device=DEVICE).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3, generator=torch.Generator(DEVICE).manual_seed(p.numel()))
    return model.requires_grad_(False)


def _engine(model, static: bool, block=16, slots=6, budget=None, kv="model") -> Engine:
    """static: the static verify step on the fused backend; else the eager verify passes
    (torch backend: the eager pass of test_verify.py, fast under the interpreter); kv: the
    K/V cache's dtype (kv_cache_dtype)."""
    backend = dict(decode_backend="triton", graph_verify_steps=True) if static else dict(
        decode_backend="torch", cuda_graphs=False)  # fmt: skip
    options = EngineOptions(**backend, **SPECULATIVE, kv_block_size=block, kv_cache_dtype=kv)
    return Engine(model, slots, 64, memory_budget=budget, options=options)


def _assert_same(got, expected):
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-4)


def _counts(engine) -> tuple:
    stats = engine.speculation.stats
    return stats.passes, stats.rows, stats.drafted, stats.accepted, stats.emitted


GREEDY = SamplingParams(n=2, temperature=0, max_new_tokens=14, ignore_eos=True)
# three of the six rows stop
SAMPLED = SamplingParams(n=2, temperature=0.5, top_k=5, max_new_tokens=14, seed=3,
                         stop_token_ids=(2, 66))  # fmt: skip


@pytest.mark.parametrize(("params", "block"), [(GREEDY, 16), (SAMPLED, 16), (GREEDY, None)],
                         ids=["greedy-paged", "sampled+stops-paged", "greedy-slots"])  # fmt: skip
def test_static_verify_passes_emit_what_eager_verify_passes_emit(model, params, block):
    budgets = [14, 5, 14, 9, 3, 14]  # rows leave at different passes: the buckets shrink
    eager, engine = _engine(model, False, block), _engine(model, True, block)
    for _ in range(2):  # the second call drafts from the first's responses
        expected = eager.generate(PROMPTS, params, max_new_tokens=budgets)
        _assert_same(engine.generate(PROMPTS, params, max_new_tokens=budgets), expected)
    # the same passes, drafts and acceptances as the eager passes
    assert _counts(engine) == _counts(eager)
    stats = engine.speculation.stats
    assert engine.scheduler.static_verify.steps == stats.passes >= 5
    assert 0 < stats.accepted < stats.drafted  # some drafts kept, some rejected
    if block is not None:
        assert engine.blocks.free_blocks == engine.blocks.num_blocks


@pytest.fixture(scope="module")
def draft_dir(model, tmp_path_factory):
    """A draft model: the target with noise of 0.1 x each weight's std added (it agrees with
    the target on its confident tokens and disagrees elsewhere)."""
    generator = torch.Generator().manual_seed(7)
    draft = build_model(model.config, seed=0).eval().requires_grad_(False)
    for mine, theirs in zip(draft.parameters(), model.parameters()):
        noise = torch.randn(mine.shape, generator=generator).to(DEVICE)
        mine.copy_(theirs + 0.1 * theirs.std().nan_to_num(0) * noise)
    path = tmp_path_factory.mktemp("draft")
    draft.save_pretrained(str(path))
    return str(path)


def test_a_draft_model_s_static_passes_emit_what_its_eager_passes_emit(model, draft_dir):
    """The draft model's acceptance (model_verify.py) reads the static grid's logits."""
    params = SamplingParams(n=2, temperature=0, max_new_tokens=14, ignore_eos=True)
    draft = dict(speculative="draft", speculative_draft_model=draft_dir)
    engines = []
    for static in (False, True):
        backend = dict(decode_backend="triton", graph_verify_steps=True) if static else dict(
            decode_backend="torch", cuda_graphs=False)  # fmt: skip
        options = EngineOptions(**backend, **{**SPECULATIVE, **draft}, kv_block_size=16)
        engines.append(Engine(model, 6, 64, options=options))
    eager, engine = engines
    _assert_same(engine.generate(PROMPTS, params), eager.generate(PROMPTS, params))
    assert _counts(engine) == _counts(eager)
    stats = engine.speculation.stats
    assert 0 < stats.accepted < stats.drafted  # some drafts kept, some rolled back
    assert engine.scheduler.static_verify.steps == stats.passes


def test_static_verify_passes_with_preemption_keep_every_token(model):
    """Seven blocks of 16 for four sequences growing to two blocks each: verify passes need
    blocks for their drafts, the newest rows are preempted and prefilled again."""
    params = SamplingParams(n=2, temperature=0, max_new_tokens=24, ignore_eos=True)
    prompts = PROMPTS[1:]
    expected = _engine(model, False, slots=4).generate(prompts, params)
    probe = _engine(model, True, slots=4)
    keys = probe.num_slots and probe.cache.keys  # (num_slots makes the cache)
    block_bytes = keys[:, 0].numel() * keys.element_size() * 2
    engine = _engine(model, True, slots=4, budget=block_bytes * 8)
    _assert_same(engine.generate(prompts, params), expected)
    assert engine.cache.num_blocks == 7 and engine.scheduler.paging.preemptions > 0
    assert engine.scheduler.static_verify.steps > 0


def test_a_kept_slot_continues_after_static_verify_passes(model):
    """Rejected drafts' K/V stay past each row's end in its blocks: the next turn, extending
    the kept slot, must not read them."""
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    results = []
    for static in (False, True):
        engine = _engine(model, static)
        first = engine.generate(PROMPTS, params, keep=True)
        turns = [p + c.token_ids + [7, 8] for p, c in zip(PROMPTS, first)]
        second = engine.generate(turns, params, reuse=[c.kv_handle for c in first])
        results.append(first + second)
    _assert_same(results[1], results[0])
    assert engine.speculation.stats.rows > engine.speculation.stats.passes  # rows together


def test_padding_goes_to_the_scratch_entry_and_the_grid_indexes_each_draft(model):
    """The inputs of one static pass: each row's drafts packed after the rows at the
    positions after its last token, in its blocks; the token bucket's padding at offset 0
    of the scratch block (the only K/V it writes); the keep grid [bucket, k + 1]."""
    from types import SimpleNamespace

    engine = _engine(model, True)
    engine.start_generation()
    scheduler, static = engine.scheduler, engine.scheduler.static_verify
    sub = SimpleNamespace(prompt_of=lambda request: [1] * request)
    lives = [SimpleNamespace(sub=sub, request=14, tokens=[3, 4], slot=2),  # last token at 15
             SimpleNamespace(sub=sub, request=3, tokens=[5], slot=1),
             SimpleNamespace(sub=sub, request=4, tokens=[6], slot=0)]  # fmt: skip
    scheduler.paging.grow([2, 1, 0], [20, 8, 8])
    static._upload(scheduler.paging, lives, [[7, 8, 9], [], [10]], static.bucket(3))
    assert static.bucket(3) == 4
    views = static.inputs.views(4 * 3)
    table = scheduler.paging.pool.table_array
    assert views.ids.tolist() == [7, 8, 9, 10] + [0] * 8
    assert views.positions.tolist() == [16, 17, 18, 5] + [0] * 8
    scratch = engine.cache.num_blocks
    assert views.entries.tolist() == [table[2, 1]] * 3 + [table[0, 0]] + [scratch] * 8
    assert views.offsets.tolist() == [0, 1, 2, 5] + [0] * 8
    assert views.slots.tolist() == [2, 2, 2, 0] + [engine.state.scratch_slot] * 8
    assert views.keep[:16].view(4, 4).tolist() == [[0, 4, 5, 6], [1, 1, 1, 1], [2, 7, 2, 2],
                                                   [3, 3, 3, 3]]  # fmt: skip
    tiles = [tuple(t) for t in views.tiles.tolist() if t[2] > t[1]]
    assert tiles == [(2, 0, 3), (0, 3, 4), (-1, 4, 12)]


def test_a_new_scheduler_drops_the_static_graphs_of_the_last_one(model):
    """A captured static step reads its own step's buffers: the scheduler a failed call
    leaves behind (Engine._reset_scheduler) makes new steps, whose graphs start afresh; the
    decode graphs (which read the state and cache only) stay."""
    options = EngineOptions(decode_backend="triton", graph_verify_steps=True,
                            max_prefill_tokens_per_step=8, graph_mixed_steps=True,
                            **SPECULATIVE)  # fmt: skip
    engine = Engine(model, 4, 64, options=options)
    engine.start_generation()
    graphs, mode = engine.runner.graphs, ("mode", False)  # keys as the runner's table has
    graphs.update({(("verify", 1), mode): "verify", (("mixed", 1, 16), mode): "mixed",
                   (1, mode): "decode"})  # fmt: skip
    engine._reset_scheduler()
    assert graphs == {(1, mode): "decode"}


def test_static_verify_passes_over_an_fp8_kv_cache_emit_what_eager_ones_emit(model):
    """e4m3 K/V with their scales (cache/fp8_kv.py): the rows' and drafts' K/V stored
    quantized, the decode and chunk attention reading them dequantized, as the eager verify
    passes over the same cache (accepting and rejecting the same drafts)."""
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    eager, engine = _engine(model, False, kv="fp8"), _engine(model, True, kv="fp8")
    _assert_same(engine.generate(PROMPTS, params), eager.generate(PROMPTS, params))
    assert engine.cache.keys.dtype == torch.float8_e4m3fn
    assert _counts(engine) == _counts(eager)
    stats = engine.speculation.stats
    assert engine.scheduler.static_verify.steps == stats.passes > 0
    assert 0 < stats.accepted < stats.drafted
