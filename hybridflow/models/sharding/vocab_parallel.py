"""Log-probabilities and entropy of target tokens when the lm_head is split by vocabulary rows
over a tensor-parallel group (Megatron's vocab-parallel cross-entropy, Shoeybi et al. 2019,
arXiv:1909.08053), in token chunks, never forming or gathering a [tokens, vocabulary] tensor.

Each rank holds rows ``[vocab_start, vocab_start + V_r)`` of the head and computes its logits
block l_r = h @ W_r.T / T; per token the ranks then combine three numbers:
    m   = max over ranks of max_j l_rj                       (all-reduce MAX)
    s   = sum over ranks of sum_j exp(l_rj - m)              (all-reduce SUM, with the two below)
    l_y = the target's logit, from the rank that holds it     (others add 0)
    t   = sum over ranks of sum_j exp(l_rj - m) * l_rj
    lse = m + log s,  logprob = l_y - lse,  entropy = lse - t / s
The backward recomputes each block: d/dl_rj = g_logprob (onehot - p) - g_entropy p (log p + H),
the weight gradient of a rank's rows is local, and the hidden-state gradient is summed over
the ranks (every rank holds the same hidden states, each sees only its vocabulary).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    targets: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    vocab_start: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [N, H] (the same on every rank of ``group``), weight_shard [V_r, H] (this rank's
    vocabulary rows, the first being ``vocab_start``), targets [N] (global ids) ->
    (logprobs [N], entropy [N] or None) in fp32 (fp64 for fp64 weights), the same on every rank. Differentiable
    w.r.t. hidden and weight_shard; every rank of the group must call it."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"expected hidden [N, H] and targets [N], got {tuple(hidden.shape)} and "
            f"{tuple(targets.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logprobs, entropy = _VocabParallelLogprobs.apply(
        hidden, weight_shard, targets, group, int(vocab_start), float(temperature),
        bool(with_entropy), int(chunk_size),
    )  # fmt: skip
    return logprobs, (entropy if with_entropy else None)


def _local_logits(h, weight, temperature):
    logits = h @ weight.T  # [C, V_r]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits / temperature if temperature != 1.0 else logits


def _local_targets(targets, vocab_start, vocab_rows):
    """(index of each target in this rank's rows, clamped; whether this rank holds it)."""
    local = targets - vocab_start
    held = (local >= 0) & (local < vocab_rows)
    return local.clamp(0, vocab_rows - 1), held


def _chunk_stats(h, weight, targets, group, vocab_start, temperature):
    """lse, target logit and sum_j p_j l_j of one chunk, combined over the group."""
    logits = _local_logits(h, weight, temperature)  # [C, V_r]
    top = logits.max(-1).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    exp = (logits - top[:, None]).exp_()
    index, held = _local_targets(targets, vocab_start, logits.shape[1])
    target_logit = logits.gather(-1, index[:, None]).squeeze(-1) * held
    sums = torch.stack([exp.sum(-1), target_logit, (exp * logits).sum(-1)])  # [3, C]
    dist.all_reduce(sums, group=group)
    sum_exp, target_logit, weighted = sums
    lse = top + sum_exp.log()
    return lse, target_logit - lse, lse - weighted / sum_exp


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, group, vocab_start, temperature, with_entropy,
                chunk_size):  # fmt: skip
        n, wide = hidden.shape[0], torch.promote_types(weight.dtype, torch.float32)
        logprobs, entropy, lse = (torch.empty(n, dtype=wide, device=hidden.device) for _ in "123")
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            chunk = _chunk_stats(hidden[start:stop], weight, targets[start:stop], group,
                                 vocab_start, temperature)  # fmt: skip
            lse[start:stop], logprobs[start:stop], entropy[start:stop] = chunk
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.config = (group, vocab_start, temperature, with_entropy, chunk_size)
        ctx.mark_non_differentiable(targets)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        group, vocab_start, temperature, with_entropy, chunk_size = ctx.config
        use_entropy = with_entropy and grad_entropy is not None
        wide = torch.promote_types(weight.dtype, torch.float32)
        grad_hidden = torch.zeros(hidden.shape, dtype=wide, device=hidden.device)
        grad_weight = torch.zeros(weight.shape, dtype=wide, device=weight.device)
        n = hidden.shape[0]
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            h = hidden[start:stop]
            log_p = _local_logits(h, weight, temperature).sub_(lse[start:stop, None])
            probs = log_p.exp()
            g_logprob = (
                grad_logprobs[start:stop].to(log_p.dtype)
                if grad_logprobs is not None
                else log_p.new_zeros(stop - start)
            )
            coefficient = g_logprob[:, None]
            if use_entropy:
                g_entropy = grad_entropy[start:stop, None].to(log_p.dtype)
                coefficient = coefficient + g_entropy * (log_p + entropy[start:stop, None])
            grad_logits = probs.mul_(coefficient).neg_()  # [C, V_r]
            index, held = _local_targets(targets[start:stop], vocab_start, weight.shape[0])
            grad_logits.scatter_add_(-1, index[:, None], (g_logprob * held)[:, None])
            if temperature != 1.0:
                grad_logits /= temperature
            grad_hidden[start:stop] = grad_logits @ weight.to(wide)
            grad_weight += grad_logits.T @ h.to(wide)
        dist.all_reduce(grad_hidden, group=group)  # each rank saw its vocabulary rows only
        return (grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype),
                None, None, None, None, None, None)  # fmt: skip
