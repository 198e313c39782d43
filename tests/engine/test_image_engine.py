"""The engine on prompts with images (tiny-vl, fp32, CPU): greedy tokens equal the model's
own greedy decoding with its images, sampled log-probs equal the trainer's pass, the vision
encoder runs once a prompt whatever n and however the samples are admitted, the image
tokens count in the cache, mixed steps (chunked prefill beside decode rows) sample what
separate prefill passes do, and what is not supported is refused."""

from __future__ import annotations

import copy
import dataclasses
import threading
import time

import pytest
import torch

from hybridflow.data.image_batch import MROPE_POSITIONS, extend_positions, prompt_image_fields
from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.images import PromptImages
from hybridflow.models import build_model
from hybridflow.models.mrope import mrope_positions
from hybridflow.models.presets import preset_config
from hybridflow.protocol import Batch

CONFIG = preset_config("tiny-vl")
SPEC = CONFIG.vision
IMAGE, START, END = SPEC.image_token_id, SPEC.vision_start_token_id, SPEC.vision_end_token_id
# an image of 4 x 6 patches (6 merged tokens), a text prompt, two images (4 + 4 tokens)
PROMPTS = [[5, START] + [IMAGE] * 6 + [END, 6, 7], [8, 9, 10],
           [11, START] + [IMAGE] * 4 + [END, 12, START] + [IMAGE] * 4 + [END]]  # fmt: skip
GRIDS = [torch.tensor([[1, 4, 6]]), None, torch.tensor([[1, 4, 4], [1, 2, 8]])]


@pytest.fixture(scope="module")
def model():
    """std-0.3 language-model weights (peaked logits: greedy far from ties), std-0.1 encoder
    weights (its features move the logits)."""
    generator = torch.Generator().manual_seed(1)
    model = build_model(CONFIG, seed=1).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if not name.endswith("bias"):
            p.normal_(0, 0.1 if name.startswith("visual.") else 0.3, generator=generator)
    return model


def _pixels():
    generator = torch.Generator().manual_seed(0)
    return [None if g is None else torch.randn(int(g.prod(-1).sum()), SPEC.patch_elements,
                                               generator=generator) for g in GRIDS]  # fmt: skip


def _images(pixels):
    return [None if g is None else PromptImages(p, g) for p, g in zip(pixels, GRIDS)]


def _greedy_reference(model, prompt, pixels, grid, steps):
    """The model's own greedy decoding: its whole forward over prompt + tokens each step
    (mRoPE rows from the ids and grids, the image features scattered)."""
    ids = list(prompt)
    for _ in range(steps):
        device = next(model.parameters()).device
        logits = model(torch.tensor([ids], device=device), pixel_values=pixels,
                       image_grid_thw=grid)  # fmt: skip
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_greedy_tokens_equal_the_models_own_decoding_with_images(model):
    pixels = _pixels()
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    engine = Engine(model, max_batch_size=4, max_seq_len=64)
    got = [c.token_ids for c in engine.generate(PROMPTS, params, images=_images(pixels))]
    for prompt, p, g, tokens in zip(PROMPTS, pixels, GRIDS, got):
        assert tokens == _greedy_reference(model, prompt, p, g, 6)
    # the images matter: other pixels, other tokens
    other = [None if p is None else p.flip(0) for p in pixels]
    moved = engine.generate(PROMPTS, params, images=_images(other))
    assert [c.token_ids for c in moved] != got


def _count_encoder_calls(model):
    calls = []
    handle = model.visual.register_forward_hook(
        lambda module, args, out: calls.append(len(args[1]))  # the images of each call
    )
    return calls, handle


@pytest.mark.parametrize("slots, calls", [(16, [3]), (2, [1, 2])])
def test_the_encoder_runs_once_a_pass_for_its_prompts_and_their_n_samples(model, slots, calls):
    """16 slots: one prefill pass, one encoder call for both prompts' images (1 + 2); 2
    slots: prompt 0's 3 samples are admitted over two passes, sharing one encoder call."""
    encoded, handle = _count_encoder_calls(model)
    try:
        params = SamplingParams(n=3, temperature=1.0, max_new_tokens=4, seed=0)
        out = Engine(model, max_batch_size=slots, max_seq_len=64).generate(
            PROMPTS, params, images=_images(_pixels()))  # fmt: skip
    finally:
        handle.remove()
    assert len(out) == 9 and encoded == calls


def test_sampled_logprobs_equal_the_trainers_pass(model):
    from hybridflow.config import ActorConfig
    from hybridflow.learners import ActorLearner

    pixels = _pixels()
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3, ignore_eos=True)
    completions = Engine(model, max_batch_size=8, max_seq_len=64).generate(
        PROMPTS, params, images=_images(pixels))  # fmt: skip
    rows = [i // 2 for i in range(len(completions))]
    width_p, width_r = max(map(len, PROMPTS)), 6
    prompts = torch.zeros(len(rows), width_p, dtype=torch.long)
    responses = torch.zeros(len(rows), width_r, dtype=torch.long)
    mask = torch.zeros(len(rows), width_p + width_r, dtype=torch.long)
    for i, (row, c) in enumerate(zip(rows, completions)):
        prompts[i, width_p - len(PROMPTS[row]) :] = torch.tensor(PROMPTS[row])
        responses[i, : len(c.token_ids)] = torch.tensor(c.token_ids)
        mask[i, width_p - len(PROMPTS[row]) : width_p + len(c.token_ids)] = 1
    positions = [mrope_positions(torch.tensor(PROMPTS[r]), GRIDS[r], IMAGE,
                                 SPEC.spatial_merge_size) for r in rows]  # fmt: skip
    tensors, arrays = prompt_image_fields(positions, [pixels[r] for r in rows],
                                          [GRIDS[r] for r in rows], width_p)  # fmt: skip
    response_mask = mask[:, width_p:].float()
    tensors[MROPE_POSITIONS] = extend_positions(tensors[MROPE_POSITIONS], response_mask)
    tensors.update(prompts=prompts, responses=responses, attention_mask=mask,
                   response_mask=response_mask)  # fmt: skip
    trained = copy.deepcopy(model).requires_grad_(True)
    actor = ActorLearner(trained, ActorConfig(ppo_mini_batch_size=6), total_steps=1, device="cpu")
    trainer = actor.compute_logprobs(Batch(tensors, arrays))["old_logprobs"]
    engine = torch.tensor([c.logprobs for c in completions])
    assert (trainer - engine).abs().max() <= 1e-5


def _paged(model, params, budget=None, per_step=0):
    """-> (engine, completions); the call's encoder features are all dropped at its end
    (each prompt's once its last sample was admitted, a recompute's once it ran)."""
    options = EngineOptions(kv_block_size=16, max_prefill_tokens_per_step=per_step)
    engine = Engine(model, max_batch_size=9, max_seq_len=64, memory_budget=budget,
                    options=options)  # fmt: skip
    subs, submission = [], engine.submission
    engine.submission = lambda *args, **kwargs: subs.append(submission(*args, **kwargs)) or subs[-1]
    completions = engine.generate(PROMPTS, params, images=_images(_pixels()))
    assert len(subs) == 1 and not subs[0].images.features
    return engine, completions


@pytest.mark.parametrize("per_step", [0, 5])
def test_preempted_image_requests_resume_with_identical_tokens(model, per_step):
    """9 sequences of 3 blocks (image tokens included) in 14 blocks: the newest are
    preempted and prefilled again, their images' features with them (per_step: in chunks
    of mixed steps)."""
    params = SamplingParams(n=3, temperature=0.9, max_new_tokens=24, seed=3, ignore_eos=True)
    probe, expected = _paged(model, params)
    block = probe.cache.keys[:, 0].numel() * probe.cache.keys.element_size() * 2
    engine, got = _paged(model, params, budget=block * 15, per_step=per_step)
    assert engine.cache.num_blocks == 14 and engine.scheduler.paging.preemptions > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


def test_image_tokens_count_in_the_prompt_limit(model):
    # prompt 2 is 14 tokens, 8 of them its images': max_seq_len=14 leaves it no room
    engine = Engine(model, max_batch_size=4, max_seq_len=14)
    with pytest.raises(ValueError, match="prompt 2 has 14 tokens"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=1), images=_images(_pixels()))
    engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=1), images=_images(_pixels())[:1])
    assert engine.prefill_tokens == len(PROMPTS[0])  # its 6 image tokens with the text


def test_what_images_do_not_run_through_is_refused(model):
    images = _images(_pixels())
    engine = Engine(model, max_batch_size=4, max_seq_len=64)
    with pytest.raises(ValueError, match="prompt 0: an image of grid"):
        engine.generate(PROMPTS, SamplingParams(), images=[images[2], None, images[0]])
    with pytest.raises(ValueError, match="prompt 2 holds image tokens but no images"):
        engine.generate(PROMPTS, SamplingParams(), images=[images[0], None, None])
    with pytest.raises(ValueError, match="prompt 0: 23 rows of pixel_values, its grids hold 24"):
        cut = PromptImages(images[0].pixel_values[:-1], images[0].image_grid_thw)
        engine.generate(PROMPTS, SamplingParams(), images=[cut, None, images[2]])
    text_only = build_model(preset_config("tiny"), seed=0)
    with pytest.raises(ValueError, match="no vision encoder"):
        Engine(text_only, max_batch_size=4, max_seq_len=64).generate(
            [[1, 2]], SamplingParams(), images=[images[0]])  # fmt: skip


def test_speculative_verify_passes_turn_rows_at_their_shift(model):
    """Drafts scored in extend passes over the decode rows (each at its slot's mRoPE shift):
    the tokens of decoding without drafts."""
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    expected = Engine(model, max_batch_size=4, max_seq_len=64).generate(
        PROMPTS, params, images=_images(_pixels()))  # fmt: skip
    options = EngineOptions(speculative="ngram", speculative_max_rows=64,
                            speculative_min_ngram=1, speculative_rule="always")  # fmt: skip
    engine = Engine(model, max_batch_size=4, max_seq_len=64, options=options)
    got = engine.generate(PROMPTS, params, images=_images(_pixels()))
    assert engine.speculation.stats.passes > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


def _turns(model, kept: bool, added, span: bool = False, block: int | None = 64,
           per_step: int = 0):  # fmt: skip
    """Two turns of each prompt with images (n=1, sampled): turn 2's prompt is turn 1's
    with its tokens and `added` (prompt index -> ids, images) after them; with kept, turn 2
    continues turn 1's slot; span: turn 1's prompt is the images' span (image_span); block:
    the cache's kv_block_size (None: contiguous); per_step: max_prefill_tokens_per_step.
    -> (turn 1, turn 2 completions, prefilled tokens)."""
    options = EngineOptions(kv_block_size=block, max_prefill_tokens_per_step=per_step)
    engine = Engine(model, max_batch_size=4, max_seq_len=96, options=options)
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=7, ignore_eos=True)
    images = _images(_pixels())
    first = engine.generate(PROMPTS, params, keep=kept, images=images)
    prompts, second_images = [], []
    for i, (prompt, completion) in enumerate(zip(PROMPTS, first)):
        extra_ids, extra_image = added.get(i, ([40, 41, 42], None))
        prompts.append(prompt + completion.token_ids + extra_ids)
        entry = images[i]
        if extra_image is not None:  # one more image after the prompt's own
            entry = PromptImages(torch.cat([entry.pixel_values, extra_image.pixel_values]),
                                 torch.cat([entry.image_grid_thw, extra_image.image_grid_thw]))  # fmt: skip
        if span and entry is not None:
            entry = dataclasses.replace(entry, image_span=len(prompt))
        second_images.append(entry)
    reuse = [c.kv_handle for c in first] if kept else None
    engine.prefill_tokens = 0
    second = engine.generate(prompts, dataclasses.replace(params, seed=8), reuse=reuse,
                             images=second_images)  # fmt: skip
    return first, second, engine.prefill_tokens


@pytest.mark.parametrize("block, per_step", [(64, 0), (None, 0), (64, 4), (None, 4)])
def test_a_kept_slot_of_a_prompt_with_images_continues_as_a_full_prefill_samples(
    model, block, per_step
):
    """Turn 2 of prompts with images continues turn 1's kept slot (its text at the slot's
    mRoPE shift): the same tokens and log-probs as prefilling turn 2 in full, and only the
    added tokens prefilled (per_step: both turns in mixed steps' chunks)."""
    full = _turns(model, kept=False, added={}, block=block)
    kept = _turns(model, kept=True, added={}, block=block, per_step=per_step)
    for full_turn, kept_turn in zip(full[:2], kept[:2]):
        assert [c.token_ids for c in kept_turn] == [c.token_ids for c in full_turn]
        for a, b in zip(kept_turn, full_turn):
            torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    # each prompt's turn-1 token the model has not read yet, and the 3 added
    assert kept[2] == 3 * 4 and full[2] == sum(len(p) + 5 + 3 for p in PROMPTS)


def test_a_continuation_that_adds_an_image_is_prefilled_in_full(model):
    pixels = torch.randn(8, SPEC.patch_elements, generator=torch.Generator().manual_seed(5))
    extra = PromptImages(pixels, torch.tensor([[1, 2, 4]]))  # 2 image tokens
    added = {0: ([43, START, IMAGE, IMAGE, END], extra)}
    full = _turns(model, kept=False, added=added)
    kept = _turns(model, kept=True, added=added)
    assert [c.token_ids for c in kept[1]] == [c.token_ids for c in full[1]]
    for a, b in zip(kept[1], full[1]):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    assert kept[2] == len(PROMPTS[0]) + 5 + 5 + 2 * 4  # prompt 0 in full, the others' 4


def test_image_pad_ids_past_the_image_span_are_text(model):
    """A later turn holding the image-pad id (the model may sample it) after its images' span
    continues its kept slot as text, as a full prefill reads it; without the span it is
    refused (more image tokens than the grids give)."""
    added = {0: ([43, IMAGE, 44], None), 2: ([IMAGE, IMAGE], None)}
    full = _turns(model, kept=False, added=added, span=True)
    kept = _turns(model, kept=True, added=added, span=True)
    assert [c.token_ids for c in kept[1]] == [c.token_ids for c in full[1]]
    for a, b in zip(kept[1], full[1]):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    assert kept[2] == 4 + 4 + 3  # continued, each its unread token and the added ones
    with pytest.raises(ValueError, match="image tokens beyond the 1 images' grids"):
        _turns(model, kept=True, added=added)


# Mixed steps: rows leave at different steps (budgets), so chunks of later prompts run
# beside decoding rows; prompt 0's image (ids 2..7) straddles the chunks of 3 and of 5 tokens
MIXED_PROMPTS = PROMPTS[::-1] + PROMPTS
MIXED_BUDGETS = [3, 9, 2, 7, 5, 8, 8, 5, 7, 2, 9, 3]


def _mixed(model, per_step: int, block: int | None):
    options = EngineOptions(max_prefill_tokens_per_step=per_step, kv_block_size=block,
                            steps_per_sync=2)  # fmt: skip
    engine = Engine(model, max_batch_size=3, max_seq_len=64, options=options)
    images = _images(_pixels())
    params = SamplingParams(n=2, temperature=0, max_new_tokens=9, ignore_eos=True)
    return engine, engine.generate(MIXED_PROMPTS, params, images=images[::-1] + images,
                                   max_new_tokens=MIXED_BUDGETS)  # fmt: skip


@pytest.mark.parametrize("per_step, block", [(3, None), (5, 16), (64, None)])
def test_mixed_steps_with_images_sample_as_separate_prefill_passes(model, per_step, block):
    """Chunks of prompts with images (each chunk's share of the encoder's features, its
    slice of the mRoPE rows) beside decode rows and text chunks: the greedy tokens and
    log-probs of prefill passes of their own; each prompt's images encoded once for its
    two samples."""
    _, expected = _mixed(model, 0, block)
    encoded, handle = _count_encoder_calls(model)
    try:
        engine, got = _mixed(model, per_step, block)
    finally:
        handle.remove()
    assert engine.scheduler.mixed_steps > 0 and not engine.scheduler.prefilling
    assert sum(encoded) == 2 * 3  # prompts 0 and 2, each twice in the call: 1 + 2 images
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


def _cut_after_first_decode(service) -> threading.Event:
    """The service's thread waits, after its first step that decodes, until the caller's
    next task (a pause) is queued: the requests are cut mid-generation whatever the timing.
    -> the event set at that step."""
    decoding, real_step = threading.Event(), service._step

    def step():
        real_step()
        if service.engine.scheduler.decode_steps and not decoding.is_set():
            decoding.set()
            deadline = time.monotonic() + 30
            while not service._inbox and time.monotonic() < deadline:
                time.sleep(0.001)

    service._step = step
    return decoding


@pytest.mark.parametrize("per_step", [0, 5])
def test_a_partial_rollout_with_images_resumes_as_the_uncut_one(model, per_step):
    """Engine.generate through a running service (a partial rollout): cut after its first
    decode step by a pause and a new policy version (same weights), then on in a paged
    cache that preempts, so rows recompute their prompts, images and all, after the
    update: the greedy tokens and log-probs of the uncut call."""
    from hybridflow.engine import RolloutService

    params = SamplingParams(n=3, temperature=0, max_new_tokens=24, ignore_eos=True)
    probe, expected = _paged(model, params)
    block = probe.cache.keys[:, 0].numel() * probe.cache.keys.element_size() * 2
    options = EngineOptions(kv_block_size=16, max_prefill_tokens_per_step=per_step,
                            steps_per_sync=2)  # fmt: skip
    engine = Engine(model, max_batch_size=9, max_seq_len=64, memory_budget=block * 15,
                    options=options)  # fmt: skip
    got = []
    with RolloutService(engine) as service:
        decoding = _cut_after_first_decode(service)
        thread = threading.Thread(target=lambda: got.extend(
            engine.generate(PROMPTS, params, images=_images(_pixels()))))  # fmt: skip
        thread.start()
        assert decoding.wait(30)
        service.pause()
        preempted = engine.scheduler.paging.preemptions
        service.resume(weights_changed=True)
        thread.join(60)
    assert engine.scheduler.paging.preemptions > preempted  # recomputed after the update
    assert any(len(c.version_spans) == 2 for c in got)  # tokens of both versions
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
