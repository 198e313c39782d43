"""The bytes and launches of one eager decode step (layers/eager.decode_forward_torch), counted
from the code on meta tensors: no GPU, no memory, the preset's real shapes.

Every aten op the step dispatches is one launch (views and allocations none), reading its
tensor inputs (an index op: the rows it gathers; an index_put: the values it writes; an
expanded input: its distinct elements) and writing its output. The Triton kernels cannot run
on meta tensors: on the triton steps each kernel entry point is replaced by a stand-in that
returns an empty output of the kernel's shape and counts one launch (two for align_pairs)
with the bytes the kernel moves (decode attention: the live positions of each row; the
grouped expert kernels: every expert's weights, which 256 rows touch). Each op is put under
the part of the layer it serves by the innermost function or module on the Python stack that
names one (PARTS, MODULE_PARTS). F.rms_norm, which meta tensors decompose, counts as the one
fused kernel it is on CUDA. An estimate of traffic, not a profile: L2 hits, the GEMMs'
re-reads of their activations and a kernel's internal passes are not counted.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from contextlib import ExitStack
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that launch nothing (views, allocations, metadata)
FREE = {
    "view", "_unsafe_view", "reshape", "expand", "slice", "select", "split", "split_with_sizes",
    "unsqueeze", "squeeze", "transpose", "t", "permute", "as_strided", "alias", "detach",
    "unflatten", "flatten", "chunk", "empty", "empty_like", "empty_strided", "new_empty",
    "unbind", "lift_fresh", "_to_copy_noop", "view_as", "narrow", "_reshape_alias",
    "expand_as", "unfold", "diagonal", "movedim", "sym_size", "sym_stride", "is_same_size",
}  # fmt: skip

# the innermost function on the stack that names a part (a function's own ops, and the ops
# of what it calls unless an inner one names a part)
PARTS = {
    "residual_norm": "residual add + norm",
    "project_q": "q proj + rope", "project_latent": "kv_a proj + latent norm + rope",
    "_project_and_store": "latent store",
    "_project_and_store_fused": "q, kv_a proj + ropes + latent norm + store", "absorbed_weights": "absorb q (W_UK)",
    "absorb_query": "absorb q (W_UK)", "latent_cached": "latent attention",
    "latent_decode_attention": "latent attention", "absorbed_attention": "latent attention",
    "expand_output": "expand out (W_UV)",
    "project_qkv": "q/k/v proj + rope", "sink_decode": "K/V store (torch: + rows gathered)",
    "_rope_store": "q/k/v proj + rope + K/V store", "decode_attention":
    "attention", "sink_softmax": "attention",
    "route": "router + top-k", "router_logits": "router + top-k",
    "topk_softmax_route": "router + top-k", "grouped_topk": "router + top-k",
    "grouped_weights": "router + top-k", "_grouped_route_triton": "router + top-k",
    "self_routed_experts_torch": "route record, shared add",
    "biased_experts_torch": "route record, shared add",
    "moe_experts": "routed experts", "routed_experts_triton": "routed experts",
    "biased_experts_grouped": "routed experts", "biased_experts_triton": "routed experts",
    "rotary_positions": "step setup", "locate": "step setup", "write_slots": "step setup",
}  # fmt: skip
# modules (by the last name of their path) whose calls name a part
MODULE_PARTS = {"o_proj": "o proj", "shared_experts": "shared experts", "embed_tokens": "embed",
                "lm_head": "lm head", "mlp": "dense MLP"}  # fmt: skip


def _distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor view covers (an expanded dim counts once)."""
    count = 1
    for size, stride in zip(t.shape, t.stride()):
        count *= size if stride else 1
    return count * t.element_size()


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def op_bytes(name: str, args, kwargs, out) -> tuple[int, int]:
    """(read, written) bytes of one aten op."""
    outs = list(_tensors(out))
    written = sum(_distinct_bytes(t) for t in outs)
    inputs = list(_tensors(args)) + list(_tensors(list(kwargs.values())))
    if name in ("index", "gather", "index_select", "embedding"):  # the gathered rows
        return written + sum(_distinct_bytes(t) for t in inputs[1:]), written
    if name in ("index_put", "index_put_", "index_copy_", "index_copy", "scatter_",
                "scatter", "masked_scatter_"):  # fmt: skip
        moved = sum(_distinct_bytes(t) for t in inputs[1:])
        return moved, sum(_distinct_bytes(t) for t in inputs[-1:])
    if name in ("copy_", "fill_", "zero_"):
        return sum(_distinct_bytes(t) for t in inputs[1:]), _distinct_bytes(inputs[0])
    return sum(_distinct_bytes(t) for t in inputs), written


class StepCounter(TorchDispatchMode):
    """Counts [launches, read, written] by (layer kind, part, op) while active. layer: the
    kind of the decoder layer running now, None outside the layers."""

    def __init__(self, model, layer_kind):
        super().__init__()
        self.rows = defaultdict(lambda: [0, 0, 0])
        self.layer = None
        self.modules = {}
        for name, module in model.named_modules():
            last = name.rsplit(".", 1)[-1]
            if last in MODULE_PARTS and not (last == "mlp" and getattr(module, "top_k", 0)):
                self.modules[id(module)] = MODULE_PARTS[last]
        if getattr(model.model, "norm", None) is not None:
            self.modules[id(model.model.norm)] = "final norm"
        kinds = [layer_kind(index, layer) for index, layer in enumerate(model.model.layers)]
        self.layers = model.model.layers
        self.plain_list = type(self.layers)
        counter = self

        class CountedLayers(self.plain_list):
            """The decoder's layer list, naming the layer the step is in while it iterates
            (the eager step calls the layers' modules, not the layers)."""

            def __iter__(self):
                for kind, layer in zip(kinds, super().__iter__()):
                    counter.layer = kind
                    yield layer
                counter.layer = None

        self.counted_list = CountedLayers

    def __enter__(self):
        self.layers.__class__ = self.counted_list
        return super().__enter__()

    def __exit__(self, *exc):
        self.layers.__class__ = self.plain_list
        return super().__exit__(*exc)

    def part(self) -> str:
        frame = sys._getframe(2)
        while frame is not None:
            module = frame.f_locals.get("self")
            if module is not None and id(module) in self.modules:
                return self.modules[id(module)]
            if frame.f_code.co_name in PARTS:
                return PARTS[frame.f_code.co_name]
            if frame.f_code.co_name == "decode_forward_torch":
                return "residual add + norm" if self.layer is not None else "step setup"
            frame = frame.f_back
        return "other"

    def add(self, op: str, launches: int, read: int, written: int) -> None:
        row = self.rows[(self.layer or "outside the layers", self.part(), op)]
        row[0] += launches
        row[1] += read
        row[2] += written

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name not in FREE:
            self.add(name, 1, *op_bytes(name, args, kwargs, out))
        return out


def kernel_stand_ins(counter: StepCounter, live: int) -> ExitStack:
    """Patches every Triton entry point the eager triton steps call with a meta stand-in that
    counts the kernel. live: the positions each row holds (a sliding layer's row reads at
    most its window of them)."""
    from hybridflow.engine.kernels.experts import moe as moe_kernels

    def nbytes(*tensors) -> int:
        return sum(_distinct_bytes(t) for t in tensors if t is not None)

    def norm_out(x, norm):
        return torch.empty_like(x), nbytes(norm.weight)

    def rms_norm(x, norm, *args, **kwargs):
        out, weight = norm_out(x, norm)
        counter.add("triton rms_norm", 1, nbytes(x) + weight, nbytes(out))
        return out

    def add_rms_norm(x, delta, norm, *args, **kwargs):
        out, weight = norm_out(x, norm)
        counter.add("triton add_rms_norm", 1, nbytes(x, delta) + weight, 2 * nbytes(out))
        return out

    def decode_attention(q, keys, values, row_slots, lengths, max_len, **kwargs):
        positions = min(max_len, live)  # a sliding layer's ring holds max_len positions
        kv = 2 * q.shape[0] * positions * keys.shape[-2] * keys.shape[-1] * keys.element_size()
        counter.add("triton decode_attention", 1, nbytes(q) + kv, nbytes(q))
        return torch.empty_like(q)

    def latent_decode_attention(q_latent, q_rope, latents, row_slots, lengths, scale, rank,
                                table=None):  # fmt: skip
        rows, heads = q_latent.shape[:2]
        cached = rows * live * latents.shape[-1] * latents.element_size()
        out = torch.empty(rows, heads, rank, dtype=torch.float32, device=q_latent.device)
        counter.add("triton latent_decode_attention", 1, nbytes(q_latent, q_rope) + cached,
                    nbytes(out))  # fmt: skip
        return out

    def align_pairs(ids, num_experts, block_m, first_expert=None):
        tokens, top_k = ids.shape
        pairs = tokens * top_k
        blocks = -(-pairs // block_m) + num_experts
        out = moe_kernels.ExpertBlocks(
            ids.new_empty(blocks * block_m), ids.new_empty(blocks), ids.new_empty(1),
            ids.new_empty(num_experts), block_m, pairs, top_k, first_expert is not None)  # fmt: skip
        counter.add("triton align_pairs (count, place)", 2, 2 * nbytes(ids),
                    nbytes(out.sorted_pairs, out.block_expert))  # fmt: skip
        return out

    def grouped_gate_up(x, gate_up, blocks, tile=None, scale=None):
        inner = gate_up.shape[1] // 2
        out = x.new_empty(blocks.sorted_pairs.shape[0], inner)
        rows = blocks.pairs * x.shape[1] * x.element_size()
        counter.add("triton grouped gate/up + silu*up", 1, nbytes(gate_up, scale) + rows,
                    nbytes(out))  # fmt: skip
        return out

    def grouped_down(act, down, blocks, tile=None, scale=None):
        out = act.new_empty(blocks.pairs, down.shape[1])
        rows = blocks.pairs * act.shape[1] * act.element_size()
        counter.add("triton grouped down", 1, nbytes(down, scale) + rows, nbytes(out))
        return out

    def biased_gate_up(x, gate_up, bias, blocks, alpha, limit):
        out = x.new_empty(blocks.sorted_pairs.shape[0], gate_up.shape[2] // 2)
        rows = blocks.pairs * x.shape[1] * x.element_size()
        counter.add("triton grouped gate/up + bias + clamped swiglu", 1,
                    nbytes(gate_up, bias) + rows, nbytes(out))  # fmt: skip
        return out

    def biased_down(act, down, blocks):
        out = act.new_empty(blocks.pairs, down.shape[2])
        rows = blocks.pairs * act.shape[1] * act.element_size()
        counter.add("triton grouped down", 1, nbytes(down) + rows, nbytes(out))
        return out

    def latent_rope_store(q, kv, norm, cos, sin, latent, entries, offsets, nope, interleaved):
        rope = q.shape[2] - nope
        q_rope = q.shape[0] * q.shape[1] * rope * q.element_size()
        stored = q.shape[0] * latent.shape[-1] * latent.element_size()
        counter.add("triton latent_rope_store", 1, q_rope + nbytes(kv, cos, sin, norm.weight),
                    q_rope + stored)  # fmt: skip

    def rope_store(q, k, v, cos, sin, positions, row_slots, key_cache, value_cache, **kwargs):
        counter.add("triton rope_store", 1, nbytes(q, k, v, positions, row_slots),
                    nbytes(q, k, v))  # fmt: skip

    def grouped_route(logits, correction, top_k, n_group, topk_group, renormalize, scaling,
                      record=None):  # fmt: skip
        ids = torch.empty(logits.shape[0], top_k, dtype=torch.int32, device=logits.device)
        weights = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)
        counter.add("triton grouped_route", 1, nbytes(logits, correction),
                    nbytes(ids, weights) * (2 if record is not None else 1))  # fmt: skip
        return ids, weights

    def combine(y, weights, bias=None, ids=None):
        out = y.new_empty(weights.shape[0], y.shape[1])
        biases = 0 if bias is None else y.shape[0] * bias.shape[1] * bias.element_size()
        counter.add("triton combine", 1, nbytes(y, weights, ids) + biases, nbytes(out))
        return out

    def bias_clamped_swiglu(gate_up, bias, row_experts, alpha, limit):
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        counter.add("triton bias + clamped swiglu", 1, nbytes(gate_up, bias, row_experts),
                    nbytes(out))  # fmt: skip
        return out

    def rms_norm_cuda(x, shape, weight=None, eps=None):
        out = torch.empty_like(x)
        counter.add("rms_norm (fused CUDA kernel)", 1, nbytes(x, weight), nbytes(out))
        return out

    stack = ExitStack()
    patches = {
        "hybridflow.engine.kernels.rowwise.rms_norm": rms_norm,
        "hybridflow.engine.kernels.rowwise.rope_store": rope_store,
        "torch.nn.functional.rms_norm": rms_norm_cuda,
        "hybridflow.engine.kernels.rowwise.add_rms_norm": add_rms_norm,
        "hybridflow.engine.kernels.attention.decode_attention": decode_attention,
        "hybridflow.engine.kernels.latent_attention.latent_decode_attention":
            latent_decode_attention,
        "hybridflow.engine.kernels.latent_rope.latent_rope_store": latent_rope_store,
        "hybridflow.engine.kernels.experts.grouped_route.grouped_route": grouped_route,
        "hybridflow.engine.kernels.experts.moe.align_pairs": align_pairs,
        "hybridflow.engine.kernels.experts.moe.grouped_gate_up": grouped_gate_up,
        "hybridflow.engine.kernels.experts.moe.grouped_down": grouped_down,
        "hybridflow.engine.kernels.experts.moe.combine": combine,
        "hybridflow.engine.kernels.experts.biased_experts.bias_clamped_swiglu": bias_clamped_swiglu,
        "hybridflow.engine.kernels.experts.biased_grouped.biased_gate_up": biased_gate_up,
        "hybridflow.engine.kernels.experts.biased_grouped.biased_down": biased_down,
    }  # fmt: skip
    for target, stand_in in patches.items():
        stack.enter_context(mock.patch(target, stand_in))
    return stack
