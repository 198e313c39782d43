"""Decode attention that reads a prompt's cached prefix once for all its samples (n > 1).

GRPO-style rollouts decode n samples of each prompt side by side. Their slots hold identical
copies of the prompt's K/V (the prefill runs once, then fans out), and the plain decode
attention reads that prefix once per sample: at n = 8 with prompts about as long as the
responses, half of a step's KV reads are the same bytes eight times. Here the attention of a
row is split at its prompt's length:

- the row kernel (attention_kernels, SHARED) covers the row's own positions [first, pos]
  (and RoPE, the new token's store, 1/rms where it applies, as usual) and leaves its rotated
  q and unnormalised softmax state (max m, sum l, accumulator) behind;
- prefix_attention runs one program per (group, kv head): a group is up to GROUP_ROWS
  consecutive rows of one prompt; it reads the prefix [0, first) once from one member's slot,
  attends all the group's query heads to it as one [rows x heads, D] block (a real matrix
  product where the row kernel's is 6-7 rows padded to 16), merges each row's own state and
  writes the output.

Rows without a shared prefix (n = 1, a last surviving sample) are groups of one with first =
0: the prefix loop is empty and the merge returns the row kernel's result. The groups are a
small table the host rewrites whenever rows are admitted or compacted (group_table).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridflow.engine import pdl
from hybridflow.engine.attention_kernels import _softmax_tile, prefetch_kv
from hybridflow.engine.pdl import wait_then_release

# Rows per group (the prefix program's query block is GROUP_ROWS x heads per kv head).
GROUP_ROWS = 8

# The prefix program's tile (BLOCK_N positions a step, num_warps, num_stages): best or within
# 0.5% of the best of 7 tiles at every shape engine_prefix.py timed (session 12).
PREFIX_CONFIG = (64, 4, 3)
# Programs per (group, kv head) along the prefix; None: prefix_splits chooses (enough for ~2
# waves). 1 by default: at 128-256-token prompts every split count above 1 was slower at every
# shape engine_prefix.py timed (session 12: 0.5b 64 x 8, x2 28.2 vs 24.1 us, x3 31.2; the
# parking and merging cost more than the parallelism gives), and in whole generations (0.5b
# 64 x 8: auto, i.e. 3, 9-12% slower). Long prompts with few groups are not measured.
PREFIX_SPLITS: int | None = 1
# At most this many prefix programs a launch (they loop over the work items): 2 per H200 SM.
PREFIX_PROGRAMS = 264
# Launch the row kernel and the prefix kernel with PDL (pdl.py, sm_90+), so the prefix
# programs start while the row kernel's last wave runs and ask L2 for their prefixes (written
# at prefill, never by the row kernel) before they wait for its state. Even inside the paths
# that suspend PDL elsewhere (split, lean). Session 12 (call6): 1.4-2.8 us a layer off the
# shared attention (0.5b 64 x 8: 24.4 -> 23.0 us), bitwise the same completions; a whole
# 0.5b 64 x 8 generation +0.4% (median of 4 rounds, 3 faster), inside that host's noise.
PDL = True


def pdl_options(tensor: torch.Tensor) -> dict:
    return pdl.pair_options(tensor) if PDL else {}


# "auto": generate() calls with n > 1 on the triton backend read each prompt's prefix once per
# group of samples; "off": never (A/B runs). On since session 12: the engine-level GPU tests
# pass (fp32, the same tokens as off), and 64 prompts x n = 8 ran 9.3% (0.5b) and 11.2% (1.5b)
# faster, in every interleaved round (NOTES run 16).
MODE = "auto"


def group_table(row_keys: list, prompt_lengths: list[int], row_slots: list[int],
                capacity: int, group_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Host-side groups of the live rows: consecutive rows with equal keys (row_keys[r]: the
    loop passes (prompt, admission), as admission appends a prompt's samples side by side and
    compaction keeps their order; samples of one prompt prefilled by two admissions are two
    groups, their K/V from two prefill passes need not be bitwise equal) form groups of up to
    group_rows (default GROUP_ROWS) rows. Returns (groups int32 [capacity + 1, 4]: row 0 holds
    the number of entries, then one entry a group: first row, rows, the slot to read the
    prefix from (the group's first row's: every member holds the same copy), prefix length;
    first int64 [capacity]: each row's prefix length). A group of one has no shared
    prefix (length 0: its row program reads everything, as without sharing); rows past the
    live ones (a graph bucket's padding) are groups of one; entries past the groups have 0
    rows."""
    group_rows = group_rows or GROUP_ROWS  # read here: A/B runs set the module's
    live = len(row_keys)
    entries, first = [], [0] * capacity
    row = 0
    while row < capacity:
        end = row + 1
        if row < live:
            while (end < live and end - row < group_rows
                   and row_keys[end] == row_keys[row]):  # fmt: skip
                end += 1
        size = end - row
        length = prompt_lengths[row] if size > 1 else 0
        entries.append([row, size, row_slots[row] if row < live else 0, length])
        first[row:end] = [length] * size
        row = end
    header = [[len(entries), 0, 0, 0]]
    entries += [[0, 0, 0, 0]] * (capacity - len(entries))
    return (torch.tensor(header + entries, dtype=torch.int32),
            torch.tensor(first, dtype=torch.int64))  # fmt: skip


@triton.jit
def _prefix_attention_kernel(
    qs_ptr, kc_ptr, vc_ptr, groups_ptr, pm_ptr, pl_ptr, pacc_ptr, out_ptr, ws_ptr, count_ptr,
    stride_cslot, stride_cpos, stride_chead, stride_o, scale_log2, num_rows, G: tl.constexpr,
    NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, FP32_DOT: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """A fixed grid of programs walks the work items (entry, kv head, split): the split's
    share of the entry's prefix (a launch of one program per possible entry spent more time
    starting the empty ones than the rest took). With SPLITS > 1 each share's softmax state
    is parked in ws and the last program of the (entry, kv head) to arrive (an atomic count,
    reset by it for the next launch) merges them in split order, so the result does not
    depend on which finished first."""
    items = tl.load(groups_ptr) * (NKV * SPLITS)  # row 0: the number of entries
    i = tl.arange(0, M_PAD)  # (row in group, head in kv group) flattened
    d = tl.arange(0, D)
    if PDL:  # before the wait: the group table (uploaded between replays) and the prefixes
        for item in range(tl.program_id(0), items, tl.num_programs(0)):
            pair = item // SPLITS
            entry = groups_ptr + (1 + pair // NKV) * 4
            base = (tl.load(entry + 2).to(tl.int64) * stride_cslot
                    + (pair % NKV) * stride_chead)  # fmt: skip
            lo, hi = _share(tl.load(entry + 3), item % SPLITS, SPLITS, BLOCK_N)
            lines = tl.arange(0, (D * 2 + 127) // 128) * 64  # 128-byte lines of a position
            prefetch_kv(kc_ptr, vc_ptr, base, lines, lo, hi, stride_cpos)
    wait_then_release(PDL)
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        split = item % SPLITS
        pair = item // SPLITS  # entry * NKV + kv head
        kv_head = pair % NKV
        entry = groups_ptr + (1 + pair // NKV) * 4
        row0 = tl.load(entry)
        count = tl.load(entry + 1)
        slot = tl.load(entry + 2)
        length = tl.load(entry + 3)
        # entries past this batch's rows (the table covers the engine's capacity), and the
        # other splits of a group of one (split 0 writes its row's own result), do nothing
        if (row0 < num_rows) & ((length > 0) | (split == 0)):
            _prefix_item(qs_ptr, kc_ptr, vc_ptr, pm_ptr, pl_ptr, pacc_ptr, out_ptr, ws_ptr,
                         count_ptr, stride_cslot, stride_cpos, stride_chead, stride_o,
                         scale_log2, num_rows, i, d, pair, kv_head, split, row0, count, slot,
                         length, G, NH, D, M_PAD, BLOCK_N, SPLITS, FP32_DOT)  # fmt: skip


@triton.jit
def _share(length, split, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Positions [lo, hi) of a prefix of `length` that share `split` of SPLITS walks: whole
    tiles each, the last ones possibly empty."""
    if SPLITS > 1:
        chunk = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(length, lo + chunk)
    else:
        lo = 0
        hi = length
    return lo, hi


@triton.jit
def _prefix_item(
    qs_ptr, kc_ptr, vc_ptr, pm_ptr, pl_ptr, pacc_ptr, out_ptr, ws_ptr, count_ptr, stride_cslot,
    stride_cpos, stride_chead, stride_o, scale_log2, num_rows, i, d, pair, kv_head, split, row0,
    count, slot, length, G: tl.constexpr, NH: tl.constexpr, D: tl.constexpr,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, FP32_DOT: tl.constexpr,
):  # fmt: skip
    rows = row0 + i // G
    valid = (i < count * G) & (rows < num_rows)
    heads = kv_head * G + i % G
    state = rows * NH + heads
    q = tl.load(qs_ptr + state[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
    m_i = tl.full([M_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([M_PAD], tl.float32)
    acc = tl.zeros([M_PAD, D], tl.float32)
    lo, hi = _share(length, split, SPLITS, BLOCK_N)
    base = slot.to(tl.int64) * stride_cslot + kv_head * stride_chead
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        offs = base + n[:, None].to(tl.int64) * stride_cpos + d[None, :]
        k = tl.load(kc_ptr + offs, mask=n_mask[:, None], other=0.0)
        v = tl.load(vc_ptr + offs, mask=n_mask[:, None], other=0.0)
        m_i, l_i, acc = _softmax_tile(q, k, v, n_mask, m_i, l_i, acc, scale_log2, FP32_DOT)
    # the row's own positions (the row kernel's state; always >= 1 position: its new token)
    m_s = tl.load(pm_ptr + state, mask=valid, other=0.0)
    l_s = tl.load(pl_ptr + state, mask=valid, other=1.0)
    acc_s = tl.load(pacc_ptr + state[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
    out_offs = rows[:, None] * stride_o + heads[:, None] * D + d[None, :]
    if (SPLITS > 1) & (length > 0):
        # park (m, l, acc) of this share: ws [entries x kv heads, SPLITS, M_PAD, D + 2] fp32
        ws = ws_ptr + pair.to(tl.int64) * (SPLITS * M_PAD * (D + 2))
        part = ws + split * (M_PAD * (D + 2)) + i * (D + 2)
        tl.store(part[:, None] + d[None, :], acc)
        tl.store(part + D, m_i)
        tl.store(part + D + 1, l_i)
        tl.debug_barrier()  # every thread's share is written before the count moves
        arrived = tl.atomic_add(count_ptr + pair, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            tl.store(count_ptr + pair, 0)
            # fold the shares into the row's own state in split order (its m is finite: an
            # empty share's -inf adds nothing)
            m, total, out = m_s, l_s, acc_s
            for k_split in tl.static_range(SPLITS):
                share = ws + k_split * (M_PAD * (D + 2)) + i * (D + 2)
                m_k = tl.load(share + D, cache_modifier=".cg")
                l_k = tl.load(share + D + 1, cache_modifier=".cg")
                acc_k = tl.load(share[:, None] + d[None, :], cache_modifier=".cg")
                m_new = tl.maximum(m, m_k)
                a = tl.exp2(m - m_new)
                b = tl.exp2(m_k - m_new)
                out = out * a[:, None] + acc_k * b[:, None]
                total = total * a + l_k * b
                m = m_new
            out = out / total[:, None]
            tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=valid[:, None])
    else:
        m = tl.maximum(m_i, m_s)
        a = tl.exp2(m_i - m)
        b = tl.exp2(m_s - m)
        out = (acc * a[:, None] + acc_s * b[:, None]) / (l_i * a + l_s * b)[:, None]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=valid[:, None])


def state_buffers(q: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What the SHARED row kernel leaves for prefix_attention: rotated q [B, nh, D] (q's
    dtype), m and l [B, nh] and the accumulator [B, nh, D] (fp32)."""
    rows, heads, dim = q.shape
    fp32 = dict(dtype=torch.float32, device=q.device)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty(rows, heads, **fp32), torch.empty(rows, heads, **fp32),
            torch.empty(rows, heads, dim, **fp32))  # fmt: skip


def prefix_splits(rows: int, num_kv_heads: int) -> int:
    """Programs per (group, kv head): a batch's groups x kv heads alone leave most of the
    GPU idle (64 groups x 2 kv heads at 512 rows, on 132 SMs), and each program walks its
    prefix one tile after another; splits make ~2 waves. PREFIX_SPLITS overrides."""
    if PREFIX_SPLITS is not None:
        return PREFIX_SPLITS
    pairs = triton.cdiv(rows, GROUP_ROWS) * num_kv_heads
    return max(1, min(8, triton.cdiv(264, pairs)))


_COUNTS: dict = {}  # device -> every count buffer made there, the newest last


def _arrival_counts(device: torch.device, size: int) -> torch.Tensor:
    """Zeroed int32 counts the prefix programs leave at zero: one buffer per device, shared by
    every layer's launch (they run one after another on the stream). Grown outside capture,
    and a grown buffer's predecessors are kept, not freed: captured graphs still use them. A
    capture that needs more gets zeros of its own (a memset node each replay)."""
    made = _COUNTS.setdefault(device, [])
    if not made or made[-1].numel() < size:
        zeros = torch.zeros(max(size, 4096), dtype=torch.int32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return zeros
        made.append(zeros)
    return made[-1]


def prefix_attention(states: tuple, groups: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, out: torch.Tensor, config: tuple | None = None,
                     group_rows: int | None = None, splits: int | None = None) -> None:  # fmt: skip
    """Attend every group's query heads to its prefix and merge each row's own state into
    out [B, nh, D]. groups: int32 [>= groups, 4] (group_table with the same group_rows);
    entries with 0 rows skip. config (BLOCK_N, num_warps, num_stages) overrides
    PREFIX_CONFIG and splits prefix_splits (benchmarks/engine_prefix.py)."""
    qs, row_max, row_sum, acc = states
    rows, num_heads, dim = qs.shape
    assert groups.shape[0] > rows, "group_table covers every row of the batch"
    num_kv = key_cache.shape[2]
    group = num_heads // num_kv
    m_pad = max(16, triton.next_power_of_2((group_rows or GROUP_ROWS) * group))
    block_n, warps, stages = config or PREFIX_CONFIG
    splits = splits or prefix_splits(rows, num_kv)
    if splits > 1:
        ws = torch.empty(rows * num_kv * splits * m_pad * (dim + 2), dtype=torch.float32,
                         device=qs.device)  # fmt: skip
        counts = _arrival_counts(qs.device, rows * num_kv)
    else:
        ws = counts = row_max  # unused
    scale_log2 = (1.0 / dim**0.5) * 1.4426950408889634
    # programs: enough for the groups a full batch makes (rows / GROUP_ROWS of them), at most
    # PREFIX_PROGRAMS; the entries past them (groups of one, a batch's tail) are walked
    programs = min(PREFIX_PROGRAMS, triton.cdiv(rows, group_rows or GROUP_ROWS) * num_kv * splits)
    _prefix_attention_kernel[(max(1, programs),)](
        qs, key_cache, value_cache, groups, row_max, row_sum, acc, out, ws, counts,
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), out.stride(0),
        scale_log2, rows, G=group, NH=num_heads, NKV=num_kv, D=dim, M_PAD=m_pad,
        BLOCK_N=block_n, SPLITS=splits, FP32_DOT=qs.dtype == torch.float32, num_warps=warps,
        num_stages=stages, **pdl_options(qs),
    )  # fmt: skip
