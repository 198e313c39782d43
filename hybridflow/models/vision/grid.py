"""Where each patch of a batch of images sits, computed from the images' patch grids alone.

``grid_thw`` [images, 3] holds each image's (frames, patch rows, patch columns). The image
processor writes an image's patches block-major: each spatial_merge_size² block of patches
(one language-model token) is contiguous, blocks in row order. Pure functions of the grids
(no weights), so the encoder's positions and windows are the same wherever they are built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def patch_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(row, column) of every patch [patches, 2] in the processor's block-major order."""
    positions = []
    for t, h, w in grid_thw.tolist():
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        blocks = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(blocks).transpose(1, 2).flatten()
        cols = cols.reshape(blocks).transpose(1, 2).flatten()
        positions.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(positions).to(grid_thw.device)


def frame_cu_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """int32 [frames + 1]: each frame of each image is one attention segment of h * w."""
    lengths = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def window_order(
    grid_thw: torch.Tensor, merge: int, window_size: int, patch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Windowed attention's layout: (order [tokens], cu_seqlens int32 [windows + 1]).

    order lists the merged tokens (spatial_merge_size² patches each) window by window, each
    window ``window_size`` pixels square (window_size // merge // patch_size tokens a side,
    cut short at the image's right and bottom edges); cu_seqlens bounds each window in
    patches. ``hidden[order]`` groups each window's patches; ``argsort(order)`` undoes it."""
    full_side = window_size // merge // patch_size
    unit = merge * merge
    order, lengths, offset = [], [], 0
    for t, h, w in grid_thw.tolist():
        rows, cols = h // merge, w // merge
        index = torch.arange(t * rows * cols).reshape(t, rows, cols)
        # a window past the image holds all of it, as one of the image's extent does: padding
        # to it would take memory growing with window_size², whatever the image
        side = min(full_side, max(rows, cols, 1))
        pad_rows, pad_cols = -rows % side, -cols % side
        padded = F.pad(index, (0, pad_cols, 0, pad_rows), value=-1)
        across, down = (cols + pad_cols) // side, (rows + pad_rows) // side
        windows = padded.reshape(t, down, side, across, side).permute(0, 1, 3, 2, 4)
        windows = windows.reshape(-1, side * side)  # [windows, side * side]
        kept = windows >= 0
        order.append(windows[kept] + offset)
        lengths.append(kept.sum(1) * unit)
        offset += t * rows * cols
    lengths = torch.cat(lengths)
    lengths = lengths[lengths > 0]
    cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return torch.cat(order).to(grid_thw.device), cu_seqlens.to(grid_thw.device)


def tokens_per_image(grid_thw: torch.Tensor, merge: int) -> list[int]:
    """Language-model tokens (merged patches) of each image."""
    return (grid_thw.prod(-1) // (merge * merge)).tolist()


def to_device(device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Host int64 index tensors on the device through one copy, pinned and non-blocking on
    CUDA (a pageable copy waits for the GPU to drain: the encoder's index tensors would
    each stall the host behind the work queued before them)."""
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors])
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]),
                                                  tensors)]  # fmt: skip
