"""The flash varlen path under torch.compile, traced on meta tensors (no GPU needed).

The trace runs in a fresh interpreter: it resets Dynamo, which is process-wide state that
compiled functions of other tests in the same worker (and any thread they left running)
share, and those in turn can break this trace."""

import json
import subprocess
import sys
import textwrap

import pytest

TRACE = textwrap.dedent(
    """
    import json, sys
    import torch
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from hybridflow.models.attention import flash_varlen_attention

    deterministic = sys.argv[1] == "True"
    graphs = {}

    def keep_backward(gm, example_inputs):
        graphs["backward"] = gm
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm), bw_compiler=keep_backward)
    attend = torch.compile(flash_varlen_attention, backend=backend, fullgraph=True, dynamic=True)
    # Two calls of different lengths under dynamic shapes: the second reuses the symbolic graph.
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
    graph = graphs["backward"].graph
    inputs = [node.meta["val"] for node in graph.nodes if node.op == "placeholder"]
    opaque = torch.ops.hybridflow.deterministic_flash_backward.default
    print(json.dumps({
        "uint64_inputs": [t.dtype for t in inputs if isinstance(t, torch.Tensor)].count(torch.uint64),
        "opaque_calls": len(graph.find_nodes(op="call_function", target=opaque)),
    }))
    """
)


def _traced_backward(deterministic: bool) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", TRACE, str(deterministic)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("deterministic", [True, False])
def test_flash_varlen_backward_carries_no_rng_state(deterministic):
    """Dropout is 0, so the kernel never reads the forward's RNG state (uint64 seed and offset):
    none is saved for the backward, nor passed to the opaque deterministic op."""
    traced = _traced_backward(deterministic)
    assert traced["uint64_inputs"] == 0
    assert traced["opaque_calls"] == int(deterministic)
