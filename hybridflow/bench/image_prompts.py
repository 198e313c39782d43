"""Prompts with images for the benchmarks of a vision-language model (``bench rollout``,
benchmarks/grpo_vs_trl.py): random RGB pictures of fixed sizes made with PIL, preprocessed
once by the model's image processor, each prompt's ids its images' vision tokens (one
image-pad token per merged patch) followed by its text ids.

The processor is the model directory's own (its preprocessor_config.json); a preset, or a
directory without one, gets transformers' Qwen2-VL processor for its encoder with the
published Qwen2.5-VL limits scaled to its patch (min_pixels 56², max_pixels 3584² at
14-pixel patches merged 2 x 2): an image keeps its size, rounded to whole merged patches.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

GEO3K_IMAGE_SIZES = ((256, 256), (384, 288), (448, 448), (576, 432))
"""Geometry3K's figures are small diagrams of ~200-600 pixels a side; these four, in turn,
give 81, 140, 256 and 315 image tokens at Qwen2.5-VL's 28-pixel merged patches."""
MIN_SIDE_IN_TOKENS, MAX_SIDE_IN_TOKENS = 2, 128
"""Qwen2.5-VL's published min_pixels (56²) and max_pixels (3584²) in merged patches a side."""


def parse_image_sizes(text: str) -> tuple[tuple[int, int], ...]:
    """``"448x448,576x432"`` -> ((448, 448), (576, 432)); argparse's type for --image-size."""
    sizes = []
    for part in text.split(","):
        width, sep, height = part.strip().lower().partition("x")
        if not (sep and width.isdigit() and height.isdigit() and int(width) and int(height)):
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r} is not WIDTHxHEIGHT in pixels (e.g. 448x448; several "
                "comma-separated, given to the prompts in turn)"
            )
        sizes.append((int(width), int(height)))
    return tuple(sizes)


def images_per_prompt(text: str) -> int:
    """argparse's type for --images-per-prompt: a whole number, 0 or more."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of images (0 or more)")
    return int(text)


def format_image_sizes(sizes) -> str:
    return ",".join(f"{w}x{h}" for w, h in sizes)


def bench_image_processor(path: str, vision):
    """The image processor of ``path`` (a model directory with a preprocessor_config.json),
    else transformers' Qwen2-VL processor for the encoder ``vision`` (a VisionSpec) with
    Qwen2.5-VL's published size limits in merged patches."""
    from hybridflow.data.images import ImageProcessor

    if (Path(path) / "preprocessor_config.json").is_file():
        return ImageProcessor.from_model_dir(path)
    unit = vision.patch_size * vision.spatial_merge_size
    return ImageProcessor.for_encoder(
        vision, min_side=MIN_SIDE_IN_TOKENS * unit, max_side=MAX_SIDE_IN_TOKENS * unit
    )


def random_images(count: int, sizes, seed: int) -> list:
    """``count`` PIL RGB images of uniform random pixels, of ``sizes`` in turn."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = []
    for i in range(count):
        width, height = sizes[i % len(sizes)]
        pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
        images.append(Image.fromarray(pixels, "RGB"))
    return images


def text_id_limit(config) -> int:
    """Random text ids stay below this: the vocabulary, or a vision model's smallest vision
    token id (a random image-pad id in the text would be read as an image's token)."""
    vision = getattr(config, "vision", None)
    if vision is None:
        return config.vocab_size
    marks = (vision.image_token_id, vision.video_token_id, vision.vision_start_token_id,
             vision.vision_end_token_id)  # fmt: skip
    return min(config.vocab_size, *marks)


@dataclass(frozen=True)
class ImagePrompts:
    """Prompts with images: ``prompts`` the ids (the images' vision tokens, then the text),
    ``images`` an engine PromptImages per prompt, ``pictures`` the PIL images of each prompt
    (for a peer that preprocesses them itself), ``image_tokens`` each prompt's image-pad
    tokens."""

    prompts: list[list[int]]
    images: list
    pictures: list[list]
    image_tokens: list[int]

    def summary(self) -> dict:
        """What a benchmark's table and JSON say of the prompts' image tokens."""
        tokens, lengths = self.image_tokens, [len(p) for p in self.prompts]
        return {
            "images_per_prompt": len(self.pictures[0]) if self.pictures else 0,
            "image_tokens_per_prompt": {"min": min(tokens), "mean": sum(tokens) / len(tokens),
                                        "max": max(tokens)},
            "prompt_tokens": {"min": min(lengths), "mean": sum(lengths) / len(lengths),
                              "max": max(lengths)},
        }  # fmt: skip


def with_images(texts: list[list[int]], images_per_prompt: int, sizes, processor, vision,
                seed: int = 0) -> ImagePrompts:  # fmt: skip
    """Each text prompt preceded by ``images_per_prompt`` random images (of ``sizes`` in
    turn over all the prompts' images), preprocessed by ``processor`` (data/images.py's
    ImageProcessor) as the data path does: one image-pad token per merged patch, mRoPE's
    position rows from the ids and grids."""
    import torch  # here: the CLI imports this module for --image-size's parser alone

    from hybridflow.data.images import expand_image_pads
    from hybridflow.engine.images import PromptImages
    from hybridflow.models.mrope import mrope_positions

    pad, merge = vision.image_token_id, vision.spatial_merge_size
    marks = [vision.vision_start_token_id, pad, vision.vision_end_token_id]
    pictures = random_images(len(texts) * images_per_prompt, sizes, seed)
    prompts, images, per_prompt, counts = [], [], [], []
    for i, text in enumerate(texts):
        own = pictures[i * images_per_prompt : (i + 1) * images_per_prompt]
        pixel_values, grid = processor(own)
        ids = expand_image_pads(marks * images_per_prompt + list(text), grid, pad, merge)
        positions = mrope_positions(torch.tensor(ids), grid, pad, merge)
        prompts.append(ids)
        images.append(PromptImages(pixel_values, grid, positions))
        per_prompt.append(own)
        counts.append(int(grid.prod(-1).sum()) // merge**2)
    return ImagePrompts(prompts, images, per_prompt, counts)
