"""Slow path for models our cached forward does not cover (the transformers fallback).

Recomputes the whole padded sequence every step (no KV cache): correct and simple, O(T^2).
Same sampler, seeds and Completion contract as the fast path.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridflow.engine.requests import Completion
from hybridflow.engine.sampling import sample_reference, split_seed


@torch.no_grad()
def generate_slow(engine, prompts: list[list[int]], params, seeds: torch.Tensor):
    """seeds: [len(prompts) * n] per-request seeds (sampling.call_seeds: a tensor, or ints
    for one prompt or seeds given per prompt)."""
    engine._check_prompts(prompts)
    device, n = engine.device, params.n
    seeds = torch.as_tensor(seeds, dtype=torch.int64)
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
    if engine.options.record_routes and getattr(engine.config, "is_moe", False):
        record_routes(engine.model, sequences, outputs)
    return outputs


@torch.no_grad()
def record_routes(model, sequences: list[list[int]], outputs: list) -> None:
    """Each completion's routing record (routes.py's layout: [prompt + tokens - 1, L_sparse,
    k]), read off one forward over every sequence but its last token: a token's experts
    depend on its prefix only, so they are the ones its step chose. Models outside our
    decoder (no router trace) get none."""
    from hybridflow.models.llama import CausalLM

    if not isinstance(model, CausalLM) or not sequences:
        return
    rows = [sequence[:-1] or sequence[:1] for sequence in sequences]
    width = max(len(row) for row in rows)
    device = model.device
    ids = torch.zeros(len(rows), width, dtype=torch.int64, device=device)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):  # left padding, as the steps above ran
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    trace = []
    model(ids, attention_mask=mask, router_trace=trace)
    routes = torch.stack([chosen for _, chosen in trace], dim=1)  # [R * width, L, k]
    routes = routes.view(len(rows), width, *routes.shape[1:]).cpu()
    dtype = np.uint8 if model.config.num_experts <= 256 else np.int16
    for i, (row, output) in enumerate(zip(rows, outputs)):
        count = len(sequences[i]) - 1
        output.routed_experts = routes[i, width - len(row) :][:count].numpy().astype(dtype)
