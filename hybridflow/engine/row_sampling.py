"""Sampling when the rows of one batch ask for different settings (a server's requests).

The same scheme as sampling.sample_reference (hierarchical draw, counter-based noise, the
filters in the same order), with temperature, top-k, top-p and min-p read per row from
tensors instead of one SamplingParams. A row samples exactly what sample_reference draws for
it alone with its settings: the arithmetic is the same op for op (division by the row's
temperature, the threshold taken from the same sorted values), so a request's tokens never
depend on what it was batched with.

Cost: a sort of the vocabulary per row when any row filters by top-k or top-p (the batch's
flags say so; a uniform batch uses the fused single-setting sampler instead: graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.engine.sampling import hierarchical_draw, row_keys


@dataclass(frozen=True)
class RowMixedMode:
    """The sampling mode of a batch whose rows differ: which filters any row uses (they
    decide which tensors the step computes, so a captured graph is specific to them)."""

    filters: bool  # some row has top-k or top-p
    min_p: bool  # some row has min-p

    def mode_key(self) -> tuple:
        return ("rows", self.filters, self.min_p)


def mixed_mode(modes) -> RowMixedMode:
    """The RowMixedMode covering these (temperature, top_k, top_p, min_p) settings."""
    filters = any(t > 0 and (k > 0 or p < 1.0) for t, k, p, _ in modes)
    return RowMixedMode(filters=filters, min_p=any(t > 0 and m > 0 for t, _, _, m in modes))


def row_thresholds(z: torch.Tensor, top_k, top_p, min_p, mode: RowMixedMode) -> torch.Tensor:
    """Per-row threshold [B] on z [B, V] fp32 (sampling.filter_threshold, row by row)."""
    rows, vocab = z.shape
    threshold = torch.full((rows,), float("-inf"), device=z.device, dtype=z.dtype)
    if mode.filters:
        sorted_z = z.sort(-1, descending=True).values  # [B, V]
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)  # [B]
        kth = sorted_z.gather(-1, (k - 1)[:, None]).squeeze(-1)
        in_top_k = torch.arange(vocab, device=z.device)[None, :] < k[:, None]
        probs = torch.softmax(sorted_z.masked_fill(~in_top_k, float("-inf")), dim=-1)
        mass_before = probs.cumsum(-1) - probs
        kept = ((mass_before < top_p[:, None]) & in_top_k).sum(-1, keepdim=True).clamp(min=1)
        nucleus = sorted_z.gather(-1, kept - 1).squeeze(-1)
        threshold = torch.where(top_p < 1.0, nucleus, torch.where(k < vocab, kth, threshold))
    if mode.min_p:
        floor = z.max(-1).values + torch.log(min_p.clamp(min=1e-30))
        threshold = torch.where(min_p > 0, torch.maximum(threshold, floor), threshold)
    return threshold


def sample_rows(logits, temperature, top_k, top_p, min_p, seed_lo, seed_hi, steps,
                mode: RowMixedMode) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """logits [B, V] -> (tokens [B] int64, logprobs [B] fp32), each row by its own settings
    (temperature 0 = greedy: argmax, log-prob at temperature 1). No host sync."""
    greedy = temperature == 0
    z = logits.float() / torch.where(greedy, 1.0, temperature)[:, None]
    threshold = row_thresholds(z, top_k, top_p, min_p, mode)
    drawn = hierarchical_draw(z, threshold, row_keys(seed_lo, seed_hi, steps))
    tokens = torch.where(greedy, z.argmax(-1), drawn)
    logprobs = z.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
    return tokens, logprobs
