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
