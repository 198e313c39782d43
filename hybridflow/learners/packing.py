"""Unpad a [B, P+R] batch into one packed sequence stream, and scatter results back to [B, R].

The model runs ``forward_packed`` on the real tokens only (no compute on padding). The log-prob
(or value) of response token ``t`` of row ``i`` is read from the hidden state of the token
*before* it, i.e. full column ``P + t - 1`` of that row.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class PackedRows:
    """Model inputs for some rows of a batch, plus where the per-token outputs go."""

    input_ids: torch.Tensor  # [N] real tokens of all rows, concatenated
    position_ids: torch.Tensor  # [N] 0-based position inside each row; [3, N] mRoPE's rows
    cu_seqlens: torch.Tensor  # int32 [S+1]
    max_seqlen: int
    hidden_index: torch.Tensor  # [M] packed index of the token that predicts each output token
    targets: torch.Tensor  # [M] the predicted (response) token ids
    out_rows: torch.Tensor  # [M] row of each output token in the [S, R] result
    out_cols: torch.Tensor  # [M] response column of each output token
    num_rows: int
    response_length: int
    routed_experts: torch.Tensor | None = None
    """[N, L_sparse, k] experts the rollout chose for each packed token (routing replay)."""
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    """The images of the packed rows, in order ([patches, C*T*P*P], [images, 3]): a
    vision-language model's features replace the rows' image-pad tokens."""
    prompt_tokens: torch.Tensor | None = None
    """[N] bool: the packed tokens that are prompt tokens. Image features go to the prompts'
    image-pad tokens only: a response may hold that token id too (a sampled token)."""

    def to(self, device: torch.device | str) -> PackedRows:
        moved = {
            name: (to_device(value, device) if torch.is_tensor(value) else value)
            for name, value in self.__dict__.items()
        }
        return PackedRows(**moved)

    def scatter(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """values [M] -> [S, R] (``fill`` where there is no response token)."""
        out = values.new_full((self.num_rows, self.response_length), fill)
        return out.index_put((self.out_rows, self.out_cols), values)


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy a CPU tensor to ``device`` without a host sync: a copy from pageable memory makes
    the host wait for the GPU's queue to drain, a pinned non-blocking copy does not, so the
    CPU keeps launching the next micro-batch while the GPU works."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def sequence_lengths(attention_mask: torch.Tensor) -> list[int]:
    """Real tokens per row of ``attention_mask [B, T]`` (what a packed micro-batch costs)."""
    return attention_mask.sum(-1).tolist()


def pack_rows(
    prompts: torch.Tensor,
    responses: torch.Tensor,
    attention_mask: torch.Tensor,
    routed_experts: torch.Tensor | None = None,
    mrope_positions: torch.Tensor | None = None,
) -> PackedRows:
    """prompts [S, P] (left-padded), responses [S, R] (right-padded), attention_mask [S, P+R];
    routed_experts [S, P+R, L_sparse, k] (optional, aligned with the mask) is packed alike,
    and mRoPE's position rows [S, 3, P+R] (a vision-language model's) into [3, N].

    Tokens with ``attention_mask == 1`` are kept in row order; positions count the kept tokens
    of each row from 0, as the rollout assigned them. Output tokens are the response positions
    whose own mask and predecessor's mask are both 1 (a row with an empty prompt has no
    predecessor for its first response token, so that token gets no log-prob).
    """
    num_rows, prompt_length = prompts.shape
    response_length = responses.shape[1]
    input_ids = torch.cat([prompts, responses], dim=1)  # [S, P+R]
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask {tuple(attention_mask.shape)} must be [B, P+R] = "
            f"{tuple(input_ids.shape)}"
        )
    keep = attention_mask.bool()
    lengths = keep.sum(-1)  # [S]
    cu_seqlens = torch.zeros(num_rows + 1, dtype=torch.int32, device=prompts.device)
    cu_seqlens[1:] = lengths.cumsum(0)
    positions = keep.long().cumsum(-1) - 1  # [S, P+R]
    packed_index = keep.flatten().long().cumsum(0).view(num_rows, -1) - 1  # [S, P+R]

    response_keep = keep[:, prompt_length:]  # [S, R]
    previous_keep = keep[:, prompt_length - 1 : -1] if prompt_length > 0 else None
    has_output = response_keep & previous_keep if previous_keep is not None else None
    if has_output is None:  # no prompt column at all: the first response token has no context
        has_output = response_keep.clone()
        has_output[:, 0] = False
        has_output[:, 1:] &= response_keep[:, :-1]
    out_rows, out_cols = has_output.nonzero(as_tuple=True)
    packed_positions = positions[keep]
    if mrope_positions is not None:
        packed_positions = mrope_positions.transpose(0, 1)[:, keep]  # [3, N]
    return PackedRows(
        input_ids=input_ids[keep],
        position_ids=packed_positions,
        cu_seqlens=cu_seqlens,
        max_seqlen=int(lengths.max()) if num_rows else 0,
        hidden_index=packed_index[out_rows, prompt_length + out_cols - 1],
        targets=responses[out_rows, out_cols],
        out_rows=out_rows,
        out_cols=out_cols,
        num_rows=num_rows,
        response_length=response_length,
        routed_experts=None if routed_experts is None else routed_experts[keep],
        prompt_tokens=_prompt_columns(keep, prompt_length)[keep],
    )


def pad_tokens(packed: PackedRows, multiple: int) -> PackedRows:
    """``packed`` with its token stream padded to a multiple of ``multiple`` tokens: the pad
    tokens (id 0) form one more sequence of their own in cu_seqlens, so no real token attends
    to them or carries state from them, and no output reads them (hidden_index, targets and
    the images' prompt slots are unchanged). FP8 training needs it: torch._scaled_mm wants
    every dim divisible by 16, and the weight gradient's inner dim is the token count."""
    count = packed.input_ids.shape[0]
    pad = -count % multiple
    if pad == 0:
        return packed
    device = packed.input_ids.device
    steps = torch.arange(pad, dtype=packed.position_ids.dtype, device=device)
    positions = steps if packed.position_ids.dim() == 1 else steps.expand(3, pad)
    routed = packed.routed_experts
    if routed is not None:  # the pads replay some real token's experts (outputs ignore them)
        routed = torch.cat([routed, routed[-1:].expand(pad, *routed.shape[1:])]) if count else None
    prompt_tokens = packed.prompt_tokens
    if prompt_tokens is not None:
        prompt_tokens = torch.cat([prompt_tokens, prompt_tokens.new_zeros(pad)])
    return dataclasses.replace(
        packed,
        input_ids=torch.cat([packed.input_ids, packed.input_ids.new_zeros(pad)]),
        position_ids=torch.cat([packed.position_ids, positions], dim=-1),
        cu_seqlens=torch.cat([packed.cu_seqlens, packed.cu_seqlens[-1:] + pad]),
        max_seqlen=max(packed.max_seqlen, pad),
        routed_experts=routed,
        prompt_tokens=prompt_tokens,
    )


def _prompt_columns(keep: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """[S, P+R] bool: True on the prompt columns."""
    columns = torch.zeros_like(keep)
    columns[:, :prompt_length] = True
    return columns


def balance_for_data_parallel(batch, dp_size: int):
    """Reorder a Batch so that a contiguous DP split (chunk ``r`` to rank ``r``) gives every
    rank nearly the same number of real tokens (Karmarkar–Karp on sequence lengths, equal
    sample counts). Call before dispatching to the actor/critic/ref worker groups."""
    from hybridflow.learners.micro_batch import balanced_dp_order

    return batch.index(balanced_dp_order(sequence_lengths(batch["attention_mask"]), dp_size))
