"""Agent episodes whose first prompt carries images (a vision-language model, data.image_key).

The row's images stay where the data path put them, one ``<image>`` placeholder each in its
messages: the loop renders the messages with the model's vision tokens in their place (the
tools' block and the chat template around them as for text), then gives each image one
image-pad token per merged patch of its grid, as the data path does
(data/images.image_prompt_ids). Every turn sends the same images with its prompt: the first
turn's prefill runs the vision encoder, later turns continue the kept K/V with text (the model's
turn, the tools' results) at the slot's mRoPE shift (engine/images.py). A turn the engine
cannot continue (its slot evicted) is prefilled in full, images included.

Tool results are text. A tool that returns an image is refused (ToolImageError): the engine
would run it (a turn that adds image tokens is prefilled in full, encoder and all), but the
trainer's batch keeps one set of images a row, the prompt's, and no mRoPE rows past them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.errors import UserError

IMAGE_PART_TYPES = ("image", "image_url", "input_image")


class ToolImageError(UserError):
    """A tool returned an image part: tool results are text (module docstring); the run
    stops with the tool's name (exit 2), as it is the tool's to change."""


@dataclass(frozen=True)
class ImagePromptIds:
    """An episode's first prompt with its images' tokens: ids (one image-pad token per
    merged patch) and mRoPE's position rows [3, len(ids)]."""

    ids: list[int]
    positions: torch.Tensor


def marked_messages(messages: list[dict]) -> list[dict]:
    """The messages with each ``<image>`` placeholder become the model's vision tokens
    (one image-pad token each, expanded after tokenizing)."""
    from hybridflow.data.images import IMAGE_PAD, PLACEHOLDER, VISION_END, VISION_START

    part = VISION_START + IMAGE_PAD + VISION_END
    return [{**m, "content": m["content"].replace(PLACEHOLDER, part)}
            if isinstance(m.get("content"), str) else dict(m) for m in messages]  # fmt: skip


def image_prompt_ids(tokenizer, rendered_ids: list[int], image_grid_thw: torch.Tensor,
                     merge_size: int) -> ImagePromptIds:  # fmt: skip
    """rendered_ids (the marked messages through the chat template: one image-pad token an
    image) -> the ids the model reads and their mRoPE rows. ValueError when the prompt's
    image tokens are not one an image."""
    from hybridflow.data.images import IMAGE_PAD, PLACEHOLDER, expand_image_pads, image_pad_id
    from hybridflow.models.mrope import mrope_positions

    pad_id = image_pad_id(tokenizer)
    grids = image_grid_thw.long().cpu()
    if rendered_ids.count(pad_id) != len(grids):
        raise ValueError(f"an episode's prompt renders {rendered_ids.count(pad_id)} "
                         f"{IMAGE_PAD} tokens for {len(grids)} images: put one {PLACEHOLDER} "
                         "in its messages where each image goes")  # fmt: skip
    ids = expand_image_pads(rendered_ids, grids, pad_id, merge_size)
    return ImagePromptIds(ids, mrope_positions(torch.tensor(ids), grids, pad_id, merge_size))


def check_text_result(name: str, result) -> None:
    """ToolImageError when a tool's result holds an image part (a content-part list, or
    one part), naming the tool."""
    parts = result if isinstance(result, list) else [result]
    if any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in parts):
        raise ToolImageError(
            f"tool {name!r} returned an image part: tool results are text (the trainer keeps "
            "a row's prompt images only)",
            "return text (e.g. what the image shows), or put the image in the row's prompt "
            "(data.image_key)",
        )
