"""The engine on prompts with images for Qwen3.5 with its encoder (tiny-hybrid-vl, fp32,
CPU): Gated DeltaNet layers beside gated attention turned by interleaved mRoPE. Greedy
tokens equal the model's own greedy decoding with its images, through separate prefill
passes and through mixed steps whose chunks split an image."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.images import PromptImages
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config

CONFIG = preset_config("tiny-hybrid-vl")
SPEC = CONFIG.vision
IMAGE, START, END = SPEC.image_token_id, SPEC.vision_start_token_id, SPEC.vision_end_token_id
PROMPTS = [[5, START] + [IMAGE] * 6 + [END, 6, 7], [8, 9, 10],
           [11, START] + [IMAGE] * 4 + [END, 12, START] + [IMAGE] * 4 + [END]]  # fmt: skip
GRIDS = [torch.tensor([[1, 4, 6]]), None, torch.tensor([[1, 4, 4], [1, 2, 8]])]


@pytest.fixture(scope="module")
def model():
    generator = torch.Generator().manual_seed(1)
    model = build_model(CONFIG, seed=1).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if not name.endswith("bias") and "A_log" not in name and "dt_bias" not in name:
            p.normal_(0, 0.1 if name.startswith("visual.") else 0.3, generator=generator)
    return model


def _pixels(flip: bool = False):
    generator = torch.Generator().manual_seed(0)
    pixels = [None if g is None else torch.randn(int(g.prod(-1).sum()), SPEC.patch_elements,
                                                 generator=generator) for g in GRIDS]  # fmt: skip
    return [p.flip(0) if flip and p is not None else p for p in pixels]


def _images(pixels):
    return [None if g is None else PromptImages(p, g) for p, g in zip(pixels, GRIDS)]


def _greedy_reference(model, prompt, pixels, grid, steps):
    ids = list(prompt)
    for _ in range(steps):
        logits = model(torch.tensor([ids]), pixel_values=pixels, image_grid_thw=grid)
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("per_step", [0, 5], ids=["prefill-passes", "mixed-steps"])
def test_greedy_tokens_equal_the_models_own_decoding_with_images(model, per_step):
    pixels = _pixels()
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    options = EngineOptions(max_prefill_tokens_per_step=per_step)
    engine = Engine(model, max_batch_size=4, max_seq_len=64, options=options)
    got = [c.token_ids for c in engine.generate(PROMPTS, params, images=_images(pixels))]
    for prompt, p, g, tokens in zip(PROMPTS, pixels, GRIDS, got):
        assert tokens == _greedy_reference(model, prompt, p, g, 6)
    moved = engine.generate(PROMPTS, params, images=_images(_pixels(flip=True)))
    assert [c.token_ids for c in moved] != got  # the images matter
