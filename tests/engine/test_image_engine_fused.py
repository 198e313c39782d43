"""Prompts with images on the fused path (the triton backend: the decode layers turn each
slot's rows at its cache position plus its mRoPE shift, RopeTable.slot_shift; the prefill of
a pass with images runs the model's own modules): tiny-vl in fp32 samples the tokens and
log-probs of the torch backend, with images of different sizes (slots of different shifts),
n > 1 samples sharing their prompt's prefix, preemption, kept slots and speculative verify
passes, and mixed steps (chunks of prompts with images beside decode rows; a static step
runs such a step eagerly). Runs on CUDA (marked gpu; graphs replayed), or on CPU under
TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device

DEVICE = triton_test_device()
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.engine import Engine, EngineOptions, SamplingParams  # noqa: E402
from hybridflow.engine.images import PromptImages  # noqa: E402
from hybridflow.models import build_model  # noqa: E402
from hybridflow.models.presets import preset_config  # noqa: E402

CONFIG = preset_config("tiny-vl")
SPEC = CONFIG.vision
IMAGE, START, END = SPEC.image_token_id, SPEC.vision_start_token_id, SPEC.vision_end_token_id
# mRoPE shifts -3 (a 2 x 3 merged grid: 6 tokens over 3 positions), 0 (text), -2 (a 2 x 2
# grid and a 1 x 4 one) and -10 (a 3 x 4 grid and a 2 x 2 one)
PROMPTS = [[5, START] + [IMAGE] * 6 + [END, 6, 7], [8, 9, 10],
           [11, START] + [IMAGE] * 4 + [END, 12, START] + [IMAGE] * 4 + [END],
           [START] + [IMAGE] * 12 + [END, 13, START] + [IMAGE] * 4 + [END, 14]]  # fmt: skip
GRIDS = [torch.tensor([[1, 4, 6]]), None, torch.tensor([[1, 4, 4], [1, 2, 8]]),
         torch.tensor([[1, 6, 8], [1, 4, 4]])]  # fmt: skip


@pytest.fixture(scope="module")
def model():
    """std-0.3 language-model weights (peaked logits), std-0.1 encoder weights; the image
    token's row zeroed (tied head: never sampled, so a later turn holds no stray image id)."""
    generator = torch.Generator().manual_seed(1)
    model = build_model(CONFIG, seed=1).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if not name.endswith("bias"):
            p.normal_(0, 0.1 if name.startswith("visual.") else 0.3, generator=generator)
    model.model.embed_tokens.weight[IMAGE].zero_()
    return model.to(DEVICE)


def _images():
    generator = torch.Generator().manual_seed(0)
    out = []
    for grid in GRIDS:
        if grid is None:
            out.append(None)
            continue
        pixels = torch.randn(int(grid.prod(-1).sum()), SPEC.patch_elements, generator=generator)
        out.append(PromptImages(pixels.to(DEVICE), grid.to(DEVICE)))
    return out


def _generate(model, backend: str, params, budget=None, block=None, **options):
    engine = Engine(model, max_batch_size=12, max_seq_len=64, memory_budget=budget,
                    options=EngineOptions(decode_backend=backend, kv_block_size=block,
                                          **options))  # fmt: skip
    assert engine.decode_backend == backend
    return engine, engine.generate(PROMPTS, params, images=_images())


# fp32 on CUDA: cuBLAS and Triton sum in other orders than the CPU's
ATOL = 1e-4 if DEVICE == "cuda" else 1e-5


def _assert_same(got, expected):
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=ATOL)


def test_shifts_differ_between_the_prompts():
    from hybridflow.engine.images import prepare_images

    prepared = prepare_images(CONFIG, PROMPTS, _images())
    assert [None if p is None else p.shift for p in prepared] == [-3, None, -2, -10]


def test_greedy_tokens_and_logprobs_equal_the_torch_backend(model):
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    _, expected = _generate(model, "torch", params, cuda_graphs=False)
    engine, got = _generate(model, "triton", params)
    _assert_same(got, expected)
    assert engine.rope.slot_shift is not None


def test_samples_sharing_their_prompts_prefix_equal_the_torch_backend(model):
    """n = 3 samples a prompt on a paged cache: the decode reads each prompt's prefix once
    for its samples (shared_prefix.py), every sample's slot at its prompt's shift."""
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=3, ignore_eos=True)
    _, expected = _generate(model, "torch", params, block=16, cuda_graphs=False)
    engine, got = _generate(model, "triton", params, block=16)
    _assert_same(got, expected)


def test_preempted_requests_resume_at_their_shift(model):
    """12 sequences of 1-2 blocks (16 positions; 21 in all) in 14 blocks: the newest are
    preempted and prefilled again (with their images), their slot's shift set again."""
    params = SamplingParams(n=3, temperature=0.9, max_new_tokens=8, seed=3, ignore_eos=True)
    _, expected = _generate(model, "torch", params, block=16, cuda_graphs=False)
    probe = Engine(model, 12, 64, options=EngineOptions(decode_backend="triton",
                                                        kv_block_size=16))  # fmt: skip
    probe._allocate()
    block = probe.cache.keys[:, 0].numel() * probe.cache.keys.element_size() * 2
    engine, got = _generate(model, "triton", params, budget=block * 15, block=16)
    assert engine.cache.num_blocks == 14 and engine.scheduler.paging.preemptions > 0
    _assert_same(got, expected)


def _two_turns(model, backend: str):
    """Turn 2 continues each prompt's kept slot with its tokens and three more (an extend
    pass at the slot's shift)."""
    engine = Engine(model, 4, 96, options=EngineOptions(decode_backend=backend,
                                                        kv_block_size=16))  # fmt: skip
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=7, ignore_eos=True)
    images = _images()
    first = engine.generate(PROMPTS, params, keep=True, images=images)
    prompts = [p + c.token_ids + [40, 41, 42] for p, c in zip(PROMPTS, first)]
    engine.prefill_tokens = 0
    second = engine.generate(prompts, params, reuse=[c.kv_handle for c in first], images=images)
    assert engine.prefill_tokens == 4 * 4  # continued: each its unread token and the 3 added
    return first + second


def test_kept_slots_continue_at_their_shift(model):
    _assert_same(_two_turns(model, "triton"), _two_turns(model, "torch"))


def test_speculative_verify_passes_turn_rows_at_their_shift(model):
    """Drafts scored in extend passes over the decode rows: each row at its slot's shift."""
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    _, expected = _generate(model, "torch", params, block=16, cuda_graphs=False)
    speculative = dict(speculative="ngram", speculative_max_rows=64, speculative_min_ngram=1,
                       speculative_rule="always")  # fmt: skip
    engine, got = _generate(model, "triton", params, block=16, **speculative)
    assert engine.speculation.stats.passes > 0
    _assert_same(got, expected)


def test_static_mixed_step_turns_decode_rows_at_their_shift(model):
    """The static mixed step's forward (scheduling/mixed_forward.py, what its graphs capture)
    turns its decode rows at their slots' shifts: their logits are the decode step's, over
    the same cache (random K/V), beside one padding chunk token."""
    from hybridflow.engine.kernels.chunk_attention import chunk_tiles, tile_count, tile_tokens
    from hybridflow.engine.scheduling.mixed_forward import static_forward_of

    engine = Engine(model, 4, 64, options=EngineOptions(decode_backend="triton",
                                                        kv_block_size=None))  # fmt: skip
    engine._allocate()  # a slot cache: no block table to fill
    cache, rope = engine.cache, engine.rope
    cache.keys.normal_(generator=torch.Generator(DEVICE).manual_seed(0))
    cache.values.normal_(generator=torch.Generator(DEVICE).manual_seed(1))
    rope.slot_shift[:3] = torch.tensor([-3, 0, -10])
    tokens, positions, slots = (torch.tensor(x, device=DEVICE) for x in
                                ([20, 21, 22], [12, 30, 17], [0, 1, 2]))  # fmt: skip
    expected = engine.runner.decode_forward(model, cache, rope, tokens, positions, slots, 64)
    scratch = torch.tensor([cache.scratch_slot], device=DEVICE)
    zero = torch.zeros(1, dtype=torch.long, device=DEVICE)
    per_tile = tile_tokens(CONFIG.num_attention_heads, CONFIG.num_key_value_heads)
    tiles = chunk_tiles([], [], [], 1, per_tile, tile_count(1, 0, per_tile))
    forward = static_forward_of(engine.extend)
    got = forward(model, cache, rope, torch.cat([tokens, zero]), torch.cat([positions, zero]),
                  (torch.cat([slots, scratch]), torch.cat([positions, zero])), slots,
                  torch.arange(3, device=DEVICE), torch.from_numpy(tiles).to(DEVICE))  # fmt: skip
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)


def test_mixed_steps_with_images_equal_the_torch_backends_prefill_passes(model):
    """Chunks of 5 tokens (the images straddle them) beside decode rows, with the static
    mixed step on (graph_mixed_steps): a step holding a chunk of a prompt with images runs
    eagerly (its embeddings and mRoPE cos/sin are no static buffer's), the text prompts'
    steps statically; the tokens and log-probs of the torch backend's prefill passes."""
    prompts = [PROMPTS[1], *PROMPTS, [15, 16, 17, 18, 19, 20, 21]]
    images = [None, *_images(), None]
    budgets = [3, 2, 6, 9, 7, 8]  # rows leave at different steps: later prompts join them
    params = SamplingParams(temperature=0, max_new_tokens=9, ignore_eos=True)

    def run(**options):
        engine = Engine(model, max_batch_size=3, max_seq_len=64,
                        options=EngineOptions(kv_block_size=16, steps_per_sync=2, **options))  # fmt: skip
        return engine, engine.generate(prompts, params, images=images, max_new_tokens=budgets)

    _, expected = run(decode_backend="torch", cuda_graphs=False)
    engine, got = run(decode_backend="triton", graph_mixed_steps=True,
                      max_prefill_tokens_per_step=5)  # fmt: skip
    scheduler = engine.scheduler
    assert 0 < scheduler.static_step.steps < scheduler.mixed_steps
    _assert_same(got, expected)


def test_an_fp8_engine_runs_prompts_with_images_with_the_encoder_in_the_models_dtype(model):
    """weight_format="fp8": the passes with images run the language model's fp8 copies (the
    first token's log-prob moves from the model dtype's, by the e4m3 error), the vision
    encoder stays in the model's dtype (the same features as without fp8), and the same
    fp8 path in mixed steps' chunks samples the same tokens."""
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    features = []
    handle = model.visual.register_forward_hook(lambda m, args, out: features.append(out))
    try:
        _, plain = _generate(model, "triton", params)
        engine, got = _generate(model, "triton", params, weight_format="fp8")
        _, chunked = _generate(model, "triton", params, weight_format="fp8",
                               max_prefill_tokens_per_step=5)  # fmt: skip
    finally:
        handle.remove()
    visual = {p.data_ptr() for p in model.visual.parameters()}
    assert engine.fp8.copies and not visual & set(engine.fp8.copies)
    assert len(features) == 3 and all(torch.equal(f, features[0]) for f in features[1:])
    for a, b in zip(got, plain):
        assert 0 < abs(a.logprobs[0] - b.logprobs[0]) < 0.25
    _assert_same(chunked, got)
