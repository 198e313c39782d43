"""Slow path for models our cached forward does not cover (the transformers fallback).

Recomputes the whole padded sequence every step (no KV cache): correct and simple, O(T^2).
Same sampler, seeds and Completion contract as the fast path.
"""

from __future__ import annotations

import torch

from hybridflow.engine.sampling import sample_reference, split_seed


@torch.no_grad()
def generate_slow(engine, prompts: list[list[int]], params, seeds: torch.Tensor):
    """seeds: [len(prompts) * n] per-request seeds (sampling.call_seeds)."""
    from hybridflow.engine.engine import Completion

    engine._check_prompts(prompts)
    device, n = engine.device, params.n
    seed_lo, seed_hi = (s.to(device) for s in split_seed(seeds))
    stop_ids = set(engine._stop_ids(params))
    sequences = [list(p) for p in prompts for _ in range(n)]
    max_new = [min(params.max_new_tokens, engine.max_seq_len - len(s)) for s in sequences]
    outputs = [Completion([], [], "length") for _ in sequences]
    live = list(range(len(sequences)))
    step = 0
    while live:
        width = max(len(sequences[r]) for r in live)
        ids = torch.zeros(len(live), width, dtype=torch.int64, device=device)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(live):  # left padding: the last column is every row's last token
            ids[i, width - len(sequences[r]) :] = torch.tensor(sequences[r])
            mask[i, width - len(sequences[r]) :] = 1
        logits = engine.model(ids, attention_mask=mask)[:, -1]  # [R, V]
        index = torch.tensor(live, device=device)
        steps = torch.full((len(live),), step, dtype=torch.int64, device=device)
        tokens, logprobs = sample_reference(logits, params, seed_lo[index], seed_hi[index], steps)
        still = []
        for r, token, logprob in zip(live, tokens.tolist(), logprobs.tolist()):
            sequences[r].append(token)
            outputs[r].token_ids.append(token)
            outputs[r].logprobs.append(logprob)
            if token in stop_ids:
                outputs[r].finish_reason = "stop"
            elif len(outputs[r].token_ids) < max_new[r]:
                still.append(r)
        live = still
        step += 1
    return outputs
