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

from hybridflow.engine.kernels import sm_count
from hybridflow.engine.kernels.attention_tiles import cache_offsets, prefetch_kv, softmax_tile
from hybridflow.engine.kernels.launch import PLAIN, Launch
from hybridflow.engine.kernels.pdl import wait_then_release

# Rows per group (the prefix program's query block is GROUP_ROWS x heads per kv head).
GROUP_ROWS = 8

# The prefix program's tile (BLOCK_N positions a step, num_warps, num_stages): best or within
# 0.5% of the best of 7 tiles at every shape timed on the H200 (0.5b and 1.5b, 64 x 8).
PREFIX_CONFIG = (64, 4, 3)
# At most this many prefix programs a launch (they loop over the work items): 2 per SM
# of the device.
PROGRAMS_PER_SM = 2


def group_table(row_keys: list, prompt_lengths: list[int], row_slots: list[int],
                capacity: int, group_rows: int = GROUP_ROWS) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Host-side groups of the live rows: consecutive rows with equal keys (row_keys[r]: the
    loop passes (prompt, admission), as admission appends a prompt's samples side by side and
    compaction keeps their order; samples of one prompt prefilled by two admissions are two
    groups, their K/V from two prefill passes need not be bitwise equal) form groups of up to
    group_rows rows. Returns (groups int32 [capacity + 1, 4]: row 0 holds
    the number of entries, then one entry a group: first row, rows, the slot to read the
    prefix from (the group's first row's: every member holds the same copy), prefix length;
    first int64 [capacity]: each row's prefix length). A group of one has no shared
    prefix (length 0: its row program reads everything, as without sharing); rows past the
    live ones (a graph bucket's padding) are groups of one; entries past the groups have 0
    rows."""
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
    qs_ptr, kc_ptr, vc_ptr, groups_ptr, pm_ptr, pl_ptr, pacc_ptr, out_ptr, stride_cslot,
    stride_cpos, stride_chead, stride_o, scale_log2, num_rows, G: tl.constexpr,
    NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr, PDL: tl.constexpr = False,
    table_ptr=None, stride_table=0, PAGE: tl.constexpr = 0,
):  # fmt: skip
    """A fixed grid of programs walks the work items (entry, kv head): the entry's prefix (a
    launch of one program per possible entry spent more time starting the empty ones than the
    rest took). With PDL the programs start while the row kernel's last wave runs and ask L2
    for their prefixes (written at prefill, never by the row kernel) before they wait for its
    state: 1.4-2.8 us a layer off the shared attention on the H200. PAGE, table: a paged
    cache (attention_tiles.cache_offsets), where the prefetch is skipped."""
    items = tl.load(groups_ptr) * NKV  # row 0: the number of entries
    i = tl.arange(0, M_PAD)  # (row in group, head in kv group) flattened
    d = tl.arange(0, D)
    if (
        PDL and not PAGE
    ):  # before the wait: the group table (uploaded between replays) and the prefixes
        for item in range(tl.program_id(0), items, tl.num_programs(0)):
            entry = groups_ptr + (1 + item // NKV) * 4
            base = (tl.load(entry + 2).to(tl.int64) * stride_cslot
                    + (item % NKV) * stride_chead)  # fmt: skip
            lines = tl.arange(0, (D * 2 + 127) // 128) * 64  # 128-byte lines of a position
            prefetch_kv(kc_ptr, vc_ptr, base, lines, 0, tl.load(entry + 3), stride_cpos)
    wait_then_release(PDL)
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        kv_head = item % NKV  # item = entry * NKV + kv head
        entry = groups_ptr + (1 + item // NKV) * 4
        row0 = tl.load(entry)
        count = tl.load(entry + 1)
        slot = tl.load(entry + 2)
        length = tl.load(entry + 3)
        # entries past this batch's rows (the table covers the engine's capacity) do nothing
        if row0 < num_rows:
            _prefix_item(qs_ptr, kc_ptr, vc_ptr, pm_ptr, pl_ptr, pacc_ptr, out_ptr,
                         stride_cslot, stride_cpos, stride_chead, stride_o, scale_log2,
                         num_rows, i, d, kv_head, row0, count, slot, length, G, NH, D, M_PAD,
                         BLOCK_N, FP32_DOT, table_ptr, stride_table, PAGE)  # fmt: skip


@triton.jit
def _prefix_item(
    qs_ptr, kc_ptr, vc_ptr, pm_ptr, pl_ptr, pacc_ptr, out_ptr, stride_cslot, stride_cpos,
    stride_chead, stride_o, scale_log2, num_rows, i, d, kv_head, row0, count, slot, length,
    G: tl.constexpr, NH: tl.constexpr, D: tl.constexpr, M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr, table_ptr, stride_table,
    PAGE: tl.constexpr,
):  # fmt: skip
    rows = row0 + i // G
    valid = (i < count * G) & (rows < num_rows)
    heads = kv_head * G + i % G
    state = rows * NH + heads
    q = tl.load(qs_ptr + state[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
    m_i = tl.full([M_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([M_PAD], tl.float32)
    acc = tl.zeros([M_PAD, D], tl.float32)
    base = kv_head * stride_chead
    if not PAGE:
        base += slot.to(tl.int64) * stride_cslot
    for n0 in range(0, length, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < length
        if PAGE >= BLOCK_N:  # an aligned tile lies in one block (attention.py's row kernel)
            block = tl.load(table_ptr + slot.to(tl.int64) * stride_table + n0 // PAGE)
            at = block.to(tl.int64) * stride_cslot + (n % PAGE).to(tl.int64) * stride_cpos
        else:
            at = cache_offsets(table_ptr, slot, n, stride_table, stride_cslot, stride_cpos,
                                 PAGE, n_mask)  # fmt: skip
        offs = base + at[:, None] + d[None, :]
        k = tl.load(kc_ptr + offs, mask=n_mask[:, None], other=0.0)
        v = tl.load(vc_ptr + offs, mask=n_mask[:, None], other=0.0)
        m_i, l_i, acc = softmax_tile(q, k, v, n_mask[None, :], m_i, l_i, acc, scale_log2, FP32_DOT)
    # merge the row's own positions (the row kernel's state; always >= 1 position: its new
    # token; an empty prefix's -inf adds nothing)
    m_s = tl.load(pm_ptr + state, mask=valid, other=0.0)
    l_s = tl.load(pl_ptr + state, mask=valid, other=1.0)
    acc_s = tl.load(pacc_ptr + state[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
    out_offs = rows[:, None] * stride_o + heads[:, None] * D + d[None, :]
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


def prefix_attention(states: tuple, groups: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, out: torch.Tensor, launch: Launch = PLAIN,
                     group_rows: int = GROUP_ROWS, table: torch.Tensor | None = None) -> None:  # fmt: skip
    """Attend every group's query heads to its prefix and merge each row's own state into
    out [B, nh, D]. groups: int32 [>= groups, 4] (group_table with the same group_rows);
    entries with 0 rows skip. launch: the pair's PDL link (Launch.pair_pdl). table: a paged
    cache's block table (attention.decode_attention)."""
    qs, row_max, row_sum, acc = states
    rows, num_heads, dim = qs.shape
    assert groups.shape[0] > rows, "group_table covers every row of the batch"
    num_kv = key_cache.shape[2]
    group = num_heads // num_kv
    m_pad = max(16, triton.next_power_of_2(group_rows * group))
    block_n, warps, stages = PREFIX_CONFIG
    scale_log2 = (1.0 / dim**0.5) * 1.4426950408889634
    # programs: enough for the groups a full batch makes (rows / group_rows of them), at most
    # PROGRAMS_PER_SM per SM; the entries past them (groups of one, a batch's tail) are walked
    programs = min(PROGRAMS_PER_SM * sm_count(qs.device), triton.cdiv(rows, group_rows) * num_kv)
    paging = {}
    if table is not None:
        paging = dict(table_ptr=table, stride_table=table.stride(0), PAGE=key_cache.shape[1])
    _prefix_attention_kernel[(max(1, programs),)](
        qs, key_cache, value_cache, groups, row_max, row_sum, acc, out, key_cache.stride(0),
        key_cache.stride(1), key_cache.stride(2), out.stride(0), scale_log2, rows, G=group,
        NH=num_heads, NKV=num_kv, D=dim, M_PAD=m_pad, BLOCK_N=block_n,
        FP32_DOT=qs.dtype == torch.float32, num_warps=warps, num_stages=stages,
        **launch.pair_keywords(), **paging,
    )  # fmt: skip
