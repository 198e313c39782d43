"""On 2 (and, where there are, 4) GPUs over NCCL: the actor of the tiny mixture of experts
with expert parallelism EP = 2 matches data parallelism over the same GPUs (bf16 compute,
fp32 masters): log-probs, policy loss, gradient norm. On 4 GPUs each expert's weights are
also FSDP2-sharded over the 2 GPUs that hold it. With actor.param_offload the expert shards
sit in host memory (FSDP2's CPU offload) and the update matches too. The CPU tests
(tests/learners/test_expert_parallel_actor.py) prove the same in fp32 over gloo; this one
runs NCCL's uneven all-to-all and the grouped GEMMs on the GPU.

    pytest -m gpu tests/learners/test_expert_parallel_gpu.py   # 2 or 4 GPUs

The same code runs on CPU processes over gloo, from tests/learners:
``python -c 'import test_expert_parallel_gpu as t; t.run("cpu", 4)'``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_ranks import join_group, leave_group

pytestmark = pytest.mark.gpu

ROWS, PROMPT, RESPONSE = 16, 32, 64
# no router losses: they pool the tokens of an EP group (not of one rank's micro-batch), so
# they differ from data parallelism by design (docs/parallelism.md, "Expert parallelism")
CFG = dict(lr=1e-4, ppo_mini_batch_size=ROWS // 2, micro_batch_size_per_gpu=4,
           router_aux_loss_coef=0.0, router_z_loss_coef=0.0, grad_clip=1e9)  # fmt: skip


def _worker(rank: int, world: int, port: int, out_dir: str, device_type: str) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from learner_helpers import actor_config, make_batch

    from hybridflow.learners import ActorLearner
    from hybridflow.models import load_model
    from hybridflow.parallel import build_mesh, train_layout

    device = join_group(rank, world, port, device_type)
    try:
        batch = make_batch(ROWS, PROMPT, RESPONSE, vocab=128, seed=31)
        shard = list(range(rank * ROWS // world, (rank + 1) * ROWS // world))
        results = {}
        ep_mesh = build_mesh(train_layout(world, ep=2), device_type)
        for name, mesh, offload in (("dp", None, False), ("ep", ep_mesh, False),
                                    ("ep_offload", ep_mesh, True)):  # fmt: skip
            model = load_model("tiny-moe", dtype=torch.float32, device=device)
            actor = ActorLearner(model, actor_config(**CFG, param_offload=offload),
                                 total_steps=2, device=device, mesh=mesh)  # fmt: skip
            experts = actor.model.model.layers[1].mlp.experts.gate_up_proj
            local = experts.to_local() if hasattr(experts, "to_local") else None
            logprobs = actor.compute_logprobs(batch.index(shard))["old_logprobs"].cpu()
            metrics = actor.update(batch.index(shard))
            results[name] = dict(logprobs=logprobs, metrics=metrics,
                                 local_experts=None if local is None else local.shape[0],
                                 expert_device=None if local is None else local.device.type)  # fmt: skip
            del actor, model
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        leave_group()


def run(device_type: str, world: int, out_dir: str) -> None:
    """Spawn ``world`` ranks and check them (``device_type`` cpu: gloo)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from gloo_ranks import free_port

    mp.start_processes(_worker, args=(world, free_port(), out_dir, device_type), nprocs=world,
                       start_method="spawn")  # fmt: skip
    ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True)
             for r in range(world)]  # fmt: skip
    # 8 experts, 4 per EP rank; with 4 ranks FSDP2 halves each rank's 4 again
    assert ranks[0]["ep"]["local_experts"] == ranks[0]["ep_offload"]["local_experts"] == 8 // world
    # param_offload: FSDP2 keeps the expert shards on the host (learners/sharding/expert_shard.py)
    assert ranks[0]["ep_offload"]["expert_device"] == "cpu"
    assert ranks[0]["ep"]["expert_device"] == device_type
    want = torch.cat([r["dp"]["logprobs"] for r in ranks])
    mask = want != 0
    for name in ("ep", "ep_offload"):
        got = torch.cat([r[name]["logprobs"] for r in ranks])
        # bf16 compute on GPUs: log-probs agree to bf16 rounding of the logits (fp32 on the CPU)
        assert (got - want)[mask].abs().max() < 1e-1
        for key in ("pg_loss", "grad_norm"):
            value, reference = ranks[0][name]["metrics"][key], ranks[0]["dp"]["metrics"][key]
            print(f"world {world} {name} {key}: {value:.6g} (data parallel {reference:.6g})")
            # a wrong scale or a missing rank's part would be off by ~50%
            assert value == pytest.approx(reference, rel=5e-2, abs=1e-3), (name, key)


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_data_parallel_on_gpus(tmp_path, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    run("cuda", world, str(tmp_path))
