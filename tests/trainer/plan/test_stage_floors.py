"""Stage floors (stage_floors.py): decode bound by the bytes it reads at small batches and by
its FLOPs at large ones, the forward pass's FLOPs, the update's multiple of it."""

from __future__ import annotations

import pytest

from hybridflow.models.presets import PRESETS
from hybridflow.trainer.plan.stage_floors import (
    StepShape,
    _matmul_weights,
    _mixing_flops,
    decode_steps,
    forward_floor,
    generation_floor,
    peak_bandwidth,
    stage_floors,
    update_floor,
)

PEAK, BANDWIDTH = 989e12, 4.8e12  # H200


def test_matmul_weights_count_the_lm_head_once_tied_or_not():
    tied, untied = PRESETS["qwen2.5-0.5b"], PRESETS["qwen2.5-7b"]
    assert tied.tie_word_embeddings and not untied.tie_word_embeddings
    assert _matmul_weights(tied) == pytest.approx(tied.num_parameters(), rel=0.001)
    embedding = untied.vocab_size * untied.hidden_size
    assert _matmul_weights(untied) == pytest.approx(untied.num_parameters() - embedding, rel=0.001)


def test_one_row_decodes_at_the_weight_read_rate():
    a = PRESETS["qwen2.5-1.5b"]
    shape = StepShape(prompts=1, samples=1, prompt_len=1, new_tokens=100)
    weight_read = 2 * _matmul_weights(a) / BANDWIDTH
    assert generation_floor(a, shape, PEAK, BANDWIDTH) == pytest.approx(100 * weight_read, rel=0.01)


def test_a_huge_batch_decodes_at_the_compute_rate():
    a = PRESETS["qwen2.5-0.5b"]
    shape = StepShape(prompts=8192, samples=8, prompt_len=1, new_tokens=2)
    rows = 8192 * 8
    matmuls = 2 * rows * 2 * _matmul_weights(a) / PEAK
    floor = generation_floor(a, shape, PEAK, BANDWIDTH)
    assert matmuls < floor < 1.05 * matmuls + 8192 * 2 * _matmul_weights(a) / PEAK


def test_scoring_and_update_floors():
    a = PRESETS["qwen2.5-0.5b"]
    shape = StepShape(prompts=128, samples=8, prompt_len=128, new_tokens=256)
    tokens = 128 * 8 * 384
    forward = forward_floor(a, shape, PEAK)
    assert forward > tokens * 2 * _matmul_weights(a) / PEAK  # plus attention
    floors = stage_floors(a, shape, PEAK, BANDWIDTH, recompute=True)
    assert floors["timing_s/update_actor"] == pytest.approx(4 * forward)
    assert floors["timing_s/old_logprob"] == floors["timing_s/ref"] == forward
    no_recompute = stage_floors(a, shape, PEAK, BANDWIDTH, recompute=False)
    assert no_recompute["timing_s/update_actor"] == pytest.approx(3 * forward)


def test_the_fp8_update_floor_runs_the_float8_linears_matmuls_at_the_fp8_peak():
    """qwen2.5-1.5b, 64 samples of 1,024 tokens, no recomputation: 3 forwards. Its decoder
    projections (every matmul weight but the lm_head) at twice the bf16 peak (H100: 1,979
    against 989 TFLOP/s) take half their bf16 time; the lm_head and attention keep theirs."""
    a = PRESETS["qwen2.5-1.5b"]
    shape = StepShape(prompts=64, samples=1, prompt_len=256, new_tokens=768)
    tokens = 64 * 1024
    projections = _matmul_weights(a) - a.vocab_size * a.hidden_size
    bf16 = update_floor(a, shape, PEAK, recompute=False)
    assert bf16 == pytest.approx(3 * forward_floor(a, shape, PEAK))
    fp8 = update_floor(a, shape, PEAK, False, fp8_weights=projections, fp8_peak_flops=2 * PEAK)
    saved = 3 * 2 * projections * tokens / (2 * PEAK)  # half of the projections' bf16 time
    assert fp8 == pytest.approx(bf16 - saved)
    assert 0.5 * bf16 < fp8 < 0.75 * bf16  # the lm_head (151,936 x 1,536) stays bf16
    assert update_floor(a, shape, PEAK, True, projections, 2 * PEAK) == pytest.approx(4 / 3 * fp8)


def test_no_floors_without_the_device_peaks():
    a = PRESETS["tiny"]
    shape = StepShape(1, 1, 1, 1)
    assert stage_floors(a, shape, None, None) == {}
    assert peak_bandwidth("cpu") is None and peak_bandwidth("NVIDIA H200") == 4.8e12


def test_a_kv_cache_that_holds_every_row_adds_no_decode_step():
    shape = StepShape(prompts=8, samples=32, prompt_len=256, new_tokens=3840)
    assert decode_steps(shape, None) == 3840
    every_row = 8 * 256 + 256 * 3840  # each prompt once, each row's generated tokens
    assert decode_steps(shape, every_row) == 3840
    a = PRESETS["llama3.1-8b"]
    unbounded = generation_floor(a, shape, PEAK, BANDWIDTH)
    assert generation_floor(a, shape, PEAK, BANDWIDTH, kv_tokens=every_row) == unbounded


def test_a_smaller_kv_cache_forces_extra_decode_steps_each_reading_the_weights():
    shape = StepShape(prompts=8, samples=32, prompt_len=256, new_tokens=3840)
    # 76 sequences of 4,096 tokens: 256 rows hold 256 * 3840 * 3841 / 2 row-positions over
    # the steps, at most 76 * 4096 - 8 * 256 of them in one step
    kv_tokens = 76 * 4096
    room = kv_tokens - 8 * 256
    steps = decode_steps(shape, kv_tokens)
    assert steps == -(-(256 * 3840 * 3841 // 2) // room) == 6105
    a = PRESETS["llama3.1-8b"]
    unbounded = generation_floor(a, shape, PEAK, BANDWIDTH)
    bounded = generation_floor(a, shape, PEAK, BANDWIDTH, kv_tokens=kv_tokens)
    weight_read = 2 * _matmul_weights(a) / BANDWIDTH
    assert bounded == pytest.approx(unbounded + (steps - 3840) * weight_read)
    floors = stage_floors(a, shape, PEAK, BANDWIDTH, kv_tokens=kv_tokens)
    assert floors["timing_s/gen"] == pytest.approx(bounded)


def test_a_kv_cache_without_room_beyond_the_prompts_is_refused():
    shape = StepShape(prompts=8, samples=32, prompt_len=256, new_tokens=16)
    with pytest.raises(ValueError, match="does not hold the prompts"):
        decode_steps(shape, 8 * 256)


def test_a_hybrid_models_matmuls_count_its_own_mixers():
    a = PRESETS["qwen3.5-4b"]  # tied: the lm_head is the embedding, counted once
    norms = a.num_hidden_layers * 2 * a.hidden_size + a.hidden_size
    assert _matmul_weights(a) == a.num_parameters() - norms


def test_a_hybrid_decode_step_reads_kv_of_its_attention_layers_and_every_rows_state():
    """Qwen3.5-4B: K/V in 8 of 32 layers; each step reads and writes every row's 49 MiB
    recurrent state. One row, long context: the bytes bound the step."""
    a = PRESETS["qwen3.5-4b"]
    shape = StepShape(prompts=1, samples=64, prompt_len=4096, new_tokens=1)
    weights = 2 * _matmul_weights(a)
    kv = 64 * 4096 * 8 * 2 * 4 * 256 * 2
    state = 64 * 2 * a.recurrent_state_bytes(2)
    prefill = 4096 * (2 * _matmul_weights(a) + _mixing_flops(a, 2048)) / PEAK
    decode = (weights + kv + state) / BANDWIDTH
    assert generation_floor(a, shape, PEAK, BANDWIDTH) == pytest.approx(prefill + decode)


def test_deltanet_layers_mix_tokens_at_a_cost_that_does_not_grow_with_the_context():
    a, dense = PRESETS["qwen3.5-4b"], PRESETS["qwen3-4b"]
    attention = 4.0 * 8 * 16 * 256  # 8 attention layers of 16 heads x 256, per position
    recurrent = 24 * 32 * 6 * 128 * 128  # 24 layers, 32 value heads against [128, 128] states
    chunk = 24 * 32 * (64 * (6 * 128 + 4 * 128) + 64 * 64 / 3)
    assert _mixing_flops(a, 1000, chunked=False) == pytest.approx(1000 * attention + recurrent)
    assert _mixing_flops(a, 1000) == pytest.approx(1000 * attention + recurrent + chunk)
    assert _mixing_flops(dense, 1000) == 4.0 * 36 * 32 * 128 * 1000
