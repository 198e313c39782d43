"""The engine's weights: new weights copied into the model's parameters in place
(copy_named_tensors, behind Engine.load_weights), and the transient copies of the triton
decode path: FusedProjections concatenates each layer's q/k/v (and interleaves gate/up) so a
decode layer runs one matmul where the model has three (two), with the RMSNorm weights
folded in."""

from __future__ import annotations

import torch


@torch.no_grad()
def copy_named_tensors(model, named_tensors, device: torch.device, bucket_bytes: int) -> None:
    """Copy (name, tensor) pairs (HF names) into the model's parameters (and buffers that a
    state dict holds, as DeepSeek's score correction), in buckets of about bucket_bytes (one
    device sync per bucket bounds the staging memory). KeyError naming an unknown
    parameter, ValueError naming a shape that does not match."""
    params = {**dict(model.named_buffers()), **dict(model.named_parameters(remove_duplicate=False))}
    pending = 0
    for name, tensor in named_tensors:
        if name not in params:
            raise KeyError(f"load_weights: {name!r} is not a parameter of the model")
        target = params[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"load_weights: {name} has shape {tuple(tensor.shape)}, "
                f"model expects {tuple(target.shape)}"
            )
        target.data.copy_(tensor, non_blocking=True)
        pending += tensor.numel() * tensor.element_size()
        if pending >= bucket_bytes and device.type == "cuda":
            torch.cuda.synchronize(device)
            pending = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class FusedProjections:
    """Concatenated copies of each layer's q/k/v (and optionally gate/up) weights, so a decode
    layer runs one matmul where the model has three (two). gate/up rows are interleaved
    (gate_0, up_0, gate_1, ...) so a matmul epilogue can pair them (gemm.gemm_nt). With gate/up,
    the RMSNorm weight in front of each is folded in (W * w, one rounding): the norms before
    them then skip their weight, and chain.py can scale rows by 1/rms in the matmul's
    epilogue. A transient copy: made when the KV cache is allocated, refreshed from the live
    parameters at every generate() (in place, so captured graphs stay valid), freed by
    Engine.release(). fold=False keeps the norm weights out (the split layer applies them).
    """

    def __init__(self, model, gate_up: bool, fold: bool = True):
        layers = model.model.layers
        attn, mlp = layers[0].self_attn, layers[0].mlp
        weight = attn.q_proj.weight
        self.q_size = attn.num_heads * attn.head_dim
        self.kv_size = attn.num_kv_heads * attn.head_dim
        rows = self.q_size + 2 * self.kv_size
        like = dict(dtype=weight.dtype, device=weight.device)
        self.qkv_weight = torch.empty(len(layers), rows, weight.shape[1], **like)
        self.qkv_bias = (
            torch.empty(len(layers), rows, **like) if attn.q_proj.bias is not None else None
        )
        self.gate_up_weight = None
        # the norm weights folded into qkv and gate/up; not when the fp8 copies must hold the
        # model's own weights (fp8.Fp8Matmul with the trainer's scales)
        self.folded = gate_up and fold
        if gate_up:
            inner, hidden = mlp.gate_proj.weight.shape
            self.gate_up_weight = torch.empty(len(layers), 2 * inner, hidden, **like)
        self.refresh(model)

    @torch.no_grad()
    def refresh(self, model) -> None:
        """Copy the live parameters in and fold the norm weights: per layer one cat into the
        q/k/v rows (one more for the biases) and one stack into the interleaved gate/up
        rows, then one fold per stacked tensor.

        Why this shape (H200): a per-layer loop of ~300 small
        ops left the GPU idle between them at the start of every generate(); one list copy
        (torch._foreach_copy_) of all slices took 3-4.5 ms of host time at 0.5b and 1.5b
        (one launch per tensor: strided gate/up targets, and even with those taken out
        3 ms), where a cat or stack per layer is one vectorised launch; and the fold as a
        broadcast multiply ran at ~0.7 TB/s (4.6 ms at 1.5b; rowwise.fold_norm_weights)."""
        for index, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight],
                      out=self.qkv_weight[index])  # fmt: skip
            if self.qkv_bias is not None:
                torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias],
                          out=self.qkv_bias[index])  # fmt: skip
            if self.gate_up_weight is not None:
                pairs = self.gate_up_weight[index].unflatten(0, (-1, 2))  # [I, 2, H]
                torch.stack([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight], dim=1,
                            out=pairs)  # fmt: skip
        layers = model.model.layers
        if self.folded:
            _fold(self.qkv_weight, [layer.input_layernorm.weight for layer in layers])
            if self.gate_up_weight is not None:
                _fold(self.gate_up_weight, [layer.post_attention_layernorm.weight
                                            for layer in layers])  # fmt: skip

    def nbytes(self) -> int:
        tensors = [self.qkv_weight, self.qkv_bias, self.gate_up_weight]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _fold(weights: torch.Tensor, norm_weights: list[torch.Tensor]) -> None:
    """weights[l, n, k] *= norm_weights[l][k] in place. One rounding, as in fp32: an
    elementwise product of bf16 (or fp16) tensors is computed in fp32 and rounded once, and
    the product of two bf16 values is exact in fp32. A Triton kernel on CUDA, torch on the
    CPU (Triton's interpreter rounds fp32 -> bf16 by truncation, so it would not be the
    same weights)."""
    norms = torch.stack(norm_weights)
    if weights.is_cuda:
        from hybridflow.engine.kernels.rowwise import fold_norm_weights

        fold_norm_weights(weights, norms)
    else:
        weights.mul_(norms[:, None, :])
