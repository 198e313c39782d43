"""MLA's absorbed decode attention (kernels/latent_attention.py) at DeepSeek-V3's widths: one
layer's step for `rows` rows of `length` cached tokens each over a paged bf16 latent cache,
the kernel against the torch reference (the rows' latents gathered, then
mla_absorbed.absorbed_attention), with the kernel's bandwidth over the floor's bytes (each
row's latents read once: rows x length x (512 + 64) x 2).

    python dev/latent_attention_bench.py --rows 64 256 --length 512 2048 8192
    TRITON_INTERPRET=1 python dev/latent_attention_bench.py --device cpu --rows 2 \
        --length 32 --heads 16  # dry run of the code paths

Every head tile (16 heads) reads each row's latents again: at 128 heads the kernel moves 8x
the floor's bytes through L2, which is what a wider head tile or a split of the positions
(flash-decoding, for few rows of long contexts) would win back.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hybridflow.engine.kernels.latent_attention import latent_decode_attention
from hybridflow.models.mixers.mla_absorbed import absorbed_attention

RANK, ROPE, BLOCK = 512, 64, 64


def time_us(fn, device: torch.device, calls: int = 10) -> float:
    if device.type == "cuda":
        from hybridflow.engine.kernels.gemm import graph_time_us

        return graph_time_us(fn, calls=calls)
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def one_shape(rows: int, length: int, heads: int, device: torch.device) -> dict:
    per_row = -(-length // BLOCK)
    blocks = rows * per_row
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    latents = torch.randn(blocks + 1, BLOCK, RANK + ROPE, device=device).to(dtype) * 0.1
    table = torch.randperm(blocks, device=device).to(torch.int32).view(rows, per_row)
    slots = torch.arange(rows, device=device)
    lengths = torch.full((rows,), length, device=device)
    q = (torch.randn(rows, heads, RANK, device=device) * 0.1).to(dtype)
    q_rope = torch.randn(rows, heads, ROPE, device=device).to(dtype)
    scale = 0.07

    def kernel():
        return latent_decode_attention(q, q_rope, latents, slots, lengths, scale, RANK, table)

    def reference():
        gathered = latents[table.long()].flatten(1, 2)[:, :length]
        visible = torch.ones(rows, length, dtype=torch.bool, device=device)
        latent, k_rope = gathered.split([RANK, ROPE], dim=-1)
        return absorbed_attention(q, q_rope, latent, k_rope, visible, scale)

    error = (kernel() - reference().float()).abs().max().item()
    kernel_us, reference_us = time_us(kernel, device), time_us(reference, device)
    floor_bytes = rows * length * (RANK + ROPE) * latents.element_size()
    return {"rows": rows, "length": length, "heads": heads, "kernel_us": round(kernel_us, 1),
            "torch_us": round(reference_us, 1), "max_error": error,
            "floor_GBps": round(floor_bytes / kernel_us / 1e3, 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--length", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    for rows in args.rows:
        for length in args.length:
            print(json.dumps(one_shape(rows, length, args.heads, device)), flush=True)


if __name__ == "__main__":
    main()
