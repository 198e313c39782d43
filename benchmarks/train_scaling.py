"""`python benchmarks/train_scaling.py --gpus 1 2`: actor-update tokens/s/GPU, scaling, memory.

    python benchmarks/train_scaling.py --model qwen2.5-0.5b --gpus 1 2

Each GPU gets the same work (``--rows-per-gpu`` sequences of random prompt/response lengths,
packed into micro-batches of at most ``--max-tokens`` tokens, balanced over ranks with
Karmarkar–Karp); one ``ActorLearner.update`` = ``--minis`` AdamW steps. Reported: real
(non-padding) tokens trained per second per GPU, scaling efficiency against the 1-GPU FSDP run
(same code path, 1 rank), and peak allocated memory per GPU, with and without optimizer-state
offload (one GPU: the step on the host). fp32 master weights, bf16 compute. Prints a markdown
table; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def make_global_batch(rows: int, prompt_len: int, response_len: int, vocab: int, seed: int):
    """Left-padded prompts (lengths U[prompt/4, prompt]), right-padded responses (U[R/8, R])."""
    from hybridflow.protocol import Batch

    g = torch.Generator().manual_seed(seed)
    old_logprob = 0.5 - math.log(vocab)
    prompts = torch.randint(10, vocab, (rows, prompt_len), generator=g)
    responses = torch.randint(10, vocab, (rows, response_len), generator=g)
    p_len = torch.randint(prompt_len // 4, prompt_len + 1, (rows,), generator=g)
    r_len = torch.randint(response_len // 8, response_len + 1, (rows,), generator=g)
    p_mask = torch.arange(prompt_len)[None] >= (prompt_len - p_len)[:, None]
    r_mask = torch.arange(response_len)[None] < r_len[:, None]
    return Batch(
        {
            "prompts": prompts * p_mask,
            "responses": responses * r_mask,
            "attention_mask": torch.cat([p_mask, r_mask], 1).long(),
            "response_mask": r_mask.float(),
            "advantages": torch.randn(rows, response_len, generator=g) * r_mask,
            # Near a random-weight model's own log-probs (-log V): ratios stay about 1, so
            # the PPO clip leaves the gradient non-zero at every vocabulary size.
            "old_logprobs": (old_logprob - torch.rand(rows, response_len, generator=g)) * r_mask,
        }
    )


def run_config(
    args, world: int, rank: int, device, name: str, fsdp, optimizer_offload: bool, zero3: bool
):
    from hybridflow.config import ActorConfig
    from hybridflow.learners import ActorLearner, balanced_dp_order
    from hybridflow.learners.packing import sequence_lengths
    from hybridflow.models import load_model

    rows_total = args.rows_per_gpu * world
    vocab = 128 if args.model.startswith("tiny") else 151936
    batch = make_global_batch(rows_total, args.prompt_len, args.response_len, vocab, seed=7)
    order = balanced_dp_order(sequence_lengths(batch["attention_mask"]), world)
    shard = batch.index(order[rank * args.rows_per_gpu : (rank + 1) * args.rows_per_gpu])
    cfg = ActorConfig(
        lr=1e-6,
        ppo_mini_batch_size=rows_total // args.minis,
        max_tokens_per_gpu=args.max_tokens,
        optimizer_offload=optimizer_offload,
    )
    model = load_model(args.model, dtype=torch.float32, device=device)
    model.enable_gradient_checkpointing(args.grad_ckpt)
    actor = ActorLearner(model, cfg, total_steps=100, device=device, fsdp=fsdp)
    actor.core.accumulate_unsharded = not zero3
    actor.update(shard)  # warm-up: kernels, allocator, optimizer state
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        metrics = actor.update(shard)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if args.profile and rank == 0 and cuda:
        # One more update under the profiler (after the timed ones): where the time goes.
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            actor.update(shard)
        safe = name.replace(" ", "_").replace("(", "").replace(")", "").replace("+", "_")
        prof.export_chrome_trace(os.path.join(args.profile, f"trace_{world}gpu_{safe}.json"))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    elif args.profile and world > 1:
        actor.update(shard)  # the other ranks join the profiled update's collectives
    tokens = int(shard["attention_mask"].sum()) * args.steps
    stats = torch.tensor(
        [tokens / elapsed, torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0, elapsed],
        dtype=torch.float64,
        device=device,
    )
    gathered = [torch.zeros_like(stats) for _ in range(world)]
    if world > 1:
        dist.all_gather(gathered, stats)
    else:
        gathered = [stats]
    del actor, model
    gc.collect()  # drop this config's weights and optimizer state before the next one
    if cuda:
        torch.cuda.empty_cache()
    rates = [float(s[0]) for s in gathered]
    return {
        "config": name,
        "gpus": world,
        "fsdp": bool(fsdp) if fsdp is not None else False,
        "optimizer_offload": optimizer_offload,
        "tokens_per_s_per_gpu": sum(rates) / world,
        "min_rank_tokens_per_s": min(rates),
        "peak_alloc_gib_max_rank": max(float(s[1]) for s in gathered),
        "seconds_per_update": max(float(s[2]) for s in gathered) / args.steps,
        "tokens_per_gpu_per_update": tokens / args.steps,
        "grad_norm": metrics["grad_norm"],
    }


def collective_bandwidth(world: int, device, mib: int = 512, repeats: int = 5) -> dict:
    """Bus bandwidth (GB/s, NCCL-tests convention: bytes × (n-1)/n / time) of the two FSDP2
    collectives: all-gather of bf16 parameter shards and reduce-scatter of fp32 gradients."""
    numel = mib * 2**20 // 4
    shard = torch.randn(numel // world, device=device)
    full = torch.empty(numel, device=device)
    out = {}
    for name, run in (
        ("all_gather_GBps", lambda: dist.all_gather_into_tensor(full, shard)),
        ("reduce_scatter_GBps", lambda: dist.reduce_scatter_tensor(shard, full)),
    ):
        run()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / repeats
        out[name] = numel * 4 * (world - 1) / world / seconds / 1e9
    return out


def worker(rank: int, world: int, port: int, args, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    if torch.cuda.is_available():
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        if args.share_cores:
            from hybridflow.controller.worker import share_host_cores

            share_host_cores(world)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:  # CPU smoke run of the script itself (--model tiny)
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        configs = [
            ("unsharded (autocast)", False, False, False),
            ("fsdp", True, False, False),
            ("unsharded+optimizer_offload", False, True, False),
            ("fsdp zero3-per-micro-batch", True, False, True),
        ]
        configs = [c for c in configs if c[0] in args.configs and (world == 1 or c[1])]
        results = []
        if world > 1 and device.type == "cuda":
            bandwidth = collective_bandwidth(world, device)
            if rank == 0:
                print(f"NCCL on {world} GPUs, 512 MiB fp32: {bandwidth}")
        for config in configs:
            try:
                results.append(run_config(args, world, rank, device, *config))
            except Exception as error:  # report and go on: one broken variant keeps the rest
                results.append({"config": config[0], "gpus": world, "error": repr(error)[:300]})
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
        dist.barrier()  # no rank tears gloo/NCCL down while another still talks
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows-per-gpu", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--response-len", type=int, default=1536)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--minis", type=int, default=2, help="optimizer steps per update")
    parser.add_argument("--steps", type=int, default=2, help="timed updates")
    parser.add_argument("--grad-ckpt", action="store_true")
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["unsharded (autocast)", "fsdp", "unsharded+optimizer_offload"],
        help="any of: 'unsharded (autocast)' (1 GPU only), fsdp, 'unsharded+optimizer_offload' "
        "(1 GPU only: masters and AdamW on the host), "
        "'fsdp zero3-per-micro-batch' (reshard and reduce-scatter after every micro-batch)",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--no-share-cores", dest="share_cores", action="store_false",
        help="keep torch's default CPU threads per rank (all cores each)",
    )  # fmt: skip
    parser.add_argument("--profile", default=None, help="directory for chrome traces (rank 0)")
    args = parser.parse_args()

    rows = []
    for world in args.gpus:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            out_path = tmp.name
        mp.start_processes(
            worker, args=(world, port, args, out_path), nprocs=world, start_method="spawn"
        )
        with open(out_path) as f:
            rows += json.load(f)
    ok = [r for r in rows if "error" not in r]
    base = next((r for r in ok if r["gpus"] == 1 and r["config"] == "fsdp"), None)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    print(f"\nmodel {args.model}, {gpu}, {args.rows_per_gpu} seqs/GPU")
    print(
        "| GPUs | config | tokens/s/GPU | scaling eff. | peak alloc GiB/GPU | s/update | tokens/GPU/update |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['gpus']} | {r['config']} | failed: {r['error']} | | | | |")
            continue
        eff = ""
        if base and r["config"].startswith("fsdp") and r["gpus"] > 1:
            same = next((b for b in rows if b["gpus"] == 1 and b["config"] == r["config"]), base)
            eff = f"{100 * r['tokens_per_s_per_gpu'] / same['tokens_per_s_per_gpu']:.1f}%"
        print(
            f"| {r['gpus']} | {r['config']} | {r['tokens_per_s_per_gpu']:,.0f} | {eff} | "
            f"{r['peak_alloc_gib_max_rank']:.1f} | {r['seconds_per_update']:.2f} | "
            f"{r['tokens_per_gpu_per_update']:,.0f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
