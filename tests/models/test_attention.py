"""The flash varlen path under torch.compile, traced on meta tensors (no GPU needed)."""

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from hybridflow.models.attention import flash_varlen_attention


def _compiled_backward_graph(deterministic: bool) -> torch.fx.GraphModule:
    """The backward graph AOT autograd builds for flash_varlen_attention, after two calls of
    different lengths under dynamic shapes (the second reuses the symbolic graph)."""
    graphs = {}

    def keep_backward(gm, example_inputs):
        graphs["backward"] = gm
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm), bw_compiler=keep_backward)
    torch._dynamo.reset()
    attend = torch.compile(flash_varlen_attention, backend=backend, fullgraph=True, dynamic=True)
    for lengths in ([5, 7], [3, 9, 4]):
        n = sum(lengths)
        cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        cu_seqlens = cu_seqlens.to("meta", torch.int32)
        q, k, v = (
            torch.randn(n, heads, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
            for heads in (4, 2, 2)
        )
        attend(q, k, v, cu_seqlens, max(lengths), deterministic).sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape
    torch._dynamo.reset()
    return graphs["backward"]


@pytest.mark.parametrize("deterministic", [True, False])
def test_flash_varlen_backward_carries_no_rng_state(deterministic):
    """Dropout is 0, so the kernel never reads the forward's RNG state (uint64 seed and offset):
    none is saved for the backward, nor passed to the opaque deterministic op."""
    graph = _compiled_backward_graph(deterministic).graph
    inputs = [node.meta["val"] for node in graph.nodes if node.op == "placeholder"]
    assert [t.dtype for t in inputs if isinstance(t, torch.Tensor)].count(torch.uint64) == 0
    opaque = torch.ops.hybridflow.deterministic_flash_backward.default
    assert len(graph.find_nodes(op="call_function", target=opaque)) == int(deterministic)
