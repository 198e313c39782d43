"""Acceptance of a draft model's tokens in a verify pass (verify.py, draft_model.py): the
target's sampling distribution p at every verified position, speculative sampling against
the draft's q (acceptance.py: accept d with probability min(1, p(d)/q(d)), at the first
rejection draw from max(0, p - q) normalised, after all of a row's drafts draw the bonus
from p), its uniforms and draws from counter-based noise (draws.py). The emitted tokens are
distributed as the target samples them; greedy rows (p and q one-hot) emit the target's
argmax chain; the log-probs are the target's, as the engine's sampler returns them.
"""

from __future__ import annotations

import torch

from hybridflow.engine.speculative.acceptance import accepted_counts, residual_probs
from hybridflow.engine.speculative.draws import (
    ACCEPT_SALT,
    RESIDUAL_SALT,
    draw,
    row_distributions,
    salted_keys,
    uniforms,
)


def accept_model_drafts(state, logits: torch.Tensor, token_rows: torch.Tensor,
                        offsets: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor,
                        draft_probs: torch.Tensor) -> tuple:  # fmt: skip
    """A verify pass's rows [R] against their drafts: logits [T, V] of every position (each
    token's row and index in it: token_rows, offsets [T]), drafts [R, W - 1] (-1 past a
    row's lengths [R]), draft_probs [R, W - 1, V] (q, zeros past a row's draft). ->
    (sampled [R, W]: the accepted drafts then the token after them, log-probs [R, W] of
    the target at each, accepted [R]). No host sync."""
    rows, k = drafts.shape
    settings = (state.temperature, state.top_k, state.top_p, state.min_p)
    probs, logprobs = row_distributions(logits, *(field[token_rows] for field in settings))
    target = probs.new_zeros((rows, k + 1, probs.shape[-1]))
    target[token_rows, offsets] = probs  # [R, W, V]
    seed_lo, seed_hi, generated = state.seed_lo[:rows], state.seed_hi[:rows], state.generated[:rows]
    steps = generated[:, None] + torch.arange(k, device=drafts.device)[None, :]  # [R, K]
    keys = salted_keys(seed_lo[:, None].expand(rows, k).reshape(-1),
                       seed_hi[:, None].expand(rows, k).reshape(-1), steps.reshape(-1),
                       ACCEPT_SALT)  # fmt: skip
    accepted = accepted_counts(target, draft_probs, drafts, lengths, uniforms(keys).view(rows, k))
    residual = residual_probs(target, draft_probs, accepted, lengths)
    following = draw(residual, salted_keys(seed_lo, seed_hi, generated + accepted, RESIDUAL_SALT))
    sampled = torch.cat([drafts.clamp(min=0), following[:, None]], 1)  # [R, W]
    sampled[torch.arange(rows, device=drafts.device), accepted] = following
    picked = logprobs.gather(-1, sampled[token_rows, offsets][:, None]).squeeze(-1)  # [T]
    sampled_logprobs = torch.zeros((rows, k + 1), dtype=picked.dtype, device=drafts.device)
    sampled_logprobs[token_rows, offsets] = picked
    return sampled, sampled_logprobs, accepted
