"""`hybridflow bench rollout`: engine throughput next to HF transformers generate, same run.

    hybridflow bench rollout --preset qwen2.5-0.5b --prompts 256 --prompt-len 128 --new-tokens 256
    hybridflow bench rollout --preset qwen2.5-1.5b --prompts 64 --n 8 --engine decode_layer=split
    python -m hybridflow.bench.cli rollout --preset tiny --prompts 8 --new-tokens 16 --device cpu
    hybridflow bench rollout --preset qwen2.5-vl-7b --prompts 64 --prompt-len 64 \\
        --images-per-prompt 1 --image-size 256x256,384x288,448x448,576x432

Random-weight presets never emit EOS on purpose, so every sample runs to --new-tokens
(ignore_eos on the engine, min_new_tokens on HF): both sides generate the same token count.
`--engine NAME=VALUE` sets any EngineOptions field (hybridflow/engine/options.py);
`--speculative ngram` runs the engine with speculative decoding off and on (speculative.py).

A vision-language model's prompts carry images (image_prompts.py): --images-per-prompt
random RGB pictures of the --image-size sizes (in turn over the prompts' images) before
--prompt-len text tokens, preprocessed once by the model's image processor; the engine and
HF's Qwen2_5_VLForConditionalGeneration get the same pixel_values and image_grid_thw, and
the table says how many image tokens a prompt has.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

from hybridflow.bench.common import (
    WARM_UP,
    counted,
    engine_options,
    make_prompts,
    run_bench_command,
    sync_device,
)
from hybridflow.bench.image_prompts import (
    GEO3K_IMAGE_SIZES,
    format_image_sizes,
    images_per_prompt,
    parse_image_sizes,
)


def add_rollout_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="qwen2.5-0.5b", help="model preset or local HF directory")
    p.add_argument("--prompts", type=int, default=256, help="prompts generated for")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens of each prompt")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens generated per sample")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=None,
        help="sequences decoded at once (default: prompts * n)",
    )
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="weights' and activations' dtype")  # fmt: skip
    p.add_argument("--device", default=None, help="device to run on (default: cuda if available)")
    p.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"],
                   help="EngineOptions.decode_backend")  # fmt: skip
    p.add_argument("--no-graphs", action="store_true", help="eager decode steps")
    p.add_argument("--engine", action="append", default=[], metavar="NAME=VALUE",
                   help="an EngineOptions field, e.g. decode_layer=split or steps_per_sync=16 "
                   "(repeatable; default: none, EngineOptions' defaults)")  # fmt: skip
    p.add_argument("--cache-dir", default=None,
                   help="pin the engine's timing choices here (EngineOptions.cache_dir; default: "
                   "not pinned)")  # fmt: skip
    p.add_argument("--retune", action="store_true",
                   help="time the engine's kernel choices again (EngineOptions.retune)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=1, help="timed runs (the median is kept)")
    p.add_argument("--hf", dest="hf", action="store_true", default=True,
                   help="time HF transformers generate on the same prompts (the default)")  # fmt: skip
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip the HF baseline")
    p.add_argument(
        "--hf-batch-size",
        type=int,
        default=None,
        help="prompts per HF generate call (default: all)",
    )
    p.add_argument("--hf-new-tokens", type=int, default=None,
                   help="tokens HF generates per sample (default: --new-tokens); fewer keeps "
                   "a slow baseline short")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and the sampling")
    p.add_argument(
        "--mean-length", type=int, default=None,
        help="make ~vocab/L random token ids stop tokens: with a random-weight model, sample "
        "lengths become ~geometric with mean L (exercises continuous batching; default: no "
        "stop tokens, every sample runs to --new-tokens)",
    )  # fmt: skip
    p.add_argument("--speculative", default=None, choices=["ngram", "draft"],
                   help="also run the engine with this speculative decoding method and print "
                   "both (bench/speculative.py; each timed call then samples a seed of its own; "
                   "draft: name the model with --engine speculative_draft_model=...; "
                   "default: off)")  # fmt: skip
    p.add_argument("--images-per-prompt", type=images_per_prompt, default=None,
                   help="random images before each prompt's text, for a vision-language model "
                   "(default: 1 for one, 0 for a text model)")  # fmt: skip
    p.add_argument("--image-size", type=parse_image_sizes, default=GEO3K_IMAGE_SIZES,
                   metavar="WxH[,WxH...]",
                   help="the images' sizes in pixels, given to the prompts' images in turn "
                   f"(default: {format_image_sizes(GEO3K_IMAGE_SIZES)}, Geometry3K-like)")  # fmt: skip
    p.add_argument("--json", default=None,
                   help="also write the results to this file (default: print only)")  # fmt: skip


def run_rollout_command(args) -> int:
    return run_bench_command("rollout", args, bench_rollout, print_result)


def _median_seconds(call, device, repeats: int) -> tuple[float, list[float], object]:
    """Median wall time of `repeats` synchronised calls, every time, and the last result."""
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = call()
        sync_device(device)
        runs.append(time.perf_counter() - start)
    return sorted(runs)[len(runs) // 2], runs, result


def stop_ids_for_mean_length(vocab: int, mean_length: int | None, seed: int) -> tuple[int, ...]:
    if not mean_length:
        return ()
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    count = max(1, round(vocab / mean_length))
    return tuple(torch.randperm(vocab, generator=g)[:count].tolist())


def bench_rollout(args, model=None, progress=None) -> dict:
    import torch

    from hybridflow.models import load_model
    from hybridflow.progress import quiet_reporter

    progress = progress or quiet_reporter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if model is None:
        with progress.task(f"loading {args.preset}"):
            dtype = getattr(torch, args.dtype)
            model = load_model(args.preset, dtype=dtype, device=device).eval()
    prompts, images, image_info = bench_prompts(model.config, args, progress)
    result = {
        "preset": args.preset, "device": torch.cuda.get_device_name(device)
        if device.type == "cuda" else "cpu", "dtype": args.dtype, "prompts": args.prompts,
        "n": args.n, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        **image_info,
    }  # fmt: skip
    engine_bench = functools.partial(bench_engine, images=images)
    if getattr(args, "speculative", None):
        from hybridflow.bench.speculative import bench_speculative

        result["speculative"] = bench_speculative(
            engine_bench, model, prompts, args, device, progress
        )
        result["engine"] = result["speculative"]["off"]
    else:
        result["engine"] = engine_bench(model, prompts, args, device, progress)
    if args.hf:
        result["hf"] = bench_hf(model, prompts, args, device, progress, images=images)
        result["speedup_vs_hf"] = result["engine"]["tokens_per_s"] / result["hf"]["tokens_per_s"]
    return result


def bench_prompts(config, args, progress) -> tuple[list[list[int]], list | None, dict]:
    """(prompt ids, an engine PromptImages per prompt or None, what the result says of the
    images): --prompt-len random text ids, after --images-per-prompt images for a
    vision-language model. UserError for images asked of a text model."""
    from hybridflow.bench.image_prompts import bench_image_processor, text_id_limit, with_images
    from hybridflow.errors import UserError

    vision = getattr(config, "vision", None)
    count = getattr(args, "images_per_prompt", None)
    count = (1 if vision is not None else 0) if count is None else count
    if count and vision is None:
        raise UserError(f"--images-per-prompt {count}: {args.preset} is a text model (no vision "
                        "encoder)", "drop --images-per-prompt, or bench a vision-language "
                        "model (e.g. --preset qwen2.5-vl-7b)")  # fmt: skip
    texts = make_prompts(args.prompts, args.prompt_len, text_id_limit(config), args.seed)
    if not count:
        return texts, None, {}
    sizes = getattr(args, "image_size", GEO3K_IMAGE_SIZES)
    with progress.task(f"making {args.prompts * count} images"):
        processor = bench_image_processor(args.preset, vision)
        made = with_images(texts, count, sizes, processor, vision, args.seed)
    return made.prompts, made.images, {"image_sizes": format_image_sizes(sizes), **made.summary()}


def bench_engine(model, prompts, args, device, progress=None, images=None) -> dict:
    import torch

    from hybridflow.engine import Engine, SamplingParams
    from hybridflow.progress import quiet_reporter

    progress = progress or quiet_reporter()
    with progress.task(WARM_UP):
        options = engine_options(args)
        engine = Engine(
            model,
            max_batch_size=args.max_batch_size or len(prompts) * args.n,
            max_seq_len=max(map(len, prompts)) + args.new_tokens,
            options=options,
        )
        stop_ids = stop_ids_for_mean_length(
            model.config.vocab_size, getattr(args, "mean_length", None), args.seed
        )
        params = SamplingParams(
            n=args.n, temperature=args.temperature, max_new_tokens=args.new_tokens,
            seed=args.seed, ignore_eos=True, stop_token_ids=stop_ids,
        )  # fmt: skip
        # Warm-up: kernel compilation and graph capture for the buckets this run uses.
        start = time.perf_counter()
        engine.generate(prompts, params, images=images)
        sync_device(device)
        warmup = time.perf_counter() - start
    # Time to first token: prefill of every prompt + first sampled token.
    repeats = max(1, getattr(args, "repeats", 1))
    first_token = SamplingParams(n=args.n, max_new_tokens=1, seed=1, ignore_eos=True)
    # --speculative: a seed per timed call (the draft store holds earlier calls' samples of
    # the prompts, never the ones drawn); with and without speculation alike
    seeds = iter(range(args.seed + 1, args.seed + 1 + repeats))
    fresh_seeds = bool(getattr(args, "speculative", None))

    def timed_call():
        seed = next(seeds) if fresh_seeds else args.seed
        return engine.generate(prompts, dataclasses.replace(params, seed=seed), images=images)

    with progress.task("timed calls", total=2 * repeats, unit="calls") as task:
        ttft = _median_seconds(
            counted(task, lambda: engine.generate(prompts, first_token, images=images)),
            device,
            repeats,
        )[0]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        speculation = engine.speculation
        before = dataclasses.replace(speculation.stats) if speculation is not None else None
        seconds, runs, completions = _median_seconds(counted(task, timed_call), device, repeats)
    stopped = sum(c.finish_reason == "stop" for c in completions)
    tokens = sum(len(c.token_ids) for c in completions)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    slots = engine.num_slots
    pinned = engine.pinned_choices()["choices"]
    engine.release()
    return {
        "backend": engine.decode_backend, "cuda_graphs": engine.cuda_graphs, "slots": slots,
        "fuse": engine.fuse_projections, "options": options.to_dict(),
        "launch": None if engine.launch is None else vars(engine.launch),
        "tokens": tokens, "seconds": seconds, "repeats": repeats,
        "tokens_per_s": tokens / seconds, "ttft_s": ttft, "peak_mem_gib": peak / 2**30,
        "warmup_s": warmup, "stopped": stopped, "runs_s": [round(r, 4) for r in runs],
        "choices": pinned,
        "speculative": speculation.stats.since(before).metrics() if before else None,
        "token_digest": hash(tuple(tuple(c.token_ids) for c in completions)),
        "decode_layer_timings_us": engine.chooser.timings if engine.chooser else {},
        "matmul_timings_us": {str(k): v for k, v in engine.matmul.timings.items()}
        if engine.matmul else {},
    }  # fmt: skip


def bench_hf(model, prompts, args, device, progress=None, images=None) -> dict:
    """transformers generate on the same weights (sdpa where transformers has it, else eager:
    hf_attention; dynamic cache), sampling, no early stop; prompts left-padded, with their
    images' pixel_values and image_grid_thw (hf_inputs)."""

    from hybridflow.progress import quiet_reporter

    progress = progress or quiet_reporter()
    hf = _hf_twin(model, device)
    attention = hf.config._attn_implementation
    batch = args.hf_batch_size or len(prompts)
    new_tokens = getattr(args, "hf_new_tokens", None) or args.new_tokens
    total, seconds = 0, 0.0
    pad = model.config.pad_token_id or 0
    stop_ids = stop_ids_for_mean_length(
        model.config.vocab_size, getattr(args, "mean_length", None), args.seed
    )
    kwargs = dict(
        max_new_tokens=new_tokens, min_new_tokens=0 if stop_ids else new_tokens,
        do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0, pad_token_id=pad,
        num_return_sequences=args.n, eos_token_id=list(stop_ids) or None,
    )  # fmt: skip

    def inputs(begin: int, stop: int) -> dict:
        return hf_inputs(model.config, prompts[begin:stop],
                         None if images is None else images[begin:stop], pad, device)  # fmt: skip

    batches = -(-len(prompts) // batch)
    with progress.task("HF generate", total=batches, unit="batches") as task:
        for start in range(0, len(prompts), batch):
            if start == 0:  # warm-up on a slice
                hf.generate(**inputs(0, 2), **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # fmt: skip
            given = inputs(start, start + batch)
            sync_device(device)
            t0 = time.perf_counter()
            out = hf.generate(**given, **kwargs)
            sync_device(device)
            seconds += time.perf_counter() - t0
            total += _count_generated(out[:, given["input_ids"].shape[1] :], stop_ids)
            task.advance()
    del hf
    return {"tokens": total, "seconds": seconds, "tokens_per_s": total / seconds,
            "new_tokens": new_tokens, "attention": attention}  # fmt: skip


def hf_inputs(config, prompts, images, pad: int, device) -> dict:
    """transformers generate's inputs for ``prompts``: ids left-padded with ``pad`` and their
    attention mask; with images (an engine PromptImages or None per prompt) also the
    prompts' pixel_values and image_grid_thw, in order, and mm_token_type_ids (1 on image
    tokens: how transformers' Qwen2.5-VL finds them for its mRoPE rows)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    out = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
    held = [entry for entry in images or () if entry is not None]
    if held:
        image_token = config.vision.image_token_id
        out["pixel_values"] = torch.cat([e.pixel_values for e in held]).to(device)
        out["image_grid_thw"] = torch.cat([e.image_grid_thw for e in held]).to(device)
        out["mm_token_type_ids"] = ((ids == image_token) & mask.bool()).long().to(device)
    return out


def _hf_class(config):
    """transformers' generating class of an HF config: its causal LM, or a vision-language
    model's image-text-to-text class (Qwen2_5_VLForConditionalGeneration)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    )

    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING):
        if type(config) in mapping:
            return mapping[type(config)]
    return None


def hf_attention(config) -> str:
    """The attention transformers runs its twin with: sdpa, or eager for a family whose
    transformers class has no sdpa path (GPT-OSS: its sinks)."""
    return "sdpa" if getattr(_hf_class(config), "_supports_sdpa", True) else "eager"


def _hf_twin(model, device):
    """The transformers model of the same architecture, its parameters the same tensors as
    `model`'s (no second copy: a 30B model fits once, not twice). Without accelerate (its
    empty-weights context keeps the rotary buffers real), a copy on the device."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**model.config.to_hf())
    config._attn_implementation = hf_attention(config)
    model_class = _hf_class(config) or transformers.AutoModelForCausalLM
    state = model.state_dict()
    if getattr(model.config, "vision", None) is not None:  # transformers 5's module names
        from hybridflow.models.families.qwen2_5_vl import transformers_name

        state = {transformers_name(name): tensor for name, tensor in state.items()}
    try:
        from accelerate import init_empty_weights
    except ImportError:
        init_empty_weights = None
    if init_empty_weights is not None:
        with init_empty_weights(include_buffers=False), torch.device(device):
            hf = model_class._from_config(config, dtype=model.dtype)
        missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
        if "lm_head.weight" in missing:  # tied: the embedding
            hf.lm_head.weight = hf.get_input_embeddings().weight
    else:
        with torch.device(device):
            hf = model_class._from_config(config, dtype=model.dtype)
        missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"HF model names differ: missing {missing}, unexpected {unexpected}")
    return hf.eval()


def _count_generated(responses, stop_ids) -> int:
    """Tokens up to and including each row's first stop id (HF pads after it)."""
    import torch

    if not stop_ids:
        return responses.numel()
    is_stop = torch.isin(responses, torch.tensor(stop_ids, device=responses.device))
    after_stop = (is_stop.cumsum(-1) - is_stop.long()) > 0  # strictly after the first stop
    return int((~after_stop).sum())


def print_result(result: dict) -> None:
    e = result["engine"]
    print(
        f"{result['preset']} {result['dtype']} on {result['device']}: {result['prompts']} prompts"
        f" x n={result['n']}, {result['prompt_len']} prompt + {result['new_tokens']} new tokens"
    )
    if "image_tokens_per_prompt" in result:
        tokens, lengths = result["image_tokens_per_prompt"], result["prompt_tokens"]
        print(
            f"  images: {result['images_per_prompt']} a prompt of {result['image_sizes']} px "
            f"(in turn); image tokens a prompt {tokens['min']}-{tokens['max']} (mean "
            f"{tokens['mean']:.0f}), prompt tokens with them {lengths['min']}-{lengths['max']}"
        )
    print(
        f"  engine ({e['backend']}, graphs={e['cuda_graphs']}, fuse={e['fuse']}, "
        f"slots={e['slots']}): "
        f"{e['tokens_per_s']:,.0f} tok/s ({e['tokens']} tokens in {e['seconds']:.3f} s), "
        f"TTFT {e['ttft_s'] * 1000:.1f} ms, peak mem {e['peak_mem_gib']:.2f} GiB"
    )
    if "speculative" in result:
        from hybridflow.bench.speculative import print_speculative

        print_speculative(result)
    if "hf" in result:
        h = result["hf"]
        print(
            f"  HF generate ({h.get('attention', 'sdpa')} attention): {h['tokens_per_s']:,.0f} "
            f"tok/s ({h['tokens']} tokens in {h['seconds']:.3f} s); engine speedup "
            f"{result['speedup_vs_hf']:.1f}x"
        )
