"""On 2 GPUs over NCCL: the actor update of qwen2.5-0.5b (bf16 compute, fp32 masters, the
flash-attention varlen kernel) with Ulysses SP = 2 and with TP = 2 matches data parallelism
over the same 2 GPUs: log-probs, losses and gradient norm. The CPU tests
(tests/learners/test_layouts_cpu.py) prove the same in fp32 over gloo; this one runs the
NCCL all-to-all, the vocab-parallel head and DTensor layers on the GPU.

    pytest -m gpu tests/learners/test_layouts_gpu.py   # 2 GPUs
"""

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu

PRESET = "qwen2.5-0.5b"  # 14 heads, 2 KV heads: SP = 2 and TP = 2 each get whole heads
ROWS, PROMPT, RESPONSE = 16, 64, 192
LAYOUTS = {"dp": {}, "sp": dict(sp=2), "tp": dict(tp=2)}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from learner_helpers import actor_config, make_batch

    from hybridflow.learners import ActorLearner
    from hybridflow.models import load_model
    from hybridflow.parallel import build_mesh, train_layout

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    try:
        batch = make_batch(ROWS, PROMPT, RESPONSE, vocab=151936, seed=31)
        shard = list(range(rank * ROWS // 2, (rank + 1) * ROWS // 2))
        cfg = dict(lr=1e-5, ppo_mini_batch_size=ROWS // 2, max_tokens_per_gpu=2048,
                   grad_clip=1e9, entropy_coeff=0.01)  # fmt: skip
        results = {}
        for name, sizes in LAYOUTS.items():
            mesh = build_mesh(train_layout(world, **sizes), "cuda") if sizes else None
            model = load_model(PRESET, dtype=torch.float32, device=device)
            actor = ActorLearner(model, actor_config(**cfg), total_steps=2, device=device,
                                 mesh=mesh)  # fmt: skip
            logprobs = actor.compute_logprobs(batch.index(shard))["old_logprobs"]
            results[name] = dict(logprobs=logprobs, metrics=actor.update(batch.index(shard)))
            del actor, model
            torch.cuda.empty_cache()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_gpu_sequence_and_tensor_parallel_match_data_parallel(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from gloo_ranks import free_port

    mp.start_processes(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2,
                       start_method="spawn")  # fmt: skip
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    want = torch.cat([r["dp"]["logprobs"] for r in ranks])
    mask = want != 0
    for name in ("sp", "tp"):
        got = torch.cat([r[name]["logprobs"] for r in ranks])
        # bf16 compute: log-probs agree to bf16 rounding of the logits
        assert (got - want)[mask].abs().max() < 1e-1, name
        for key in ("pg_loss", "entropy", "grad_norm"):
            value, reference = ranks[0][name]["metrics"][key], ranks[0]["dp"]["metrics"][key]
            print(f"{name} {key}: {value:.6g} (data parallel {reference:.6g})")
            # a wrong scale or a missing rank's part would be off by ~50%
            assert value == pytest.approx(reference, rel=5e-2, abs=1e-3), (name, key)
