"""`python benchmarks/rollout.py --out DIR`: engine tokens/s, step time and TTFT vs HF generate.

Also checks the engine on the device (fast path vs eager torch path vs the trainer's
log-probs) and can profile a decode step. Prints a table last; writes JSON + markdown to --out.

    python benchmarks/rollout.py --out $OUT                 # full suite (H200: ~4 min)
    python benchmarks/rollout.py --out /tmp/r --only check  # just the device checks
    python benchmarks/rollout.py --out $OUT --only variants --presets qwen3-30b-a3b  # one model
    python benchmarks/rollout.py --out $OUT --only moegap   # MoE gap, with and without replay
    python benchmarks/rollout.py --out $OUT --only gap      # bf16 gap per decode path, fp8, FP8 KV
    python benchmarks/rollout.py --out $OUT --only fp8speed # bf16 vs fp8 rollout tok/s (1.5b, 30B-A3B)
    python benchmarks/rollout.py --device cpu --quick       # CPU dry run of every code path
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from types import SimpleNamespace

import torch

from hybridflow.bench.common import make_prompts
from hybridflow.bench.rollout import bench_engine, bench_hf
from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.models import load_model
from hybridflow.models.heads.logprobs import logprobs_from_hidden

EAGER = EngineOptions(decode_backend="torch", cuda_graphs=False)  # the reference path


def trainer_logprobs(model, prompt, tokens, temperature, routes=None):
    """routes: a completion's routing record, replayed (mixture-of-experts models)."""
    ids = torch.tensor(prompt + tokens, device=model.device)
    extra = {}
    if routes is not None:  # the last token was never fed back: the router picks its experts
        replay = torch.full((len(ids), *routes.shape[1:]), -1, dtype=torch.long)
        replay[: len(routes)] = torch.from_numpy(routes.astype("int64"))
        extra["routed_experts"] = replay.to(ids.device)
    hidden = model.forward_packed(
        ids, torch.arange(len(ids), device=ids.device),
        torch.tensor([0, len(ids)], dtype=torch.int32, device=ids.device), len(ids), **extra,
    )  # fmt: skip
    start = len(prompt) - 1
    lp, _ = logprobs_from_hidden(
        hidden[start : start + len(tokens)], model.lm_head.weight,
        torch.tensor(tokens, device=ids.device), temperature=temperature,
    )  # fmt: skip
    return lp.float().cpu()


@torch.no_grad()
def logprob_gap(model, engine, prompts, params) -> dict:
    completions = engine.generate(prompts, params)
    diffs = []
    for i, c in enumerate(completions):
        expected = trainer_logprobs(model, prompts[i // params.n], c.token_ids, params.temperature)
        diffs.append((torch.tensor(c.logprobs) - expected).abs())
    d = torch.cat(diffs)
    return {"max_abs": d.max().item(), "mean_abs": d.mean().item(), "tokens": d.numel()}


@torch.no_grad()
def moe_gaps(device, preset: str = "qwen3-30b-a3b") -> dict:
    """A mixture of experts in bf16: the engine's log-probs against the trainer's, with the
    trainer routing each token itself and replaying the engine's routing record; and the
    importance ratio exp(trainer - engine) tails PPO clips."""
    model = load_model(preset, dtype=torch.bfloat16, device=device).eval()
    prompts = make_prompts(16, 64, model.config.vocab_size, 1)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=64, seed=0, ignore_eos=True)
    engine = Engine(model, max_batch_size=32, max_seq_len=128)
    completions = engine.generate(prompts, params)
    engine.release()
    out = {}
    for replay in (False, True):
        diffs = []
        for i, c in enumerate(completions):
            routes = c.routed_experts if replay else None
            expected = trainer_logprobs(model, prompts[i // params.n], c.token_ids,
                                        params.temperature, routes)  # fmt: skip
            diffs.append(expected - torch.tensor(c.logprobs))
        d = torch.cat(diffs)
        ratio = d.exp()
        _record(out, f"{preset}_bf16_{'replay' if replay else 'no_replay'}", {
            "max_abs": d.abs().max().item(), "mean_abs": d.abs().mean().item(),
            "ratio_max": ratio.max().item(), "ratio_min": ratio.min().item(),
            "ratio_outside_0.8_1.25": (((ratio < 0.8) | (ratio > 1.25)).float().mean().item()),
            "tokens": d.numel(),
        })  # fmt: skip
    return out


def _record(out: dict, key: str, value) -> None:
    """Store and print at once: a run cut by its timeout still shows what it measured."""
    out[key] = value
    print(f"check {key}: {json.dumps(value)}", flush=True)


# Decode layers forced one at a time for the bf16 gap, the fp8 matmuls and the FP8 KV cache:
# (name, EngineOptions fields).
GAP_PATHS = [("default", {}), ("default:no-shared-prefix", {"shared_prefix": False}),
             ("split", {"decode_layer": "split"}), ("chain", {"decode_layer": "chain"}),
             ("lean:qkv+mlp", {"decode_layer": "lean:qkv+mlp"}),
             ("lean:qkv", {"decode_layer": "lean:qkv"}),
             ("lean:mlp", {"decode_layer": "lean:mlp"}),
             ("fp8", {"weight_format": "fp8"}), ("fp8_kv", {"kv_cache_dtype": "fp8"}),
             ("fp8+fp8_kv", {"weight_format": "fp8", "kv_cache_dtype": "fp8"})]  # fmt: skip


@torch.no_grad()
def bf16_gaps(device, preset: str = "qwen2.5-0.5b") -> dict:
    """The bf16 log-prob gap (engine vs trainer) through each decode layer: they round at
    different places (lean adds products into the residual inside cuBLAS; the chain scales
    rows by 1/rms in its epilogues; the shared-prefix attention merges two softmax parts),
    and the chooser picks among them per batch size. n = 2, so the shared prefix is on unless
    a path turns it off."""
    model = load_model(preset, dtype=torch.bfloat16, device=device).eval()
    prompts = make_prompts(16, 64, model.config.vocab_size, 1)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=64, seed=0, ignore_eos=True)
    out = {}
    for name, fields in GAP_PATHS:
        engine = Engine(model, max_batch_size=32, max_seq_len=128, options=EngineOptions(**fields))
        gap = logprob_gap(model, engine, prompts, params)
        gap["layers"] = ({str(k): v for k, v in engine.chooser.decisions.items()}
                         if engine.chooser else {})  # fmt: skip
        gap["options"] = fields
        _record(out, f"{preset}_bf16_{name}", gap)
        engine.release()
    return out


@torch.no_grad()
def check_correctness(device, quick: bool) -> dict:
    """Fast path (triton + graphs) vs eager torch path on the device, and vs the trainer.
    The bf16 0.5b gap (docs/performance.md, Log-prob gap (bf16)) runs first."""
    out = {}
    if not quick:
        model = load_model("qwen2.5-0.5b", dtype=torch.bfloat16, device=device).eval()
        prompts = make_prompts(16, 64, model.config.vocab_size, 1)
        params = SamplingParams(n=2, temperature=1.0, max_new_tokens=64, seed=0, ignore_eos=True)
        engine = Engine(model, max_batch_size=32, max_seq_len=128)
        _record(out, "qwen0.5b_bf16_fast_vs_trainer", logprob_gap(model, engine, prompts, params))
        engine.release()
        eager = Engine(model, max_batch_size=32, max_seq_len=128, options=EAGER)
        _record(out, "qwen0.5b_bf16_eager_vs_trainer", logprob_gap(model, eager, prompts, params))
        del model, engine, eager
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model("tiny-4l", dtype=dtype, device=device).eval()
        for p in model.parameters():  # peaked logits: greedy far from ties
            p.normal_(0, 0.3)
        prompts = make_prompts(6, 9, model.config.vocab_size, 0) + [[20, 21], list(range(30, 70))]
        params = SamplingParams(n=3, temperature=0.9, max_new_tokens=24, seed=4)
        greedy = SamplingParams(n=2, temperature=0, max_new_tokens=24, ignore_eos=True)
        fast = Engine(model, max_batch_size=8, max_seq_len=96)  # 8 slots < 24 rows: refills
        eager = Engine(model, max_batch_size=24, max_seq_len=96, options=EAGER)
        name = str(dtype).split(".")[-1]
        for label, p in (("greedy", greedy), ("sampled", params)):
            a = fast.generate(prompts, p)
            b = eager.generate(prompts, p)
            same = sum(x.token_ids == y.token_ids for x, y in zip(a, b))
            _record(out, f"{name}_{label}_same_as_eager", f"{same}/{len(a)}")
        _record(out, f"{name}_fast_vs_trainer", logprob_gap(model, fast, prompts, params))
        _record(out, f"{name}_eager_vs_trainer", logprob_gap(model, eager, prompts, params))
    return out


@torch.no_grad()
def profile_step(device, preset: str, prompts: int) -> str:
    """Kernel-level profile of CUDA-graph decode replays (top kernels by device time)."""
    from torch.profiler import ProfilerActivity, profile

    model = load_model(preset, dtype=torch.bfloat16, device=device).eval()
    ids = make_prompts(prompts, 128, model.config.vocab_size, 0)
    engine = Engine(model, max_batch_size=prompts, max_seq_len=384)
    params = SamplingParams(max_new_tokens=64, seed=0, ignore_eos=True)
    engine.generate(ids, params)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(ids, params)
        torch.cuda.synchronize()
    return prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=40, max_name_column_width=60
    )


@torch.no_grad()
def profile_prefill(device, preset: str, prompts: int) -> str:
    """Where a prefill-only generate() (max_new_tokens=1) spends its wall time: host ops by
    self CPU time and the device kernel total, next to the wall clock."""
    from torch.profiler import ProfilerActivity, profile

    model = load_model(preset, dtype=torch.bfloat16, device=device).eval()
    ids = make_prompts(prompts, 128, model.config.vocab_size, 0)
    engine = Engine(model, max_batch_size=prompts, max_seq_len=384)
    params = SamplingParams(max_new_tokens=1, seed=0, ignore_eos=True)
    for _ in range(2):
        engine.generate(ids, params)
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(ids, params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(ids, params)
        torch.cuda.synchronize()
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events)
    head = f"prefill-only generate: wall {wall * 1000:.1f} ms, kernels {device_us / 1000:.1f} ms"
    cpu = events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50)
    gpu = events.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=50)
    return "\n".join([head, cpu, gpu])


@torch.no_grad()
def step_breakdown(device, preset: str, batch: int, length: int) -> dict:
    """Median times (us) of one decode step's parts at `batch` rows of `length` cached tokens."""
    import triton.testing

    from hybridflow.engine.kernels import attention, rowwise, sampler
    from hybridflow.engine.sampling import request_seeds, sample_reference, split_seed

    model = load_model(preset, dtype=torch.bfloat16, device=device).eval()
    cfg = model.config
    layer = model.model.layers[0]
    x = torch.randn(batch, cfg.hidden_size, device=device, dtype=torch.bfloat16)

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1000

    t = {}
    a, m = layer.self_attn, layer.mlp
    t["qkv_gemms"] = bench(lambda: (a.q_proj(x), a.k_proj(x), a.v_proj(x)))
    attn_in = torch.randn(batch, a.num_heads * a.head_dim, device=device, dtype=torch.bfloat16)
    t["o_gemm"] = bench(lambda: a.o_proj(attn_in))
    t["gate_up_gemms"] = bench(lambda: (m.gate_proj(x), m.up_proj(x)))
    inner = torch.randn(batch, cfg.intermediate_size, device=device, dtype=torch.bfloat16)
    t["down_gemm"] = bench(lambda: m.down_proj(inner))
    t["silu_mul"] = bench(lambda: rowwise.silu_mul(inner, inner))
    t["add_rms_norm"] = bench(lambda: rowwise.add_rms_norm(x.clone(), x, layer.input_layernorm))
    slots = batch
    cache_k = torch.randn(slots + 1, length + 1, cfg.num_key_value_heads, cfg.head_dim,
                          device=device, dtype=torch.bfloat16)  # fmt: skip
    cache_v = torch.randn_like(cache_k)
    q = torch.randn(batch, a.num_heads, a.head_dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(batch, a.num_kv_heads, a.head_dim, device=device, dtype=torch.bfloat16)
    row_slots = torch.arange(batch, device=device)
    lengths = torch.full((batch,), length, device=device)
    cos = torch.randn(length + 1, a.head_dim, device=device, dtype=torch.bfloat16)
    t["rope_store"] = bench(lambda: rowwise.rope_store(q, k, k, cos, cos, lengths, row_slots,
                                                       cache_k, cache_v))  # fmt: skip
    t["decode_attention"] = bench(
        lambda: attention.decode_attention(q, cache_k, cache_v, row_slots, lengths, length + 1)
    )
    per_layer = sum(t.values())
    hidden = torch.randn(batch, cfg.hidden_size, device=device, dtype=torch.bfloat16)
    t["lm_head"] = bench(lambda: model.lm_head(hidden))
    logits = model.lm_head(hidden)
    lo, hi = split_seed(request_seeds(0, batch, 1))
    lo, hi, steps = (
        lo.to(device),
        hi.to(device),
        torch.zeros(batch, dtype=torch.int64, device=device),
    )
    params = SamplingParams()
    t["sample_fused"] = bench(lambda: sampler.sample_fused(logits, params, lo, hi, steps))
    t["sample_torch"] = bench(lambda: sample_reference(logits, params, lo, hi, steps))
    t["per_layer_sum"] = per_layer
    t["step_estimate"] = per_layer * cfg.num_hidden_layers + t["lm_head"] + t["sample_fused"]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = (
        2 * cfg.num_hidden_layers * batch * length * cfg.num_key_value_heads * cfg.head_dim * 2
    )
    t["roofline_step_us_at_4.3TBps"] = (weight_bytes + kv_bytes) / 4.3e12 * 1e6
    return {k: round(v, 1) for k, v in t.items()}


# The table's workloads (128 prompt + 256 new tokens each); engine: EngineOptions fields
# (none: the defaults); hf: also time HF transformers generate on the same prompts.
VARIANTS = [
    dict(preset="qwen2.5-0.5b", prompts=256, hf=True),
    dict(preset="qwen2.5-0.5b", prompts=1024),
    dict(preset="qwen2.5-1.5b", prompts=256, hf=True),
    dict(preset="qwen2.5-0.5b", prompts=64, n=8, hf=True),
    dict(preset="qwen2.5-1.5b", prompts=64, n=8, hf=True),
    # a mixture of experts (random bf16 weights, 61 GB); HF generate (a per-expert loop)
    # runs ~300 tok/s here, so it generates 32 tokens per sample instead of 256
    dict(preset="qwen3-30b-a3b", prompts=256, hf=True, hf_new_tokens=32),
    dict(preset="qwen3-30b-a3b", prompts=64, n=8),
    dict(preset="qwen3-30b-a3b", prompts=1024),
    # the fp8 rollout (e4m3 routed experts, W8A8 attention): 61 GB of bf16 weights and
    # ~31 GB of fp8 copies, so an H200 (an H100's 80 GB leaves no room for the cache)
    dict(preset="qwen3-30b-a3b", prompts=256, engine={"weight_format": "fp8"}),
]
QUICK_VARIANTS = [
    dict(preset="tiny", prompts=4, hf=True,
         engine={"decode_backend": "torch", "cuda_graphs": False, "steps_per_sync": 4}),
    dict(preset="tiny", prompts=2, n=2, engine={"decode_backend": "torch", "cuda_graphs": False}),
    dict(preset="tiny", prompts=2, n=2, engine={"decode_backend": "torch", "cuda_graphs": False,
                                                "kv_cache_dtype": "fp8"}),
]  # fmt: skip


def run_variants(device, variants, quick: bool) -> list[dict]:
    rows, models = [], {}
    for variant in variants:
        preset, prompts, n = variant["preset"], variant["prompts"], variant.get("n", 1)
        fields = variant.get("engine", {})
        args = SimpleNamespace(
            preset=preset, prompts=prompts, prompt_len=128 if not quick else 8,
            new_tokens=256 if not quick else 8, n=n, max_batch_size=None, temperature=1.0,
            dtype="bfloat16", device=str(device), backend=fields.get("decode_backend", "auto"),
            engine=[f"{k}={v!r}" for k, v in fields.items() if k != "decode_backend"],
            hf=variant.get("hf", False), hf_batch_size=None, seed=0,
            hf_new_tokens=variant.get("hf_new_tokens"),
            repeats=3 if not quick else 1,
        )  # fmt: skip
        if preset not in models:
            models.clear()
            torch.cuda.empty_cache() if device.type == "cuda" else None
            models[preset] = load_model(preset, dtype=torch.bfloat16, device=device).eval()
        model = models[preset]
        prompt_ids = make_prompts(prompts, args.prompt_len, model.config.vocab_size, 0)
        row = {"preset": preset, "prompts": prompts, "n": n, "engine_options": fields}
        try:
            row.update(bench_engine(model, prompt_ids, args, device))
            if args.hf:
                row["hf_tokens_per_s"] = bench_hf(model, prompt_ids, args, device)["tokens_per_s"]
                row["speedup_vs_hf"] = row["tokens_per_s"] / row["hf_tokens_per_s"]
        except Exception as e:  # keep the other variants' numbers
            row["error"] = repr(e)
            traceback.print_exc()
        skip = ("matmul_timings_us", "decode_layer_timings_us", "choices")
        print(json.dumps({k: v for k, v in row.items() if k not in skip}), flush=True)
        rows.append(row)
    return rows


# --only fp8speed: each preset in bf16, then with the fp8 rollout (weight_format=fp8: W8A8
# dense projections, a mixture of experts' routed experts weight-only e4m3), 256 prompts
FP8_SPEED_PRESETS = "qwen2.5-1.5b,qwen3-30b-a3b"


def fp8_speed(device, presets: list[str], quick: bool) -> dict:
    """bf16 against fp8 rollout tok/s per preset (run_variants' rows, their table, and the
    fp8 / bf16 ratio of each preset both ran). quick: the triton backend for both (the CPU's
    interpreter, TRITON_INTERPRET=1), 2 prompts."""
    base = {"decode_backend": "triton", "cuda_graphs": False} if quick else {}
    variants = [dict(preset=preset, prompts=2 if quick else 256, engine={**base, **fields})
                for preset in presets for fields in ({}, {"weight_format": "fp8"})]  # fmt: skip
    rows = run_variants(device, variants, quick)
    ratios = {bf16["preset"]: round(fp8["tokens_per_s"] / bf16["tokens_per_s"], 3)
              for bf16, fp8 in zip(rows[::2], rows[1::2])
              if "error" not in bf16 and "error" not in fp8}  # fmt: skip
    print("fp8 / bf16 tok/s:", json.dumps(ratios), flush=True)
    return {"rows": rows, "table": table(rows), "fp8_over_bf16": ratios}


def table(rows: list[dict]) -> str:
    lines = ["| preset | prompts x n | options | tok/s | ms/step | TTFT ms | peak GiB | HF tok/s "
             "| x HF |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        options = " ".join(f"{k}={v}" for k, v in r["engine_options"].items()) or "defaults"
        if "error" in r:
            lines.append(f"| {r['preset']} | {r['prompts']} x {r['n']} | {options} | "
                         f"error: {r['error'][:60]} | | | | | |")  # fmt: skip
            continue
        hf = f"{r['hf_tokens_per_s']:,.0f}" if "hf_tokens_per_s" in r else ""
        x = f"{r['speedup_vs_hf']:.1f}" if "speedup_vs_hf" in r else ""
        # decode time per step: the timed call minus a prefill (TTFT, a separate call), over
        # the decode steps; "-" when that call took longer than the whole timed one (a host
        # busy with other work), which would make it negative
        steps = r["tokens"] / (r["prompts"] * r["n"]) - 1
        decode_s = r["seconds"] - r["ttft_s"]
        step_ms = f"{decode_s / max(steps, 1) * 1000:.2f}" if decode_s > 0 else "-"
        lines.append(
            f"| {r['preset']} | {r['prompts']} x {r['n']} | {options} | {r['tokens_per_s']:,.0f} "
            f"| {step_ms} | {r['ttft_s'] * 1000:.0f} | {r['peak_mem_gib']:.2f} | {hf} | {x} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/rollout_bench"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small shapes (CPU dry run)")
    parser.add_argument("--only", default="check,profile,variants")
    parser.add_argument("--presets", default=None,
                        help="comma-separated presets: run only their variants (e.g. "
                        "qwen3-30b-a3b)")  # fmt: skip
    parser.add_argument("--profile-cases", default="qwen2.5-0.5b:256",
                        help="preset:prompts,... for --only profile")  # fmt: skip
    parser.add_argument("--prefill-cases", default="qwen2.5-0.5b:256",
                        help="preset:prompts,... for --only prefill")  # fmt: skip
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device(args.device)
    results, parts = {}, args.only.split(",")
    start = time.time()
    if "check" in parts:
        results["check"] = check_correctness(device, args.quick)
        print("check", json.dumps(results["check"], indent=1), flush=True)
    if "gap" in parts:
        results["gap"] = bf16_gaps(device)
    if "moegap" in parts:
        results["moegap"] = moe_gaps(device)
    if "fp8speed" in parts:
        presets = (args.presets or FP8_SPEED_PRESETS).split(",")
        results["fp8speed"] = fp8_speed(device, presets, args.quick)
        print(results["fp8speed"]["table"], flush=True)
    if "breakdown" in parts and device.type == "cuda":
        results["breakdown"] = {
            "0.5b_b256_L256": step_breakdown(device, "qwen2.5-0.5b", 256, 256),
        }
        print("breakdown", json.dumps(results["breakdown"], indent=1), flush=True)
    profiles = [("prefill", profile_prefill, args.prefill_cases),
                ("profile", profile_step, args.profile_cases)]  # fmt: skip
    for part, profiler, cases in profiles:
        if part not in parts or device.type != "cuda":
            continue
        for case in cases.split(","):  # preset:prompts
            preset, prompts = case.split(":")
            try:
                results[f"{part} {case}"] = profiler(device, preset, int(prompts))
                print(part, case, results[f"{part} {case}"], flush=True)
            except Exception:
                traceback.print_exc()
    if "variants" in parts:
        variants = QUICK_VARIANTS if args.quick else VARIANTS
        if args.presets:
            variants = [v for v in variants if v["preset"] in args.presets.split(",")]
        results["variants"] = run_variants(device, variants, args.quick)
        results["table"] = table(results["variants"])
    results["wall_s"] = time.time() - start
    with open(os.path.join(args.out, "rollout.json"), "w") as f:
        json.dump(results, f, indent=1)
    if "table" in results:
        with open(os.path.join(args.out, "rollout.md"), "w") as f:
            f.write(results["table"] + "\n")
        for r in results.get("variants", []):  # per-shape timings (us) behind the choices
            if r.get("matmul_timings_us"):
                print(r["preset"], r["prompts"], "gate/up", json.dumps(r["matmul_timings_us"]))
            if r.get("decode_layer_timings_us"):
                print(r["preset"], r["prompts"], "decode layers",
                      json.dumps(r["decode_layer_timings_us"]))  # fmt: skip
        print(results["table"])
    print(f"wall {results['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
