"""The images of chat requests to a vision-language model: decoded, checked and preprocessed
as the data path does (data/images.py), and their image-pad tokens in the prompt.

    images = ChatImages(processor, pad_id, max_seq_len, limits)
    pixel_values, grids = images.preprocess(req.images)      # a worker thread: it resizes
    prompt = images.expand(rendered_ids, grids)               # one pad per merged patch

Each image is refused with a 400 naming its part (messages[i].content[k]) when it cannot be
decoded, has no pixels, is too narrow for the processor, or has more than
ServerLimits.max_image_pixels (read from its header, before its pixels are decoded); so is
a request with more than ServerLimits.max_images images, or whose images alone take the
context. Images are decoded and resized one at a time, so a request holds one full-size
image at most, besides the processor's output (bounded by the context: a merged patch is a
token). A server over a text-only model refuses every image part.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from hybridflow.data.images import (
    IMAGE_PAD,
    ImageProcessor,
    decode_image,
    expand_image_pads,
    image_pad_id,
)
from hybridflow.data.schema import DataSchemaError
from hybridflow.engine.images import PromptImages
from hybridflow.serve.chat_messages import ImagePart
from hybridflow.serve.limits import ServerLimits
from hybridflow.serve.openai_protocol import ChatRequest
from hybridflow.serve.prompts import PromptBuilder
from hybridflow.serve.request_error import RequestError


def chat_images(engine, tokenizer, processor: ImageProcessor | None, max_seq_len: int,
                limits: ServerLimits) -> ChatImages | None:  # fmt: skip
    """The server's ChatImages (None: a text-only model); ValueError for a vision-language
    engine without its processor, or a tokenizer without the image-pad token."""
    vision = getattr(getattr(engine, "config", None), "vision", None)
    if processor is None:
        if vision is not None:
            raise ValueError("a vision-language model is served with its image processor: "
                             "build_app(..., image_processor=ImageProcessor.for_model(path))")  # fmt: skip
        return None
    return ChatImages(processor, image_pad_id(tokenizer), max_seq_len, limits)


def refuse_images(images: list[ImagePart], model_name: str) -> None:
    """A 400 naming the first image part: this server's model takes no images."""
    if images:
        raise RequestError(f"{images[0].where}: the model {model_name!r} takes no images (it "
                           "is a text-only model): send text parts only, or serve a "
                           "vision-language model", images[0].where, "images_not_supported")  # fmt: skip


class ChatImages:
    """processor: the model's image processor (data/images.py); pad_id: its tokenizer's
    image-pad token; max_seq_len: the server's (image tokens count in it)."""

    def __init__(self, processor: ImageProcessor, pad_id: int, max_seq_len: int,
                 limits: ServerLimits):  # fmt: skip
        self.processor, self.pad_id = processor, pad_id
        self.max_seq_len, self.limits = max_seq_len, limits

    def check_count(self, images: list[ImagePart]) -> None:
        if len(images) > self.limits.max_images:
            extra = images[self.limits.max_images]
            raise RequestError(f"{extra.where}: a request takes at most "
                               f"{self.limits.max_images} images; this one has {len(images)}",
                               extra.where, "too_many_images")  # fmt: skip

    def preprocess(self, images: list[ImagePart]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (pixel_values [patches, C*T*P*P], image_grid_thw [images, 3]); RequestError
        naming the first image that cannot be used."""
        self.check_count(images)
        pixels, grids, tokens = [], [], 0
        merge = self.processor.merge_size**2
        for image in images:
            message, _, part = image.where.partition(".")
            try:  # "messages[0]: key 'content[1]' cannot be decoded as an image (...)"
                decoded = decode_image(image.data, message, part, Path("."),
                                       self.limits.max_image_pixels)  # fmt: skip
            except DataSchemaError as error:
                raise RequestError(str(error), image.where, "invalid_image") from None
            values, grid = self.processor([decoded])
            del decoded  # one full-size image at a time
            tokens += int(grid.prod(-1).sum()) // merge
            if tokens >= self.max_seq_len:
                raise RequestError(
                    f"{image.where}: the images up to this one take {tokens} tokens; this "
                    f"server's max_seq_len is {self.max_seq_len}: send fewer or smaller images",
                    image.where, "context_length_exceeded",
                )  # fmt: skip
            pixels.append(values)
            grids.append(grid)
        return torch.cat(pixels), torch.cat(grids)

    async def chat_prompt(self, prompts: PromptBuilder,
                          req: ChatRequest) -> tuple[list[int], PromptImages | None]:  # fmt: skip
        """A chat's prompt ids (rendered, checked by `prompts`), and its images (None
        without): each image part's pad token repeated once per merged patch of its image.
        The images are decoded and resized in a worker thread (the event loop serves on)."""
        ids = prompts.chat_prompt(req)
        self.check_count(req.images)
        self.check_pads(ids, len(req.images), "messages")
        if not req.images:
            return ids, None
        pixels, grids = await asyncio.to_thread(self.preprocess, req.images)
        return prompts.check_length(self.expand(ids, grids), "messages"), PromptImages(
            pixels, grids
        )

    def check_pads(self, ids: list[int], images: int, param: str) -> None:
        """The rendered prompt holds one image-pad token per image: no more (text that
        spells the token out would take an image's place), no fewer (a template that drops
        content parts)."""
        found = ids.count(self.pad_id)
        if found != images:
            raise RequestError(
                f"the prompt holds {found} {IMAGE_PAD} tokens for {images} images: "
                f"the text must not hold {IMAGE_PAD} itself (send images as image_url parts)",
                param, "invalid_image",
            )  # fmt: skip

    def expand(self, ids: list[int], grids: torch.Tensor) -> list[int]:
        """Rendered ids (one pad per image) -> one pad per merged patch of each image."""
        self.check_pads(ids, len(grids), "messages")
        return expand_image_pads(ids, grids, self.pad_id, self.processor.merge_size)
