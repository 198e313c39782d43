"""The Triton kernels over an FP8 KV cache (cache/fp8_kv.py): rope_store and the decode
attention's new-token store write the e4m3 bytes and scales of the eager reference
(quantize_heads) bit for bit, and decode attention over e4m3 K/V with their scales equals
attention over the dequantized cache; the fused engine matches the eager one. CUDA, or the
CPU under TRITON_INTERPRET=1 (fp32)."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device

from hybridflow.engine.cache.fp8_kv import dequantize_heads, quantize_heads

pytestmark = [pytest.mark.gpu] if torch.cuda.is_available() else []
SEQ, BLOCK, KV_HEADS, HEADS, DIM = 64, 16, 2, 6, 16
E4M3 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def device():
    return triton_test_device()  # skips without CUDA or TRITON_INTERPRET=1


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _fp8_cache(device, generator, blocks: int):
    """Paged e4m3 K/V [blocks + 1, BLOCK, kv, D] filled from random vectors, their scales."""
    shape = (blocks + 1, BLOCK, KV_HEADS, DIM)
    caches = []
    for _ in range(2):
        values, scales = quantize_heads(torch.randn(shape, generator=generator) * 3)
        caches += [values.to(device), scales.to(device)]
    return caches  # keys, key scales, values, value scales


def _rope(device):
    from hybridflow.models.presets import preset_config
    from hybridflow.models.rope import rope_cos_sin

    return rope_cos_sin(preset_config("tiny"), torch.arange(SEQ, device=device), torch.float32)


def test_rope_store_writes_the_references_bytes_and_scales(device):
    from hybridflow.engine.kernels import rowwise

    generator = torch.Generator().manual_seed(0)
    rows = 5
    q, k, v = (torch.randn(rows, n, DIM, generator=generator).to(device) * 4
               for n in (HEADS, KV_HEADS, KV_HEADS))  # fmt: skip
    cos, sin = _rope(device)
    positions = torch.tensor([0, 3, 17, 40, 63], device=device)
    blocks = torch.tensor([0, 1, 2, 2, 3], device=device)
    offsets = positions % BLOCK
    plain_k = torch.zeros(5, BLOCK, KV_HEADS, DIM, device=device)
    plain_v = torch.zeros_like(plain_k)
    q_plain, k_plain = q.clone(), k.clone()
    rowwise.rope_store(q_plain, k_plain, v, cos, sin, positions, blocks, plain_k, plain_v,
                       rotate_k=True, cache_positions=offsets)  # fmt: skip
    keys, key_scales, values, value_scales = _fp8_cache(device, generator, 4)
    q_fp8, k_fp8 = q.clone(), k.clone()
    rowwise.rope_store(q_fp8, k_fp8, v, cos, sin, positions, blocks, keys, values,
                       rotate_k=True, cache_positions=offsets,
                       kv_scales=(key_scales, value_scales))  # fmt: skip
    assert torch.equal(q_fp8, q_plain) and torch.equal(k_fp8, k_plain)  # unquantized in place
    for cache, scales, plain in ((keys, key_scales, plain_k), (values, value_scales, plain_v)):
        want_values, want_scales = quantize_heads(plain[blocks, offsets].cpu())
        assert _same_bits(cache[blocks, offsets].cpu(), want_values)
        assert torch.equal(scales[blocks, offsets].cpu(), want_scales)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_attention_over_e4m3_equals_attention_over_the_dequantized_cache(device, splits):
    from hybridflow.engine.kernels import attention

    generator = torch.Generator().manual_seed(splits)
    rows = 3
    keys, key_scales, values, value_scales = _fp8_cache(device, generator, 2 * SEQ // BLOCK)
    table = torch.randperm(2 * SEQ // BLOCK, generator=generator).view(2, SEQ // BLOCK)
    table = table.to(torch.int32).to(device)
    row_slots = torch.tensor([1, 0, 1], device=device)
    positions = torch.tensor([5, 33, 63], device=device)
    q = torch.randn(rows, HEADS, DIM, generator=generator).to(device)
    plain_k = dequantize_heads(keys, key_scales, torch.float32)
    plain_v = dequantize_heads(values, value_scales, torch.float32)
    want = attention.decode_attention(q, plain_k, plain_v, row_slots, positions + 1, SEQ,
                                      splits=splits, autotune=False, table=table)  # fmt: skip
    got = attention.decode_attention(q, keys, values, row_slots, positions + 1, SEQ,
                                     splits=splits, autotune=False, table=table,
                                     kv_scales=(key_scales, value_scales))  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # with RoPE: the new token's k/v stored as the reference quantizes them, and attended as
    # the cache will read them back
    k_new, v_new = (torch.randn(rows, KV_HEADS, DIM, generator=generator).to(device) * 2
                    for _ in range(2))  # fmt: skip
    cos, sin = _rope(device)
    plain_caches = (torch.zeros_like(plain_k), torch.zeros_like(plain_v))
    attention.decode_attention_rope(q, k_new, v_new, cos, sin, positions, *plain_caches,
                                    row_slots, SEQ, splits=splits, autotune=False,
                                    table=table)  # fmt: skip
    out = attention.decode_attention_rope(q, k_new, v_new, cos, sin, positions, keys, values,
                                          row_slots, SEQ, splits=splits, autotune=False,
                                          table=table, kv_scales=(key_scales, value_scales))  # fmt: skip
    at = table[row_slots, positions // BLOCK].long(), positions % BLOCK
    for cache, scales, plain in ((keys, key_scales, plain_caches[0]),
                                 (values, value_scales, plain_caches[1])):  # fmt: skip
        want_values, want_scales = quantize_heads(plain[at].cpu())
        assert _same_bits(cache[at].cpu(), want_values)
        assert torch.equal(scales[at].cpu(), want_scales)
    rotated_q = q.clone()
    from hybridflow.engine.kernels import rowwise

    scratch = torch.zeros(1, SEQ, KV_HEADS, DIM, device=device)
    rowwise.rope_store(rotated_q, k_new.clone(), v_new, cos, sin, positions,
                       torch.zeros_like(row_slots), scratch, scratch.clone())  # fmt: skip
    want = attention.decode_attention(
        rotated_q, dequantize_heads(keys, key_scales, torch.float32),
        dequantize_heads(values, value_scales, torch.float32), row_slots, positions + 1, SEQ,
        splits=splits, autotune=False, table=table,
    )  # fmt: skip
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_the_fused_engine_over_an_fp8_cache_matches_the_eager_one(device):
    from hybridflow.engine import Engine, EngineOptions, SamplingParams
    from hybridflow.models import build_model
    from hybridflow.models.presets import preset_config

    model = build_model(preset_config("tiny"), seed=1, device=device).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3, generator=torch.Generator(device).manual_seed(p.numel()))
    model.requires_grad_(False)
    prompts = [[5, 17, 9, 33, 2, 71], [40, 41], [100, 3, 8, 19, 23, 60, 61, 62, 63, 7]]
    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    results = {}
    for backend in ("triton", "torch"):
        options = EngineOptions(decode_backend=backend, kv_cache_dtype="fp8", cuda_graphs=False,
                                kv_block_size=16)  # fmt: skip
        engine = Engine(model, 4, 64, options=options)
        results[backend] = engine.generate(prompts, greedy)
        assert engine.cache.keys.dtype == E4M3
    for fused, eager in zip(results["triton"], results["torch"]):
        assert fused.token_ids == eager.token_ids
        assert fused.logprobs == pytest.approx(eager.logprobs, abs=1e-4)
