"""The rollout engine on a transformers-written Qwen2.5-VL: greedy tokens (fp32) equal
transformers' own `generate` with the images (its rope_deltas, our per-slot shift), for a
prompt with one image and one with two."""

import pytest
import torch
from qwen2_5_vl_helpers import image_batch, transformers_model

from hybridflow.engine import Engine, SamplingParams
from hybridflow.engine.images import PromptImages
from hybridflow.models.checkpoint_io.hf_checkpoint import load_model_from_dir

pytest.importorskip("transformers")
STEPS = 8


def test_greedy_tokens_with_images_equal_transformers_generate(tmp_path):
    reference = transformers_model()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # peaked logits: greedy far from ties
        for param in reference.model.language_model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.3, generator=generator)
    reference.generation_config.eos_token_id = None
    reference.save_pretrained(tmp_path)
    ours = load_model_from_dir(str(tmp_path)).eval()
    ids, mask, pixels, grid, _ = image_batch()
    patches = grid.prod(-1).tolist()  # row 0: image 0; row 1: images 1 and 2
    rows = [(0, slice(0, 1), slice(0, patches[0])),
            (1, slice(1, 3), slice(patches[0], sum(patches)))]  # fmt: skip
    prompts, images, expected = [], [], []
    for row, images_of, pixels_of in rows:
        prompt = ids[row][mask[row].bool()]
        prompts.append(prompt.tolist())
        images.append(PromptImages(pixels[pixels_of], grid[images_of]))
        with torch.no_grad():
            out = reference.generate(
                input_ids=prompt[None], attention_mask=torch.ones_like(prompt)[None],
                pixel_values=pixels[pixels_of], image_grid_thw=grid[images_of],
                mm_token_type_ids=(prompt == ours.config.vision.image_token_id).long()[None],
                do_sample=False, max_new_tokens=STEPS, pad_token_id=0,
            )  # fmt: skip
        expected.append(out[0, len(prompt) :].tolist())
    params = SamplingParams(temperature=0, max_new_tokens=STEPS, ignore_eos=True)
    got = Engine(ours, max_batch_size=4, max_seq_len=64).generate(prompts, params, images=images)
    assert [c.token_ids for c in got] == expected
