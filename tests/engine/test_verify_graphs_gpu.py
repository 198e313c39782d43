"""Verify passes captured as CUDA graphs (EngineOptions.graph_verify_steps, speculative/
static_verify.py) emit what the eager verify passes of the same fused engine emit, in fp32 on
a tiny model: greedy and sampled, a paged and a slot cache, two calls (the second drafting
from the first's responses: the graphs replayed), graphs captured by Engine.warm_up, rows
preempted by a small block budget, an FP8 KV cache; a draft model's sampled tokens follow
the target's exact distribution (chi-square, as tests/engine/speculative/
test_draft_model.py's on the eager pass); and in bf16 a second epoch's drafts are still
accepted.

    pytest -m gpu tests/engine/test_verify_graphs_gpu.py
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.sampling import allowed_probs_reference
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

PROMPTS = [[5, 17, 9, 33, 2, 71] * 3, [40, 41, 42, 40, 41], [100, 3, 8, 19, 23, 60, 61], [12, 13]]
# verify every tail step with a draft (what the measured rule decides: test_rule.py)
SPECULATIVE = dict(speculative="ngram", speculative_draft_tokens=4, speculative_max_rows=64,
                   speculative_min_ngram=1, speculative_rule="always", steps_per_sync=4)  # fmt: skip


@pytest.fixture(scope="module")
def model():
    """std-0.3 weights: peaked logits, greedy far from ties."""
    generator = torch.Generator().manual_seed(1)
    model = build_model(preset_config("tiny"), seed=1).eval().requires_grad_(False)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model.to("cuda")


def _engine(model, captured: bool, block=16, budget=None, slots=8, kv="model") -> Engine:
    """captured: verify passes with static shapes, replayed as CUDA graphs; else the eager
    verify passes of the same fused engine (its decode steps replayed as graphs either way);
    kv: the K/V cache's dtype."""
    options = EngineOptions(decode_backend="triton", kv_block_size=block, kv_cache_dtype=kv,
                            graph_verify_steps=captured, **SPECULATIVE)  # fmt: skip
    return Engine(model, slots, 96, memory_budget=budget, options=options)


def _assert_same(got, expected, atol=1e-4):
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=atol)


def _counts(engine) -> tuple:
    stats = engine.speculation.stats
    return stats.passes, stats.rows, stats.drafted, stats.accepted, stats.emitted


@pytest.mark.parametrize("block", [16, None], ids=["paged", "slots"])
@pytest.mark.parametrize(
    "params",
    [SamplingParams(n=2, temperature=0, max_new_tokens=24, ignore_eos=True),
     SamplingParams(n=2, temperature=0.8, top_p=0.9, max_new_tokens=24, seed=2,
                    stop_token_ids=(41,))],
    ids=["greedy", "sampled"],
)  # fmt: skip
def test_captured_verify_passes_emit_what_eager_verify_passes_emit(model, params, block):
    budgets = [24, 5, 24, 9, 3, 24, 16, 11]  # rows leave at different passes
    eager, engine = _engine(model, False, block), _engine(model, True, block)
    for _ in range(2):  # the second call drafts from the first's responses
        expected = eager.generate(PROMPTS, params, max_new_tokens=budgets)
        _assert_same(engine.generate(PROMPTS, params, max_new_tokens=budgets), expected)
    static = engine.scheduler.static_verify
    assert _counts(engine) == _counts(eager)
    assert static.steps > static.captures > 0  # passes replayed graphs captured before
    assert static.steps == engine.speculation.stats.passes > 0
    assert engine.speculation.stats.accepted > 0


def test_captured_verify_passes_over_an_fp8_kv_cache_emit_what_eager_ones_emit(model):
    """e4m3 K/V with their scales: the captured passes store the rows' and drafts' K/V
    quantized and read them dequantized, as the eager passes over the same cache."""
    params = SamplingParams(n=2, temperature=0, max_new_tokens=24, ignore_eos=True)
    eager, engine = _engine(model, False, kv="fp8"), _engine(model, True, kv="fp8")
    for _ in range(2):  # the second call replays the graphs
        _assert_same(engine.generate(PROMPTS, params), eager.generate(PROMPTS, params))
    assert engine.cache.keys.dtype == torch.float8_e4m3fn
    assert _counts(engine) == _counts(eager)
    assert engine.scheduler.static_verify.captures > 0
    assert 0 < engine.speculation.stats.accepted < engine.speculation.stats.drafted


def test_warm_up_captures_the_verify_graphs_that_the_passes_then_replay(model):
    params = SamplingParams(n=2, temperature=0, max_new_tokens=24, ignore_eos=True)
    expected = _engine(model, False).generate(PROMPTS, params)
    engine = _engine(model, True)
    captured = engine.warm_up(params)
    static = engine.scheduler.static_verify
    assert static.captures == len(static.buckets) > 0
    assert captured == static.captures + len(engine.runner.buckets)
    _assert_same(engine.generate(PROMPTS, params), expected)
    assert static.captures == len(static.buckets) and static.steps > 0


def test_captured_verify_passes_with_preemption_keep_every_token(model):
    """Seven blocks of 16 for four sequences growing to two blocks each (as
    test_static_verify_fused.py's): the newest rows are preempted and prefilled again."""
    params = SamplingParams(n=2, temperature=0, max_new_tokens=24, ignore_eos=True)
    prompts = [[40, 41, 42, 40, 41], [12, 13]]
    expected = _engine(model, False, slots=4).generate(prompts, params)
    probe = _engine(model, True, slots=4)
    keys = probe.num_slots and probe.cache.keys  # (num_slots makes the cache)
    block_bytes = keys[:, 0].numel() * keys.element_size() * 2
    engine = _engine(model, True, budget=block_bytes * 8, slots=4)
    _assert_same(engine.generate(prompts, params), expected)
    assert engine.cache.num_blocks == 7 and engine.scheduler.paging.preemptions > 0
    assert engine.scheduler.static_verify.captures > 0


SAMPLES = 6000
PROMPT = [5, 17, 9, 33, 2, 71]
TOP_P = SamplingParams(n=SAMPLES, temperature=1.0, top_p=0.9, max_new_tokens=3, seed=11,
                       ignore_eos=True)  # fmt: skip


def _exact_joint(target) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) of the target's sampler after PROMPT, by enumerating its allowed sets."""
    joint = {(): 1.0}
    for _ in range(3):
        prefixes = list(joint)
        logits = target(torch.tensor([PROMPT + list(p) for p in prefixes]))[:, -1]
        probs = allowed_probs_reference(logits, TOP_P)
        joint = {(*p, t): joint[p] * float(row[t]) for p, row in zip(prefixes, probs)
                 for t in row.nonzero().flatten().tolist()}  # fmt: skip
    return joint


def _chi2(observed: dict, expected_probs: dict, total: int) -> tuple[float, float]:
    """Pearson's statistic over the cells expecting >= 5 samples and the rest pooled, and
    the critical value at p ~ 3e-5 (Wilson-Hilferty, z = 4)."""
    assert set(observed) <= set(expected_probs), "a sequence the target never samples"
    big = [cell for cell, p in expected_probs.items() if p * total >= 5]
    cells = [(observed.get(c, 0), expected_probs[c] * total) for c in big]
    rest = (total - sum(o for o, _ in cells), total - sum(e for _, e in cells))
    if rest[1] > 0:
        cells.append(rest)
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return stat, dof * (1 - 2 / (9 * dof) + 4.0 * math.sqrt(2 / (9 * dof))) ** 3


def test_a_draft_model_s_captured_passes_follow_the_target_distribution(tmp_path):
    """test_draft_model.py's target and draft (tests/engine/conftest.py's model with logits
    4x as large: at temperature 1 and top-p 0.9 its first three tokens take ~1,400
    sequences; the draft the same with noise of 0.2 x each weight's std, accepted 20-90%
    of the time): one captured pass of two drafts a row, then the rows' last tokens."""
    generator = torch.Generator().manual_seed(1)
    target = build_model(preset_config("tiny"), seed=1).eval().requires_grad_(False)
    for name, p in target.named_parameters():
        if not name.endswith("bias"):
            p.normal_(0, 0.3, generator=generator)
    target.model.norm.weight.mul_(4)
    generator = torch.Generator().manual_seed(7)
    draft = build_model(target.config, seed=0).eval().requires_grad_(False)
    for mine, theirs in zip(draft.parameters(), target.parameters()):
        noise = torch.randn(mine.shape, generator=generator) * theirs.std().nan_to_num(0)
        mine.copy_(theirs + 0.2 * noise)
    draft.save_pretrained(str(tmp_path / "draft"))
    joint = _exact_joint(target)  # on the CPU, before the engine takes the model
    assert sum(p * SAMPLES >= 5 for p in joint.values()) >= 50  # a test of many cells
    fields = {**SPECULATIVE, "speculative": "draft", "speculative_draft_tokens": 2,
              "speculative_draft_model": str(tmp_path / "draft"), "speculative_max_rows": SAMPLES}  # fmt: skip
    options = EngineOptions(decode_backend="triton", kv_block_size=None, graph_verify_steps=True,
                            **fields)  # fmt: skip
    engine = Engine(target.to("cuda"), SAMPLES, 16, options=options)
    counts: dict[tuple[int, ...], int] = {}
    for completion in engine.generate([PROMPT], TOP_P):
        counts[tuple(completion.token_ids)] = counts.get(tuple(completion.token_ids), 0) + 1
    stats = engine.speculation.stats
    assert engine.scheduler.static_verify.captures > 0
    assert 0.2 * stats.drafted < stats.accepted < 0.9 * stats.drafted  # both paths, often
    stat, critical = _chi2(counts, joint, SAMPLES)
    assert stat < critical, (stat, critical)


def test_bf16_captured_verify_passes_accept_a_second_epoch_s_drafts(model):
    """bf16: the captured drafts attend through the paged chunk kernel (the eager pass
    through FlashAttention); the second call's drafts, its first call's responses, are
    accepted (more than one token a row a pass; test_verify_fused.py measured 1.68 of at
    most 5 for the eager pass on an H100, and bounds it at 1.5)."""
    half = build_model(preset_config("tiny"), seed=1).eval().requires_grad_(False)
    half.load_state_dict(model.state_dict())
    half = half.to("cuda", torch.bfloat16)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=40, ignore_eos=True)
    engine = _engine(half, True, slots=8)
    engine.generate(PROMPTS[:3], params)
    stats = engine.speculation.stats
    before = (stats.rows, stats.emitted)
    engine.generate(PROMPTS[:3], params)
    assert engine.scheduler.static_verify.captures > 0
    assert (stats.emitted - before[1]) / (stats.rows - before[0]) > 1.3
