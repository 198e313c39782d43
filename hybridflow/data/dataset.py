"""Prompt dataset: validated records -> prompt token ids -> left-padded batches.

The chat template is applied once, when the dataset is built, so the training loop only
gathers and pads ids. Prompts longer than `max_prompt_length` are filtered (the count is
kept in `num_filtered` for the log), raise an error, or are truncated from the left (the
end of the prompt, with the generation prompt, is what the model must see). A prompt with
more characters than that many tokens can stand for is handled so before it is tokenized,
as its row is read (char_limits.py): tokenizing a huge prompt costs many times its size.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridflow.data.char_limits import char_limit, keep_last_chars, text_chars
from hybridflow.data.chat import ChatTokenizer, encode_chat_prompt
from hybridflow.data.image_batch import prompt_image_fields
from hybridflow.data.images import ImageProcessor, image_prompt_ids
from hybridflow.data.sampler import ResumableSampler
from hybridflow.data.schema import DataSchemaError, PromptRecord, iter_prompt_records

OVERLONG_MODES = ("filter", "error", "truncate")


@dataclass(frozen=True)
class PromptItem:
    """One tokenised prompt; `index` is the row's position in the source records. A prompt
    with images: its ids hold an image-pad token per merged patch, ``image_grid_thw`` the
    grids its images will have, ``mrope_positions`` [3, len(prompt_ids)] its position rows
    (data/images.py); the pixels are made when a batch is (collate_prompts)."""

    prompt_ids: list[int]
    record: PromptRecord
    index: int
    image_grid_thw: torch.Tensor | None = None
    mrope_positions: torch.Tensor | None = None


def tokenize_records(
    records: Iterable[PromptRecord],
    tokenizer: ChatTokenizer,
    max_prompt_length: int | None,
    overlong: str = "filter",
    images: ImageProcessor | None = None,
) -> tuple[list[PromptItem], int]:
    """Apply the chat template to each record as it comes; returns (items kept, number
    filtered). A record with images is tokenized with its image tokens (``images``: the
    model's image processor), which count towards max_prompt_length. A prompt longer than any tokenization of max_prompt_length tokens could be
    (char_limits.py) is filtered, refused or cut before it is tokenized, so `records` may
    be a stream whose rows are dropped as they are read."""
    if overlong not in OVERLONG_MODES:
        raise ValueError(f"overlong={overlong!r}; expected one of {OVERLONG_MODES}")
    chars_at_most = char_limit(tokenizer, max_prompt_length)
    items, num_filtered = [], 0
    for index, record in enumerate(records):
        chars = text_chars(record.prompt)
        if chars_at_most is not None and chars > chars_at_most:
            if overlong == "filter":
                num_filtered += 1
                continue
            if overlong == "error":
                raise DataSchemaError(
                    f"{record.where}: prompt has {chars} characters, more than "
                    f"data.max_prompt_length={max_prompt_length} tokens can hold with this "
                    f"tokenizer ({chars_at_most}); raise the limit or set the overlong "
                    "prompt mode to 'filter' or 'truncate'"
                )
            record = replace(record, prompt=keep_last_chars(record.prompt, 2 * chars_at_most))
        grid = positions = None
        if record.images:
            prompt_ids, grid, positions = _image_prompt_ids(record, tokenizer, images)
        else:
            prompt_ids = encode_chat_prompt(tokenizer, record.prompt)
        if not prompt_ids:
            raise DataSchemaError(
                f"{record.where}: the prompt is no tokens after the chat template "
                f"({type(tokenizer).__name__}): check the row's messages, and that the "
                "tokenizer is the one the data was written for (model.tokenizer_path)"
            )
        if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
            if overlong == "error":
                raise DataSchemaError(
                    f"{record.where}: prompt has {len(prompt_ids)} tokens, more than "
                    f"data.max_prompt_length={max_prompt_length}; raise the limit or set "
                    f"the overlong prompt mode to 'filter' or 'truncate'"
                )
            if overlong == "filter":
                num_filtered += 1
                continue
            if record.images:
                raise DataSchemaError(
                    f"{record.where}: prompt has {len(prompt_ids)} tokens with its images' "
                    f"tokens, more than data.max_prompt_length={max_prompt_length}, and a "
                    "prompt with images is not truncated; raise the limit or set the "
                    "overlong prompt mode to 'filter'"
                )
            prompt_ids = prompt_ids[-max_prompt_length:]
        items.append(PromptItem(prompt_ids, record, index, grid, positions))
    return items, num_filtered


def _image_prompt_ids(record: PromptRecord, tokenizer, images: ImageProcessor | None):
    """(ids with image tokens, the images' grids, mRoPE rows) of a record with images."""
    if images is None:
        raise DataSchemaError(
            f"{record.where}: the row has {len(record.images)} images, and the model has no "
            "image processor (a vision-language model's preprocessor_config.json)",
            "use a vision-language model (Qwen2.5-VL), or prompts without images",
        )
    grid = torch.tensor([images.grid_of(image.width, image.height) for image in record.images])
    try:
        ids, positions = image_prompt_ids(record.prompt, grid, tokenizer, images.merge_size)
    except ValueError as error:
        raise DataSchemaError(f"{record.where}: {error}") from None
    return ids, grid, positions


class PromptDataset:
    """Tokenised prompts, indexable; see module docstring for overlong handling."""

    def __init__(
        self,
        records: Iterable[PromptRecord],
        tokenizer: ChatTokenizer,
        max_prompt_length: int | None = None,
        overlong: str = "filter",
        images: ImageProcessor | None = None,
    ):
        self.max_prompt_length = max_prompt_length
        self.images = images  # the processor a batch's pixels are made with (collate_prompts)
        self.items, self.num_filtered = tokenize_records(
            records, tokenizer, max_prompt_length, overlong, images
        )
        if not self.items:
            raise DataSchemaError(
                f"all {self.num_filtered} prompts are longer than "
                f"data.max_prompt_length={max_prompt_length}; raise the limit"
            )

    @classmethod
    def from_files(
        cls,
        paths: str | Path | Sequence[str | Path],
        tokenizer: ChatTokenizer,
        max_prompt_length: int | None = None,
        overlong: str = "filter",
        known_data_sources: Iterable[str] | None = None,
        prompt_key: str = "prompt",
        image_key: str | None = None,
        images: ImageProcessor | None = None,
    ) -> PromptDataset:
        """image_key: the column of the rows' images; images: the model's processor."""
        records = iter_prompt_records(paths, known_data_sources, prompt_key, image_key)
        return cls(records, tokenizer, max_prompt_length, overlong, images)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> PromptItem:
        return self.items[index]

    def data_sources(self) -> list[str]:
        return sorted({item.record.data_source for item in self.items})


def _object_array(values: Sequence[Any]) -> np.ndarray:
    """A 1-D object array, even when the values are lists or dicts of equal shape."""
    array = np.empty(len(values), dtype=object)
    for position, value in enumerate(values):
        array[position] = value
    return array


def collate_prompts(
    items: Sequence[PromptItem],
    pad_token_id: int,
    pad_to: int | None = None,
    images: ImageProcessor | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """Left-pad prompts into tensors and gather the per-row metadata into arrays.

    Returns `(tensors, arrays)`:
      tensors: `prompts` [B, P] int64 (left-padded), `attention_mask` [B, P] int64.
      arrays: `data_source`, `ground_truth`, `raw_prompt`, `extra_info`, `ability`
              (object), `index` (int64) — all [B].
    `P` is the longest prompt, or `pad_to` (fixed shapes for the engine) when given.
    A batch holding images also gets each row's pixel_values and image_grid_thw and the
    prompts' mRoPE rows (data/image_batch.py): the images are preprocessed here, once a
    prompt, by ``images`` (the model's processor).
    """
    longest = max(len(item.prompt_ids) for item in items)
    width = longest if pad_to is None else pad_to
    if width < longest:
        raise ValueError(f"pad_to={pad_to} is shorter than the longest prompt ({longest})")
    prompts = torch.full((len(items), width), pad_token_id, dtype=torch.long)  # [B, P]
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)  # [B, P]
    for row, item in enumerate(items):
        length = len(item.prompt_ids)
        prompts[row, width - length :] = torch.tensor(item.prompt_ids, dtype=torch.long)
        attention_mask[row, width - length :] = 1
    records = [item.record for item in items]
    arrays = {
        "data_source": _object_array([r.data_source for r in records]),
        "ground_truth": _object_array([r.ground_truth for r in records]),
        "raw_prompt": _object_array([r.prompt for r in records]),
        "extra_info": _object_array([r.extra_info for r in records]),
        "ability": _object_array([r.ability for r in records]),
        "index": np.array([item.index for item in items], dtype=np.int64),
    }
    tensors = {"prompts": prompts, "attention_mask": attention_mask}
    if any(item.image_grid_thw is not None for item in items):
        image_tensors, image_arrays = _collate_images(items, width, images)
        tensors.update(image_tensors)
        arrays.update(image_arrays)
    return tensors, arrays


def _collate_images(items: Sequence[PromptItem], width: int, images: ImageProcessor | None):
    """Each row's images preprocessed (their grids as tokenized), and every row's rows."""
    if images is None:
        raise ValueError("a batch of prompts with images needs the model's image processor")
    pixels, grids, rows = [], [], []
    for item in items:
        pixel_values = grid = None
        if item.image_grid_thw is not None:
            pixel_values, grid = images([image.open() for image in item.record.images])
            if not torch.equal(grid, item.image_grid_thw):
                raise ValueError(f"{item.record.where}: the images' grids {grid.tolist()} are "
                                 f"not those tokenized ({item.image_grid_thw.tolist()})")  # fmt: skip
        pixels.append(pixel_values)
        grids.append(grid)
        length = len(item.prompt_ids)
        rows.append(item.mrope_positions if item.mrope_positions is not None
                    else torch.arange(length).expand(3, length))  # fmt: skip
    return prompt_image_fields(rows, pixels, grids, width)


def make_prompt_batch(
    items: Sequence[PromptItem],
    pad_token_id: int,
    pad_to: int | None = None,
    images: ImageProcessor | None = None,
):
    """`collate_prompts` wrapped in a `hybridflow.protocol.Batch`."""
    from hybridflow.protocol import Batch

    tensors, arrays = collate_prompts(items, pad_token_id, pad_to, images)
    return Batch(tensors=tensors, arrays=arrays, meta={})


class PromptLoader:
    """Dataset + resumable sampler: `next_batch()` gives the next training `Batch`."""

    def __init__(
        self,
        dataset: PromptDataset,
        batch_size: int,
        pad_token_id: int,
        seed: int = 0,
        shuffle: bool = True,
        pad_to: int | None = None,
        images: ImageProcessor | None = None,
    ):
        self.dataset, self.pad_token_id, self.pad_to = dataset, pad_token_id, pad_to
        self.images = images
        self.sampler = ResumableSampler(len(dataset), batch_size, seed=seed, shuffle=shuffle)

    def next_items(self) -> list[PromptItem]:
        return [self.dataset[i] for i in self.sampler.next_batch()]

    def next_batch(self):
        return make_prompt_batch(self.next_items(), self.pad_token_id, self.pad_to, self.images)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])


def build_prompt_datasets(
    data_config: Any,
    tokenizer: ChatTokenizer,
    seed: int = 0,
    known_data_sources: Iterable[str] | None = None,
    image_key: str | None = None,
    images: ImageProcessor | None = None,
) -> tuple[PromptDataset, PromptDataset | None]:
    """Train and validation datasets from the `data` config section (validation: None when
    `val_files` is empty). Every file is validated before any model is loaded; each
    dataset's `num_filtered` is the count of overlong prompts dropped (as the rows are read,
    so memory holds the prompts kept), for the log. image_key: the rows' image column (a
    vision-language model's), images: its processor."""
    from hybridflow.data.builtin import iter_records

    def build(files, split, overlong):
        records = iter_records(
            files,
            split=split,
            known_data_sources=known_data_sources,
            prompt_key=data_config.prompt_key,
            builtin_train_size=data_config.builtin_train_size,
            builtin_val_size=data_config.builtin_val_size,
            seed=seed,
            image_key=image_key,
        )
        return PromptDataset(records, tokenizer, data_config.max_prompt_length, overlong, images)

    train = build(data_config.train_files, "train", data_config.overlong_prompts)
    val = None
    if data_config.val_files:
        val = build(data_config.val_files, "test", data_config.overlong_prompts)
    return train, val
