"""Routing replay, the engine's half: each finished request's expert ids, read from the cache's
routing record (kv_cache.KVCache.routes), and laid out for the trainer.

A request's record has one row per token that went through the model: its prompt, then its
generated tokens but the last (nothing is sampled after the last, so it is never fed back):
row i = the k experts each sparse layer chose for the token at position i. The trainer's
forward over prompt + response replays them (models/moe.py); it routes the last token itself.

Reading does not stall the GPU: the rows a finished request needs were written by steps that
the last snapshot read back covers (readback.py), so the gather runs on a side stream after
that snapshot's event, beside the chunk the GPU is decoding, and the host waits for it only.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridflow.engine.host import upload


class RouteReader:
    """Reads requests' routing records (one gather and one copy per retirement)."""

    def __init__(self, cache, device: torch.device):
        self.cache = cache
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def read(self, slots: list[int], lengths: list[int], after=None) -> list[np.ndarray]:
        """Positions [0, lengths[i]) of slots[i]'s record -> [lengths[i], L_sparse, k] arrays
        (uint8 or int16). after: a CUDA event that follows every write of those positions
        (the last snapshot's), or None (the default stream's work so far)."""
        if not slots:
            return []
        width = max(max(lengths), 1)
        if self.stream is None:
            rows = self.cache.read_routes(torch.tensor(slots), width).clone()
        else:
            if after is None:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
            else:
                self.stream.wait_event(after)
            with torch.cuda.stream(self.stream):
                # the slots go up on this stream, ahead of the gather that reads them: on the
                # default stream their copy would queue behind the chunk being decoded, which
                # this stream does not wait for, and the gather would read the index's memory
                # before the copy lands (stale slot numbers, out of the cache's bounds)
                index = upload(self.device, torch.tensor(slots))[0]
                rows = self.cache.read_routes(index, width).cpu()  # waits for this stream only
        return [rows[i, :n].numpy() for i, n in enumerate(lengths)]


def padded_routes(records: list[np.ndarray | None], prompt_lengths: list[int],
                  prompt_width: int, response_width: int) -> torch.Tensor:  # fmt: skip
    """Completions' routing records -> routed_experts [B, prompt_width + response_width,
    L_sparse, k] int16, aligned with input_ids = cat(prompts left-padded to prompt_width,
    responses right-padded to response_width); -1 (models.moe.NO_ROUTE) where nothing was
    recorded: padding, each response's last token, a request without a record."""
    shape = next((r.shape[1:] for r in records if r is not None), None)
    if shape is None:
        raise ValueError("padded_routes: no completion carries a routing record")
    out = np.full((len(records), prompt_width + response_width, *shape), -1, dtype=np.int16)
    for row, (record, prompt) in enumerate(zip(records, prompt_lengths)):
        if record is None:
            continue
        start = prompt_width - prompt  # left padding
        count = min(len(record), prompt + response_width)
        out[row, start : start + count] = record[:count]
    return torch.from_numpy(out)
