"""Fused sampler kernels for the hierarchical scheme of sampling.py (read its docstring).

Pass 1 (grid rows x splits, the splits of sampling.SPLIT_SIZE tokens): per split, the max m,
the sum s of exp(z - m) over all tokens (the log-prob's logsumexp, unfiltered) and the sum f
of exp(z - m) over allowed tokens; one exp per entry (block-wise max: the running scalar sums
are rescaled when a block raises the max), no per-entry noise. With min-p a max-only pass
runs first (the threshold needs the row max).
Combine (grid rows): logsumexp from the (m, s) partials, Gumbel-max over the splits' log
f + m, then an inverse-CDF walk through the chosen split only (tl.cumsum per block); with
`state`, also the decode-state update of state.advance.

Same hash, splits and uniforms as sampling.sample_reference, so the CPU and CUDA paths draw
the same tokens up to fp rounding at a split/CDF boundary (rare: see tests/engine).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from hybridflow.engine import sampling
from hybridflow.engine.kernels.launch import PLAIN, Launch
from hybridflow.engine.kernels.pdl import wait_then_release
from hybridflow.engine.sampling import SPLIT_SIZE, SamplingParams

# The hash constants of sampling.py, as constants a Triton kernel may read.
MIX_C1 = tl.constexpr(sampling._MIX_C1)
MIX_C2 = tl.constexpr(sampling._MIX_C2)
STEP_SALT = tl.constexpr(sampling._STEP_SALT)
SEED_SALT = tl.constexpr(sampling._SEED_SALT)
SCAN_SALT = tl.constexpr(sampling._SCAN_SALT)
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
def _uniform(bits):
    """uint32 -> fp32 in (0, 1): sampling.uniform_from_bits."""
    return ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)


@triton.jit
def _row_threshold(
    threshold_ptr,
    part_m_ptr,
    row,
    log_min_p,
    HAS_THRESHOLD: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """The row's filter threshold (a token is allowed iff z >= it); min-p from the split maxima
    (max is exact in any order, so every program of the row gets the same value)."""  # fmt: skip
    threshold = tl.full([], float("-inf"), tl.float32)
    if HAS_THRESHOLD:
        threshold = tl.load(threshold_ptr + row)
    if HAS_MIN_P:
        sp = tl.arange(0, SPLITS_PAD)
        maxima = tl.load(part_m_ptr + row * SPLITS + sp, mask=sp < SPLITS, other=float("-inf"))
        threshold = tl.maximum(threshold, tl.max(maxima, axis=0) + log_min_p)
    return threshold


@triton.jit
def _split_stats_kernel(
    logits_ptr, stride_l, V, threshold_ptr, part_m_ptr, part_s_ptr, part_f_ptr, part_idx_ptr,
    inv_temperature, log_min_p, MAX_ONLY: tl.constexpr, GREEDY: tl.constexpr,
    SCALE: tl.constexpr, HAS_THRESHOLD: tl.constexpr, HAS_MIN_P: tl.constexpr,
    SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, SPLIT_SIZE: tl.constexpr,
    BLOCK_V: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Pass 1, one (row, split): m = max z; s = sum exp(z - m) (all tokens); f = the same sum
    over allowed tokens (only when filtering; else f = s); GREEDY (never filtered): also the
    first argmax. MAX_ONLY: just m (min-p needs the row max before anything is allowed)."""
    wait_then_release(PDL)
    row = tl.program_id(0)
    split = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride_l
    part = row * SPLITS + split
    offs = tl.arange(0, BLOCK_V)
    lo = split * SPLIT_SIZE
    filtered: tl.constexpr = HAS_THRESHOLD or HAS_MIN_P
    if filtered and not MAX_ONLY:
        threshold = _row_threshold(threshold_ptr, part_m_ptr, row, log_min_p, HAS_THRESHOLD,
                                   HAS_MIN_P, SPLITS, SPLITS_PAD)  # fmt: skip
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    f = tl.zeros([], tl.float32)
    best_idx = lo
    for v0 in range(lo, lo + SPLIT_SIZE, BLOCK_V):
        idx = v0 + offs
        z = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        if SCALE:
            z = z * inv_temperature
        block_max = tl.max(z, axis=0)
        if GREEDY:
            if block_max > m:  # strict: the first block holding the max wins ties
                best_idx = v0 + tl.argmax(z, axis=0)
        if not MAX_ONLY:
            m_new = tl.maximum(m, block_max)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: no nan
            rescale = tl.exp(m - m_safe)  # the only per-block extra exp; 0 while m = -inf
            mass = tl.exp(z - m_safe)  # the one exp per entry
            s = s * rescale + tl.sum(mass, axis=0)
            if filtered:
                f = f * rescale + tl.sum(tl.where(z >= threshold, mass, 0.0), axis=0)
        m = tl.maximum(m, block_max)
    tl.store(part_m_ptr + part, m)
    if not MAX_ONLY:
        tl.store(part_s_ptr + part, s)
        if filtered:
            tl.store(part_f_ptr + part, f)
        if GREEDY:
            tl.store(part_idx_ptr + part, best_idx)


@triton.jit
def _sample_combine_kernel(
    logits_ptr, stride_l, V, seed_lo_ptr, seed_hi_ptr, step_ptr, threshold_ptr, part_m_ptr,
    part_s_ptr, part_f_ptr, part_idx_ptr, inv_temperature, log_min_p, tok_ptr, logprob_ptr,
    finished_ptr, slot_ptr, generated_ptr, max_new_ptr, stop_mask_ptr, state_tok_ptr,
    positions_ptr, out_tok_ptr, out_lp_ptr, stride_out, GREEDY: tl.constexpr,
    SCALE: tl.constexpr, HAS_THRESHOLD: tl.constexpr, HAS_MIN_P: tl.constexpr,
    SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, SPLIT_SIZE: tl.constexpr,
    BLOCK_V: tl.constexpr, ADVANCE: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Per row: logsumexp from the partials; the token (greedy: the best split's argmax; else
    Gumbel-max over splits, then the inverse-CDF walk inside the chosen split); log-prob
    = z - logsumexp. ADVANCE: also state.advance (record, count, stop, move)."""
    wait_then_release(PDL)
    row = tl.program_id(0)
    sp = tl.arange(0, SPLITS_PAD)
    mask = sp < SPLITS
    parts = row * SPLITS + sp
    m = tl.load(part_m_ptr + parts, mask=mask, other=float("-inf"))
    m_row = tl.max(m, axis=0)
    s = tl.load(part_s_ptr + parts, mask=mask, other=0.0)
    if GREEDY:
        best = tl.argmax(m, axis=0)  # first split on ties = lowest token id, like torch.argmax
        idx = tl.load(part_idx_ptr + parts, mask=mask, other=0)
        token = tl.sum(tl.where(sp == best, idx, 0), axis=0)
        z_token = m_row
    else:
        filtered: tl.constexpr = HAS_THRESHOLD or HAS_MIN_P
        if filtered:
            f = tl.load(part_f_ptr + parts, mask=mask, other=0.0)
        else:
            f = s
        step = tl.load(step_ptr + row).to(tl.uint32)
        key = _mix32(step ^ tl.full([], STEP_SALT, tl.uint32))
        key = _mix32(key ^ tl.load(seed_lo_ptr + row).to(tl.uint32))
        key = _mix32(
            key ^ tl.load(seed_hi_ptr + row).to(tl.uint32) ^ tl.full([], SEED_SALT, tl.uint32)
        )
        u = _uniform(_mix32(key ^ (sp.to(tl.uint32) * tl.full([], GOLDEN, tl.uint32))))
        gumbel = -LN2 * tl.log2(-tl.log2(u))  # + ln(ln 2): argmax-neutral
        has_mass = mask & (f > 0)  # f = 0: the split has no allowed token
        score = tl.where(has_mass, tl.log(tl.where(has_mass, f, 1.0)) + m + gumbel, float("-inf"))
        chosen = tl.argmax(score, axis=0)
        m_chosen = tl.sum(tl.where(sp == chosen, m, 0.0), axis=0)
        target = _uniform(_mix32(key ^ tl.full([], SCAN_SALT, tl.uint32)))
        target = target * tl.sum(tl.where(sp == chosen, f, 0.0), axis=0)
        if filtered:
            threshold = _row_threshold(threshold_ptr, part_m_ptr, row, log_min_p, HAS_THRESHOLD,
                                       HAS_MIN_P, SPLITS, SPLITS_PAD)  # fmt: skip
        base = logits_ptr + row.to(tl.int64) * stride_l
        lo = chosen * SPLIT_SIZE
        offs = tl.arange(0, BLOCK_V)
        running = tl.zeros([], tl.float32)
        found = tl.zeros([], tl.int32)
        token = lo
        last_positive = lo  # the rounding fallback: last token of the split with mass > 0
        # No break in Triton: every block of the split is read; `found` freezes the token.
        for v0 in range(0, SPLIT_SIZE, BLOCK_V):
            idx = lo + v0 + offs
            z = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            if SCALE:
                z = z * inv_temperature
            mass = tl.exp(z - m_chosen)
            if filtered:
                mass = tl.where(z >= threshold, mass, 0.0)
            positive = mass > 0
            hit = (tl.cumsum(mass, axis=0) + running >= target) & positive
            first = tl.min(tl.where(hit, offs, BLOCK_V), axis=0)
            token = tl.where((found == 0) & (first < BLOCK_V), lo + v0 + first, token)
            found = tl.maximum(found, (first < BLOCK_V).to(tl.int32))
            last_positive = tl.maximum(last_positive, tl.max(tl.where(positive, idx, -1), axis=0))
            running += tl.sum(mass, axis=0)
        token = tl.where(found == 1, token, last_positive)
        z_token = tl.load(base + token).to(tl.float32)
        if SCALE:
            z_token = z_token * inv_temperature
    lse = m_row + tl.log(tl.sum(tl.where(mask, s * tl.exp(m - m_row), 0.0), axis=0))
    token = token.to(tl.int64)
    logprob = z_token - lse
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
    block_v: int = SPLIT_SIZE,
    state=None,
    split_size: int = SPLIT_SIZE,
    launch: Launch = PLAIN,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Same contract, splits and uniforms as sampling.sample_reference.

    logits [B, V] (bf16/fp16/fp32) -> (tokens [B] int64, logprobs [B] fp32). block_v is the
    kernels' tile (a power of two; free, it does not change the draw); split_size belongs to
    the sampling scheme (only tests pass another value). With `state` (a DecodeState whose
    first rows these are), the combine kernel also applies state.advance; nothing returned.

    Launch shape (reasoned, not measured): at 256 x 151,936 the first pass is
    256 x 38 programs of one 4096-token tile each (8 KB of bf16, 16 entries per thread with 8
    warps, loads all issued before the reductions: no loop-carried latency, no rescale), ~700
    resident CTAs keep ~5 MB in flight, enough for HBM. The combine walks one tile per row."""
    rows, vocab = logits.shape
    device = logits.device
    splits, width = sampling.split_layout(vocab, split_size)
    block_v = min(block_v, triton.next_power_of_2(width))
    # The kernels walk whole tiles; a one-split vocabulary only needs enough tiles to cover it.
    kernel_split = width if splits > 1 else triton.cdiv(width, block_v) * block_v
    if kernel_split % block_v:
        raise ValueError(f"split size {width} must be a multiple of block_v={block_v}")
    part_m, part_s, part_f = (
        torch.empty(rows, splits, dtype=torch.float32, device=device) for _ in range(3)
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
        # kernels sample under the resulting threshold.
        z = logits.float() * (1.0 / temperature) if scale else logits.float()
        threshold = sampling.filter_threshold(z, params.top_k, params.top_p, 0.0)
    elif has_threshold:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1].float()
        threshold = kth * (1.0 / temperature) if scale else kth
    has_min_p = not greedy and params.min_p > 0
    common = dict(
        GREEDY=greedy, SCALE=scale, HAS_THRESHOLD=has_threshold, HAS_MIN_P=has_min_p,
        SPLITS=splits, SPLITS_PAD=max(2, triton.next_power_of_2(splits)),
        SPLIT_SIZE=kernel_split, BLOCK_V=block_v, num_warps=8 if block_v >= 4096 else 4,
        **launch.keywords(),
    )  # fmt: skip
    rows_args = (logits, logits.stride(0), vocab)
    scalars = (1.0 / temperature, math.log(params.min_p) if has_min_p else 0.0)
    stats_args = (*rows_args, threshold, part_m, part_s, part_f, part_idx, *scalars)
    if has_min_p:
        _split_stats_kernel[(rows, splits)](*stats_args, MAX_ONLY=True, **common)
    _split_stats_kernel[(rows, splits)](*stats_args, MAX_ONLY=False, **common)
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
        *rows_args, seed_lo, seed_hi, steps, threshold, part_m, part_s, part_f, part_idx,
        *scalars, tokens, logprobs, st.finished, st.row_slots, st.generated, st.max_new,
        st.stop_mask, st.tokens, st.positions, st.out_tokens, st.out_logprobs, stride_out,
        ADVANCE=state is not None, **common,
    )  # fmt: skip
    return None if state is not None else (tokens, logprobs)
