"""Multimodal RoPE (Qwen2-VL, Qwen2.5-VL): three position rows, temporal, height, width.

Text tokens have one position in all three rows; the tokens of an image get (start,
start + row, start + column) of its merged patch grid, where start is where the image
begins; the text after an image continues from start + max(grid rows, grid columns), the
largest position of the image plus one. A head's rotary frequencies are cut into
``mrope_section`` (in frequency pairs), the first section turned by the temporal row, the
second by the height row, the third by the width row.

The rows are data: :func:`mrope_positions` is a pure function of the token ids and the image
grids, computed once where a prompt is prepared and carried beside its tokens, so every
forward (training, rollout) uses the same positions. With equal rows (text only) the turn
equals plain RoPE's.
"""

from __future__ import annotations

import torch

from hybridflow.models.rope import rope_parameters


def mrope_positions(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    image_token_id: int,
    spatial_merge_size: int,
) -> torch.Tensor:
    """One sequence's position rows [3, T] (long) from its ids [T] and the grids [images, 3]
    of the images it holds, in order. ValueError when its image tokens do not match the
    grids (an image's tokens are t * h * w / merge² consecutive ``image_token_id``)."""
    ids = input_ids.tolist()
    grids = [] if image_grid_thw is None else image_grid_thw.tolist()
    rows = torch.empty(3, len(ids), dtype=torch.long)
    cursor, next_position = 0, 0
    for t, h, w in grids:
        start = _index_of(ids, image_token_id, cursor)
        if start is None:
            raise ValueError(f"{len(grids)} image grids, fewer runs of image tokens in the ids")
        text = start - cursor
        rows[:, cursor:start] = torch.arange(next_position, next_position + text)
        next_position += text
        grid_h, grid_w = h // spatial_merge_size, w // spatial_merge_size
        count = t * grid_h * grid_w
        if ids[start : start + count] != [image_token_id] * count:
            raise ValueError(
                f"an image of grid {(t, h, w)} needs {count} consecutive image tokens at "
                f"index {start}; the ids hold fewer"
            )
        frame, row, col = torch.meshgrid(torch.arange(t), torch.arange(grid_h),
                                         torch.arange(grid_w), indexing="ij")  # fmt: skip
        block = torch.stack([frame, row, col]).flatten(1) + next_position
        rows[:, start : start + count] = block
        next_position += max(grid_h, grid_w)
        cursor = start + count
    if _index_of(ids, image_token_id, cursor) is not None:
        raise ValueError(f"the ids hold image tokens beyond the {len(grids)} images' grids")
    rows[:, cursor:] = torch.arange(next_position, next_position + len(ids) - cursor)
    return rows.to(input_ids.device)


def _index_of(ids: list[int], token: int, start: int) -> int | None:
    try:
        return ids.index(token, start)
    except ValueError:
        return None


def batch_mrope_positions(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    image_token_id: int,
    spatial_merge_size: int,
) -> torch.Tensor:
    """Rows [3, B, T] of a padded batch (positions over each row's real tokens, 0 at its
    padding); image_grid_thw lists the batch's images row by row, in order."""
    batch, length = input_ids.shape
    rows = torch.zeros(3, batch, length, dtype=torch.long, device=input_ids.device)
    grids = (
        image_grid_thw.cpu() if image_grid_thw is not None else torch.zeros(0, 3, dtype=torch.long)
    )
    merge_unit = spatial_merge_size**2
    image_tokens = (grids.prod(-1) // merge_unit).tolist()
    used = 0
    for b in range(batch):
        real = attention_mask[b].bool() if attention_mask is not None else slice(None)
        ids = input_ids[b][real]
        count = int((ids == image_token_id).sum())
        first = used
        while count > 0 and used < len(image_tokens):
            count -= image_tokens[used]
            used += 1
        rows[:, b, real] = mrope_positions(ids, grids[first:used], image_token_id,
                                           spatial_merge_size).to(rows.device)  # fmt: skip
    if used != len(image_tokens):
        raise ValueError(f"image_grid_thw lists {len(image_tokens)} images, the ids hold "
                         f"the tokens of {used}")  # fmt: skip
    return rows


def mrope_cos_sin(
    config, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [..., rotary_dim] for position rows [3, ...]: frequency section i turned by
    row i (config.mrope_section, in frequency pairs), or, interleaved (Qwen3.5's
    config.mrope_interleaved), pair j turned by row j mod 3 while that row's section lasts;
    computed in fp32, cast to dtype."""
    inv_freq, scale = rope_parameters(config, positions.device)  # [head_dim // 2]
    freqs = positions.float().unsqueeze(-1) * inv_freq  # [3, ..., head_dim // 2]
    if getattr(config, "mrope_interleaved", False):
        freqs = _interleaved(freqs, config.mrope_section)
    else:
        sections = freqs.split(list(config.mrope_section), dim=-1)
        freqs = torch.cat([section[i % 3] for i, section in enumerate(sections)], dim=-1)
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def _interleaved(freqs: torch.Tensor, section: tuple[int, ...]) -> torch.Tensor:
    """Rows' frequencies [3, ..., P] -> [..., P]: pair j from row 1 (height) when j = 1 mod 3
    and j < 3 * section[1], from row 2 (width) when j = 2 mod 3 and j < 3 * section[2], else
    from row 0 (temporal)."""
    out = freqs[0].clone()
    for row in (1, 2):
        pairs = slice(row, 3 * section[row], 3)
        out[..., pairs] = freqs[row][..., pairs]
    return out
