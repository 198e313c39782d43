"""Fused sampler kernels: the vocabulary split over programs, one pass over the logits (two
with min-p), no fp32 [B, V] copy; the decode-state update folded into the combine kernel.

Same noise and filters as sampling.sample_reference (the hash constants are shared), so the
CPU and CUDA paths draw the same tokens up to the fast log2's last bits.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from hybridflow.engine import sampling
from hybridflow.engine.sampling import SamplingParams

# The hash constants of sampling.py, as constants a Triton kernel may read.
MIX_C1 = tl.constexpr(sampling._MIX_C1)
MIX_C2 = tl.constexpr(sampling._MIX_C2)
STEP_SALT = tl.constexpr(sampling._STEP_SALT)
SEED_SALT = tl.constexpr(sampling._SEED_SALT)
GOLDEN = tl.constexpr(sampling._GOLDEN)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * tl.full([], MIX_C1, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], MIX_C2, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _log2(x, FAST_MATH: tl.constexpr):
    if FAST_MATH:  # lg2.approx: the noise needs no last-bit accuracy
        return tl.extra.cuda.libdevice.fast_log2f(x)
    else:
        return tl.log2(x)


@triton.jit
def _sample_split_kernel(
    logits_ptr, stride_l, V, seed_lo_ptr, seed_hi_ptr, step_ptr, threshold_ptr,
    part_m_ptr, part_s_ptr, part_score_ptr, part_idx_ptr, part_z_ptr, inv_temperature,
    log_min_p, MAX_ONLY: tl.constexpr, GREEDY: tl.constexpr, SCALE: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr, HAS_MIN_P: tl.constexpr, SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr, SPLIT_SIZE: tl.constexpr, BLOCK_V: tl.constexpr,
    FAST_MATH: tl.constexpr,
):  # fmt: skip
    """One (row, vocab split): running max/sum-exp of z = logits / T and the best Gumbel score
    over allowed tokens. MAX_ONLY: just the split max (min-p needs the row max first)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride_l
    part = row * SPLITS + split
    offs = tl.arange(0, BLOCK_V)
    lo = split * SPLIT_SIZE
    if MAX_ONLY:
        m = tl.full([BLOCK_V], float("-inf"), tl.float32)
        for v0 in range(lo, lo + SPLIT_SIZE, BLOCK_V):
            idx = v0 + offs
            z = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            if SCALE:
                z = z * inv_temperature
            m = tl.maximum(m, z)
        tl.store(part_m_ptr + part, tl.max(m, axis=0))
        return
    threshold = float("-inf")
    if HAS_THRESHOLD:
        threshold = tl.load(threshold_ptr + row)
    if HAS_MIN_P:
        sp = tl.arange(0, SPLITS_PAD)
        maxima = tl.load(part_m_ptr + row * SPLITS + sp, mask=sp < SPLITS, other=float("-inf"))
        threshold = tl.maximum(threshold, tl.max(maxima, axis=0) + log_min_p)
    if not GREEDY:
        step = tl.load(step_ptr + row).to(tl.uint32)
        seed_lo = tl.load(seed_lo_ptr + row).to(tl.uint32)
        seed_hi = tl.load(seed_hi_ptr + row).to(tl.uint32)
        key = _mix32(step ^ tl.full([], STEP_SALT, tl.uint32))
        key = _mix32(key ^ seed_lo)
        key = _mix32(key ^ seed_hi ^ tl.full([], SEED_SALT, tl.uint32))
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    best_score = float("-inf")
    best_idx = 0
    best_z = 0.0
    for v0 in range(lo, lo + SPLIT_SIZE, BLOCK_V):
        idx = v0 + offs
        z = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        if SCALE:
            z = z * inv_temperature
        m_new = tl.maximum(m, z)
        s = s * tl.exp(tl.where(m_new == float("-inf"), 0.0, m - m_new)) + tl.where(
            z == float("-inf"), 0.0, tl.exp(z - m_new)
        )
        m = m_new
        if GREEDY:
            score = z
        else:
            token_mix = idx.to(tl.uint32) * tl.full([], GOLDEN, tl.uint32)
            bits = _mix32(key ^ token_mix)
            u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            gumbel = -LN2 * _log2(-_log2(u, FAST_MATH), FAST_MATH)  # + ln(ln 2): argmax-neutral
            score = tl.where(z >= threshold, z + gumbel, float("-inf"))
        block_best = tl.max(score, axis=0)
        block_idx = tl.argmax(score, axis=0)
        if block_best > best_score:
            best_score = block_best
            best_idx = v0 + block_idx
            best_z = tl.sum(tl.where(offs == block_idx, z, 0.0), axis=0)
    m_split = tl.max(m, axis=0)
    s_split = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - m_split)), axis=0)
    tl.store(part_m_ptr + part, m_split)
    tl.store(part_s_ptr + part, s_split)
    tl.store(part_score_ptr + part, best_score)
    tl.store(part_idx_ptr + part, best_idx)
    tl.store(part_z_ptr + part, best_z)


@triton.jit
def _sample_combine_kernel(
    part_m_ptr, part_s_ptr, part_score_ptr, part_idx_ptr, part_z_ptr, tok_ptr, logprob_ptr,
    finished_ptr, slot_ptr, generated_ptr, max_new_ptr, stop_mask_ptr, state_tok_ptr,
    positions_ptr, out_tok_ptr, out_lp_ptr, stride_out,
    SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, ADVANCE: tl.constexpr,
):  # fmt: skip
    """Per row: the winning split's token, log-prob = z - logsumexp; with ADVANCE, also the
    decode-state update of state.advance (record, count, stop, move) in the same launch."""
    row = tl.program_id(0)
    sp = tl.arange(0, SPLITS_PAD)
    mask = sp < SPLITS
    parts = row * SPLITS + sp
    m = tl.load(part_m_ptr + parts, mask=mask, other=float("-inf"))
    s = tl.load(part_s_ptr + parts, mask=mask, other=0.0)
    m_row = tl.max(m, axis=0)
    lse = m_row + tl.log(tl.sum(tl.where(mask, s * tl.exp(m - m_row), 0.0), axis=0))
    score = tl.load(part_score_ptr + parts, mask=mask, other=float("-inf"))
    best = tl.argmax(score, axis=0)  # first split on ties = lowest token id, like torch.argmax
    token = tl.sum(tl.where(sp == best, tl.load(part_idx_ptr + parts, mask=mask, other=0), 0))
    token = token.to(tl.int64)
    z = tl.sum(tl.where(sp == best, tl.load(part_z_ptr + parts, mask=mask, other=0.0), 0.0))
    logprob = z - lse
    if ADVANCE:
        finished = tl.load(finished_ptr + row).to(tl.int32)
        live = 1 - finished
        slot = tl.load(slot_ptr + row)
        column = tl.load(generated_ptr + row)
        tl.store(out_tok_ptr + slot * stride_out + column, token)
        tl.store(out_lp_ptr + slot * stride_out + column, logprob)
        generated = column + live
        stop = tl.load(stop_mask_ptr + token).to(tl.int32)
        stop = stop | (generated >= tl.load(max_new_ptr + row)).to(tl.int32)
        tl.store(finished_ptr + row, (finished | stop).to(finished_ptr.dtype.element_ty))
        old_token = tl.load(state_tok_ptr + row)
        tl.store(state_tok_ptr + row, tl.where(live == 1, token, old_token))
        tl.store(positions_ptr + row, tl.load(positions_ptr + row) + live)
        tl.store(generated_ptr + row, generated)
    else:
        tl.store(tok_ptr + row, token)
        tl.store(logprob_ptr + row, logprob)


def sample_fused(
    logits: torch.Tensor,
    params: SamplingParams,
    seed_lo: torch.Tensor,
    seed_hi: torch.Tensor,
    steps: torch.Tensor,
    block_v: int = 2048,
    target_splits: int = 16,
    state=None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Same contract and noise as sampling.sample_reference.

    The vocabulary is split over `target_splits` programs per row (one program per row left
    most SMs idle: measured 234 us at 256 x 152k on an H200), then combined per row.
    With `state` (a DecodeState whose first rows these are), the combine kernel also applies
    state.advance and nothing is returned."""
    rows, vocab = logits.shape
    device = logits.device
    split_size = triton.cdiv(triton.cdiv(vocab, target_splits), block_v) * block_v
    splits = triton.cdiv(vocab, split_size)
    part_m, part_s, part_score, part_z = (
        torch.empty(rows, splits, dtype=torch.float32, device=device) for _ in range(4)
    )
    part_idx = torch.empty(rows, splits, dtype=torch.int32, device=device)
    greedy = params.greedy
    temperature = 1.0 if greedy else float(params.temperature)
    scale = temperature != 1.0
    # Thresholds in the kernel's own arithmetic (z = logits * (1 / T)), so the boundary token
    # compares equal to itself.
    has_threshold = not greedy and (0 < params.top_k < vocab or params.top_p < 1.0)
    threshold = part_m  # placeholder pointer when unused
    if has_threshold and params.top_p < 1.0:
        # top-p needs the sorted distribution: torch sort (graph-safe, slower), then the
        # kernel samples under the resulting threshold.
        z = logits.float() * (1.0 / temperature) if scale else logits.float()
        threshold = sampling.filter_threshold(z, params.top_k, params.top_p, 0.0)
    elif has_threshold:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1].float()
        threshold = kth * (1.0 / temperature) if scale else kth
    has_min_p = not greedy and params.min_p > 0
    common = dict(
        GREEDY=greedy, SCALE=scale, HAS_THRESHOLD=has_threshold,
        HAS_MIN_P=has_min_p, SPLITS=splits, SPLITS_PAD=max(2, triton.next_power_of_2(splits)),
        SPLIT_SIZE=split_size, BLOCK_V=block_v, FAST_MATH=logits.is_cuda, num_warps=4,
    )  # fmt: skip
    args = (
        logits, logits.stride(0), vocab, seed_lo, seed_hi, steps, threshold, part_m, part_s,
        part_score, part_idx, part_z, 1.0 / temperature,
        math.log(params.min_p) if has_min_p else 0.0,
    )  # fmt: skip
    if has_min_p:
        _sample_split_kernel[(rows, splits)](*args, MAX_ONLY=True, **common)
    _sample_split_kernel[(rows, splits)](*args, MAX_ONLY=False, **common)
    if state is None:
        tokens = torch.empty(rows, dtype=torch.int64, device=device)
        logprobs = torch.empty(rows, dtype=torch.float32, device=device)
        st = SimpleNamespace(
            finished=tokens, row_slots=tokens, generated=tokens, max_new=tokens,
            stop_mask=tokens, tokens=tokens, positions=tokens, out_tokens=tokens,
            out_logprobs=logprobs,
        )  # fmt: skip
        stride_out = 0
    else:
        tokens = logprobs = part_m  # unused pointers
        st, stride_out = state, state.out_tokens.stride(0)
    _sample_combine_kernel[(rows,)](
        part_m, part_s, part_score, part_idx, part_z, tokens, logprobs, st.finished,
        st.row_slots, st.generated, st.max_new, st.stop_mask, st.tokens, st.positions,
        st.out_tokens, st.out_logprobs, stride_out, SPLITS=splits,
        SPLITS_PAD=common["SPLITS_PAD"], ADVANCE=state is not None,
    )  # fmt: skip
    return None if state is not None else (tokens, logprobs)
