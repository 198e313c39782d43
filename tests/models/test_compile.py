"""A decoder layer traces into one graph (no graph breaks) on the CUDA packed attention path."""

import torch
from model_helpers import small_config

from hybridflow.models.attention import make_packed_attention
from hybridflow.models.llama import CausalLM
from hybridflow.models.rope import rope_cos_sin


def _run_compiled_layer(device: str, backend: str, dtype: torch.dtype) -> None:
    config = small_config("qwen3", head_dim=16)
    with torch.device(device):
        layer = CausalLM(config).to(dtype).model.layers[0]
    torch._dynamo.reset()
    # fullgraph=True raises on any graph break; aot_eager traces fwd+bwd without codegen.
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=True)
    for lengths in ([5, 7], [3, 9, 4]):
        n = sum(lengths)
        cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
        cu_seqlens = cu_seqlens.to(torch.int32)
        x = torch.randn(n, config.hidden_size, device=device, dtype=dtype, requires_grad=True)
        positions = torch.cat([torch.arange(k) for k in lengths]).to(device)
        cos, sin = rope_cos_sin(config, positions, dtype)
        attend = make_packed_attention(backend, cu_seqlens, 64, n)
        compiled(x, cos, sin, attend)[0].sum().backward()  # (hidden, routing)
        assert x.grad.shape == x.shape


def test_layer_compiles_without_graph_breaks_flash_varlen_path():
    # The CUDA kernel is traced on meta tensors (its shape rules), no GPU needed.
    _run_compiled_layer("meta", "flash_varlen", torch.bfloat16)


def test_moe_layer_compiles_without_graph_breaks_grouped_gemm_path():
    """The sparse layer's grouped-GEMM path (what CUDA runs) has no host sync or data-dependent
    shape: one graph, forward and backward, bf16 on the CPU."""
    from model_helpers import small_moe_config

    from hybridflow.models.moe import resolve_expert_backend

    config = small_moe_config("qwen3_moe", head_dim=16)
    layer = CausalLM(config).to(torch.bfloat16).model.layers[0]
    layer.mlp.expert_backend = "grouped_mm"
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=True)
    for lengths in ([5, 7], [3, 9, 4]):
        n = sum(lengths)
        cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        x = torch.randn(n, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        positions = torch.cat([torch.arange(k) for k in lengths])
        cos, sin = rope_cos_sin(config, positions, torch.bfloat16)
        attend = make_packed_attention("sdpa_loop", cu_seqlens.to(torch.int32), 16, n)
        compiled(x, cos, sin, attend)[0].sum().backward()
        assert x.grad.shape == x.shape
    cuda = torch.device("cuda")  # the choice only: no GPU needed
    assert resolve_expert_backend("auto", cuda, (32, 16), torch.bfloat16) == "grouped_mm"
    assert resolve_expert_backend("auto", cuda, (32, 16), torch.float32) == "loop"
    assert resolve_expert_backend("auto", cuda, (32, 4), torch.bfloat16) == "loop"  # 8-byte rows
