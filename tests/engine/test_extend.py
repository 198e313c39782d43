"""The triton extend pass (kept-KV turns): its varlen attention's spans on any device, and on
CUDA in bf16 the FlashAttention path against each token as a decode row over its slot."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.prefill import (
    RopeTable,
    _sequence_spans,
    extend_forward_triton,
    host_spans,
)


def test_sequence_spans_list_every_cached_and_new_position_of_each_sequence():
    # sequence 0: slot 3, cached 2 + new 3 (positions 2..4); sequence 1: slot 1, cached 4 + new 1
    positions = torch.tensor([2, 3, 4, 4])
    slots = torch.tensor([3, 3, 3, 1])
    last = torch.tensor([2, 3])
    gather_slots, gather_positions, cu_new, cu_all, max_new, max_all = _sequence_spans(
        positions, slots, last
    )
    assert gather_slots.tolist() == [3] * 5 + [1] * 5
    assert gather_positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    assert cu_new.tolist() == [0, 3, 4] and cu_all.tolist() == [0, 5, 10]
    assert (max_new, max_all) == (3, 5)


def test_host_spans_equal_the_derived_ones():
    slots, cached, new = torch.tensor([3, 1, 0]), torch.tensor([2, 4, 0]), torch.tensor([3, 1, 2])
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached.tolist(), new.tolist())])
    token_slots = torch.repeat_interleave(slots, new)
    last = new.cumsum(0) - 1
    derived = _sequence_spans(positions, token_slots, last)
    tensors, maxima = host_spans(slots, cached, new)
    for a, b in zip(tensors, derived[:4]):
        assert a.tolist() == b.tolist()
    assert maxima == derived[4:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kept_kv_turns_in_bf16_continue_as_a_full_prefill_would():
    """The scheduler's extend pass (host-built spans, FlashAttention) against a full prefill
    of the same conversation: the next token's log-prob agrees to bf16 rounding."""
    from hybridflow.engine import Engine, EngineOptions, SamplingParams
    from hybridflow.models import build_model
    from hybridflow.models.presets import preset_config

    model = build_model(preset_config("tiny"), seed=1, device="cuda").to(torch.bfloat16).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3, generator=torch.Generator("cuda").manual_seed(p.numel()))
    prompts = [[5, 17, 9, 33, 2, 71], [40, 41], [100, 3, 8, 19, 23, 60, 61, 62, 63, 7]]
    deltas = [[7, 8, 9], [11], [3, 4, 5, 6, 7, 8, 9, 10]]
    greedy = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)
    first_tokens = {}
    for keep in (False, True):
        engine = Engine(model, 4, 64, options=EngineOptions(decode_backend="triton"))
        first = engine.generate(prompts, greedy, keep=keep)
        turn2 = [p + c.token_ids + d for p, c, d in zip(prompts, first, deltas)]
        handles = [c.kv_handle for c in first] if keep else None
        second = engine.generate(turn2, greedy, reuse=handles)
        first_tokens[keep] = [(c.token_ids[0], c.logprobs[0]) for c in second]
        if keep:
            assert engine.prefill_tokens < sum(map(len, prompts)) + sum(map(len, turn2))
    for (token_a, logprob_a), (token_b, logprob_b) in zip(first_tokens[True], first_tokens[False]):
        assert token_a == token_b and abs(logprob_a - logprob_b) < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_extend_matches_decode_rows_in_bf16():
    import dataclasses

    from hybridflow.engine.cache.kv_cache import allocate_cache
    from hybridflow.models import build_model
    from hybridflow.models.presets import preset_config

    device = torch.device("cuda")
    config = dataclasses.replace(preset_config("qwen2.5-0.5b"), num_hidden_layers=2)
    model = build_model(config, seed=1, device=device).to(torch.bfloat16).eval()
    generator = torch.Generator(device).manual_seed(0)
    shape = model.config
    cache = allocate_cache(2, 4, 256, shape.num_key_value_heads, shape.head_dim, torch.bfloat16,
                           device)  # fmt: skip
    cache.keys.normal_(generator=generator)
    cache.values.normal_(generator=generator)
    rope = RopeTable(model.config, 256, torch.bfloat16, device)
    cached, new, slots = [37, 5, 120], [33, 1, 64], [2, 0, 3]
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, new)]).to(device)
    token_slots = torch.repeat_interleave(torch.tensor(slots), torch.tensor(new)).to(device)
    last = (torch.tensor(new).cumsum(0) - 1).to(device)
    ids = torch.randint(0, model.config.vocab_size, (sum(new),), device=device,
                        generator=generator)  # fmt: skip
    from torch.profiler import ProfilerActivity, profile

    logits, kernels = {}, {}
    for kernel in ("decode", "flash"):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            logits[kernel] = extend_forward_triton(
                model, cache, rope, ids, positions, token_slots, last, autotune=False,
                attention_kernel=kernel,
            ).float()  # fmt: skip
            torch.cuda.synchronize()
        kernels[kernel] = " ".join(event.key for event in prof.key_averages())
    assert "flash" in kernels["flash"] and "_decode_attention" not in kernels["flash"]
    assert "_decode_attention" in kernels["decode"]
    scale = logits["decode"].abs().max()
    assert (logits["flash"] - logits["decode"]).abs().max() <= 0.02 * scale
    assert (logits["flash"].argmax(-1) == logits["decode"].argmax(-1)).float().mean() >= 0.66


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mixed_forward_runs_decode_rows_and_flash_chunks_as_all_decode_rows_in_bf16():
    """A mixed step's forward (scheduler's mixed.py): 3 decode rows through decode_attention,
    then 2 chunks through FlashAttention over their gathered spans, against every token as a
    decode row; both kernels ran."""
    import dataclasses

    from hybridflow.engine.cache.kv_cache import allocate_cache
    from hybridflow.models import build_model
    from hybridflow.models.presets import preset_config

    device = torch.device("cuda")
    config = dataclasses.replace(preset_config("qwen2.5-0.5b"), num_hidden_layers=2)
    model = build_model(config, seed=1, device=device).to(torch.bfloat16).eval()
    generator = torch.Generator(device).manual_seed(0)
    shape = model.config
    cache = allocate_cache(2, 6, 256, shape.num_key_value_heads, shape.head_dim, torch.bfloat16,
                           device)  # fmt: skip
    cache.keys.normal_(generator=generator)
    cache.values.normal_(generator=generator)
    rope = RopeTable(model.config, 256, torch.bfloat16, device)
    row_positions, row_slots = [40, 7, 200], [1, 4, 5]  # decode rows: one token each
    cached, new, slots = [0, 90], [48, 17], [2, 0]  # chunks: a prompt's first, a later one
    chunk_positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, new)])
    positions = torch.cat([torch.tensor(row_positions), chunk_positions]).to(device)
    token_slots = torch.cat([torch.tensor(row_slots),
                             torch.repeat_interleave(torch.tensor(slots), torch.tensor(new))])  # fmt: skip
    token_slots = token_slots.to(device)
    keep = torch.tensor([0, 1, 2, 3 + 48 - 1, 3 + 48 + 17 - 1], device=device)
    ids = torch.randint(0, shape.vocab_size, (3 + sum(new),), device=device, generator=generator)
    tensors, maxima = host_spans(torch.tensor(slots), torch.tensor(cached), torch.tensor(new))
    spans = (*(t.to(device) for t in tensors[:2]), *(t.to(device, torch.int32) for t in tensors[2:]),
             *maxima)  # fmt: skip
    from torch.profiler import ProfilerActivity, profile

    logits, kernels = {}, {}
    for kernel, extra in (("decode", {}), ("flash", {"decode_rows": 3, "spans": spans})):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            logits[kernel] = extend_forward_triton(
                model, cache, rope, ids, positions, token_slots, keep, autotune=False,
                attention_kernel=kernel, max_len=201, **extra,
            ).float()  # fmt: skip
            torch.cuda.synchronize()
        kernels[kernel] = " ".join(event.key for event in prof.key_averages())
    assert "flash" in kernels["flash"] and "_decode_attention" in kernels["flash"]
    scale = logits["decode"].abs().max()
    assert (logits["flash"] - logits["decode"]).abs().max() <= 0.02 * scale
