"""A batch's images: where a Batch keeps them, how a packed forward gathers them, and how
the rollout hands them to the engine (prompt_images).

Images vary in number and size from row to row, so a Batch (protocol.py) keeps them as
object arrays, one entry a row (row operations index, repeat and chunk them with the
tokens): ``pixel_values`` (a [patches, C*T*P*P] tensor, empty for a text-only row) and
``image_grid_thw`` ([images, 3]). mRoPE's position rows are a tensor beside the tokens,
``mrope_positions`` [B, 3, P+R] aligned with ``attention_mask``: each prompt's rows as the
data path computed them (models/mrope.py), each response continuing from its prompt's
largest position plus one, 0 on padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

MROPE_POSITIONS = "mrope_positions"
PIXEL_VALUES = "pixel_values"
IMAGE_GRID_THW = "image_grid_thw"


def prompt_image_fields(
    prompt_rows: Sequence[torch.Tensor],
    pixel_values: Sequence[torch.Tensor | None],
    image_grids: Sequence[torch.Tensor | None],
    width: int,
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """A prompt batch's entries: (tensors, arrays). prompt_rows[i] [3, p_i]: row i's
    position rows, left-padded to ``width`` (0 on padding) as its tokens are."""
    positions = torch.zeros(len(prompt_rows), 3, width, dtype=torch.long)
    for i, rows in enumerate(prompt_rows):
        positions[i, :, width - rows.shape[1] :] = rows
    patch = next((p.shape[1] for p in pixel_values if p is not None), 0)
    pixels = [torch.zeros(0, patch) if p is None else p for p in pixel_values]
    grids = [torch.zeros(0, 3, dtype=torch.long) if g is None else g for g in image_grids]
    return {MROPE_POSITIONS: positions}, {PIXEL_VALUES: _objects(pixels),
                                          IMAGE_GRID_THW: _objects(grids)}  # fmt: skip


def extend_positions(positions: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Prompt rows [B, 3, P] -> [B, 3, P + R]: response token j of a row at its prompt's
    largest position plus 1 + j in all three rows, 0 after the response ends."""
    after = positions.amax(dim=(1, 2)) + 1  # [B]
    steps = response_mask.long().cumsum(-1) - 1  # [B, R]
    responses = ((after[:, None] + steps) * response_mask.long()).unsqueeze(1).expand(-1, 3, -1)
    return torch.cat([positions, responses], dim=-1)


def _objects(values: Sequence) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = list(values)
    return array


def pack_images(batch, rows: Sequence[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The images of ``rows`` of the batch, in order: (pixel_values, image_grid_thw), or
    (None, None) when those rows hold none."""
    grids = [batch.arrays[IMAGE_GRID_THW][row] for row in rows]
    if not any(len(grid) for grid in grids):
        return None, None
    pixels = [batch.arrays[PIXEL_VALUES][row] for row in rows]
    return torch.cat(pixels), torch.cat(grids)


def prompt_images(batch, dataset_positions: bool = True) -> list:
    """Each prompt row's images for the engine (engine/images.PromptImages; None for a row
    without), with the mRoPE rows the data path computed over its real tokens
    (dataset_positions; else none: the engine computes them from the ids it is given)."""
    from hybridflow.engine.images import PromptImages

    images = []
    for row, mask in enumerate(batch.tensors["attention_mask"].bool()):
        grid = batch.arrays[IMAGE_GRID_THW][row]
        if not len(grid):
            images.append(None)
            continue
        positions = batch.tensors[MROPE_POSITIONS][row][:, mask] if dataset_positions else None
        images.append(PromptImages(batch.arrays[PIXEL_VALUES][row], grid, positions))
    return images
