"""Prompts with images in the engine: the vision encoder's features in the prefill, mRoPE's
position rows in the prefill and the decode.

A prompt's images come as a PromptImages (its pixel_values and image_grid_thw, as the data
path preprocessed them, and optionally mRoPE's rows [3, p] it computed). Its ids hold one
image-pad token per merged patch (models/mrope.py checks the count), so the KV cache, the
prefill budget and max_seq_len count the image tokens as they count text.

Prefill: a pass runs the encoder once, over the images of the prompts whose first sample
it admits (encode_missing); a prompt's features stay with the submission until its last
sample is admitted (n samples of a prompt may be admitted over several passes when slots
are few), so the n samples share one encoder call. The features take the places of the
image-pad tokens in the prompts' embeddings, and each token is turned by its three mRoPE
rows: the pass takes those embeddings and each token's cos/sin (prefill.py, on either
backend; an fp8 engine's projections included: the encoder alone stays in the model's dtype).

Mixed steps (scheduling/mixed.py) prefill a prompt a chunk per step: chunk_inputs gives a
chunk its slice of the prompt's mRoPE rows and its share of the features (an image may
straddle chunks), encoded at the prompt's first chunk holding image tokens and held until
its samples are admitted, beside the decode rows and text chunks, which turn at the RoPE
table's rows. Such a step runs eagerly (the static step's graphs read no embeddings).

Decode: every token after the prompt has equal rows (text), at the prompt's largest position
plus one and on, so its turn is plain RoPE at ``cache position + shift`` with ``shift =
largest position + 1 - prompt length`` (<= 0: an image's tokens span fewer positions than
tokens). The shift is kept per cache slot (RopeTable.slot_shift, a buffer at a fixed
address that CUDA graphs read) and added by the decode and extend passes of both backends
(the fused decode attention reads it per row: kernels/attention.py): transformers'
rope_deltas. A kept slot (scheduling/kept.py) keeps it: the next turn's
text tokens (the model's turn and a tool's result) extend the slot at their cache position
plus the shift, as its decode steps did; a turn that adds images is prefilled in full.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.engine.host import upload
from hybridflow.models.mrope import mrope_cos_sin, mrope_positions


@dataclass(frozen=True)
class PromptImages:
    """One prompt's images: pixel_values [patches, C*T*P*P], image_grid_thw [images, 3]
    (the model's image processor's output), positions: mRoPE's rows [3, p] of the prompt
    (None: computed from its ids and the grids). image_span: the images' tokens are among
    the first image_span ids; the ids after are text whatever they are (a conversation's
    later turns: the model may have sampled the image-pad id, which is no image), as the
    trainer's forward reads them (image_slots). None: the whole prompt."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    positions: torch.Tensor | None = None
    image_span: int | None = None


@dataclass
class PreparedImages:
    """A checked PromptImages with its rows [3, p] and its decode shift."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    positions: torch.Tensor
    shift: int
    span: int
    """The ids whose image tokens are the images' (PromptImages.image_span)."""


def prepare_images(config, prompts: list[list[int]], images: list | None) -> list | None:
    """images (one PromptImages or None per prompt) checked against the prompts' ids ->
    PreparedImages or None per prompt; None when no prompt has images. ValueError naming
    the first bad prompt."""
    if images is None or all(entry is None for entry in images):
        return None
    vision = getattr(config, "vision", None)
    if vision is None:
        raise ValueError(f"images given to a {config.model_type} model, which has no vision "
                         "encoder")  # fmt: skip
    if len(images) != len(prompts):
        raise ValueError(f"images: one entry (or None) per prompt; {len(images)} for "
                         f"{len(prompts)} prompts")  # fmt: skip
    prepared: list[PreparedImages | None] = []
    for i, (ids, entry) in enumerate(zip(prompts, images)):
        if entry is None:
            if vision.image_token_id in ids:
                raise ValueError(f"prompt {i} holds image tokens but no images")
            prepared.append(None)
            continue
        grid = entry.image_grid_thw.long().cpu()
        patches = int(grid.prod(-1).sum())
        if entry.pixel_values.shape[0] != patches:
            raise ValueError(f"prompt {i}: {entry.pixel_values.shape[0]} rows of pixel_values, "
                             f"its grids hold {patches} patches")  # fmt: skip
        span = len(ids) if entry.image_span is None else entry.image_span
        if not 0 < span <= len(ids):
            raise ValueError(f"prompt {i}: image_span={span} is not within its {len(ids)} ids")
        try:
            rows = mrope_positions(torch.tensor(ids[:span]), grid, vision.image_token_id,
                                   vision.spatial_merge_size)  # fmt: skip
        except ValueError as err:
            raise ValueError(f"prompt {i}: {err}") from None
        after = int(rows.max()) + 1  # the text past the span: on from the largest position
        rows = torch.cat([rows, torch.arange(after, after + len(ids) - span).expand(3, -1)], 1)
        if entry.positions is not None:
            given = entry.positions.long().cpu()
            if given.shape != rows.shape or not torch.equal(given, rows):
                raise ValueError(f"prompt {i}: its mRoPE positions are not those of its ids "
                                 "and image grids")  # fmt: skip
        shift = int(rows.max()) + 1 - len(ids)
        prepared.append(PreparedImages(entry.pixel_values, grid, rows, shift, span))
    return prepared


class ImageFeatures:
    """A submission's encoder features, per prompt, from its first sample's admission to
    its last's (module docstring); encode_missing fills them."""

    def __init__(self, prepared: list[PreparedImages | None], n: int):
        self.prepared, self.n = prepared, n
        self.features: dict[int, torch.Tensor] = {}
        self.all_admitted: set[int] = set()  # prompts whose last sample was admitted

    def admitted(self, request: int) -> None:
        """Request admitted: its prompt's features go when it is the prompt's last sample."""
        if request % self.n == self.n - 1:
            self.all_admitted.add(request // self.n)
            self.features.pop(request // self.n, None)

    def recomputed(self, prompt: int) -> None:
        """A preempted request's recompute is done with its prompt's features: they go
        unless samples of the prompt are still to be admitted."""
        if prompt in self.all_admitted:
            self.features.pop(prompt, None)


@dataclass
class Segment:
    """One sequence of a packed prefill: its submission's images (or None), its prompt,
    and how many tokens of it the pass runs (the prompt, or the prompt and tokens a
    preempted request had generated)."""

    images: ImageFeatures | None
    prompt: int
    prompt_length: int
    length: int

    @property
    def entry(self) -> PreparedImages | None:
        return None if self.images is None else self.images.prepared[self.prompt]

    @property
    def shift(self) -> int:
        return 0 if self.entry is None else self.entry.shift

    def rows(self) -> torch.Tensor:
        """Its mRoPE rows [3, length] (an image prompt's): the prompt's, then its largest
        position plus one and on."""
        entry = self.entry
        after = int(entry.positions.max()) + 1
        tail = torch.arange(after, after + self.length - self.prompt_length)
        return torch.cat([entry.positions, tail.expand(3, -1)], dim=1)


def has_images(segments: list[Segment]) -> bool:
    return any(segment.entry is not None for segment in segments)


def encode_missing(model, segments: list[Segment]) -> None:
    """One encoder call over the images of every segment whose prompt's features are not
    held yet, each prompt's features then held by its ImageFeatures. One call a prefill pass,
    not one a prompt: a 7B encoder call is ~400 launches (32 blocks) and a host round trip,
    and a pass's image tokens are at most its prefill tokens, which the engine's workspace
    plans the encoder's activations for (cache/workspace.vision_prefill)."""
    wanted: dict[tuple[int, int], Segment] = {}
    for segment in segments:
        key = (id(segment.images), segment.prompt)
        if segment.entry is not None and segment.prompt not in segment.images.features:
            wanted.setdefault(key, segment)
    if not wanted:
        return
    entries = [segment.entry for segment in wanted.values()]
    # The encoder runs in the model's dtype, also under weight_format="fp8" (whose copies are
    # the decoder layers': fp8/matmul.py): it is small (~0.7B of a 7B model's weights) and
    # runs once a prompt, not once a token, so fp8 would save little, and its rounding would
    # move the features of every image token, which every later token attends to.
    weight = next(model.visual.parameters())
    pixels = _device_rows([e.pixel_values for e in entries], weight.device).to(weight.dtype)
    grids = torch.cat([e.image_grid_thw for e in entries])  # on the host, as the encoder reads
    features = model.visual(pixels, grids)
    unit = model.config.vision.spatial_merge_size**2
    counts = [int(e.image_grid_thw.prod(-1).sum()) // unit for e in entries]
    for segment, rows in zip(wanted.values(), features.split(counts)):
        segment.images.features[segment.prompt] = rows


def _device_rows(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensors concatenated on the device: host ones through one pinned, non-blocking
    copy (a pageable copy waits for the GPU to drain)."""
    on_host = all(t.device.type == "cpu" for t in tensors)
    if not on_host:
        return torch.cat([t.to(device) for t in tensors])
    rows = torch.cat(tensors)
    if device.type == "cuda":
        return rows.pin_memory().to(device, non_blocking=True)
    return rows.to(device)


@torch.no_grad()
def prefill_inputs(model, ids: torch.Tensor, segments: list[Segment]):
    """(hidden [N, H], cos, sin [N, D]) for packed ids [N] of these segments in order: the
    token embeddings with each image prompt's features at its image tokens (within its
    images' span), each token's cos/sin from its mRoPE rows (text: equal rows; after a
    prompt: its largest position plus one and on). One encoder call, one scatter and one
    upload for the pass, whatever its prompts."""
    config = model.config
    encode_missing(model, segments)
    hidden = model.model.embed_tokens(ids)
    rows, spans, features = [], [], []
    for segment in segments:
        entry = segment.entry
        span = torch.zeros(segment.length, dtype=torch.int64)  # where its image tokens may be
        if entry is None:
            rows.append(torch.arange(segment.length).expand(3, -1))
        else:
            rows.append(segment.rows())
            span[: entry.span] = 1  # past it: text (PromptImages.image_span)
            features.append(segment.images.features[segment.prompt])
        spans.append(span)
    positions, span = upload(ids.device, torch.cat(rows, dim=1), torch.cat(spans))
    if features:
        slots = (ids == config.vision.image_token_id) & span.bool()
        hidden = hidden.masked_scatter(slots.unsqueeze(-1), torch.cat(features).to(hidden.dtype))
    cos, sin = mrope_cos_sin(config, positions.view(3, -1), hidden.dtype)
    return hidden, cos, sin


@dataclass
class ImageChunk:
    """A chunk of a prompt with images in a mixed step (scheduling/mixed.py): its segment,
    the ids its slot holds (the prompt, and a preempted request's tokens), the chunk's first
    position and token count, and the index of its first token among the pass's."""

    segment: Segment
    ids: list[int]
    start: int
    count: int
    at: int

    def image_tokens(self, image_token_id: int) -> tuple[int, list[int]]:
        """(how many of the prompt's image tokens come before the chunk, the chunk's own
        image tokens as indices among the pass's): those within the images' span."""
        span = self.segment.entry.span
        before = self.ids[: min(self.start, span)].count(image_token_id)
        own = self.ids[self.start : min(self.start + self.count, span)]
        return before, [self.at + i for i, t in enumerate(own) if t == image_token_id]


@torch.no_grad()
def chunk_inputs(model, rope, ids: torch.Tensor, rotary: torch.Tensor,
                 chunks: list[ImageChunk]):  # fmt: skip
    """(hidden [N, H], cos, sin [N, D]) for a pass of ids [N] whose tokens turn at rotary
    [N] (the RoPE table's rows: decode rows, text chunks, continuations), but for chunks of
    prompts with images: their tokens' mRoPE rows, sliced from the prompt's, and the
    encoder's features at their image tokens, the chunk's share of the prompt's (an image
    may straddle chunks). A prompt's images are encoded at its first chunk that holds
    image tokens (one encoder call for the pass's) and held until its samples are
    admitted, as a prefill pass's."""
    image_token_id = model.config.vision.image_token_id
    found = [(chunk, *chunk.image_tokens(image_token_id)) for chunk in chunks]
    encode_missing(model, [chunk.segment for chunk, _, own in found if own])
    index = torch.cat([torch.arange(c.at, c.at + c.count) for c in chunks])
    rows = torch.cat([c.segment.rows()[:, c.start : c.start + c.count] for c in chunks], dim=1)
    slots = torch.tensor([i for _, _, own in found for i in own], dtype=torch.int64)
    index, rows, slots = upload(ids.device, index, rows, slots)
    hidden = model.model.embed_tokens(ids)
    cos, sin = rope.cos[rotary], rope.sin[rotary]
    cos[index], sin[index] = mrope_cos_sin(model.config, rows.view(3, -1), cos.dtype)
    features = [chunk.segment.images.features[chunk.segment.prompt][before : before + len(own)]
                for chunk, before, own in found if own]  # fmt: skip
    if features:
        hidden[slots] = torch.cat(features).to(hidden.dtype)
    return hidden, cos, sin


def set_slot_shifts(rope, slots: list[int], shifts: list[int], device) -> None:
    """The decode shift of each slot (0 for a text prompt: a slot may have held an image
    prompt before)."""
    if rope.slot_shift is None:
        return
    index, values = upload(device, torch.tensor(slots), torch.tensor(shifts))  # no host sync
    rope.slot_shift[index] = values
