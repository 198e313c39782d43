"""A draft model's verify passes (speculative/draft_model.py, model_verify.py) in the engine,
CPU fp32 eager: greedy tokens and log-probs equal the engine's without speculation (a draft
that disagrees with the target now and then, in a slot and a paged cache); a draft equal to
the target accepts everything at temperature 0; sampled tokens at temperature 1 with top-p
follow the target's exact distribution (chi-square over many samples, and the same test
rejects a rule that resamples from p instead of the residual), all three with a draft whose
embedding table is larger or smaller than the target's too. Drafts with per-sequence kinds (a
Gated DeltaNet model's recurrent states, a GPT-OSS model's ring of 8 positions that wraps,
a hybrid draft for an attention model) give the plain engine's greedy tokens, their state
after rejected drafts is the state of their tokens fed afresh, and a hybrid draft's sampled
tokens follow a hybrid target's distribution. Drafts the engine cannot run are refused,
naming what to set."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.sampling import allowed_probs_reference
from hybridflow.engine.speculative import model_verify, rollback
from hybridflow.engine.speculative.draft_model import (
    DraftCache,
    DraftModel,
    draft_model_problem,
    to_vocabulary,
)
from hybridflow.models import build_model
from hybridflow.models.layer_spec import LayerSpec
from hybridflow.models.presets import preset_config

EAGER = dict(decode_backend="torch", cuda_graphs=False, steps_per_sync=4)
PROMPTS = [[5, 17, 9, 33, 2, 71] * 3, [40, 41, 42, 40, 41], list(range(60, 80)) * 2, [12, 13]]


def _perturbed(model, scale: float, seed: int = 7, vocab: int | None = None):
    """A copy of `model` with noise of `scale` x each weight's std added: a draft that
    agrees with the target on its confident tokens and disagrees elsewhere. `vocab`: the
    copy's embedding table and lm_head cut or grown to that many rows (a grown row drawn at
    the weight's std), as a family's models pad their tables to different sizes."""
    generator = torch.Generator().manual_seed(seed)
    config = model.config if vocab is None else model.config.replace(vocab_size=vocab)
    copy = build_model(config, seed=0).eval().requires_grad_(False)
    for (_, mine), (_, theirs) in zip(copy.named_parameters(), model.named_parameters()):
        noise = torch.randn(mine.shape, generator=generator) * theirs.std().nan_to_num(0)
        both = tuple(slice(0, min(a, b)) for a, b in zip(mine.shape, theirs.shape))
        mine.copy_(noise)
        mine[both] = theirs[both] + scale * noise[both]
    return copy


def _saved(model, tmp_path_factory, name: str) -> str:
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def draft_dir(model, tmp_path_factory):
    return _saved(_perturbed(model, 0.1), tmp_path_factory, "draft")


@pytest.fixture(scope="module")
def peaked(model):
    """The tiny model with logits 4x as large: at temperature 1 and top-p 0.9 its first
    three tokens take ~1,400 sequences, 112 of them likely enough for a test of 6,000."""
    copy = build_model(model.config, seed=0).eval().requires_grad_(False)
    copy.load_state_dict(model.state_dict())
    copy.model.norm.weight.mul_(4)
    return copy


@pytest.fixture(scope="module", params=[(128, 128, 7), (128, 160, 11), (160, 128, 7)],
                ids=["same-table", "larger-draft-table", "smaller-draft-table"])  # fmt: skip
def peaked_pair(peaked, tmp_path_factory, request):
    """(the peaked target, its draft's directory) at (target, draft) table sizes: the
    target's grown rows are new tokens it samples (~half its first token's mass), the
    draft's q is cut or padded to them. The noise's seed: a draft accepted 20-90% of the time."""
    target_vocab, draft_vocab, seed = request.param
    target = peaked if target_vocab == 128 else _perturbed(peaked, 0.0, vocab=target_vocab)
    draft = _perturbed(target, 0.2, seed, vocab=draft_vocab)
    return target, _saved(draft, tmp_path_factory, "peaked_draft")


@pytest.fixture(scope="module")
def same_dir(model, tmp_path_factory):
    return _saved(model, tmp_path_factory, "same")


def _engine(model, draft: str | None, block=None, slots=8, max_seq_len=128, budget=None,
            **extra) -> Engine:  # fmt: skip
    fields = dict(EAGER, **extra)
    if draft is not None:
        fields.update(speculative="draft", speculative_draft_model=draft, speculative_rule="always",
                      speculative_max_rows=max(slots, 16))  # fmt: skip
    options = EngineOptions(**fields, kv_block_size=block)
    return Engine(model, slots, max_seq_len, memory_budget=budget, options=options)


def _assert_same(got, expected):
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
    for a, b in zip(got, expected):  # other matmul shapes: equal up to fp32 rounding
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("block", [None, 16])
def test_greedy_tokens_and_logprobs_equal_the_engine_without_speculation(model, draft_dir, block):
    params = SamplingParams(n=2, temperature=0, max_new_tokens=40, ignore_eos=True,
                            stop_token_ids=(17,))  # fmt: skip
    budgets = [40, 12, 40, 25, 33, 40, 7, 40]  # rows leave at different steps
    expected = _engine(model, None, block).generate(PROMPTS, params, max_new_tokens=budgets)
    engine = _engine(model, draft_dir, block)
    _assert_same(engine.generate(PROMPTS, params, max_new_tokens=budgets), expected)
    stats = engine.speculation.stats
    assert 0 < stats.accepted < stats.drafted  # some drafts kept, some rolled back
    _assert_same(engine.generate(PROMPTS, params, max_new_tokens=budgets), expected)  # again
    if block is not None:
        assert engine.blocks.free_blocks == engine.blocks.num_blocks


def test_a_draft_equal_to_the_target_accepts_everything_greedy(model, same_dir):
    params = SamplingParams(n=2, temperature=0, max_new_tokens=30, ignore_eos=True)
    expected = _engine(model, None).generate(PROMPTS, params)
    engine = _engine(model, same_dir, speculative_draft_tokens=3)
    _assert_same(engine.generate(PROMPTS, params), expected)
    stats = engine.speculation.stats
    assert stats.drafted > 0 and stats.accepted >= 0.98 * stats.drafted
    assert stats.emitted / stats.rows > 3.5  # 3 drafts and the bonus a pass, nearly always


def test_sampled_tokens_repeat_for_a_seed_and_differ_across_seeds(model, draft_dir):
    params = SamplingParams(n=2, temperature=0.8, top_k=20, max_new_tokens=20, ignore_eos=True)
    engine = _engine(model, draft_dir)
    first = engine.generate(PROMPTS, params, seeds=[1, 2, 3, 4])
    again = engine.generate(PROMPTS, params, seeds=[1, 2, 3, 4])
    other = engine.generate(PROMPTS, params, seeds=[5, 6, 7, 8])
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]
    assert engine.speculation.stats.accepted > 0


# -- the distribution ---------------------------------------------------------------------------

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


def _sampled_triples(model, draft_dir) -> tuple[dict, object]:
    engine = _engine(model, draft_dir, slots=SAMPLES, max_seq_len=16, speculative_draft_tokens=2)
    counts: dict[tuple[int, ...], int] = {}
    for completion in engine.generate([PROMPT], TOP_P):
        key = tuple(completion.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts, engine.speculation.stats


def test_sampled_tokens_follow_the_target_distribution(peaked_pair):
    target, draft_dir = peaked_pair
    counts, stats = _sampled_triples(target, draft_dir)
    assert 0.2 * stats.drafted < stats.accepted < 0.9 * stats.drafted  # both paths, often
    joint = _exact_joint(target)
    assert sum(p * SAMPLES >= 5 for p in joint.values()) >= 50  # a test of many cells
    stat, critical = _chi2(counts, joint, SAMPLES)
    assert stat < critical, (stat, critical)


def test_resampling_rejections_from_the_target_fails_the_test(peaked, tmp_path_factory,
                                                               monkeypatch):  # fmt: skip
    peaked_draft_dir = _saved(_perturbed(peaked, 0.2), tmp_path_factory, "peaked_draft")

    def from_target(target_probs, draft_probs, accepted, lengths):
        return target_probs[torch.arange(len(accepted)), accepted]  # wrong: p, not max(0, p - q)

    monkeypatch.setattr(model_verify, "residual_probs", from_target)
    counts, _ = _sampled_triples(peaked, peaked_draft_dir)
    stat, critical = _chi2(counts, _exact_joint(peaked), SAMPLES)
    assert stat > 3 * critical, (stat, critical)


# -- embedding tables of other sizes --------------------------------------------------------------


def test_logits_are_cut_or_padded_to_the_target_vocabulary():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert to_vocabulary(logits, 3).tolist() == [[1.0, 2.0, 3.0]]
    assert to_vocabulary(logits, 6).tolist() == [[1.0, 2.0, 3.0, 4.0, -math.inf, -math.inf]]
    assert to_vocabulary(logits, 4).equal(logits)


@pytest.mark.parametrize("target_vocab, draft_vocab", [(128, 160), (160, 128)],
                         ids=["larger-draft-table", "smaller-draft-table"])  # fmt: skip
def test_a_draft_with_another_table_size_gives_the_engine_s_greedy_tokens(
        model, tmp_path, target_vocab, draft_vocab):  # fmt: skip
    """The draft drafts only ids both tables have; the target's tokens past the draft's
    table (a smaller draft) are fed to it as id 0."""
    target = (
        model
        if target_vocab == model.config.vocab_size
        else _perturbed(model, 0.0, vocab=target_vocab)
    )
    draft_dir = str(tmp_path / "draft")
    _perturbed(target, 0.1, vocab=draft_vocab).save_pretrained(draft_dir)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=40, ignore_eos=True)
    expected = _engine(target, None).generate(PROMPTS, params)
    engine = _engine(target, draft_dir)
    _assert_same(engine.generate(PROMPTS, params), expected)
    stats = engine.speculation.stats
    assert 0 < stats.accepted < stats.drafted
    past_the_draft = [t for c in expected for t in c.token_ids if t >= draft_vocab]
    assert (len(past_the_draft) > 0) == (target_vocab > draft_vocab)


# -- refusals -------------------------------------------------------------------------------------


def test_a_draft_the_engine_cannot_run_is_refused_naming_what_to_set(model):
    windows = SimpleNamespace(layer_specs=lambda: [LayerSpec("attention", window=64)])
    problem = draft_model_problem(windows, "odd")
    assert problem.startswith("speculative_draft_model='odd': the engine's passes cannot run")
    assert "no windowed cache kind yet" in problem and "speculative=ngram" in problem
    vision = build_model(preset_config("tiny-vl"), seed=0)
    with pytest.raises(ValueError, match="vision-language model cannot draft.*speculative=ngram"):
        DraftModel(vision, model.config, "tiny-vl")


@pytest.mark.parametrize("preset", ["tiny", "tiny-deepseek-v3", "tiny-hybrid", "tiny-gpt-oss"])
def test_the_engine_reserves_what_the_draft_cache_takes(model, preset):
    """The engine's own cache leaves room for the draft's (allocation.py reserves
    DraftModel.cache_bytes): the reserve is the bytes the DraftCache allocates (K/V, or an
    MLA model's latent; recurrent states and rings) and the copies of the per-sequence kinds
    of as many rows."""
    draft = DraftModel(build_model(preset_config(preset), seed=0), model.config, preset)
    cache = DraftCache(draft.model, 3, 40)
    copies = rollback.save(cache.cache, [0, 1, 2]) or []
    copied = sum(t.numel() * t.element_size() for t in copies)
    assert (copied > 0) == (preset in ("tiny-hybrid", "tiny-gpt-oss"))
    assert cache.cache.nbytes() + copied == draft.cache_bytes(3, 40) > 0


def test_rows_preempted_before_a_pass_leave_the_others_drafts_in_line(model, draft_dir):
    """A paged cache too small for every row: making room for a pass preempts the newest
    rows, after their drafts were made; the others verify their own drafts."""
    params = SamplingParams(n=2, temperature=0, max_new_tokens=40, ignore_eos=True)
    expected = _engine(model, None).generate(PROMPTS, params)
    # 24 blocks of 16 positions (2 layers of 2 x 16 fp32 K and V: 4 KiB a block)
    engine = _engine(model, draft_dir, block=16, budget=24 * 4096)
    _assert_same(engine.generate(PROMPTS, params), expected)
    assert engine.scheduler.paging.preemptions > 0 and engine.speculation.stats.accepted > 0


# -- drafts with per-sequence kinds: a recurrent state, a window's ring ---------------------------

STATEFUL = {  # (target preset, draft preset: None for a noisy copy of the target, kv block)
    "hybrid": ("tiny-hybrid", None, None),
    "gpt-oss": ("tiny-gpt-oss", None, 16),  # a ring of 8 positions: it wraps
    "attention-target-hybrid-draft": ("tiny", "tiny-hybrid", None),
    "gpt-oss-target-hybrid-draft": ("tiny-gpt-oss", "tiny-hybrid", 16),  # both roll back
}
STATEFUL_PROMPTS = [[5, 17, 9, 33, 2, 71] * 2, list(range(60, 70))]


def _spread(preset: str, seed: int):
    """A preset's model with weights of std 0.3: its greedy tokens do not settle into one
    repeated token."""
    generator = torch.Generator().manual_seed(seed)
    model = build_model(preset_config(preset), seed=seed).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if not name.endswith("bias") and p.dim() > 1:
            p.normal_(0, 0.3, generator=generator)
    return model


@pytest.fixture(scope="module", params=list(STATEFUL))
def stateful(request, tmp_path_factory):
    """(target, its draft's directory, the kv block size): the draft a copy of the target
    with noise (accepted part of the time) or a model of another family (rejected)."""
    target_preset, draft_preset, block = STATEFUL[request.param]
    target = _spread(target_preset, 1)
    draft = _perturbed(target, 0.02) if draft_preset is None else _spread(draft_preset, 2)
    return target, _saved(draft, tmp_path_factory, "stateful_draft"), block, draft_preset


def _assert_rolled_back(stats, other_family: bool):
    """Drafts were rejected (so the draft's state was rolled back) and, from a copy of the
    target, accepted too (so accepted drafts were fed again)."""
    assert stats.accepted < stats.drafted
    assert other_family or stats.accepted > 0


def test_a_draft_with_per_sequence_kinds_gives_the_engine_s_greedy_tokens(stateful):
    target, draft_dir, block, draft_preset = stateful
    params = SamplingParams(n=2, temperature=0, max_new_tokens=24, ignore_eos=True)
    expected = _engine(target, None, block).generate(STATEFUL_PROMPTS, params)
    engine = _engine(target, draft_dir, block, speculative_draft_tokens=3)
    got = engine.generate(STATEFUL_PROMPTS, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):  # a recurrence run in chunks rounds otherwise
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=2e-4)
    _assert_rolled_back(engine.speculation.stats, draft_preset is not None)


def test_a_draft_s_state_after_rejections_is_that_of_its_tokens_fed_afresh(stateful,
                                                                           monkeypatch):  # fmt: skip
    """Each draft call's drafts and q equal those of the same draft feeding every row from
    its first token into a new cache: the per-sequence kinds were rolled back past the
    rejected drafts and moved through the accepted ones."""
    target, draft_dir, block, draft_preset = stateful
    propose = DraftModel.propose
    calls = []

    def checked(self, scheduler, limits):
        kept = scheduler.draft_cache
        scheduler.draft_cache = None  # a new cache for the reference
        fresh_drafts, fresh_q = propose(self, scheduler, limits)
        scheduler.draft_cache = kept
        drafts, q = propose(self, scheduler, limits)
        assert drafts == fresh_drafts
        torch.testing.assert_close(q, fresh_q, rtol=0, atol=1e-4)
        calls.append(len(drafts))
        return drafts, q

    monkeypatch.setattr(DraftModel, "propose", checked)
    engine = _engine(target, draft_dir, block, speculative_draft_tokens=3)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=24, ignore_eos=True)
    engine.generate(STATEFUL_PROMPTS, params, seeds=[1, 2])
    assert len(calls) > 5
    _assert_rolled_back(engine.speculation.stats, draft_preset is not None)


@pytest.fixture(scope="module")
def peaked_hybrid():
    """tiny-hybrid with logits 6x as large (its final norm is zero-centered: a scale of
    1 + weight): at temperature 1 and top-p 0.9 its first three tokens take ~7,700
    sequences, 66 of them likely enough for a test of 6,000."""
    model = build_model(preset_config("tiny-hybrid"), seed=0).eval().requires_grad_(False)
    model.model.norm.weight.add_(1).mul_(6).sub_(1)
    return model


def test_sampled_tokens_follow_the_target_distribution_with_a_hybrid_draft(peaked_hybrid,
                                                                           tmp_path):  # fmt: skip
    draft = _perturbed(peaked_hybrid, 0.2)
    draft.model.norm.weight.add_(1).div_(1.5).sub_(1)  # q flatter than p: rejected often
    draft.save_pretrained(str(tmp_path))
    counts, stats = _sampled_triples(peaked_hybrid, str(tmp_path))
    assert 0.2 * stats.drafted < stats.accepted < 0.9 * stats.drafted  # both paths, often
    joint = _exact_joint(peaked_hybrid)
    assert sum(p * SAMPLES >= 5 for p in joint.values()) >= 50  # a test of many cells
    stat, critical = _chi2(counts, joint, SAMPLES)
    assert stat < critical, (stat, critical)
