"""The triton decode step and the one place that decides which decode layer runs it.

Three layers compute the same math (split.py: eight launches, cuBLAS; chain.py: five
launches, the norms inside Triton matmuls; lean.py: cuBLAS with the norms inside attention and
SiLU*up, in three variants). Which is fastest depends on the model and the batch size (on the
H200 the chain wins at 0.5b/256 rows, split or lean at 1024 rows and on 1.5b), so with
`decode_layer="auto"` each batch-size bucket times every layer that applies as CUDA-graph
replays, once, during the decode graph's warm-up, and keeps the fastest; the choice is pinned
(choices.py), so later processes run the same kernels.
"""

from __future__ import annotations

import functools

import torch

from hybridflow.engine.choices import PinnedChoices
from hybridflow.engine.kernels.launch import PLAIN, Launch
from hybridflow.engine.options import LEAN_VARIANTS

# A layer other than split must beat split by this share to be kept: at a tie (0.5b, 1024
# rows: chain 2418 vs split 2420 us a forward) whole generate() calls ran 3% slower with the
# chain.
MARGINS = {"chain": 0.02}


class DecodeLayerChooser:
    """Which decode layer each batch-size bucket runs. layer: EngineOptions.decode_layer."""

    def __init__(self, layer: str = "auto", pinned: PinnedChoices | None = None):
        self.layer = layer
        self.pinned = pinned if pinned is not None else PinnedChoices()
        self.decisions: dict[tuple, str] = {}  # (bucket, hidden) -> layer name
        self.timings: dict[str, dict] = {}  # for reports: layer -> us a forward

    def wanted(self, usable: dict[str, bool]) -> list[str]:
        """The layers to consider, given which apply (usable: name -> bool for "chain" and
        "lean"). "split" always applies and comes first."""
        lean = [f"lean:{v}" for v in LEAN_VARIANTS] if usable.get("lean") else []
        chain = ["chain"] if usable.get("chain") else []
        if self.layer == "auto":
            return ["split", *chain, *lean]
        if self.layer == "chain":
            return chain or ["split"]
        if self.layer == "lean":
            return lean or ["split"]
        if self.layer.startswith("lean:"):
            return [self.layer] if lean else ["split"]
        return ["split"]

    def choose(self, rows: int, hidden: int, candidates: dict) -> str:
        """candidates: layer name -> zero-argument forward, in wanted() order. One candidate
        runs as is; several are timed once per bucket (outside graph capture)."""
        if len(candidates) == 1:
            return next(iter(candidates))
        if not torch.cuda.is_available():  # nothing to time (interpreter tests): the chain
            return "chain" if "chain" in candidates else next(iter(candidates))
        from hybridflow.engine.kernels.gemm import _row_bucket, graph_time_us

        key = (_row_bucket(rows), hidden)
        if key not in self.decisions:
            pinned = self.pinned.get("decode_layer", key)
            if pinned in candidates:
                self.decisions[key] = pinned
                return pinned
            if torch.cuda.is_current_stream_capturing():
                return next(iter(candidates))
            # 5 x 5 forwards each (~50 ms at 1024 rows): with 2 x 3 the order of two layers
            # ~3% apart flipped between processes at 1024 rows
            times = {name: graph_time_us(run, calls=5, replays=5)
                     for name, run in candidates.items()}  # fmt: skip
            self.timings[f"forward{key}"] = {n: round(t, 1) for n, t in times.items()}
            self.decisions[key] = pick_fastest(times)
            self.pinned.put("decode_layer", key, self.decisions[key])
        return self.decisions[key]


def pick_fastest(times: dict[str, float]) -> str:
    """The fastest layer, a layer with a MARGINS share having to beat split by it."""
    split = times.get("split")
    winners = [name for name, t in times.items()
               if split is None or name == "split" or t < split * (1 - MARGINS.get(name, 0.0))]  # fmt: skip
    return min(winners, key=times.get)


@torch.no_grad()
def decode_forward_triton(
    model,
    cache,
    rope,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    row_slots: torch.Tensor,
    max_len: int,
    *,
    fused=None,
    matmul=None,
    chain=None,
    chooser: DecodeLayerChooser | None = None,
    launch: Launch = PLAIN,
    autotune: bool = True,
    shared=None,
    experts=None,
) -> torch.Tensor:
    """Same contract as eager.decode_forward_torch; fused kernels, attention over live
    lengths only (max_len only sizes the split of the sequence among thread blocks).

    fused: weights.FusedProjections (None: weights in place); matmul: matmul_choice.
    DecodeMatmul; chain: chain.DecodeChain (needs fused gate/up); chooser: which layer runs
    (None: split); launch: PDL/TMA options (the split and lean layers run without PDL: their
    cuBLAS matmuls break every other link, and PDL measured 0-2.5% slower there); autotune:
    the attention tile. shared: (first [B], groups) of shared_prefix.group_table: each
    prompt's prefix is read once per group of its samples. experts: layers.moe.ExpertMatmuls
    (a mixture-of-experts model runs the split layer, its sparse MLPs through layers/moe.py,
    each row's expert ids recorded at its position when the cache keeps a routing record)."""
    from hybridflow.engine.kernels import attention
    from hybridflow.engine.layers import lean
    from hybridflow.engine.layers.chain import chain_layers
    from hybridflow.engine.layers.moe import route_target
    from hybridflow.engine.layers.split import fused_layers

    def attend_with(layer_launch):
        def attend(index, q, k, v, norm=None):
            return attention.decode_attention_rope(
                q, k, v, rope.cos, rope.sin, positions, cache.keys[index], cache.values[index],
                row_slots, max_len, norm=norm, shared=shared, launch=layer_launch,
                autotune=autotune, table=cache.block_table, kv_scales=cache.layer_scales(index),
                shifts=rope.slot_shift,  # mRoPE: each slot's rotary shift (engine/images.py)
            )  # fmt: skip

        return attend

    plain = launch.without_pdl()

    def run_split():
        routes = None
        if cache.routes is not None:
            routes = route_target(cache, *cache.locate(row_slots, positions))
        return fused_layers(model, tokens, attend_with(plain), fused, matmul, launch=plain,
                            routes=routes, experts=experts)  # fmt: skip

    def run_chain():
        return chain_layers(model, tokens, attend_with(launch), fused, chain)

    def run_lean(variant):
        return lean.lean_layers(model, tokens, attend_with(plain), fused, matmul, variant,
                                launch=plain)  # fmt: skip

    rows = tokens.shape[0]
    runs = {"split": run_split, "chain": run_chain}
    runs.update({f"lean:{v}": functools.partial(run_lean, v) for v in LEAN_VARIANTS})
    usable = {
        "chain": fused is not None and fused.gate_up_weight is not None
        and chain is not None and chain.applies(rows),
        "lean": lean.applies(model, fused),
    }  # fmt: skip
    if chooser is None:
        path = "split"
    else:
        candidates = {name: runs[name] for name in chooser.wanted(usable)}
        path = chooser.choose(rows, model.config.hidden_size, candidates)
    return model.lm_head(runs[path]())
