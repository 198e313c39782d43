"""On 2 GPUs over NCCL: the tensor-parallel engine on the triton backend (the split layer's
fused kernels on each GPU's shard, NCCL all-reduces after o_proj and down_proj) draws the
greedy tokens of one GPU's triton engine with the whole model, in fp32 (qwen2.5-0.5b: 14
heads and 2 KV heads, 7 and 1 a GPU), eagerly and with the all-reduces captured in the decode
graphs; decode_backend="auto" picks triton for the shard.

    pytest -m gpu tests/engine/test_tensor_parallel_fused_gpu.py   # 2 GPUs

The CPU test (tests/engine/test_tensor_parallel_fused.py) proves the same over gloo under
TRITON_INTERPRET=1 on the tiny preset, fp8 weights included; this code runs there too, from
tests/engine:
``TRITON_INTERPRET=1 python -c 'import test_tensor_parallel_fused_gpu as t; t.run("cpu", "tiny")'``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_ranks import free_port, join_group, leave_group

pytestmark = pytest.mark.gpu

PRESET = "qwen2.5-0.5b"
PROMPTS = [[151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30], [9707, 11, 1879],
           [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]]  # fmt: skip


def _load(preset: str, device) -> torch.nn.Module:
    """The preset (a fixed seed) in fp32 with a wider embedding (std 0.3, tied to the head):
    peaked logits, so that the greedy tokens have no near ties that rounding could flip."""
    from hybridflow.models import load_model

    model = load_model(preset, dtype=torch.float32, device=device).eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(1)
    embedding = model.model.embed_tokens.weight
    with torch.no_grad():
        embedding.copy_(torch.randn(embedding.shape, generator=generator) * 0.3)
    return model


def _shard(whole, device):
    from hybridflow.engine.tensor_parallel import local_shard, tensor_parallel_model

    rank, world = dist.get_rank(), dist.get_world_size()
    shard = tensor_parallel_model(whole.config, dist.group.WORLD, torch.float32, device)
    with torch.no_grad():
        params = dict(shard.named_parameters())
        for name, tensor in whole.named_parameters():
            params[name].copy_(local_shard(name, tensor, rank, world))
    return shard


def _tokens(model, tokens: int, **options) -> tuple[list[list[int]], str]:
    """(greedy tokens of PROMPTS, the engine's decode backend)."""
    from hybridflow.engine import Engine, EngineOptions, SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)
    engine = Engine(model, 8, 256, options=EngineOptions(**options))
    vocab = model.config.vocab_size
    prompts = [[token % vocab for token in prompt] for prompt in PROMPTS]
    return [c.token_ids for c in engine.generate(prompts, params)], engine.decode_backend


def _worker(rank: int, world: int, port: int, device_type: str, preset: str) -> None:
    device = join_group(rank, world, port, device_type)
    try:
        cuda = device_type == "cuda"
        # auto is torch on the CPU, where the interpreter runs the kernels when asked
        backend, tokens = ("auto", 24) if cuda else ("triton", 4)
        whole = _load(preset, device)
        expected, used = _tokens(whole, tokens, decode_backend=backend, cuda_graphs=False)
        assert used == "triton"
        shard = _shard(whole, device)
        del whole
        eager, used = _tokens(shard, tokens, decode_backend=backend, cuda_graphs=False)
        assert used == "triton" and eager == expected
        if cuda:  # the NCCL all-reduces captured in the decode graphs
            assert _tokens(shard, tokens, decode_backend=backend, cuda_graphs=True)[0] == eager
        dist.barrier()
    finally:
        leave_group()


def run(device_type: str = "cuda", preset: str = PRESET, world: int = 2) -> None:
    """Spawn ``world`` ranks (``device_type`` cpu: gloo, a smoke run of this test's code)."""
    mp.start_processes(_worker, args=(world, free_port(), device_type, preset), nprocs=world,
                       start_method="spawn")  # fmt: skip


def test_two_gpu_tensor_parallel_triton_decode_draws_the_tokens_of_one_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run()
