"""Decode layers in five launches each: qkv, attention, o_proj, gate/up, down.

The split layer (split.py) runs eight per layer at decode sizes: add+RMSNorm, qkv,
attention, o_proj, add+RMSNorm, gate/up+SiLU, down, cuBLAS's split-K reduce. At 256 rows of a
0.5B model each is a few microseconds of mostly fixed cost, so launches, not bytes, set the
step time. Here the norms ride on the matmuls (kernels/gemm.py, _gemm_nt_kernel):

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
for qkv at 256 rows), more than the launch it saved. Deterministic: no float atomics. Each
matmul's tile is chosen by timing CUDA-graph replays, outside capture (the decode graph's
warm-up runs each step first), and pinned (choices.py); whether a batch size runs this layer
at all is the chooser's (chooser.py).
"""

from __future__ import annotations

import math

import torch
import triton

from hybridflow.engine.choices import PinnedChoices
from hybridflow.engine.kernels import gemm
from hybridflow.engine.kernels.launch import PLAIN, Launch

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the fastest gemm_nt tiles at decode
# shapes on the H200: deep pipelines for the skinny ones, 64 x 128 for gate/up; the last won
# qkv at 1024 rows by 2% with TMA loads. Each tile adds compile and tuning time to the first
# generate().
CHAIN_TILES = [
    (64, 64, 64, 4, 7),
    (64, 32, 64, 4, 8),
    (64, 64, 128, 4, 4),
    (64, 128, 64, 4, 3),
    (64, 128, 64, 4, 5),
    (128, 128, 64, 8, 3),
    (64, 128, 64, 4, 4),
]
RESIDUAL_SPLITS = [1, 2, 4]


INTERPRETER_PLAN = ((16, 32, 32, 4, 1), 2)  # CPU tests: small tile, a K split when it fits


def _key(kind: str, rows: int, weight: torch.Tensor) -> tuple:
    return (kind, gemm._row_bucket(rows), *weight.shape, str(weight.dtype))


class DecodeChain:
    """The five-launch decode layer's matmuls, their tile choices and scratch buffers.

    max_rows: the largest batch it runs. launch: PDL, weight prefetch and TMA (the chain is
    all Triton, so every launch can overlap the previous one). pinned: where tile choices are
    kept across processes."""

    def __init__(self, max_rows: int = 1024, *, launch: Launch = PLAIN,
                 pinned: PinnedChoices | None = None):  # fmt: skip
        self.max_rows = max_rows
        self.launch = launch
        self.pinned = pinned if pinned is not None else PinnedChoices()
        self.plans: dict[tuple, tuple] = {}  # op key -> (tile, splits)
        self.timings: dict[str, dict] = {}  # for reports: candidate -> us
        self._scratch: dict[tuple, tuple] = {}  # (op key, tile, splits) -> (workspace, counts)
        self._sums: dict[tuple, torch.Tensor] = {}  # (bucket, hidden, device) -> [parts, rows]

    def applies(self, rows: int) -> bool:
        return rows <= self.max_rows

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

    def norm_linear(self, residual, sums, eps, weight, bias=None, silu_pairs=False):
        """RMSNorm(residual) @ weight^T (+ bias), the norm's weight folded into `weight`;
        silu_pairs as gemm_nt."""
        sums, parts = sums
        rows, depth = residual.shape
        kind = "norm_silu" if silu_pairs else "norm"
        tile, _ = self._plan(kind, residual, weight)
        cols = weight.shape[0]
        out = torch.empty(rows, cols // 2 if silu_pairs else cols, dtype=residual.dtype,
                          device=residual.device)  # fmt: skip
        self._launch(residual, weight, bias, out, tile, 1, silu_pairs=silu_pairs,
                     norm=(sums, parts, eps))  # fmt: skip
        return out

    def residual_linear(self, x, weight, bias, residual, sums) -> tuple:
        """residual += x @ weight^T (+ bias), in place; returns (sums, parts) of the new rows."""
        sums = sums[0]
        tile, splits = self._plan("residual", x, weight)
        scratch = self._scratch_for(_key("residual", x.shape[0], weight), tile, splits, x)
        self._launch(x, weight, bias, residual, tile, splits, sums_out=sums, scratch=scratch)
        return sums, triton.cdiv(weight.shape[0], tile[1])

    # -- internals -------------------------------------------------------------------------

    def _launch(self, x, weight, bias, out, tile, splits, *, silu_pairs=False, norm=None,
                sums_out=None, scratch=None):  # fmt: skip
        rows, depth = x.shape
        cols = weight.shape[0]
        block_m, block_n, block_k, warps, stages = tile
        if depth % (splits * block_k) or x.stride(1) != 1 or weight.stride(1) != 1:
            raise ValueError(f"chain matmul: K={depth} is not {splits} x a multiple of {block_k}")
        sums_in, parts, eps = norm if norm is not None else (out, 1, 0.0)
        sums = sums_out if sums_out is not None else sums_in
        ws, counts = scratch if scratch is not None else (out, out)
        grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n), splits)
        options = gemm.launch_options(weight, block_k, depth // splits, self.launch)
        *descriptors, tma = gemm.tma_operands(x, weight, block_m, block_n, block_k,
                                              self.launch.tma)  # fmt: skip
        gemm._gemm_nt_kernel[grid](
            x, weight, bias if bias is not None else weight, out, rows, cols, depth // splits,
            x.stride(0), weight.stride(0), 0, out.stride(0), sums_in, sums, ws, counts,
            sums.stride(0), parts, depth, eps, *descriptors, HAS_BIAS=bias is not None, TMA=tma,
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
                pinned = self.pinned.get("chain_tile", key)
                if pinned is not None and self._known(kind, key, *pinned):
                    self.plans[key] = pinned
                else:
                    self._check_not_capturing("tile choice")
                    self.plans[key] = self._tune(kind, key, x, weight)
                    self.pinned.put("chain_tile", key, self.plans[key])
        return self.plans[key]

    @staticmethod
    def _known(kind: str, key: tuple, tile: tuple, splits: int) -> bool:
        """A pinned (tile, splits) is still a candidate (the tables may have changed)."""
        depth = key[3]
        allowed = RESIDUAL_SPLITS if kind == "residual" else [1]
        return tuple(tile) in CHAIN_TILES and splits in allowed and not depth % (splits * tile[2])

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
    states [B, H]. attend as in split.fused_layers; fused: FusedProjections with gate/up and
    the norms folded in."""
    from hybridflow.engine.kernels import rowwise

    hidden = model.model.embed_tokens(tokens)  # [B, H] residual stream, updated in place
    sums = chain.start(hidden)
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        bias = fused.qkv_bias[index] if fused.qkv_bias is not None else None
        eps = layer.input_layernorm.eps
        qkv = chain.norm_linear(hidden, sums, eps, fused.qkv_weight[index], bias)
        q, k, v = qkv.split([fused.q_size, fused.kv_size, fused.kv_size], dim=-1)
        q = q.unflatten(-1, (attn.num_heads, attn.head_dim))
        k = k.unflatten(-1, (attn.num_kv_heads, attn.head_dim))
        v = v.unflatten(-1, (attn.num_kv_heads, attn.head_dim))
        if attn.q_norm is not None:
            q, k = rowwise.qk_norm_(q, k, attn.q_norm, attn.k_norm)
        out = attend(index, q, k, v)
        sums = chain.residual_linear(out.flatten(-2), attn.o_proj.weight, attn.o_proj.bias,
                                     hidden, sums)  # fmt: skip
        eps = layer.post_attention_layernorm.eps
        act = chain.norm_linear(hidden, sums, eps, fused.gate_up_weight[index], silu_pairs=True)
        sums = chain.residual_linear(act, layer.mlp.down_proj.weight, None, hidden, sums)
    return rowwise.rms_norm(hidden, model.model.norm, launch=chain.launch)
