"""The FP8 KV cache (kv_cache_dtype="fp8", cache/fp8_kv.py) on the eager passes: each head's
vector quantized within e4m3's rounding step, stores and reads through the cache, the fan-out
copying scales with values, the sampled tokens' log-probs near the model-dtype cache's, and
the kinds it does not cover refused with the key to set."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.cache.fp8_kv import (
    dequantize_heads,
    fp8_kv_device_problem,
    fp8_kv_problem,
    quantize_heads,
)
from hybridflow.engine.cache.sizing import make_cache
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config

PROMPTS = [[5, 17, 9, 33, 2, 71], [40, 41], [100, 3, 8, 19, 23, 60, 61, 62, 63, 7], [12]]
EAGER = dict(decode_backend="torch", cuda_graphs=False)


def test_each_heads_vector_is_quantized_within_an_e4m3_step():
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0))
    x[1, 2] *= 300.0  # a head 300x larger than the others keeps its own scale
    x[4, 0] = 0.0
    values, scale = quantize_heads(x)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (5, 3)
    back = dequantize_heads(values, scale, torch.float32)
    # e4m3: 3 mantissa bits, a relative step of 2^-3 at most, half of it after rounding;
    # below 2^-6 of the head's max the subnormal step 2^-9 * scale bounds the error
    bound = x.abs() * 2**-4 + scale[..., None] * 2**-10
    assert ((back - x).abs() <= bound).all()
    assert (back[4, 0] == 0).all()
    assert scale[1, 2] > 100 * scale[1, 1]


def _model(dtype=torch.float32):
    model = build_model(preset_config("tiny"), seed=1).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    return model.to(dtype).requires_grad_(False)


def test_the_paged_cache_stores_e4m3_with_scales_and_reads_back_the_model_dtype():
    config = preset_config("tiny")
    cache, _ = make_cache(config, 2, 32, 16, None, 0, torch.bfloat16, torch.device("cpu"),
                          kv_fp8=True)  # fmt: skip
    heads, dim = config.num_key_value_heads, config.head_dim
    assert cache.keys.dtype == torch.float8_e4m3fn and cache.scales.keys.shape == (
        *cache.keys.shape[:-1],
    )
    k = torch.randn(3, heads, dim).bfloat16()
    v = torch.randn(3, heads, dim).bfloat16()
    entries, offsets = torch.tensor([0, 0, 1]), torch.tensor([0, 5, 2])
    cache.store(1, entries, offsets, k, v)
    keys, values = cache.layer(1)
    assert keys.dtype == torch.bfloat16
    expected = dequantize_heads(*quantize_heads(k), torch.bfloat16)
    assert torch.equal(keys[entries, offsets], expected)
    assert (keys[entries, offsets] - k).abs().max() <= k.abs().max() * 2**-4
    # the fan-out of a prompt's partial block to a sample's copies scales with the values
    cache.copy_entries(
        (torch.tensor([0]), torch.tensor([5])), (torch.tensor([2]), torch.tensor([7]))
    )
    assert torch.equal(cache.layer(1)[0][2, 7], expected[1])
    bf16, _ = make_cache(config, 2, 32, 16, None, 0, torch.bfloat16, torch.device("cpu"))
    # half the bytes a position, plus a 4-byte scale a head for K and V
    per_head = (dim + 4) / (2 * dim)
    assert cache.nbytes() / bf16.nbytes() == pytest.approx(per_head, rel=1e-6)


def _completions(model, kv_cache_dtype, params, **options):
    engine = Engine(model, 4, 64, options=EngineOptions(kv_cache_dtype=kv_cache_dtype, **EAGER,
                                                        **options))  # fmt: skip
    return engine, engine.generate(PROMPTS, params)


def test_fp8_kv_log_probs_stay_within_the_stated_gap_of_the_model_dtype_cache():
    """Greedy tokens of a tiny fp32 model: the first token comes from the prefill (its own
    K/V, unquantized), so it matches; the log-probs of the tokens both caches sample differ
    by what the e4m3 rounding of K/V adds. Measured here (peaked logits: weights of std
    0.3): max 0.110, mean 0.0125 over 48 tokens; bounds 0.25 and 0.03."""
    model = _model()
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    engine, fp8 = _completions(model, "fp8", greedy)
    assert engine.cache.keys.dtype == torch.float8_e4m3fn
    _, reference = _completions(model, "model", greedy)
    gaps = []
    for a, b in zip(fp8, reference):
        assert a.logprobs[0] == pytest.approx(b.logprobs[0], abs=1e-5)
        for token_a, token_b, lp_a, lp_b in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            if token_a != token_b:
                break  # past a divergence the two score different sequences
            gaps.append(abs(lp_a - lp_b))
    gaps = torch.tensor(gaps)
    assert len(gaps) >= 20 and gaps.max() < 0.25 and gaps.mean() < 0.03
    assert gaps.max() > 0  # the K/V rounding did happen


def test_a_slot_cache_or_another_cache_kind_is_refused_naming_the_key():
    problems = EngineOptions(kv_cache_dtype="fp8", kv_block_size=None).validate()
    assert any("kv_cache_dtype='fp8' covers the paged cache only" in p for p in problems)
    (problem,) = EngineOptions(kv_cache_dtype="bf8").validate()
    assert "kv_cache_dtype='bf8': must be one of model, fp8" in problem
    hybrid = preset_config("tiny-hybrid").layer_specs()
    assert "gated_deltanet" in fp8_kv_problem(hybrid, paged=True)
    sinks = preset_config("tiny-gpt-oss").layer_specs()
    assert "windowed" in fp8_kv_problem(sinks, paged=True)
    assert fp8_kv_problem(preset_config("tiny").layer_specs(), paged=True) is None
    model = build_model(preset_config("tiny-hybrid"), seed=1).eval()
    with pytest.raises(ValueError, match=r"set rollout.engine.kv_cache_dtype=model"):
        Engine(model, 2, 32, options=EngineOptions(kv_cache_dtype="fp8", **EAGER))


def test_the_shared_prefix_grouping_stays_off_over_an_fp8_cache():
    model = _model()
    engine = Engine(model, 2, 32, options=EngineOptions(kv_cache_dtype="fp8", **EAGER))
    engine.decode_backend = "triton"  # what decides the grouping besides the option
    assert not engine.shares_prefixes(4)
    plain = Engine(model, 2, 32, options=EngineOptions(**EAGER))
    plain.decode_backend = "triton"
    assert plain.shares_prefixes(4)


def test_the_triton_kernels_need_e4m3_conversions_the_torch_backend_does_not():
    problem = fp8_kv_device_problem("triton", (8, 0))
    assert "compute capability >= 8.9" in problem and "this GPU has 8.0" in problem
    assert fp8_kv_device_problem("triton", (9, 0)) is None
    assert fp8_kv_device_problem("torch", (8, 0)) is None
    assert fp8_kv_device_problem("triton", None) is None
