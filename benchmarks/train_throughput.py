"""`python benchmarks/train_throughput.py`: fwd+bwd tokens/s and MFU, ours packed vs HF padded.

    python benchmarks/train_throughput.py --preset qwen2.5-1.5b --json out.json

Results: docs/performance.md, Training throughput (MFU).

Same random sequences (lengths uniform in [min_len, max_len]) for every variant, grouped in
micro-batches of at most --tokens-per-batch real tokens. Ours runs them packed (no padding);
HF runs each micro-batch as one right-padded batch with sdpa and gradient checkpointing.

FLOPs of one micro-batch (only real tokens count, padding is not useful work):
    model_flops = 6 * (P_nonembed + V*H) * tokens + 6 * n_layers * n_heads * head_dim * sum(L_i^2)
P_nonembed excludes the embedding table; V*H is the lm_head matmul, which runs whether or not
it is tied. The attention term is causal (half of 4*L^2*d per layer forward, x3 for fwd+bwd).
The narrower formula without the lm_head term is reported as mfu_no_lm_head.
MFU = model_flops / time / peak, with peak = 989 TFLOP/s (H100/H200 dense bf16 datasheet);
the measured bf16 matmul ceiling of the same run is printed next to it.

Also measures the packed attention paths alone (fwd+bwd, with a correctness check against
per-sequence SDPA) so the default backend is chosen by measurement.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
import traceback

import torch

from hybridflow.models import build_model, preset_config
from hybridflow.models.attention import make_packed_attention
from hybridflow.models.heads.logprobs import logprobs_from_hidden

PEAK_BF16_FLOPS = 989e12

START = time.perf_counter()
RESULTS: dict = {"sections": {}}


def elapsed() -> float:
    return time.perf_counter() - START


def log(*parts) -> None:
    print(f"[{elapsed():6.1f}s]", *parts, flush=True)


def save(path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(RESULTS, f, indent=2, default=str)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# -- data -------------------------------------------------------------------------------------


def make_micro_batches(args, vocab_size: int) -> list[list[torch.Tensor]]:
    """Random sequences grouped greedily into micro-batches of <= tokens_per_batch tokens."""
    generator = torch.Generator().manual_seed(1234)
    batches, current, used = [], [], 0
    while len(batches) < args.warmup + args.steps:
        length = int(torch.randint(args.min_len, args.max_len + 1, (1,), generator=generator))
        if used + length > args.tokens_per_batch and current:
            batches.append(current)
            current, used = [], 0
        current.append(torch.randint(0, vocab_size, (length,), generator=generator))
        used += length
    return batches


def pack(sequences, device):
    lengths = torch.tensor([len(s) for s in sequences])
    cu_seqlens = torch.zeros(len(sequences) + 1, dtype=torch.int32)
    cu_seqlens[1:] = lengths.cumsum(0)
    return dict(
        input_ids=torch.cat(sequences).to(device),
        position_ids=torch.cat([torch.arange(n) for n in lengths.tolist()]).to(device),
        cu_seqlens=cu_seqlens.to(device),
        max_seqlen=int(lengths.max()),
    )


def model_flops(config, sequences) -> tuple[float, float]:
    tokens = sum(len(s) for s in sequences)
    dense = 6 * config.num_parameters(include_embeddings=False) * tokens
    lm_head = 6 * config.vocab_size * config.hidden_size * tokens
    attn_dim = config.num_attention_heads * config.head_dim
    attention = 6 * config.num_hidden_layers * attn_dim * sum(len(s) ** 2 for s in sequences)
    return dense + lm_head + attention, dense + attention


# -- measurements -----------------------------------------------------------------------------


def measure_matmul(device) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return 2 * 8192**3 * 10 / (time.perf_counter() - t)


def attention_paths(args, device, config, backends: list[str]) -> dict:
    """fwd+bwd time of each packed attention backend on one micro-batch's q/k/v."""
    batch = make_micro_batches(args, config.vocab_size)[0]
    packed = pack(batch, device)
    n = packed["input_ids"].shape[0]
    shape_q = (n, config.num_attention_heads, config.head_dim)
    shape_kv = (n, config.num_key_value_heads, config.head_dim)
    q0 = torch.randn(shape_q, device=device, dtype=torch.bfloat16)
    k0 = torch.randn(shape_kv, device=device, dtype=torch.bfloat16)
    v0 = torch.randn(shape_kv, device=device, dtype=torch.bfloat16)
    grad_out = torch.randn(shape_q, device=device, dtype=torch.bfloat16)

    def run(backend):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        attend = make_packed_attention(backend, packed["cu_seqlens"], packed["max_seqlen"], n)
        out = attend(q, k, v)
        out.backward(grad_out)
        return out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()

    reference = run("sdpa_loop")
    results = {}
    for backend in backends:
        try:
            t0 = time.perf_counter()
            got = run(backend)
            sync(device)
            first_call_s = time.perf_counter() - t0
            errors = [float((a - b).norm() / b.norm()) for a, b in zip(got, reference, strict=True)]
            times = []
            for _ in range(args.attention_repeats):
                sync(device)
                t0 = time.perf_counter()
                run(backend)
                sync(device)
                times.append(time.perf_counter() - t0)
            results[backend] = dict(
                ms=1e3 * statistics.median(times),
                first_call_s=first_call_s,
                rel_err_out_dq_dk_dv=errors,
                correct=max(errors) < 2e-2,
            )
        except Exception as error:  # report and continue: one broken path must not end the run
            results[backend] = dict(error=f"{type(error).__name__}: {error}"[:500])
        log("attention", backend, results[backend])
    return results


def time_steps(step, batches, warmup) -> list[float]:
    times = []
    for i, batch in enumerate(batches):
        sync(DEVICE)
        t0 = time.perf_counter()
        step(batch)
        sync(DEVICE)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def summarize(name, times, batches, config, warmup, peak_mem, matmul_flops) -> dict:
    measured = batches[warmup:]
    tokens = sum(sum(len(s) for s in b) for b in measured)
    flops = [model_flops(config, b) for b in measured]
    total_time = sum(times)
    result = dict(
        variant=name,
        steps=len(times),
        tokens=tokens,
        tokens_per_s=tokens / total_time,
        step_s_median=statistics.median(times),
        tflops=sum(f[0] for f in flops) / total_time / 1e12,
        mfu=sum(f[0] for f in flops) / total_time / PEAK_BF16_FLOPS,
        mfu_no_lm_head=sum(f[1] for f in flops) / total_time / PEAK_BF16_FLOPS,
        fraction_of_measured_matmul=sum(f[0] for f in flops) / total_time / matmul_flops,
        peak_mem_gib=peak_mem / 2**30,
    )
    log(
        name, json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()})
    )
    return result


def ours_variant(args, config, batches, backend, checkpointing, compiled, matmul_flops):
    model = build_model(config, dtype=torch.bfloat16, device=DEVICE).train()
    model.attention_backend = backend
    model.gradient_checkpointing = checkpointing
    if compiled:
        for layer in model.model.layers:
            layer.compile(dynamic=True)
    head = model.lm_head.weight

    def step(sequences):
        packed = pack(sequences, DEVICE)
        if compiled:
            packed["max_seqlen"] = args.max_len  # an upper bound is valid; avoids recompiles
        targets = torch.roll(packed["input_ids"], -1)
        hidden = model.forward_packed(**packed)
        logprobs, _ = logprobs_from_hidden(
            hidden, head, targets, chunk_size=args.chunk_size, fused=args.head == "fused"
        )
        (-logprobs.mean()).backward()

    torch.cuda.reset_peak_memory_stats() if DEVICE.type == "cuda" else None
    times = time_steps(step, batches, args.warmup)
    peak = torch.cuda.max_memory_allocated() if DEVICE.type == "cuda" else 0
    name = (
        f"ours packed {backend}"
        + (" chunked head" if args.head == "chunked" else "")
        + (" +ckpt" if checkpointing else "")
        + (" +compile" if compiled else "")
    )
    return summarize(name, times, batches, config, args.warmup, peak, matmul_flops)


def hf_variant(args, config, batches, checkpointing, matmul_flops):
    import transformers

    hf_config = transformers.AutoConfig.for_model(**config.to_hf())
    with torch.device(DEVICE):
        model = transformers.AutoModelForCausalLM.from_config(
            hf_config, attn_implementation="sdpa", dtype=torch.bfloat16
        )
    model.train()
    model.config.use_cache = False
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    pad = config.pad_token_id or 0

    def step(sequences):
        width = max(len(s) for s in sequences)
        input_ids = torch.full((len(sequences), width), pad, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for i, s in enumerate(sequences):
            input_ids[i, : len(s)], mask[i, : len(s)] = s, 1
        labels = input_ids.masked_fill(mask == 0, -100)
        out = model(
            input_ids=input_ids.to(DEVICE),
            attention_mask=mask.to(DEVICE),
            labels=labels.to(DEVICE),
            use_cache=False,
        )
        out.loss.backward()

    torch.cuda.reset_peak_memory_stats() if DEVICE.type == "cuda" else None
    times = time_steps(step, batches, args.warmup)
    peak = torch.cuda.max_memory_allocated() if DEVICE.type == "cuda" else 0
    name = "HF transformers padded sdpa" + (" +ckpt" if checkpointing else "")
    result = summarize(name, times, batches, config, args.warmup, peak, matmul_flops)
    padded = sum(len(b) * max(len(s) for s in b) for b in batches[args.warmup :])
    result["padding_fraction"] = 1 - result["tokens"] / padded
    return result


def free_memory() -> None:
    gc.collect()
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()


def main() -> int:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-1.5b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens-per-batch", type=int, default=16384)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--head", choices=["fused", "chunked"], default="fused",
                        help="the log-prob head (models/heads/fused_head.py or the token-chunked one)")  # fmt: skip
    parser.add_argument(
        "--chunk-size", type=int, default=4096, help="tokens per chunked-head block"
    )
    parser.add_argument("--attention-backends", default="flash_varlen,nested")
    parser.add_argument("--attention-repeats", type=int, default=10)
    parser.add_argument(
        "--variants",
        default="attention,ours,hf-ckpt,ours-ckpt,attention-flex,ours-compile",
        help="comma list, run in this order: attention, attention-<backend>, ours, ours-ckpt, "
        "ours-compile, hf-ckpt, hf",
    )
    parser.add_argument("--time-budget", type=float, default=1e9, help="skip variants after this")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    DEVICE = torch.device(args.device)
    config = preset_config(args.preset)
    import transformers

    RESULTS.update(
        command=" ".join(sys.argv),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        torch=torch.__version__,
        transformers=transformers.__version__,
        device=torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu",
        preset=args.preset,
        params=config.num_parameters(),
        params_non_embedding=config.num_parameters(include_embeddings=False),
        args=vars(args),
    )
    matmul_flops = measure_matmul(DEVICE) if DEVICE.type == "cuda" else float("nan")
    RESULTS["matmul_bf16_tflops"] = matmul_flops / 1e12
    log("env", {k: RESULTS[k] for k in ("device", "torch", "transformers", "matmul_bf16_tflops")})
    batches = make_micro_batches(args, config.vocab_size)
    RESULTS["micro_batches"] = [[len(s) for s in b] for b in batches]
    backend = "flash_varlen" if DEVICE.type == "cuda" else "sdpa_loop"

    for variant in args.variants.split(","):
        if elapsed() > args.time_budget:
            RESULTS.setdefault("skipped", []).append(variant)
            log("skip", variant)
            continue
        try:
            if variant.startswith("attention"):
                # "attention" runs --attention-backends; "attention-flex" etc. one more path.
                names = variant.split("-", 1)[1:] or args.attention_backends.split(",")
                paths = RESULTS["sections"].setdefault("attention", {})
                paths.update(attention_paths(args, DEVICE, config, names))
                correct = {k: v["ms"] for k, v in paths.items() if v.get("correct")}
                if correct:
                    backend = min(correct, key=correct.get)
                RESULTS["chosen_backend"] = backend
            elif variant.startswith("ours"):
                RESULTS["sections"][variant] = ours_variant(
                    args,
                    config,
                    batches,
                    backend,
                    checkpointing="ckpt" in variant,
                    compiled="compile" in variant,
                    matmul_flops=matmul_flops,
                )
            elif variant.startswith("hf"):
                RESULTS["sections"][variant] = hf_variant(
                    args, config, batches, "ckpt" in variant, matmul_flops
                )
            else:
                raise ValueError(f"unknown variant {variant!r}")
        except Exception as error:
            traceback.print_exc()
            RESULTS["sections"][variant] = f"error: {type(error).__name__}: {error}"[:800]
        free_memory()
        save(args.json)

    print("\n| variant | tokens/s | TFLOP/s | MFU (989) | MFU no lm_head | step s | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    for section in RESULTS["sections"].values():
        if isinstance(section, dict) and "tokens_per_s" in section:
            print(
                f"| {section['variant']} | {section['tokens_per_s']:.0f} | {section['tflops']:.1f} "
                f"| {section['mfu']:.1%} | {section['mfu_no_lm_head']:.1%} "
                f"| {section['step_s_median']:.3f} | {section['peak_mem_gib']:.1f} |"
            )
    print(
        json.dumps({k: v for k, v in RESULTS.items() if k != "micro_batches"}, default=str)[:3000]
    )
    save(args.json)
    return 0


DEVICE = torch.device("cpu")

if __name__ == "__main__":
    sys.exit(main())
