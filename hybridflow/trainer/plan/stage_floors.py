"""Lower bounds on the time of each stage of a GRPO step on one GPU, from the model's shape,
the batch and the device's peak: the benchmark prints each beside the measured stage, so the
distance to the hardware is visible per stage rather than as one MFU figure.

- generation: prefill of each unique prompt (compute-bound) plus one decode step per new
  token, each bounded by the larger of its matmul FLOPs and the bytes it must read (every
  weight once, and the K/V of every live row up to its position). Every row decodes in
  every step when the KV cache holds them all; a cache of ``kv_tokens`` positions that does
  not forces more steps (at step k each row holds its k generated tokens, a prompt's blocks
  shared by its samples: the steps are at least the row-positions to hold over what the
  cache holds at once), and each extra step reads every weight once more (the recomputation
  of preempted rows is not counted);
- a scoring pass (old log-probs, reference): one forward over every token;
- the actor update: forward + backward (3 forwards), 4 with activation recomputation; with
  FP8 training the float8 linears' matmuls at the device's FP8 peak (update_floor).

Matmul FLOPs are 2 per weight per token (the lm_head's included, tied or not; the embedding is
a lookup), attention 4·(heads·head_dim) per token, attention layer and position attended
(causal: half the sequence on average for a full pass). A hybrid model's Gated DeltaNet
layers attend to nothing: their delta rule costs a fixed amount per token (_delta_rule_flops),
they keep no K/V, and each decode step reads and writes every row's recurrent state (conv +
fp32 SSM state) instead. A floor assumes the peak: real kernels reach 60-80% of it at best,
so a stage at 2× its floor has room, one at 1.2× has little.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.trainer.plan.memory_activations import DELTA_CHUNK_TOKENS

# HBM bandwidth per device, bytes/s, from the vendors' data sheets (SXM parts).
PEAK_HBM_BYTES_PER_S = {
    "H200": 4.8e12,
    "H100": 3.35e12,
    "H800": 3.35e12,
    "A100": 2.04e12,
    "A800": 2.04e12,
    "L40S": 0.864e12,
    "A10G": 0.6e12,
    "RTX 4090": 1.008e12,
}


def peak_bandwidth(device_name: str | None) -> float | None:
    """HBM bytes/s of the named device, None if unknown."""
    for key, bandwidth in PEAK_HBM_BYTES_PER_S.items():
        if device_name and key in device_name:
            return bandwidth
    return None


@dataclass(frozen=True)
class StepShape:
    """One GRPO step's work: `prompts` unique prompts of `prompt_len` tokens, `samples` each,
    `new_tokens` generated per sample (every sample to full length)."""

    prompts: int
    samples: int
    prompt_len: int
    new_tokens: int


def _matmul_weights(a) -> int:
    """Weights a token multiplies by: every layer's token mixer and MLP (a mixture of experts'
    decode step at batch sizes where every expert is touched) and the lm_head."""
    mixers = sum(a.mixer_parameters(spec.mixer) for spec in a.layer_specs())
    return mixers + a.mlp_parameters() + a.vocab_size * a.hidden_size


def _delta_rule_flops(a, chunked: bool) -> float:
    """FLOPs of one token's gated delta rule in all Gated DeltaNet layers, beyond their
    projections. Per value head against the [Dk, Dv] state: 6·Dk·Dv (q's read, k's
    prediction, the rank-one write). Chunked (prefill, training), per token of a chunk of C:
    C·(6·Dk + 4·Dv) more (the WY products of kβ and vβ, the masked k·kᵀ and q·kᵀ, and the
    latter's product with v') and C²/3 for the triangular solve."""
    layers = a.num_hidden_layers - a.kv_layers
    if not layers:
        return 0.0
    dk, dv, c = a.linear_key_head_dim, a.linear_value_head_dim, DELTA_CHUNK_TOKENS
    per_head = 6.0 * dk * dv + ((c * (6 * dk + 4 * dv) + c * c / 3) if chunked else 0.0)
    return layers * a.linear_num_value_heads * per_head


def _mixing_flops(a, positions: float, chunked: bool = True) -> float:
    """Token-mixing FLOPs of one token: attending over `positions` earlier positions in each
    layer that keeps K/V, plus the delta rule of the recurrent layers (chunked in a prefill
    or a full pass, one recurrent step in decode)."""
    attention = 4.0 * a.kv_layers * a.num_attention_heads * a.head_dim * positions
    return attention + _delta_rule_flops(a, chunked)


def decode_steps(shape: StepShape, kv_tokens: int | None) -> int:
    """The fewest decode steps that generate every row in full through a KV cache of
    ``kv_tokens`` positions (None: unbounded): one per new token, more when the cache cannot
    hold every row's generated tokens (beside each prompt's, shared by its samples) at once."""
    if kv_tokens is None:
        return shape.new_tokens
    room = kv_tokens - shape.prompts * shape.prompt_len
    if room <= 0:
        raise ValueError(f"a KV cache of {kv_tokens} positions does not hold the prompts")
    rows = shape.prompts * shape.samples
    row_positions = rows * shape.new_tokens * (shape.new_tokens + 1) // 2
    return max(shape.new_tokens, -(-row_positions // room))


def generation_floor(a, shape: StepShape, peak_flops: float, bandwidth: float,
                     dtype_bytes: int = 2, kv_tokens: int | None = None) -> float:  # fmt: skip
    """Seconds: prefill of each unique prompt + one decode step per new token, plus the
    weight reads of the extra steps a KV cache of ``kv_tokens`` positions forces. A decode
    step reads every weight, each row's K/V up to its position, and reads and writes each
    row's recurrent state (hybrid models)."""
    weights = _matmul_weights(a)
    prefill_tokens = shape.prompts * shape.prompt_len
    seconds = prefill_tokens * (2.0 * weights + _mixing_flops(a, shape.prompt_len / 2)) / peak_flops
    rows = shape.prompts * shape.samples
    kv_bytes_per_position = a.kv_bytes_per_token(dtype_bytes)
    state_bytes = 2 * a.recurrent_state_bytes(dtype_bytes)  # read, then written back
    weight_bytes = weights * dtype_bytes
    for step in range(shape.new_tokens):
        context = shape.prompt_len + step
        flops = rows * (2.0 * weights + _mixing_flops(a, context, chunked=False))
        read = weight_bytes + rows * (context * kv_bytes_per_position + state_bytes)
        seconds += max(flops / peak_flops, read / bandwidth)
    extra_steps = decode_steps(shape, kv_tokens) - shape.new_tokens
    return seconds + extra_steps * weight_bytes / bandwidth


def forward_floor(a, shape: StepShape, peak_flops: float) -> float:
    """Seconds of one forward pass over every token of every sample (a scoring pass)."""
    length = shape.prompt_len + shape.new_tokens
    tokens = shape.prompts * shape.samples * length
    return tokens * (2.0 * _matmul_weights(a) + _mixing_flops(a, length / 2)) / peak_flops


def update_floor(a, shape: StepShape, peak_flops: float, recompute: bool = True,
                 fp8_weights: int = 0, fp8_peak_flops: float | None = None) -> float:  # fmt: skip
    """Seconds of the actor update over every token: forward + backward (3 forwards), 4 with
    activation recomputation. FP8 training (actor.precision=fp8): the matmuls of the
    ``fp8_weights`` weights that compute in float8 (learners/fp8_training.fp8_linear_names),
    forward and backward, at ``fp8_peak_flops``; the lm_head, attention and any linear left
    in bf16 at ``peak_flops``."""
    passes = 4 if recompute else 3
    seconds = passes * forward_floor(a, shape, peak_flops)
    if not fp8_weights:
        return seconds
    tokens = shape.prompts * shape.samples * (shape.prompt_len + shape.new_tokens)
    fp8_flops = passes * 2.0 * fp8_weights * tokens
    return seconds - fp8_flops / peak_flops + fp8_flops / fp8_peak_flops


def stage_floors(a, shape: StepShape, peak_flops: float | None, bandwidth: float | None,
                 recompute: bool = True, kv_tokens: int | None = None) -> dict[str, float]:  # fmt: skip
    """{timing key: floor seconds} for the stages a floor is known for; empty without the
    device's peaks (a CPU, an unknown GPU). ``kv_tokens``: the positions the rollout's KV
    cache holds (None: every row at once)."""
    if not peak_flops or not bandwidth:
        return {}
    forward = forward_floor(a, shape, peak_flops)
    return {
        "timing_s/gen": generation_floor(a, shape, peak_flops, bandwidth, kv_tokens=kv_tokens),
        "timing_s/old_logprob": forward,
        "timing_s/ref": forward,
        "timing_s/update_actor": update_floor(a, shape, peak_flops, recompute),
    }
