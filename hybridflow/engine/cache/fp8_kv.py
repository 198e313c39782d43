"""An FP8 KV cache (EngineOptions.kv_cache_dtype = "fp8"): K and V stored as float8 e4m3 with
a scale per (position, kv head), half the bytes of a bf16 cache a position.

Each head's vector of one token is quantized on its own: scale = max|x| * (1/448) (fp32),
values x / scale rounded to e4m3 (fp8/e4m3.py's rows, the formula of the fp8 matmuls'
activations, which the Triton stores reproduce bit for bit). Readers dequantize a tile as
values * scale in the model dtype before the dot products. vLLM keeps static scales, one per
tensor or per kv head, 1.0 unless calibrated offline (docs: Quantized KV Cache); a dynamic
scale per token and head needs no calibration and follows each head's own range, at one
fp32 a head's 64-128 e4m3 values: 3-6% of the bytes beside them.

What it covers: the paged cache (blocks.py) of full-attention layers, in the eager passes
(prefill, extend, decode) and the Triton ones (rope_store, decode attention, the chunk
attention of the static mixed steps and verify passes, graph-captured or not). Others are
refused when the engine starts (:func:`fp8_kv_problem`): the slot cache, MLA's latent, the
sliding-window rings and recurrent states (kinds.py) keep their dtype-specific kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.engine.fp8.e4m3 import quantize_rows_reference


@dataclass
class KVScales:
    """The scales of an FP8 KV cache's keys and values, and the dtype K/V are computed in
    (what readers dequantize to)."""

    keys: torch.Tensor  # [L, entries, positions, kv_heads] fp32
    values: torch.Tensor  # the same shape
    dtype: torch.dtype

    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (e4m3 [..., D], scale [...] fp32): each D-vector quantized on its own."""
    rows = quantize_rows_reference(x.reshape(-1, x.shape[-1]))
    return rows.values.view(x.shape), rows.scale.view(x.shape[:-1])


def dequantize_heads(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    """quantize_heads' inverse: values [..., D] e4m3 times scale [...] -> dtype."""
    return (values.float() * scale.unsqueeze(-1)).to(dtype)


def allocate_scales(shape: tuple, dtype: torch.dtype, device: torch.device) -> KVScales:
    """Scales for K/V caches of ``shape`` [L, entries, positions, kv_heads, D]: ones (a
    never-written position dequantizes to the zeros its values hold)."""
    return KVScales(torch.ones(shape[:-1], device=device), torch.ones(shape[:-1], device=device),
                    dtype)  # fmt: skip


def fp8_kv_problem(specs, paged: bool) -> str | None:
    """Why an FP8 KV cache cannot hold a model of these layer specs (None: it can): every
    layer must keep plain K/V (full attention, no window) in a paged cache."""
    if not paged:
        return ("kv_cache_dtype='fp8' covers the paged cache only, and kv_block_size is null "
                "(the slot cache; or set rollout.engine.kv_block_size, e.g. 64)")  # fmt: skip
    kinds = sorted({f"{spec.mixer} ({spec.cache} cache{', windowed' if spec.window else ''})"
                    for spec in specs
                    if spec.mixer != "attention" or spec.cache != "kv" or spec.window})  # fmt: skip
    if kinds:
        return (f"kv_cache_dtype='fp8' covers full-attention K/V only, and this model has "
                f"{', '.join(kinds)} layers")  # fmt: skip
    return None


MIN_TRITON_CAPABILITY = (8, 9)  # Triton converts e4m3 (fp8e4nv) on Ada and Hopper and newer


def fp8_kv_device_problem(backend: str, capability: tuple[int, int] | None) -> str | None:
    """Why the Triton kernels cannot run an FP8 KV cache on a GPU of this compute capability
    (None: they can; the torch backend converts e4m3 anywhere)."""
    if backend != "triton" or capability is None or capability >= MIN_TRITON_CAPABILITY:
        return None
    return (f"kv_cache_dtype='fp8' on the triton backend needs compute capability >= 8.9 "
            f"(Triton's e4m3 conversions), and this GPU has {capability[0]}.{capability[1]}")  # fmt: skip
