"""Images of prompt rows in verl's schema, read and preprocessed once, in the data path.

A row names its images under ``data.image_key`` (verl's default ``images``): a list (or
one) of encoded image bytes, a path, or a dict ``{"bytes": ..., "path": ...}`` (how
Hugging Face datasets store an Image column, e.g. geo3k's parquet). Each ``<image>`` in the
prompt's messages marks where one image goes, in order.

Each image is decoded with PIL and refused, naming the file, the row and the image, when it
takes more than MAX_IMAGE_BYTES encoded (a file's size read before it is opened), cannot be
decoded, has no pixels, or has more than ``max_pixels`` (checked from its header, before its
pixels are decoded: PIL's decompression-bomb guard). The model directory's image
processor (transformers' PIL one: no torchvision needed; torchvision's when it is installed)
turns the images into ``pixel_values`` and ``image_grid_thw``; the prompt's ids get one
image-pad token per merged patch, and mRoPE's position rows are computed once from them.
"""

from __future__ import annotations

import io
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridflow.data.chat import ChatTokenizer, encode_chat_prompt
from hybridflow.data.errors import DataSchemaError
from hybridflow.errors import UserError

PLACEHOLDER = "<image>"
# Qwen2-VL/2.5-VL's chat template writes an image part as these three tokens; the pad is
# then repeated once per merged patch
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
MAX_IMAGE_PIXELS = 89_478_485
"""PIL's own decompression-bomb threshold (Image.MAX_IMAGE_PIXELS): larger images are
refused before their pixels are decoded."""
MAX_IMAGE_BYTES = 64 * 2**20
"""The largest encoded image taken (a file's size read before it is opened): a photo at
MAX_IMAGE_PIXELS is ~30 MB as JPEG, and the Qwen-VL processors shrink anything past 12.8
megapixels. A file past it would be read whole (a 2 GB PNG with trailing bytes took
`data geo3k` past 17 GB) for no pixel the model sees."""
MAX_ASPECT_RATIO = 200
"""The Qwen-VL image processors refuse an image whose long side is over 200 times its
short side (their smart_resize): refused as the row is read, not in the middle of a run."""


def _open(value: Any, base_dir: Path) -> tuple[Any, str]:
    """The image file object of one entry and how to name it (its path, or "bytes")."""
    if isinstance(value, dict):
        data = value.get("bytes")
        if isinstance(data, str):  # a JSON file's text, base64 or not: never a path
            raise TypeError("holds {'bytes': <a string>}: 'bytes' must be the image file's "
                            "bytes (a parquet binary column), or give its file as 'path'")  # fmt: skip
        value = data if data is not None else value.get("path") or value.get("image")
    if isinstance(value, (bytes, bytearray, memoryview)):
        _check_bytes(len(value), "holds an image of")
        return io.BytesIO(bytes(value)), "bytes"
    if isinstance(value, str) and value:
        path = _image_path(value, base_dir)
        _check_bytes(path.stat().st_size, f"names the image file {path} of")
        return path, str(path)
    raise TypeError(f"holds a {type(value).__name__}, not image bytes, a path or "
                    "{'bytes': ..., 'path': ...}")  # fmt: skip


def _image_path(text: str, base_dir: Path) -> Path:
    """The image file ``text`` names (relative: to ``base_dir`` where it is there);
    FileNotFoundError when there is none, or the text is no path (too long, a NUL byte)."""
    try:
        path = Path(text.removeprefix("file://"))
        if not path.is_absolute() and (base_dir / path).exists():
            path = base_dir / path
        if path.is_file():
            return path
    except (OSError, ValueError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        shown = text if len(text) <= 60 else f"{text[:57]}..."
        raise FileNotFoundError(
            f"names no image file: {shown!r} is not a path ({reason})"
        ) from None
    raise FileNotFoundError(f"no image file {path}")


class ImageTooLarge(ValueError):
    """An encoded image past MAX_IMAGE_BYTES (refused before it is read)."""


def _check_bytes(size: int, what: str) -> None:
    if size > MAX_IMAGE_BYTES:
        raise ImageTooLarge(f"{what} {size:,} bytes, more than the {MAX_IMAGE_BYTES:,} an "
                            "image may take: shrink it or save it as JPEG (the model sees at "
                            "most its processor's max_pixels)")  # fmt: skip


def decode_image(value: Any, where: str, key: str, base_dir: Path, max_pixels: int):
    """One image entry -> an RGB PIL image; DataSchemaError naming ``where`` (file and row),
    ``key`` and the image file when it cannot be used."""
    from PIL import Image

    try:
        source, name = _open(value, base_dir)
    except (FileNotFoundError, TypeError, ImageTooLarge) as error:
        raise DataSchemaError(f"{where}: key '{key}' {error}") from None
    named = "" if name == "bytes" else f" ({name})"
    try:
        with warnings.catch_warnings():
            # the size is checked below, against max_pixels; PIL itself refuses twice its own
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(source)
            width, height = image.size
            if width < 1 or height < 1:
                raise DataSchemaError(f"{where}: key '{key}'{named} is a {width}x{height} "
                                      "image, which has no pixels")  # fmt: skip
            if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
                raise DataSchemaError(
                    f"{where}: key '{key}'{named} is a {width}x{height} image: its long side "
                    f"is over {MAX_ASPECT_RATIO} times its short side, which the image "
                    "processor refuses",
                    "crop or pad the image",
                )
            if width * height > max_pixels:
                raise DataSchemaError(
                    f"{where}: key '{key}'{named} is a {width}x{height} image, more than "
                    f"{max_pixels} pixels",
                    "shrink the image (the model sees at most its processor's max_pixels)",
                )
            image.load()
            return image.convert("RGB")
    except DataSchemaError:
        raise
    except Image.DecompressionBombError as error:
        raise DataSchemaError(f"{where}: key '{key}'{named} has more than {max_pixels} pixels "
                              f"({error})") from None  # fmt: skip
    except Image.UnidentifiedImageError:  # its text holds the repr of a BytesIO
        raise DataSchemaError(f"{where}: key '{key}'{named} cannot be decoded as an image (not "
                              "a format PIL reads, or not an image)") from None  # fmt: skip
    except (OSError, ValueError, SyntaxError) as error:
        raise DataSchemaError(f"{where}: key '{key}'{named} cannot be decoded as an image "
                              f"({error})") from None  # fmt: skip


def row_images(
    row: dict[str, Any],
    image_key: str,
    where: str,
    base_dir: str | Path = ".",
    max_pixels: int = MAX_IMAGE_PIXELS,
) -> list:
    """The decoded images of one row ([] when it has none under ``image_key``)."""
    entries = row.get(image_key)
    if entries is None:
        return []
    if not isinstance(entries, (list, tuple)):
        entries = [entries]
    return [decode_image(entry, where, f"{image_key}[{i}]", Path(base_dir), max_pixels)
            for i, entry in enumerate(entries)]  # fmt: skip


@dataclass(frozen=True)
class ImageEntry:
    """One checked image of a row, kept encoded (its bytes, or the path of its file) with
    its size: a dataset holds no decoded pixels; :meth:`open` decodes it again."""

    source: bytes | str
    width: int
    height: int

    def open(self):
        from PIL import Image

        data = io.BytesIO(self.source) if isinstance(self.source, bytes) else self.source
        with Image.open(data) as image:
            return image.convert("RGB")


def row_image_entries(
    row: dict[str, Any],
    image_key: str,
    where: str,
    base_dir: str | Path = ".",
    max_pixels: int = MAX_IMAGE_PIXELS,
) -> tuple[ImageEntry, ...]:
    """Each image of the row decoded once to check it (row_images), then kept encoded."""
    entries = row.get(image_key)
    if entries is None:
        return ()
    if not isinstance(entries, (list, tuple)):
        entries = [entries]
    kept = []
    for i, entry in enumerate(entries):
        image = decode_image(entry, where, f"{image_key}[{i}]", Path(base_dir), max_pixels)
        source, name = _open(entry, Path(base_dir))
        kept.append(ImageEntry(source.getvalue() if name == "bytes" else name, *image.size))
    return tuple(kept)


def check_placeholders(messages: list[dict[str, str]], images: int, where: str, key: str) -> None:
    """One ``<image>`` in the messages for each image of the row."""
    marks = sum(message["content"].count(PLACEHOLDER) for message in messages)
    if marks != images:
        raise DataSchemaError(
            f"{where}: the prompt has {marks} {PLACEHOLDER} placeholders, key '{key}' holds "
            f"{images} images",
            f"put one {PLACEHOLDER} in the prompt where each image goes",
        )


class ImageProcessor:
    """The image processor of a model directory (its preprocessor_config.json)."""

    def __init__(self, processor: Any):
        self.processor = processor
        self.merge_size = int(processor.merge_size)

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike) -> ImageProcessor:
        """transformers' PIL image processor (torchvision's where it is installed, faster);
        UserError naming the directory when it holds none."""
        from transformers import AutoImageProcessor

        config = Path(path) / "preprocessor_config.json"
        if not config.is_file():
            raise UserError(f"{path} has no preprocessor_config.json (the image processor of "
                            "a vision-language model)", "copy the model directory again")  # fmt: skip
        _read_json_object(config)  # a file transformers fails on is named by line
        try:
            import torchvision  # noqa: F401

            backend = "torchvision"
        except ImportError:  # CPU torch builds from local disk: the PIL one is as exact
            backend = "pil"
        try:
            processor = AutoImageProcessor.from_pretrained(str(path), backend=backend)
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise UserError(f"{config} holds a value transformers refuses "
                            f"({type(error).__name__}: {error})", PROCESSOR_FIX) from None  # fmt: skip
        problems = processor_problems(processor, _vision_config(Path(path)))
        if problems:
            raise UserError(f"{config}: {'; '.join(problems)}", PROCESSOR_FIX)
        return cls(processor)

    @classmethod
    def for_encoder(cls, spec, min_side: int = 32, max_side: int = 64) -> ImageProcessor:
        """transformers' PIL Qwen2-VL processor for an encoder of our own (a preset, which
        has no model directory): its patch, merge and frame sizes, images resized to
        between min_side² and max_side² pixels (a small encoder's few tokens)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        size = {"shortest_edge": min_side * min_side, "longest_edge": max_side * max_side}
        return cls(Qwen2VLImageProcessorPil(
            patch_size=spec.patch_size, merge_size=spec.spatial_merge_size,
            temporal_patch_size=spec.temporal_patch_size, size=size,
        ))  # fmt: skip

    @classmethod
    def for_model(cls, path: str) -> ImageProcessor:
        """A model directory's processor, or for_encoder of a preset's vision encoder."""
        from hybridflow.models.presets import PRESETS

        if path in PRESETS and PRESETS[path].vision is not None:
            return cls.for_encoder(PRESETS[path].vision)
        return cls.from_model_dir(path)

    def __call__(self, images: list) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (pixel_values [patches, C*T*P*P] fp32, image_grid_thw [images, 3] long)."""
        out = self.processor(images=images, return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"].long()

    def grid_of(self, width: int, height: int) -> tuple[int, int, int]:
        """The patch grid (1, rows, columns) an image of that size gets, without resizing
        it: the processor's own rule (smart_resize: each side a multiple of patch_size *
        merge_size, the area within its min and max pixels)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        processor = self.processor
        patch = int(processor.patch_size)
        rows, cols = smart_resize(height, width, patch * self.merge_size,
                                  processor.size.shortest_edge, processor.size.longest_edge)  # fmt: skip
        return 1, rows // patch, cols // patch


PROCESSOR_FIX = "correct the value in preprocessor_config.json, or copy the model directory again"
# the processor's sizes and config.json's vision_config names for them: patches the encoder
# does not cut (other sizes) fail deep in its first matmul or in the image-token count
PROCESSOR_SIZES = (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                   ("temporal_patch_size", "temporal_patch_size"))  # fmt: skip


def processor_problems(processor: Any, vision: dict[str, Any]) -> list[str]:
    """Why an image processor's patches do not fit the encoder ``vision`` (config.json's
    vision_config) describes, or its pixel bounds cannot resize an image ([] if fine)."""
    problems = []
    for ours, theirs in PROCESSOR_SIZES:
        value, expected = getattr(processor, ours, None), vision.get(theirs)
        if isinstance(expected, int) and value != expected:
            problems.append(f"{ours} = {value}, but config.json's vision_config.{theirs} = "
                            f"{expected}: the encoder reads patches of its own sizes")  # fmt: skip
    size = getattr(processor, "size", None)
    low, high = getattr(size, "shortest_edge", None), getattr(size, "longest_edge", None)
    whole = all(isinstance(n, int) and not isinstance(n, bool) for n in (low, high))
    if not (whole and 0 <= low <= high and high >= 1):
        problems.append(f"size shortest_edge = {low}, longest_edge = {high} (min_pixels, "
                        "max_pixels: an image's area bounds) must be whole numbers with "
                        "0 <= shortest_edge <= longest_edge and longest_edge >= 1")  # fmt: skip
    return problems


def _read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; UserError naming the file and line when it is not one."""
    import json

    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as error:
        where = f" (line {error.lineno}, column {error.colno})" if hasattr(error, "lineno") else ""
        raise UserError(f"{path} is not valid JSON{where}", PROCESSOR_FIX) from None
    if not isinstance(value, dict):
        raise UserError(f"{path} must hold a JSON object, not a {type(value).__name__}",
                        PROCESSOR_FIX)  # fmt: skip
    return value


def _vision_config(model_dir: Path) -> dict[str, Any]:
    """config.json's vision_config ({} when unreadable: the model checks say why)."""
    import json

    try:
        vision = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))[
            "vision_config"
        ]
    except (OSError, ValueError, RecursionError, KeyError, TypeError):
        return {}
    return vision if isinstance(vision, dict) else {}


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt with its images, ready for the model: ids with an image-pad token per
    merged patch, the images' pixel_values and grids, mRoPE's rows [3, len(ids)]."""

    prompt_ids: list[int]
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    position_ids: torch.Tensor


def image_prompt_ids(
    messages: list[dict[str, str]],
    image_grid_thw: torch.Tensor,
    tokenizer: ChatTokenizer,
    merge_size: int,
) -> tuple[list[int], torch.Tensor]:
    """A prompt's ids, each ``<image>`` become the model's vision tokens with one image-pad
    token per merged patch of its grid, and mRoPE's position rows [3, len(ids)] for them."""
    from hybridflow.models.mrope import mrope_positions

    part = VISION_START + IMAGE_PAD + VISION_END
    marked = [{**m, "content": m["content"].replace(PLACEHOLDER, part)} for m in messages]
    ids = encode_chat_prompt(tokenizer, marked)
    pad_id = image_pad_id(tokenizer)
    if ids.count(pad_id) != len(image_grid_thw):
        raise ValueError(f"the chat template made {ids.count(pad_id)} {IMAGE_PAD} tokens of "
                         f"{len(image_grid_thw)} images")  # fmt: skip
    expanded = expand_image_pads(ids, image_grid_thw, pad_id, merge_size)
    return expanded, mrope_positions(torch.tensor(expanded), image_grid_thw, pad_id, merge_size)


def image_pad_id(tokenizer: ChatTokenizer) -> int:
    """The tokenizer's image-pad token id; ValueError when it has none."""
    pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    if pad_id is None or pad_id == getattr(tokenizer, "unk_token_id", None):
        raise ValueError(f"the tokenizer has no {IMAGE_PAD} token (a vision-language model's "
                         "tokenizer has): set model.tokenizer_path to the model's own")  # fmt: skip
    return pad_id


def expand_image_pads(ids: list[int], image_grid_thw: torch.Tensor, pad_id: int,
                      merge_size: int) -> list[int]:  # fmt: skip
    """ids with one image-pad token per image (in order) -> with one per merged patch of
    that image's grid (the ids' pad count must equal the number of grids)."""
    counts = iter((image_grid_thw.prod(-1) // merge_size**2).tolist())
    expanded: list[int] = []
    for token in ids:
        expanded += [token] * next(counts) if token == pad_id else [token]
    return expanded


def image_prompt(
    messages: list[dict[str, str]],
    images: list,
    tokenizer: ChatTokenizer,
    processor: ImageProcessor,
) -> ImagePrompt:
    """Preprocess one prompt's images and tokenize its messages around them."""
    pixel_values, grids = processor(images)
    ids, positions = image_prompt_ids(messages, grids, tokenizer, processor.merge_size)
    return ImagePrompt(ids, pixel_values, grids, positions)
