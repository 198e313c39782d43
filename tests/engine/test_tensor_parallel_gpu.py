"""On 2 GPUs over NCCL: the 3D-HybridEngine reshard of qwen2.5-0.5b from FSDP2 over both GPUs
(fp32 masters) into a rollout engine of TP = 2 (bf16 and fp32 shards), and that engine's
decoding. The CPU tests (tests/engine/test_reshard.py, test_tensor_parallel.py) prove the
same over gloo on the tiny preset; this one runs NCCL's all-to-all and all-reduces on CUDA
tensors, the eager decode path's all-reduces and their capture in CUDA graphs.

    pytest -m gpu tests/engine/test_tensor_parallel_gpu.py   # 2 GPUs

Checked: every engine parameter is its slice of the full model, the bytes each GPU
receives are the plan's (parallel/reshard_plan.py), no bucket's buffers pass the bucket
size (half of what a GPU sends and receives); an fp32 TP = 2 engine draws the greedy tokens
of one GPU with the whole fp32 model, and with CUDA graphs the tokens it draws eagerly.
The same code runs on CPU processes over gloo, from tests/engine:
``python -c 'import test_tensor_parallel_gpu as t; t.run("cpu", "tiny")'``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_ranks import join_group, leave_group

pytestmark = pytest.mark.gpu

PRESET = "qwen2.5-0.5b"  # 14 heads, 2 KV heads: TP = 2 gets whole KV heads
PROMPTS = [[151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30], [9707, 11, 1879],
           [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]]  # fmt: skip


def _reshard(model, rollout, dtype, device, bucket_bytes: int) -> tuple[dict, object]:
    """FSDP2 over the world, then the reshard into a TP engine shard of ``dtype``."""
    from torch.distributed.fsdp import fully_shard

    from hybridflow.engine.reshard import Resharder
    from hybridflow.engine.tensor_parallel import tensor_parallel_model
    from hybridflow.parallel.layout import build_mesh, train_layout
    from hybridflow.parallel.reshard_plan import parameter_shapes, rollout_blocks

    mesh = build_mesh(train_layout(dist.get_world_size()), device.type)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh.submesh("fsdp"))
    fully_shard(model, mesh=mesh.submesh("fsdp"))
    group = build_mesh(rollout, device.type).group("tp")
    engine_model = tensor_parallel_model(model.config, group, dtype, device)
    targets = dict(engine_model.named_parameters())
    shapes = dict(parameter_shapes(model.config))
    blocks = {name: rollout_blocks(name, shapes[name], rollout)[dist.get_rank()]
              for name in targets}  # fmt: skip
    sources = dict(model.named_parameters())
    stats = Resharder(sources, targets, blocks, bucket_bytes=bucket_bytes).run(sources)
    return stats, engine_model


def _load(preset: str, device) -> torch.nn.Module:
    """The preset (a fixed seed) with a wider embedding (std 0.3, tied to the head): peaked
    logits, so that the greedy tokens have no near ties that rounding could flip."""
    from hybridflow.models import load_model

    model = load_model(preset, dtype=torch.float32, device=device)
    generator = torch.Generator().manual_seed(1)
    embedding = model.model.embed_tokens.weight
    with torch.no_grad():
        embedding.copy_(torch.randn(embedding.shape, generator=generator) * 0.3)
    return model


def _tokens(model, vocab: int, **options) -> list[list[int]]:
    from hybridflow.engine import Engine, EngineOptions, SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    engine = Engine(model, 8, 256, options=EngineOptions(decode_backend="torch", **options))
    prompts = [[token % vocab for token in prompt] for prompt in PROMPTS]
    return [c.token_ids for c in engine.generate(prompts, params)]


def _check_traffic(stats, planned, device, bucket_bytes: int) -> None:
    """The most any rank received and sent are the plan's; buckets as asked."""
    most = torch.tensor([stats.bytes_received, stats.bytes_sent], device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    assert most.tolist() == [planned.received, planned.sent], (stats, planned)
    assert 0 < stats.peak_buffer_bytes <= bucket_bytes and stats.buckets >= 2, stats


def _worker(rank: int, world: int, port: int, device_type: str, preset: str) -> None:
    from hybridflow.engine.tensor_parallel import local_shard
    from hybridflow.parallel.layout import rollout_layout, train_layout
    from hybridflow.parallel.reshard_plan import reshard_traffic

    device = join_group(rank, world, port, device_type)
    try:
        train, rollout = train_layout(world), rollout_layout(world, tp=world)
        whole = _load(preset, device).eval()
        vocab = whole.config.vocab_size
        full = {name: p.detach().clone() for name, p in whole.named_parameters()}
        expected = _tokens(whole.requires_grad_(False), vocab, cuda_graphs=False)  # one GPU
        del whole
        for dtype in (torch.bfloat16, torch.float32):
            model = _load(preset, device)
            planned = reshard_traffic(model.config, train, rollout,
                                      element_bytes=torch.finfo(dtype).bits // 8)  # fmt: skip
            bucket_bytes = planned.sent  # half of a sync's send + receive: several buckets
            stats, engine_model = _reshard(model, rollout, dtype, device, bucket_bytes)
            for name, param in engine_model.named_parameters():
                want = local_shard(name, full[name], dist.get_rank(), world).to(dtype)
                assert torch.equal(param, want), name
            _check_traffic(stats, planned, device, bucket_bytes)
            if dtype == torch.float32:
                eager = _tokens(engine_model, vocab, cuda_graphs=False)
                assert eager == expected
                if device_type == "cuda":  # the all-reduces captured in the decode graphs
                    assert _tokens(engine_model, vocab, cuda_graphs=True) == eager
            del model, engine_model
        dist.barrier()
    finally:
        leave_group()


def run(device_type: str = "cuda", preset: str = PRESET, world: int = 2) -> None:
    """Spawn ``world`` ranks (``device_type`` cpu: gloo, a smoke run of this test's code)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(world, port, device_type, preset), nprocs=world,
                       start_method="spawn")  # fmt: skip


def test_two_gpu_reshard_and_tensor_parallel_decode_match_one_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run()
