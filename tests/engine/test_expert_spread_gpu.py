"""On 2 GPUs over NCCL: the rollout's experts spread over two replicas of one GPU each
(engine/expert_spread.py; tiny-moe, 4 of the 8 experts a GPU). The CPU test
(tests/engine/test_expert_spread.py) proves tokens and routes over gloo in fp32 on the
torch loop; this one runs NCCL's uneven all-to-all and the rounds' all-reduce on CUDA
tensors, in fp32 and through the grouped GEMMs in bf16, on the torch backend and on the
fused layers (the triton backend: each rank's experts on the grouped Triton kernels).

    pytest -m gpu tests/engine/test_expert_spread_gpu.py   # 2 GPUs

Checked: each replica generates its own prompts with budgets that differ (so one replica
serves the other's experts after its own end); in fp32 the greedy tokens and routing record
of each are one GPU's with the whole model on the same backend; in bf16 the spread run draws as many tokens as
asked. The same code runs on CPU processes over gloo, from tests/engine:
``python -c 'import test_expert_spread_gpu as t; t.run("cpu")'``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_ranks import join_group, leave_group
from test_moe_tensor_parallel_gpu import PROMPTS, _model

pytestmark = pytest.mark.gpu

BUDGETS = [4, 16, 9]


def _spread(whole, dtype, device):
    from hybridflow.engine.expert_spread import expert_parallel_model, spread_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    shard = expert_parallel_model(whole.config, dist.group.WORLD, None, dtype, device)
    with torch.no_grad():
        params = dict(shard.named_parameters())
        for name, tensor in whole.named_parameters():
            params[name].copy_(spread_shard(name, tensor, rank, world))
    return shard


def _generate(model, prompts, budgets, backend: str):
    from hybridflow.engine import Engine, EngineOptions, SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    engine = Engine(model, 4, 64, options=EngineOptions(decode_backend=backend))
    assert engine.decode_backend == backend and not engine.cuda_graphs
    out = engine.generate(prompts, params, max_new_tokens=budgets)
    return [c.token_ids for c in out], [c.routed_experts.tolist() for c in out]


def _worker(rank: int, world: int, port: int, device_type: str) -> None:
    device = join_group(rank, world, port, device_type)
    try:
        mine = list(range(rank, len(PROMPTS), world))  # rank 0: prompts 0 and 2; rank 1: 1
        prompts, budgets = [PROMPTS[i] for i in mine], [BUDGETS[i] for i in mine]
        # the fused layers' grouped Triton kernels on the GPU, the torch loop everywhere
        backends = ("torch", "triton") if device_type == "cuda" else ("torch",)
        for dtype in (torch.float32, torch.bfloat16):
            whole = _model(dtype, device)
            spread = _spread(whole, dtype, device)
            assert spread.model.layers[1].mlp.experts.gate_up_proj.shape[0] == 8 // world
            for backend in backends:
                tokens, routes = _generate(spread, prompts, budgets, backend)
                assert [len(t) for t in tokens] == budgets
                if dtype == torch.float32:
                    assert (tokens, routes) == _generate(whole, prompts, budgets, backend)
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


def test_two_gpu_replicas_with_spread_experts_draw_one_gpus_tokens():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run("cuda")
