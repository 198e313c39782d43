"""Decode layers in five launches each: qkv, attention, o_proj, gate/up, down.

The split path (forward.fused_layers) runs eight per layer at decode sizes: add+RMSNorm, qkv,
attention, o_proj, add+RMSNorm, gate/up+SiLU, down, cuBLAS's split-K reduce. At 256 rows of a
0.5B model each is a few microseconds of mostly fixed cost (NOTES.md), so launches, not bytes,
set the step time. Here the norms ride on the matmuls (gemm._gemm_nt_kernel):

- o_proj and down add their product into the residual stream in their epilogue and write
  each tile's sums of squares of the new rows (RESIDUAL; a K split is reduced inside the
  kernel by the last program of each tile, in split order: SERIAL);
- qkv and gate/up read the residual stream itself with the RMSNorm weight folded into their
  weights (FusedProjections(fold_norms=True)) and scale each output row by its 1/rms from
  those partial sums (ROW_RSTD), so the normalised activations are never formed.

Rounding: RMSNorm(h) @ W^T becomes rstd * (h @ (W * w)^T): the bf16 rounding moves from the
normalised activations to the folded weights (same precision, another place; the split path
with folded weights rounds h * rstd instead). Normalising inside the matmul's prologue kept
the rounding exact but cost ~4 us per matmul on the H200 (A through registers: 9.0 vs 5.1 us
for qkv at 256 rows), more than the launch it saved. Deterministic: no float atomics. Which path a batch size runs ("auto") and each matmul's tile are chosen by
timing CUDA-graph replays, outside capture (the decode graph's warm-up runs each step first).
"""

from __future__ import annotations

import math

import torch
import triton

from hybridflow.engine import gemm

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the fastest gemm_nt tiles at decode
# shapes on the H200 (benchmarks/engine_gemm.py, session 3): deep pipelines for the skinny
# ones, 64 x 128 for gate/up.
CHAIN_TILES = [
    (64, 64, 64, 4, 7),
    (64, 32, 64, 4, 8),
    (64, 64, 128, 4, 4),
    (64, 128, 64, 4, 3),
    (64, 128, 64, 4, 5),
    (128, 128, 64, 8, 3),
    # session 5 (TMA loads): won qkv at 1024 rows by 2%; (128, 128, 64, 8, 4) and
    # (64, 256, 64, 8, 3) were tried too and never won (each tile adds compile and tuning time
    # to the first generate())
    (64, 128, 64, 4, 4),
]
RESIDUAL_SPLITS = [1, 2, 4]
# "auto" takes the chain only when its forward replays are this much faster: at a tie (0.5b,
# 1024 rows with PDL: 2418 vs 2420 us) whole generate() calls ran 3% slower with the chain.
CHAIN_MARGIN = 0.02
MARGINS = {"chain": CHAIN_MARGIN}  # per decode path (choose); others: any win
# Each matmul asks L2 (evict-last) for the weight of the matmul two launches later (qkv ->
# gate/up, o_proj -> down, gate/up -> next qkv, down -> next o_proj), so the weights could
# arrive while earlier kernels run. Measured slower (0.5b/256 with PDL: 158k vs 167k tok/s,
# NOTES.md run 8: each program issues its share of ~10^5 prefetches ahead of its own loads);
# off, kept for the next attempt (e.g. from the attention kernel, or fewer, larger requests).
PREFETCH_AHEAD = False


def _lines(weight: torch.Tensor | None) -> int:
    """128-byte lines of a contiguous weight (0 without one)."""
    if weight is None:
        return 0
    assert weight.is_contiguous()
    return triton.cdiv(weight.numel() * weight.element_size(), 128)


INTERPRETER_PLAN = ((16, 32, 32, 4, 1), 2)  # CPU tests: small tile, a K split when it fits


def _key(kind: str, rows: int, weight: torch.Tensor) -> tuple:
    return (kind, gemm._row_bucket(rows), *weight.shape, weight.dtype, weight.device.index)


class DecodeChain:
    """The five-launch decode layer's matmuls, their tile choices and scratch buffers.

    mode: "auto" (per batch-size bucket, time the whole decode forward both ways and keep the
    faster), "on" (always, where it applies), "off" (never)."""

    def __init__(self, mode: str = "auto", max_rows: int = 1024):
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"fuse_norms={mode!r} not in auto/on/off")
        self.mode = mode
        self.max_rows = max_rows
        self.plans: dict[tuple, tuple] = {}  # op key -> (tile, splits)
        self.decisions: dict[tuple, str] = {}  # (bucket, hidden) -> decode path (choose)
        self.timings: dict[str, dict] = {}  # for the notes: candidate -> us
        self._scratch: dict[tuple, tuple] = {}  # (op key, tile, splits) -> (workspace, counts)
        self._sums: dict[tuple, torch.Tensor] = {}  # (bucket, hidden, device) -> [parts, rows]

    # -- when ------------------------------------------------------------------------------

    def applies(self, rows: int) -> bool:
        return self.mode != "off" and rows <= self.max_rows

    def choose(self, rows: int, hidden: int, candidates: dict) -> str:
        """Which decode path this batch size runs: candidates maps a path name ("split",
        "chain", "lean:qkv", ...) to a zero-argument forward; "split" must be among them.
        Timed once per bucket as graph replays where more than one is left (mode "on" keeps
        the chain only, where it is a candidate); a path other than split must beat split
        by its MARGINS share."""
        candidates = dict(candidates)
        if self.mode == "off":
            candidates.pop("chain", None)
        if self.mode == "on" and "chain" in candidates:
            return "chain"
        if not torch.cuda.is_available():  # nothing to time (interpreter tests): the chain
            return "chain" if "chain" in candidates else "split"
        if len(candidates) == 1:
            return next(iter(candidates))
        key = (gemm._row_bucket(rows), hidden)
        if key not in self.decisions:
            if torch.cuda.is_current_stream_capturing():
                return "split"
            # 5 x 5 forwards each (~50 ms at 1024 rows): with 2 x 3 the two layers' order
            # flipped between processes at 1024 rows, where they are ~3% apart (run 9)
            times = {name: gemm.graph_time_us(run, calls=5, replays=5)
                     for name, run in candidates.items()}  # fmt: skip
            self.timings[f"forward{key}"] = {n: round(t, 1) for n, t in times.items()}
            limit = {n: times["split"] * (1 - MARGINS.get(n, 0.0)) for n in times}
            winners = [n for n in times if n == "split" or times[n] < limit[n]]
            self.decisions[key] = min(winners, key=times.get)
        return self.decisions[key]

    # -- the ops ---------------------------------------------------------------------------

    def sums_buffer(self, rows: int, hidden: int, device) -> torch.Tensor:
        """[parts, bucket] fp32 partial sums of squares of the residual rows (parts: one per
        output tile of the narrowest tile)."""
        key = (gemm._row_bucket(rows), hidden, device)
        if key not in self._sums:
            self._check_not_capturing("sums buffer")
            parts = triton.cdiv(hidden, min(t[1] for t in CHAIN_TILES + [INTERPRETER_PLAN[0]]))
            self._sums[key] = torch.zeros(parts, key[0], dtype=torch.float32, device=device)
        return self._sums[key]

    def start(self, hidden: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Sums of squares of the embedding rows (one part) for the first layer's norm."""
        sums = self.sums_buffer(*hidden.shape, hidden.device)
        values = hidden.float()
        torch.sum(values * values, dim=-1, out=sums[0, : hidden.shape[0]])
        return sums, 1

    def norm_linear(self, residual, sums, eps, weight, bias=None, silu_pairs=False, ahead=None):
        """RMSNorm(residual) @ weight^T (+ bias), the norm's weight folded into `weight`;
        silu_pairs as gemm_nt; ahead: a later matmul's weight to prefetch into L2."""
        sums, parts = sums
        rows, depth = residual.shape
        kind = "norm_silu" if silu_pairs else "norm"
        tile, _ = self._plan(kind, residual, weight)
        cols = weight.shape[0]
        out = torch.empty(rows, cols // 2 if silu_pairs else cols, dtype=residual.dtype,
                          device=residual.device)  # fmt: skip
        self._launch(residual, weight, bias, out, tile, 1, silu_pairs=silu_pairs,
                     norm=(sums, parts, eps), ahead=ahead)  # fmt: skip
        return out

    def residual_linear(self, x, weight, bias, residual, sums, ahead=None) -> tuple:
        """residual += x @ weight^T (+ bias), in place; returns (sums, parts) of the new rows.
        ahead as norm_linear."""
        sums = sums[0]
        tile, splits = self._plan("residual", x, weight)
        scratch = self._scratch_for(_key("residual", x.shape[0], weight), tile, splits, x)
        self._launch(x, weight, bias, residual, tile, splits, sums_out=sums, scratch=scratch,
                     ahead=ahead)  # fmt: skip
        return sums, triton.cdiv(weight.shape[0], tile[1])

    # -- internals -------------------------------------------------------------------------

    def _launch(self, x, weight, bias, out, tile, splits, *, silu_pairs=False, norm=None,
                sums_out=None, scratch=None, ahead=None):  # fmt: skip
        rows, depth = x.shape
        cols = weight.shape[0]
        block_m, block_n, block_k, warps, stages = tile
        if depth % (splits * block_k) or x.stride(1) != 1 or weight.stride(1) != 1:
            raise ValueError(f"chain matmul: K={depth} is not {splits} x a multiple of {block_k}")
        sums_in, parts, eps = norm if norm is not None else (out, 1, 0.0)
        sums = sums_out if sums_out is not None else sums_in
        ws, counts = scratch if scratch is not None else (out, out)
        grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n), splits)
        options = gemm.launch_options(x, weight, block_k, depth // splits)
        if ahead is not None and PREFETCH_AHEAD and x.is_cuda:
            options.update(PF_NEXT=True, PF_LINE=128 // ahead.element_size())
        *descriptors, tma = gemm.tma_operands(x, weight, block_m, block_n, block_k)
        gemm._gemm_nt_kernel[grid](
            x, weight, bias if bias is not None else weight, out, rows, cols, depth // splits,
            x.stride(0), weight.stride(0), 0, out.stride(0), sums_in, sums, ws, counts,
            sums.stride(0), parts, depth, eps, ahead if ahead is not None else weight,
            _lines(ahead), *descriptors, HAS_BIAS=bias is not None, TMA=tma,
            SILU_PAIRS=silu_pairs, PARTIAL=False, FP32=x.dtype == torch.float32,
            ROW_RSTD=norm is not None, N_SS_PAD=max(2, triton.next_power_of_2(parts)),
            RESIDUAL=sums_out is not None, SERIAL=splits > 1, BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
            **options,
        )  # fmt: skip

    def _scratch_for(self, key, tile, splits, x):
        if splits == 1:
            return None
        skey = (key, tile, splits)
        if skey not in self._scratch:
            self._check_not_capturing("split-K workspace")
            block_m, block_n = tile[:2]
            tiles = triton.cdiv(key[1], block_m) * triton.cdiv(key[2], block_n)
            self._scratch[skey] = (
                torch.empty(
                    tiles * splits * block_m * block_n, dtype=torch.float32, device=x.device
                ),  # fmt: skip
                torch.zeros(tiles, dtype=torch.int32, device=x.device),  # reset by the kernel
            )
        return self._scratch[skey]

    @staticmethod
    def _check_not_capturing(what: str) -> None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"DecodeChain: {what} first needed during CUDA-graph capture")

    def _plan(self, kind: str, x: torch.Tensor, weight: torch.Tensor) -> tuple:
        key = _key(kind, x.shape[0], weight)
        if key not in self.plans:
            if not x.is_cuda:
                tile, splits = INTERPRETER_PLAN
                depth = x.shape[1]
                fits = kind == "residual" and depth % (splits * tile[2]) == 0
                self.plans[key] = (tile, splits if fits else 1)
            else:
                self._check_not_capturing("tile choice")
                self.plans[key] = self._tune(kind, key, x, weight)
        return self.plans[key]

    def _tune(self, kind: str, key: tuple, x: torch.Tensor, weight: torch.Tensor) -> tuple:
        """Time every (tile, split) on this op as graph replays, several weight copies so L2
        holds none (as in a real step), and keep the fastest."""
        bucket, cols, depth = key[1:4]
        nbytes = weight.numel() * weight.element_size()
        copies = [weight] + [weight.clone() for _ in range(min(7, math.ceil(100e6 / nbytes) - 1))]
        a = torch.randn(bucket, depth, dtype=x.dtype, device=x.device)
        hidden = cols if kind == "residual" else depth
        sums = torch.rand(triton.cdiv(hidden, 32), bucket, device=x.device) + 1.0
        residual = torch.randn(bucket, hidden, dtype=x.dtype, device=x.device)
        norm = (sums, triton.cdiv(hidden, 64), 1e-6)
        out_cols = cols // 2 if kind == "norm_silu" else cols
        out = torch.empty(bucket, out_cols, dtype=x.dtype, device=x.device)
        times: dict[tuple, float] = {}
        for tile in CHAIN_TILES:
            for splits in RESIDUAL_SPLITS if kind == "residual" else [1]:
                if depth % (splits * tile[2]) or tile[0] > max(64, bucket):
                    continue
                scratch = self._scratch_for(key, tile, splits, x)

                def call(w, tile=tile, splits=splits, scratch=scratch):
                    if kind == "residual":
                        self._launch(a, w, None, residual, tile, splits, sums_out=sums,
                                     scratch=scratch)  # fmt: skip
                    else:
                        self._launch(a, w, None, out, tile, 1, norm=norm,
                                     silu_pairs=kind == "norm_silu")  # fmt: skip

                def cycled(call=call, state={"i": 0}):  # noqa: B006 (per-candidate counter)
                    state["i"] = (state["i"] + 1) % len(copies)
                    call(copies[state["i"]])

                try:
                    times[(tile, splits)] = gemm.graph_time_us(cycled, calls=len(copies) * 2)
                except triton.runtime.errors.OutOfResources:
                    continue
        copies.clear()
        self.timings[str(key[:4])] = {f"{t}x{s}": round(us, 2) for (t, s), us in times.items()}
        best = min(times, key=times.get)
        # keep only the chosen tile's workspace
        for skey in [k for k in self._scratch if k[0] == key and k[1:] != best]:
            del self._scratch[skey]
        return best


def chain_layers(model, tokens, attend, fused, chain: DecodeChain) -> torch.Tensor:
    """Embedding + every decoder layer in five launches; returns the final-normed hidden
    states [B, H]. attend as in forward.fused_layers; fused: FusedProjections with gate/up and
    the norms folded in."""
    from hybridflow.engine import kernels

    hidden = model.model.embed_tokens(tokens)  # [B, H] residual stream, updated in place
    sums = chain.start(hidden)
    layers = model.model.layers
    for index, layer in enumerate(layers):
        attn = layer.self_attn
        bias = fused.qkv_bias[index] if fused.qkv_bias is not None else None
        eps = layer.input_layernorm.eps
        last = index + 1 == len(layers)
        qkv = chain.norm_linear(hidden, sums, eps, fused.qkv_weight[index], bias,
                                ahead=fused.gate_up_weight[index])  # fmt: skip
        q, k, v = qkv.split([fused.q_size, fused.kv_size, fused.kv_size], dim=-1)
        q = q.unflatten(-1, (attn.num_heads, attn.head_dim))
        k = k.unflatten(-1, (attn.num_kv_heads, attn.head_dim))
        v = v.unflatten(-1, (attn.num_kv_heads, attn.head_dim))
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        out = attend(index, q, k, v)
        sums = chain.residual_linear(
            out.flatten(-2), attn.o_proj.weight, attn.o_proj.bias, hidden, sums,
            ahead=layer.mlp.down_proj.weight,
        )  # fmt: skip
        eps = layer.post_attention_layernorm.eps
        act = chain.norm_linear(hidden, sums, eps, fused.gate_up_weight[index], silu_pairs=True,
                                ahead=None if last else fused.qkv_weight[index + 1])  # fmt: skip
        sums = chain.residual_linear(
            act, layer.mlp.down_proj.weight, None, hidden, sums,
            ahead=None if last else layers[index + 1].self_attn.o_proj.weight,
        )  # fmt: skip
    return kernels.rms_norm(hidden, model.model.norm)
