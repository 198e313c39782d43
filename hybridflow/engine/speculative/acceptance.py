"""Speculative sampling: which draft tokens to keep so that the tokens emitted are distributed
exactly as plain sampling from the target model would emit them (Leviathan et al. 2023,
"Fast Inference from Transformers via Speculative Decoding"; Chen et al. 2023).

Rule, per position i of a row's k drafts d_1..d_k, with p_i the target's sampling
distribution after the accepted prefix (temperature, top-k, top-p, min-p applied) and q_i
the draft's: accept d_{i+1} with probability min(1, p_i(d)/q_i(d)); at the first rejection
emit a token from the residual max(0, p_i - q_i) normalised, and stop; when all k are
accepted, emit a bonus token from p_k. `speculative_accept` is this rule for any q (a draft
model's).

Drafts with no model (n-gram matches: drafts.py) are deterministic: q_i is one-hot on d, so
the rule accepts d with probability p_i(d) and on rejection draws from p_i with d removed.
`accepted_lengths` runs that case as a coupling: the verifier samples every position with
the engine's own sampler (s_i ~ p_i, the same counter-based noise a plain decode step of
that row would draw) and accepts d_{i+1} iff s_i == d_{i+1}. P(accept) = p_i(d); given a
rejection, s_i is p_i conditioned on s != d, which is the normalised residual: the same
rule. And since s_i is what the plain step would have sampled from the same prefix, the
emitted tokens are the ones the engine emits without speculation, for a given seed, at any
temperature (up to the float rounding of a different forward shape), and their log-probs
are the target's.
"""

from __future__ import annotations

import torch


def accepted_lengths(sampled: torch.Tensor, drafts: torch.Tensor,
                     draft_lengths: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Deterministic drafts, by the coupling (module docstring). sampled [R, K+1]: the
    target's sample at each verified position (position i follows the row's last token and
    drafts 1..i); drafts [R, K] (entries past a row's length ignored); draft_lengths [R].
    -> accepted drafts per row [R] in [0, draft_lengths]. No host sync."""
    k = drafts.shape[1]
    within = torch.arange(k, device=drafts.device)[None, :] < draft_lengths[:, None]
    match = (sampled[:, :k] == drafts) & within  # [R, K]
    return match.to(torch.int64).cumprod(1).sum(1)


def emitted_lengths(accepted: torch.Tensor, stops: torch.Tensor) -> torch.Tensor:
    """Tokens a row emits from a verify pass [R]: its accepted drafts and the token after
    them (the correction or the bonus), cut after the first stop among them. stops [R, K+1]:
    whether each sampled token is a stop token."""
    positions = torch.arange(stops.shape[1], device=stops.device)[None, :]
    stopped = stops & (positions <= accepted[:, None])
    first_stop = stopped.to(torch.uint8).argmax(1)
    return torch.where(stopped.any(1), first_stop + 1, accepted + 1)


def speculative_accept(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                       drafts: torch.Tensor, generator: torch.Generator | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The rule for any draft distribution (a draft model's). target_probs [R, K+1, V] (the
    target's sampling distributions at each verified position), draft_probs [R, K, V] (the
    draft's, from which drafts [R, K] were drawn). -> (accepted [R], next token [R]: the
    residual's draw at the first rejection, the bonus from position K when all are
    accepted). Draws from `generator` (host-synchronous sampling: tests and small drafts;
    the engine draws from counter-based noise instead: model_verify.py)."""
    rows, k, _ = draft_probs.shape
    lengths = torch.full((rows,), k, dtype=torch.int64, device=drafts.device)
    u = torch.rand((rows, k), generator=generator, device=drafts.device,
                   dtype=target_probs.dtype)  # fmt: skip
    accepted = accepted_counts(target_probs, draft_probs, drafts, lengths, u)
    residual = residual_probs(target_probs, draft_probs, accepted, lengths)
    following = torch.multinomial(residual, 1, generator=generator).squeeze(-1)
    return accepted, following


def accepted_counts(target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: torch.Tensor,
                    lengths: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Drafts kept per row [R] in [0, lengths]: d_{i+1} while u_i < p_i(d) / q_i(d) (target_probs
    [R, >= K+1, V], draft_probs [R, K, V], drafts [R, K] (past a row's length: any value),
    lengths [R], u [R, K] uniforms in (0, 1)). No host sync."""
    k = drafts.shape[1]
    index = drafts.clamp(min=0)[..., None]
    picked_target = target_probs[:, :k].gather(-1, index).squeeze(-1)  # [R, K]
    picked_draft = draft_probs.gather(-1, index).squeeze(-1)
    within = torch.arange(k, device=drafts.device)[None, :] < lengths[:, None]
    # u < p/q without dividing (q > 0 wherever the draft was drawn)
    keep = (u.to(picked_target.dtype) * picked_draft < picked_target) & within
    return keep.to(torch.int64).cumprod(1).sum(1)


def residual_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                   accepted: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The distribution of each row's token after its accepted drafts [R, V]: the residual
    max(0, p - q) normalised at a rejection; p itself after all `lengths` drafts (the bonus:
    q is 0 there). No host sync."""
    rows, k, _ = draft_probs.shape
    row = torch.arange(rows, device=accepted.device)
    target_next = target_probs[row, accepted]  # [R, V]
    draft_next = draft_probs[row, accepted.clamp(max=max(k - 1, 0))] if k else 0.0
    draft_next = torch.where((accepted < lengths)[:, None], draft_next, 0.0)
    residual = (target_next - draft_next).clamp(min=0)
    # p == q exactly leaves no residual mass; a rejection then has probability 0 anyway
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, target_next, residual)
    return residual / residual.sum(-1, keepdim=True)
