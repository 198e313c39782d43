"""FusedProjections.refresh (run at the start of every generate()): host time and device
time, against the previous version (one list copy of everything, including the strided
gate/up rows, then torch's broadcast multiply for the fold).

    PYTHONPATH=. python benchmarks/engine_refresh.py   # H200, ~30 s
"""

from __future__ import annotations

import time

import torch

from hybridflow.engine.forward import FusedProjections
from hybridflow.models import load_model


def refresh_before(fused: FusedProjections, model) -> None:
    """Session 9's refresh: everything in one _foreach_copy_, the fold as torch mul_."""
    layers = model.model.layers
    q, kv = fused.q_size, fused.kv_size
    targets, sources = [], []
    for index, layer in enumerate(layers):
        attn, weight = layer.self_attn, fused.qkv_weight[index]
        targets += [weight[:q], weight[q : q + kv], weight[q + kv :]]
        sources += [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
        if fused.qkv_bias is not None:
            bias = fused.qkv_bias[index]
            targets += [bias[:q], bias[q : q + kv], bias[q + kv :]]
            sources += [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        pairs = fused.gate_up_weight[index].unflatten(0, (-1, 2))
        targets += [pairs[:, 0], pairs[:, 1]]
        sources += [layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]
    torch._foreach_copy_(targets, sources)
    for weights, norms in [(fused.qkv_weight, [x.input_layernorm.weight for x in layers]),
                           (fused.gate_up_weight,
                            [x.post_attention_layernorm.weight for x in layers])]:  # fmt: skip
        weights.mul_(torch.stack(norms)[:, None, :])


def timed(fn, repeats: int = 10) -> tuple[float, float]:
    """(host ms to queue, wall ms until the device finished), medians."""
    host, wall = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        queued = time.perf_counter()
        torch.cuda.synchronize()
        host.append((queued - start) * 1e3)
        wall.append((time.perf_counter() - start) * 1e3)
    return sorted(host)[repeats // 2], sorted(wall)[repeats // 2]


def compare(preset: str) -> list[str]:
    model = load_model(preset, dtype=torch.bfloat16, device="cuda").eval()
    for layer in model.model.layers:  # norm weights away from 1, so folding shows
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
        layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    fused = FusedProjections(model, gate_up=True)
    after = [fused.qkv_weight.clone(), fused.gate_up_weight.clone()]
    refresh_before(fused, model)
    same = torch.equal(after[0], fused.qkv_weight) and torch.equal(after[1], fused.gate_up_weight)
    lines = []
    for name, fn in [("before", lambda: refresh_before(fused, model)),
                     ("now", lambda: fused.refresh(model))]:  # fmt: skip
        fn()
        host, wall = timed(fn)
        lines.append(f"| {preset} | {name} | {host:.2f} | {wall:.2f} | {same} |")
    return lines


@torch.no_grad()
def main() -> None:
    print("| model | refresh | host ms | wall ms | same weights |\n|---|---|---|---|---|")
    for preset in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
        print("\n".join(compare(preset)), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
