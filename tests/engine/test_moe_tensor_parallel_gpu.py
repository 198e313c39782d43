"""On 2 GPUs over NCCL: a mixture of experts' tensor-parallel engine (tiny-moe), its experts
split over the GPUs (4 of 8 each). The CPU test (tests/engine/test_moe_tensor_parallel.py)
proves the tokens and routes over gloo in fp32 on the torch loop; this one runs NCCL's
all-reduces on CUDA tensors, and in bf16 the grouped-GEMM path (torch._grouped_mm over a
rank's share, the pairs routed elsewhere masked) and the Triton kernels on a share.

    pytest -m gpu tests/engine/test_moe_tensor_parallel_gpu.py   # 2 GPUs

Checked: fp32 greedy tokens and routing record equal one GPU's with the whole model (eager,
and with CUDA graphs the eager tokens); in bf16 each split sparse layer's output, through the
grouped GEMMs and through the Triton kernels, is the whole layer's to bf16 rounding. The same
code runs on CPU processes over gloo, from tests/engine:
``python -c 'import test_moe_tensor_parallel_gpu as t; t.run("cpu")'``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_ranks import join_group, leave_group

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 9, 33, 2, 71], [40, 41], [100, 3, 8, 19, 23, 60, 61, 62, 63, 7]]


def _model(dtype, device):
    from hybridflow.models import build_model
    from hybridflow.models.presets import preset_config

    generator = torch.Generator().manual_seed(2)
    model = build_model(preset_config("tiny-moe"), seed=2).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if not name.endswith("norm.weight"):
            p.normal_(0, 0.3, generator=generator)
    return model.to(device=device, dtype=dtype)


def _shard(whole, dtype, device):
    from hybridflow.engine.tensor_parallel import local_shard, tensor_parallel_model

    rank, world = dist.get_rank(), dist.get_world_size()
    shard = tensor_parallel_model(whole.config, dist.group.WORLD, dtype, device)
    with torch.no_grad():
        params = dict(shard.named_parameters())
        for name, tensor in whole.named_parameters():
            params[name].copy_(local_shard(name, tensor, rank, world))
    return shard


def _generate(model, **options):
    from hybridflow.engine import Engine, EngineOptions, SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    engine = Engine(model, 4, 64, options=EngineOptions(decode_backend="torch", **options))
    out = engine.generate(PROMPTS, params)
    return [c.token_ids for c in out], [c.routed_experts.tolist() for c in out]


def _split_layers_match(device) -> None:
    """bf16: a split sparse layer (grouped GEMMs on CUDA, the Triton kernels) = the whole one."""
    from hybridflow.engine.layers.moe import experts_torch, experts_triton

    whole = _model(torch.bfloat16, device)
    shard = _shard(whole, torch.bfloat16, device)
    x = torch.randn(64, whole.config.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.to(device=device, dtype=torch.bfloat16)
    expected = experts_torch(whole.model.layers[1].mlp, x, None, 0).float()
    paths = [experts_torch]
    if device.type == "cuda":  # (the interpreter does not round bf16 as CUDA does)
        paths.append(experts_triton)
    for path in paths:
        got = path(shard.model.layers[1].mlp, x, None, 0).float()
        # each rank's part rounded to bf16 before the sum: a rounding step of the whole's scale
        error = ((got - expected).norm() / expected.norm()).item()
        assert error < 1e-2, (path.__name__, error)


def _worker(rank: int, world: int, port: int, device_type: str) -> None:
    device = join_group(rank, world, port, device_type)
    try:
        whole = _model(torch.float32, device)
        expected = _generate(whole, cuda_graphs=False)  # one GPU, the whole model
        shard = _shard(whole, torch.float32, device)
        assert shard.model.layers[1].mlp.experts.gate_up_proj.shape[0] == 8 // world
        eager = _generate(shard, cuda_graphs=False)
        assert eager == expected
        if device_type == "cuda":  # the sparse layers' all-reduces captured in the graphs
            assert _generate(shard, cuda_graphs=True) == eager
        _split_layers_match(device)
        dist.barrier()
    finally:
        leave_group()


def run(device_type: str = "cuda", world: int = 2) -> None:
    """Spawn ``world`` ranks (``device_type`` cpu: gloo, a smoke run of this test's code)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(world, port, device_type), nprocs=world,
                       start_method="spawn")  # fmt: skip


def test_two_gpu_moe_tensor_parallel_decode_matches_one_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run("cuda")
