"""`python benchmarks/lora_rollout.py`: generation with LoRA adapters decoded unmerged
(rollout.lora_in_place: the actor's base weights read in place, engine/adapters.py) against
the engine over a merged copy (the default: fused projections, the timed decode layers), in
one process: tokens/s, and the GPU memory of the weights each holds beside the actor's
(its fused copies not counted).

    python benchmarks/lora_rollout.py --preset qwen2.5-7b --prompts 256 --rank 64
    python benchmarks/lora_rollout.py --preset tiny --device cpu --prompts 4 --new-tokens 8  # smoke

A preset has random weights; the adapters get random B (trained adapters are not zero), so
both engines compute the same policy: the merged copy is W + scale·B·A in the model's dtype.
Each engine: one untimed warm-up call (compilation, timing choices, graph capture), then the
median of --repeats timed calls of --prompts prompts × --prompt-len tokens, --new-tokens new
tokens each (no EOS). Prints a markdown table; --json writes it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapted_model(preset: str, rank: int, dtype, device):
    """The preset with LoRA adapters of `rank` on every projection, B drawn at random."""
    from hybridflow.learners.lora import apply_lora
    from hybridflow.models import load_model

    model = load_model(preset, dtype=dtype, device=device).eval()
    apply_lora(model, rank=rank, alpha=2 * rank, target_modules=TARGETS)
    generator = torch.Generator(device).manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.02, generator=generator)
    return model.requires_grad_(False)


def merged_model(model, preset: str, dtype, device):
    from hybridflow.learners.lora import lora_scalings, merge_lora_stream
    from hybridflow.models import load_model

    merged = load_model(preset, dtype=dtype, device=device).eval()
    state = dict(merge_lora_stream(model.state_dict().items(), lora_scalings(model)))
    merged.load_state_dict(state)
    return merged.requires_grad_(False)


def time_engine(name, model, args, weight_bytes) -> dict:
    from hybridflow.engine import Engine, EngineOptions, SamplingParams

    options = EngineOptions(cache_dir=args.cache_dir)
    if args.device == "cpu":
        options = EngineOptions(decode_backend="torch", cuda_graphs=False)
    engine = Engine(model, max_batch_size=args.prompts,
                    max_seq_len=args.prompt_len + args.new_tokens, options=options)  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = torch.randint(
        3, min(vocab, 1000), (args.prompts, args.prompt_len), generator=generator
    )
    prompts = prompts.tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=0,
                            ignore_eos=True)  # fmt: skip
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    engine.generate(prompts, params)  # warm-up: compile, time, capture
    seconds = []
    for _ in range(args.repeats):
        sync()
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        sync()
        seconds.append(time.perf_counter() - start)
    tokens = sum(len(c.token_ids) for c in out)
    median = statistics.median(seconds)
    row = dict(rollout=name, tokens_per_s=tokens / median, seconds=median,
               weights_gib=weight_bytes / 2**30, fuse=engine.fuse_projections)  # fmt: skip
    engine.release()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--cache-dir", default=None, help="the engine's pinned choices")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = adapted_model(args.preset, args.rank, dtype, args.device)
    adapters = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n
    )
    base = sum(p.numel() * p.element_size() for p in model.parameters()) - adapters
    # unmerged, the engine reads the actor's own tensors: nothing beside them
    rows = [time_engine("adapters unmerged (lora_in_place)", model, args, 0)]
    merged = merged_model(model, args.preset, dtype, args.device)
    rows.append(time_engine("merged copy", merged, args, base))
    print(f"{args.preset} LoRA rank {args.rank} on {args.device}: {args.prompts} prompts x "
          f"({args.prompt_len} + {args.new_tokens}) tokens, median of {args.repeats}")  # fmt: skip
    print("| rollout | tok/s | s | weights beside the actor's, GiB | fused projections |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rollout']} | {r['tokens_per_s']:,.0f} | {r['seconds']:.3f} "
              f"| {r['weights_gib']:.2f} | {r['fuse']} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
