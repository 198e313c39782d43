"""`python benchmarks/weight_sync.py`: what one weight sync into a tensor-parallel rollout moves and costs.

    python benchmarks/weight_sync.py [--model qwen2.5-0.5b] [--world 2] [--train-tp 1]
                                 [--rollout-tp 2] [--bucket-mb 256] [--repeats 3] [--device cpu]

Starts `--world` processes joined by gloo (`--device cpu`) or NCCL (`--device cuda`, one GPU
each). Each builds its FSDP2 shard of `--model`'s
training weights (tensor-parallel first with `--train-tp`; random values, no whole model
anywhere) and its shard of a tensor-parallel engine of `--rollout-tp` ranks, both bf16
(what both ways put on the wire on a GPU: FSDP2 gathers in its bf16 param_dtype, the
reshard casts fp32 masters before sending), then syncs the one into the other `--repeats`
times two ways:

- reshard: engine/reshard.py, each rank receiving only the blocks of its rollout shard that
  other ranks hold, one all_to_all per bucket of at most `--bucket-mb`;
- gather: what a sync without it does (the data-parallel rollout's today), every parameter
  all-gathered whole on every rank in turn (DTensor.full_tensor), its slice copied.

Per way, the largest over ranks of: MiB received, MiB sent, the transient MiB (the reshard's
largest bucket buffers; the gather's largest whole tensor), and the median seconds of a sync;
with the plan's figure (parallel/reshard_plan.reshard_traffic) beside the measured one.
Over gloo on CPU cores the seconds are the host's memory and loopback speed, not NVLink's.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MIB = 2**20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sharded_training_model(preset: str, train, device: str):
    """This rank's FSDP2 (+ TP) shards of the model, materialised shard by shard (meta
    first, so no rank ever holds the whole model)."""
    from torch.distributed.fsdp import fully_shard

    from hybridflow.models.llama import CausalLM
    from hybridflow.models.presets import preset_config
    from hybridflow.models.sharding.tensor_parallel import parallelize_decoder
    from hybridflow.parallel.layout import build_mesh

    mesh = build_mesh(train, torch.device(device).type)
    with torch.device("meta"):
        model = CausalLM(preset_config(preset)).to(torch.bfloat16)
    if train.tp > 1:
        parallelize_decoder(model, mesh.submesh("tp"))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh.submesh("fsdp"))
    fully_shard(model, mesh=mesh.submesh("fsdp"))
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(dist.get_rank())
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().normal_(0, 0.02, generator=generator)
    return model


def gather_sync(model, targets: dict, rank_in_group: int, size: int) -> tuple[int, int]:
    """Every parameter whole on every rank, one at a time -> (bytes received, largest)."""
    from hybridflow.engine.tensor_parallel import local_shard

    received = largest = 0
    for name, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        targets[name].copy_(local_shard(name, full, rank_in_group, size))
        own = param.to_local().numel() if hasattr(param, "to_local") else full.numel()
        received += (full.numel() - own) * full.element_size()
        largest = max(largest, full.numel() * full.element_size())
    return received, largest


def ranks_main(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        args.device = f"cuda:{rank}"
    dist.init_process_group("nccl" if args.device != "cpu" else "gloo", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        queue.put(measure(args, world))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(args, world: int) -> dict:
    from hybridflow.engine.reshard import Resharder
    from hybridflow.engine.tensor_parallel import tensor_parallel_model
    from hybridflow.models.presets import preset_config
    from hybridflow.parallel.layout import build_mesh, rollout_layout, train_layout
    from hybridflow.parallel.reshard_plan import parameter_shapes, rollout_blocks

    train = train_layout(world, tp=args.train_tp)
    rollout = rollout_layout(world, tp=args.rollout_tp)
    model = sharded_training_model(args.model, train, args.device)
    tp_mesh = build_mesh(rollout, torch.device(args.device).type)
    engine_model = tensor_parallel_model(preset_config(args.model), tp_mesh.group("tp"),
                                         torch.bfloat16, args.device)  # fmt: skip
    targets = dict(engine_model.named_parameters())
    shapes = dict(parameter_shapes(preset_config(args.model)))
    rank = dist.get_rank()
    blocks = {name: rollout_blocks(name, shapes[name], rollout)[rank] for name in targets}
    sources = dict(model.named_parameters())
    resharder = Resharder(sources, targets, blocks, bucket_bytes=args.bucket_mb * MIB)
    result = {"reshard": [], "gather": []}
    stats = None
    cuda = args.device != "cpu"
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        stats = resharder.run(dict(model.named_parameters()))
        if cuda:
            torch.cuda.synchronize()
        result["reshard"].append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        gathered, largest = gather_sync(model, targets, tp_mesh.rank_in("tp"), args.rollout_tp)
        if cuda:
            torch.cuda.synchronize()
        result["gather"].append(time.perf_counter() - start)
    result.update(rank=rank, received=stats.bytes_received, sent=stats.bytes_sent,
                  kept=stats.bytes_kept, peak=stats.peak_buffer_bytes, buckets=stats.buckets,
                  gathered=gathered, largest=largest)  # fmt: skip
    return result


def table(args, world: int, per_rank: list[dict]) -> str:
    from hybridflow.models.presets import preset_config
    from hybridflow.parallel.layout import rollout_layout, train_layout
    from hybridflow.parallel.reshard_plan import reshard_traffic

    plan = reshard_traffic(preset_config(args.model), train_layout(world, tp=args.train_tp),
                           rollout_layout(world, tp=args.rollout_tp), element_bytes=2)  # fmt: skip

    def most(key):
        return max(r[key] for r in per_rank) / MIB

    def seconds(way):
        return statistics.median(max(r[way][i] for r in per_rank) for i in range(args.repeats))

    header = ("| way | MiB received | plan | MiB sent | transient MiB | buckets | s a sync |\n"
              "|---|---|---|---|---|---|---|")  # fmt: skip
    rows = [
        f"| reshard | {most('received'):.3f} | {plan.received / MIB:.3f} | {most('sent'):.3f} | "
        f"{most('peak'):.3f} | {per_rank[0]['buckets']} | {seconds('reshard'):.3f} |",
        f"| gather | {most('gathered'):.3f} | {plan.gathered / MIB:.3f} | "
        f"{most('gathered'):.3f} | {most('largest'):.3f} | - | {seconds('gather'):.3f} |",
    ]
    link = "NCCL GPUs" if args.device == "cuda" else "gloo CPU processes"
    title = (f"{args.model}: training FSDP2 {world // args.train_tp} x TP {args.train_tp} -> "
             f"rollout TP {args.rollout_tp} x DP {world // args.rollout_tp}, {world} {link}; "
             f"rollout shard {plan.rollout_shard / MIB:.3f} MiB a rank, "
             f"{plan.kept / MIB:.3f} MiB of it kept locally")  # fmt: skip
    return "\n".join([title, "", header, *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--train-tp", type=int, default=1)
    parser.add_argument("--rollout-tp", type=int, default=2)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(ranks_main, args=(args.world, free_port(), args, queue),
                       nprocs=args.world, start_method="spawn")  # fmt: skip
    per_rank = sorted((queue.get() for _ in range(args.world)), key=lambda r: r["rank"])
    print(table(args, args.world, per_rank))


if __name__ == "__main__":
    main()
