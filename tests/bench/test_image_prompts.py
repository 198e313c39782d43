"""The benchmarks' prompts with images: sizes parsed, the processor a preset gets keeps
Geometry3K-sized images at their size (whole merged patches), each prompt's ids hold one
image-pad token per merged patch of its images, and text ids never take a vision token."""

from __future__ import annotations

import argparse

import pytest

from hybridflow.bench.image_prompts import (
    GEO3K_IMAGE_SIZES,
    bench_image_processor,
    parse_image_sizes,
    text_id_limit,
    with_images,
)
from hybridflow.models.presets import preset_config


def test_image_sizes_parse_and_a_bad_one_is_named():
    assert parse_image_sizes("448x448, 576X432") == ((448, 448), (576, 432))
    for bad in ("448", "0x10", "ax3", "10x10,"):
        with pytest.raises(argparse.ArgumentTypeError, match="WIDTHxHEIGHT"):
            parse_image_sizes(bad)


def test_a_presets_processor_keeps_geo3k_sized_images_at_their_size():
    """Qwen2.5-VL-7B: 28-pixel merged patches, nothing shrunk or grown (its published
    min/max pixels)."""
    vision = preset_config("qwen2.5-vl-7b").vision
    processor = bench_image_processor("qwen2.5-vl-7b", vision)
    grids = [processor.grid_of(w, h) for w, h in GEO3K_IMAGE_SIZES]
    assert [t * h * w // 4 for t, h, w in grids] == [81, 140, 256, 315]
    assert processor.grid_of(3000, 3000) == (1, 214, 214)  # under 3584², kept
    assert processor.grid_of(20, 20) == (1, 4, 4)  # grown to 56²


def test_a_model_directorys_own_processor_is_used(tmp_path):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56).save_pretrained(tmp_path)
    vision = preset_config("qwen2.5-vl-7b").vision
    processor = bench_image_processor(str(tmp_path), vision)
    assert processor.grid_of(448, 448) == (1, 4, 4)  # its max_pixels, not the preset's


def test_each_prompt_holds_its_images_tokens_then_its_text():
    config = preset_config("tiny-vl")
    vision = config.vision
    processor = bench_image_processor("tiny-vl", vision)
    texts = [[20, 21, 22], [30, 31, 32]]
    made = with_images(texts, 2, ((32, 32), (48, 64), (64, 32)), processor, vision, seed=0)
    # 16-pixel merged patches: 32x32 -> 4 tokens, 48x64 -> 12, 64x32 -> 8; in turn
    assert made.image_tokens == [4 + 12, 8 + 4]
    start, pad, end = (
        vision.vision_start_token_id,
        vision.image_token_id,
        vision.vision_end_token_id,
    )
    assert made.prompts[0] == [start] + [pad] * 4 + [end, start] + [pad] * 12 + [end] + texts[0]
    second = made.images[1]
    assert second.image_grid_thw.tolist() == [[1, 4, 8], [1, 4, 4]]
    assert second.pixel_values.shape == (32 + 16, vision.patch_elements)
    assert second.positions.shape == (3, len(made.prompts[1]))
    assert [p.size for p in made.pictures[1]] == [(64, 32), (32, 32)]
    summary = made.summary()
    assert summary["images_per_prompt"] == 2
    assert summary["image_tokens_per_prompt"] == {"min": 12, "mean": 14.0, "max": 16}


def test_random_text_stays_below_the_vision_tokens():
    config = preset_config("tiny-vl")
    assert text_id_limit(config) == 124  # its image-pad id; the vocabulary is 128
    assert text_id_limit(preset_config("tiny")) == preset_config("tiny").vocab_size
    assert text_id_limit(preset_config("qwen2.5-vl-7b")) == 151652
