"""On 2 (and, where there are, 4) GPUs over NCCL: the actor of the tiny mixture of experts
with expert parallelism EP = 2 matches data parallelism over the same GPUs (bf16 compute,
fp32 masters): log-probs, policy loss, gradient norm. On 4 GPUs each expert's weights are
also FSDP2-sharded over the 2 GPUs that hold it. The CPU tests
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
        for name, mesh in (("dp", None), ("ep", build_mesh(train_layout(world, ep=2),
                                                          device_type))):  # fmt: skip
            model = load_model("tiny-moe", dtype=torch.float32, device=device)
            actor = ActorLearner(model, actor_config(**CFG), total_steps=2, device=device,
                                 mesh=mesh)  # fmt: skip
            experts = actor.model.model.layers[1].mlp.experts.gate_up_proj
            local = experts.to_local().shape[0] if hasattr(experts, "to_local") else None
            logprobs = actor.compute_logprobs(batch.index(shard))["old_logprobs"].cpu()
            metrics = actor.update(batch.index(shard))
            results[name] = dict(logprobs=logprobs, metrics=metrics, local_experts=local)
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
    assert ranks[0]["ep"]["local_experts"] == 8 // world
    want = torch.cat([r["dp"]["logprobs"] for r in ranks])
    got = torch.cat([r["ep"]["logprobs"] for r in ranks])
    mask = want != 0
    # bf16 compute on GPUs: log-probs agree to bf16 rounding of the logits (fp32 on the CPU)
    assert (got - want)[mask].abs().max() < 1e-1
    for key in ("pg_loss", "grad_norm"):
        value, reference = ranks[0]["ep"]["metrics"][key], ranks[0]["dp"]["metrics"][key]
        print(f"world {world} ep {key}: {value:.6g} (data parallel {reference:.6g})")
        # a wrong scale or a missing rank's part would be off by ~50%
        assert value == pytest.approx(reference, rel=5e-2, abs=1e-3), key


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_data_parallel_on_gpus(tmp_path, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    run("cuda", world, str(tmp_path))
