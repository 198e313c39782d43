"""Decode attention with each prompt's prefix read once for its samples (shared_prefix.py),
against the plain kernel: same outputs, same cache writes."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device

from hybridflow.engine.kernels.shared_prefix import group_table

pytestmark = [pytest.mark.gpu] if torch.cuda.is_available() else []


def test_group_table_groups_consecutive_rows_of_one_prompt():
    """Rows of one prompt form groups of up to group_rows rows; a group of one has no
    shared prefix (first 0); padding rows past the live ones are groups of one; entries
    past the groups have 0 rows."""
    prompts = [4, 4, 4, 7, 9, 9, 9, 9, 9]
    lengths = [10, 10, 10, 5, 12, 12, 12, 12, 12]
    slots = [3, 8, 1, 0, 2, 5, 6, 7, 4]
    groups, first = group_table(prompts, lengths, slots, capacity=12, group_rows=4)
    assert groups[0].tolist() == [7, 0, 0, 0]  # the number of entries
    assert groups[1:9].tolist() == [[0, 3, 3, 10], [3, 1, 0, 0], [4, 4, 2, 12], [8, 1, 4, 0],
                                    [9, 1, 0, 0], [10, 1, 0, 0], [11, 1, 0, 0], [0, 0, 0, 0]]  # fmt: skip
    assert first.tolist() == [10, 10, 10, 0, 12, 12, 12, 12, 0, 0, 0, 0]
    assert groups[8:, 1].sum() == 0 and groups[1:, 1].sum() == 12


@pytest.fixture(scope="module")
def device():
    return triton_test_device()  # skips without CUDA or TRITON_INTERPRET=1


def _prefix_cache(device, prompts, lengths, slots, seq, kv_heads, dim):
    """Random caches whose slots of one prompt share identical positions [0, length)."""
    shape = (max(slots) + 2, seq, kv_heads, dim)
    caches = []
    for _ in range(2):
        cache = torch.randn(*shape, device=device)
        for row, (prompt, length) in enumerate(zip(prompts, lengths)):
            lead = prompts.index(prompt)
            cache[slots[row], :length] = cache[slots[lead], :length]
        caches.append(cache)
    return caches


@pytest.mark.parametrize("rope", [False, True])
def test_shared_prefix_attention_equals_plain_attention(device, rope):
    """Groups of 3 and 4 rows, 9 rows of one prompt (a group of GROUP_ROWS = 8 and a group
    of one), a lone row, rows whose own part is only the new token, prefixes shorter than a
    tile and not a multiple of it: outputs and cache writes equal the plain kernel's (fp32)."""
    groups = _check_against_plain(device, rope)
    sizes = [n for n in groups[1:, 1].tolist() if n]
    assert max(sizes) == 8 and sum(sizes) == 17


def _check_against_plain(device, rope) -> torch.Tensor:
    from hybridflow.engine.kernels import attention
    from hybridflow.models.presets import preset_config
    from hybridflow.models.rope import rope_cos_sin

    heads, kv_heads, dim, seq = 6, 2, 16, 80
    prompts = [0] * 3 + [1] + [2] * 9 + [3] * 4
    prompt_len = {0: 37, 1: 20, 2: 9, 3: 33}
    lengths = [prompt_len[p] for p in prompts]
    rows = len(prompts)
    slots = torch.randperm(rows + 3)[:rows].tolist()
    extra = [0, 5, 17, 3, 0, 1, 2, 8, 9, 30, 4, 6, 7, 11, 0, 40, 2]  # own tokens per row
    positions = torch.tensor([n + e for n, e in zip(lengths, extra)], device=device)
    keys, values = _prefix_cache(device, prompts, lengths, slots, seq, kv_heads, dim)
    groups, first = group_table(prompts, lengths, slots, capacity=rows)
    shared = (first.to(device), groups.to(device))
    slots_t = torch.tensor(slots, device=device)
    q = torch.randn(rows, heads, dim, device=device)
    if rope:
        k, v = (torch.randn(rows, kv_heads, dim, device=device) for _ in range(2))
        cos, sin = rope_cos_sin(preset_config("tiny"), torch.arange(seq, device=device),
                                torch.float32)  # fmt: skip
        results = []
        for extra_args in ({}, {"shared": shared}):
            kc, vc = keys.clone(), values.clone()
            out = attention.decode_attention_rope(
                q, k, v, cos, sin, positions, kc, vc, slots_t, seq, **extra_args
            )
            results.append((out, kc, vc))
        (expected, kc_ref, vc_ref), (got, kc, vc) = results
        assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    else:
        lengths_t = positions + 1
        expected = attention.decode_attention(q, keys, values, slots_t, lengths_t, seq,
                                                      splits=1)  # fmt: skip
        got = attention.decode_attention(q, keys, values, slots_t, lengths_t, seq,
                                                 shared=shared)  # fmt: skip
        # a second launch gives the same (nothing left behind between launches)
        again = attention.decode_attention(q, keys, values, slots_t, lengths_t, seq,
                                                   shared=shared)  # fmt: skip
        assert torch.equal(again, got)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    return groups


def test_a_wrong_prefix_length_changes_the_output(device):
    """The comparison above can fail: the shared kernel reads a group's prefix from its
    first row's slot only, so a member whose own copy differs gets another output there
    (and in the engine every copy is the same, so this is the saving)."""
    from hybridflow.engine.kernels import attention

    heads, kv_heads, dim, seq = 4, 2, 16, 40
    prompts, lengths, slots = [0, 0, 0], [20, 20, 20], [0, 1, 2]
    keys, values = _prefix_cache(device, prompts, lengths, slots, seq, kv_heads, dim)
    keys[1, :20] += 1.0  # row 1's copy of the prefix differs from row 0's
    q = torch.randn(3, heads, dim, device=device)
    lengths_t = torch.tensor([25, 25, 25], device=device)
    slots_t = torch.tensor(slots, device=device)
    plain = attention.decode_attention(q, keys, values, slots_t, lengths_t, seq, splits=1)
    groups, first = group_table(prompts, lengths, slots, capacity=3)
    shared = attention.decode_attention(q, keys, values, slots_t, lengths_t, seq,
                                                shared=(first.to(device), groups.to(device)))  # fmt: skip
    # row 1 read row 0's prefix copy in the shared kernel: differs; rows 0 and 2 agree
    assert not torch.allclose(shared[1], plain[1], atol=1e-3)
    torch.testing.assert_close(shared[0], plain[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared[2], plain[2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer", ["split", "lean:qkv+mlp"])
def test_engine_generations_with_shared_prefixes_equal_plain_ones(device, layer, monkeypatch):
    """A whole generate() with n = 3 through the triton decode path with shared_prefix on
    against the eager engine: the same tokens, log-probs within fp32 noise, and the prefix
    kernel ran. Six slots for 18 requests with early stops: rows retire, compact and refill, so the
    group table is rewritten many times (a stale table would read another prompt's prefix:
    other tokens). Through the split layer and "lean", which puts 1/rms, bias and RoPE inside
    the row kernel before q is left for the prefix kernel (the chain layer attends through the
    split layer's call; test_kernels.py's all-auto-chain engine runs it with n = 2)."""
    from hybridflow.engine import Engine, EngineOptions, SamplingParams
    from hybridflow.engine.kernels import shared_prefix
    from hybridflow.models import build_model
    from hybridflow.models.presets import preset_config

    model = build_model(preset_config("tiny"), seed=1, device=device).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3, generator=torch.Generator(device).manual_seed(p.numel()))
    vocab = model.config.vocab_size
    prompts = [[(5 * i + j) % (vocab - 3) + 3 for j in range(4 + 3 * i)] for i in range(6)]
    # 5 tokens: with stops at 10% of the vocabulary, rows still retire at different steps
    # and the 18 requests pass through the six slots; each step costs interpreter time
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=5, seed=5,
                            stop_token_ids=list(range(3, 3 + vocab // 10)))  # fmt: skip
    calls = []
    real = shared_prefix.prefix_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(shared_prefix, "prefix_attention", counted)
    # off: the eager engine, which reads every row's own prefix (an interpreted triton
    # engine without sharing would cost as much as the one with it)
    eager = EngineOptions(decode_backend="torch", cuda_graphs=False, steps_per_sync=2)
    off = Engine(model, max_batch_size=6, max_seq_len=64, options=eager).generate(prompts, params)
    options = EngineOptions(decode_backend="triton", decode_layer=layer, shared_prefix=True,
                            steps_per_sync=2)  # fmt: skip
    on = Engine(model, max_batch_size=6, max_seq_len=64, options=options).generate(prompts, params)
    assert calls
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    assert {c.finish_reason for c in on} == {"stop", "length"}
    for a, b in zip(on, off):
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0) < 1e-4


def test_samples_of_one_prompt_from_two_admissions_are_two_groups():
    """Two prefill passes need not give bitwise the same prompt K/V (other batch shapes,
    other kernels), so rows of one prompt admitted twice keep reading their own copies."""
    keys = [(5, 0), (5, 0), (5, 1), (5, 1), (5, 1)]
    groups, first = group_table(keys, [9] * 5, [0, 1, 2, 3, 4], capacity=5)
    assert groups[:3].tolist() == [[2, 0, 0, 0], [0, 2, 0, 9], [2, 3, 2, 9]]
    assert first.tolist() == [9] * 5


def test_few_rows_over_long_caches_keep_their_sequence_splits(device, monkeypatch):
    """4 rows x 2 kv heads cannot fill a GPU: the plain kernel splits each row's positions
    over several programs (attention_splits > 1 at a 600-position bound), which sharing (one
    split) would undo; there the group table is ignored and the splits run."""
    from hybridflow.engine.kernels import attention, shared_prefix

    calls = []
    monkeypatch.setattr(shared_prefix, "prefix_attention", lambda *a, **k: calls.append(1))
    heads, kv_heads, dim, seq = 4, 2, 16, 600
    assert attention.attention_splits(4, kv_heads, seq, sms=132) > 1
    prompts, lengths, slots = [0, 0, 0, 0], [300] * 4, [0, 1, 2, 3]
    keys, values = _prefix_cache(device, prompts, lengths, slots, seq, kv_heads, dim)
    q = torch.randn(4, heads, dim, device=device)
    lengths_t = torch.tensor([310, 420, 301, 599], device=device)
    slots_t = torch.tensor(slots, device=device)
    groups, first = group_table(list(zip(prompts, [0] * 4)), lengths, slots, capacity=4)
    got = attention.decode_attention(q, keys, values, slots_t, lengths_t, seq,
                                             shared=(first.to(device), groups.to(device)))  # fmt: skip
    expected = attention.decode_attention(q, keys, values, slots_t, lengths_t, seq)
    assert not calls
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
