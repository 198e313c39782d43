"""The distributions and draws of verify passes over a draft model's tokens (draft_model.py):
each row's sampling distribution as probabilities (the target's p, the draft's q), and draws
from counter-based noise, so that a request's tokens depend on its seed only (never on its
batch), as the engine's sampler's do (sampling.py).

Speculative sampling needs three independent draws per position: the draft's token from q,
the uniform that accepts it, the residual's token at a rejection. Each hashes the row's
(seed, sampling step) key with a salt of its own, and none is the plain sampler's key.
"""

from __future__ import annotations

import torch

from hybridflow.engine.row_sampling import RowMixedMode, row_thresholds
from hybridflow.engine.sampling import hierarchical_draw, mix32, row_keys, uniform_from_bits

DRAFT_SALT = 0x3C6EF372  # the draft model's token at a position
ACCEPT_SALT = 0xA54FF53A  # the uniform that accepts a draft token
RESIDUAL_SALT = 0x510E527F  # the token drawn from the residual at a rejection (or the bonus)

_EVERY_FILTER = RowMixedMode(filters=True, min_p=True)


def row_distributions(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """logits [N, V] and each row's settings [N] -> (probs [N, V] fp32: the distribution the
    engine's sampler draws each row's token from, filtered and renormalised, one-hot on the
    argmax for a greedy row; logprobs [N, V]: log_softmax of the tempered logits, the
    log-probs the engine returns (at temperature 1 for a greedy row))."""
    greedy = temperature == 0
    z = logits.float() / torch.where(greedy, 1.0, temperature)[:, None]
    threshold = row_thresholds(z, top_k, top_p, min_p, _EVERY_FILTER)
    probs = torch.softmax(z.masked_fill(z < threshold[:, None], float("-inf")), dim=-1)
    best = torch.nn.functional.one_hot(z.argmax(-1), z.shape[-1]).to(probs.dtype)
    return torch.where(greedy[:, None], best, probs), torch.log_softmax(z, dim=-1)


def salted_keys(seed_lo: torch.Tensor, seed_hi: torch.Tensor, steps: torch.Tensor,
                salt: int) -> torch.Tensor:  # fmt: skip
    """One 32-bit key per (request seed, sampling step) [N], apart from the plain sampler's
    and from other salts'."""
    return mix32(row_keys(seed_lo, seed_hi, steps) ^ salt)


def draw(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """A token per row [N] from probs [N, V] (rows summing to 1; zeros never drawn), by the
    engine's hierarchical draw under the keys [N]."""
    unrestricted = torch.full(probs.shape[:1], float("-inf"), device=probs.device)
    return hierarchical_draw(torch.log(probs), unrestricted, keys)


def uniforms(keys: torch.Tensor) -> torch.Tensor:
    """A uniform in (0, 1) per key, fp32."""
    return uniform_from_bits(keys)
