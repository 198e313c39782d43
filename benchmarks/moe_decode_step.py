"""`python benchmarks/moe_decode_step.py --out DIR`: one decode step of the MoE families'
presets (moonlight-16b-a3b: MLA, grouped-routed and shared experts; gpt-oss-20b: sink
attention, sliding windows, biased experts) at 256 rows, every row at --position (128 + 256:
the middle of a 256 x (128 + 256) rollout), bf16, on the engine's eager step
(layers/eager.decode_forward_torch, as the engine decodes these families).

Each step variant (STEPS): "torch" (the model's own modules: the pure reference), "before"
(the Triton steps as the engine ran them before: latent / sink attention kernels and the
fused norms, the model's projections, ropes and experts), "triton" (what the engine's triton
backend runs now: the ropes, norm and cache stores of MLA and of the sink layers in one
launch each, the experts on grouped Triton kernels), and between them "triton" with the
experts as before, and with GPT-OSS's experts on torch._grouped_mm and the row-wise bias +
SwiGLU kernel (the Triton step's prefill path; for moonlight the same as "triton").

Two tables per preset:

1. --account (CPU, no GPU): the bytes and launches of one step, counted from the code on meta
   tensors (benchmarks/decode_bytes.py): per layer kind, each part and op, launches, MB read
   and written; the step's totals per variant against the floor.
2. on CUDA: each variant's step time, eager and replayed as a CUDA graph (the engine's
   decode), against the floor; its logits' largest difference from the torch step's.

The floor is the bytes a step must read: the weights (an untied embedding's rows only), each
row's latent or K/V of its live positions (a sliding layer's window), over the HBM peak.

    python benchmarks/moe_decode_step.py --out $OUT               # H100/H200: ~3 min
    python benchmarks/moe_decode_step.py --account                # CPU: the byte tables
    TRITON_INTERPRET=1 python benchmarks/moe_decode_step.py --device cpu --quick   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import ExitStack, nullcontext
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).parent))

from decode_bytes import StepCounter, kernel_stand_ins  # noqa: E402
from delta_step import number, peak_bandwidth, percent, timed_us  # noqa: E402

PRESETS = ("moonlight-16b-a3b", "gpt-oss-20b")
QUICK_PRESETS = ("tiny-deepseek-v3", "tiny-gpt-oss")
TRITON_STEPS = dict(recurrent_step="triton", attention_step="triton", latent_step="triton",
                    norm_step="triton")  # fmt: skip
# (name, the eager step's arguments, the rows up to which GPT-OSS's experts take the Triton
# kernels on the Triton step: layers/biased_moe.DECODE_ROWS, 0 for torch._grouped_mm always;
# former: MLA's and the sink layers' projections as the model's modules run them)
STEPS = (
    ("torch", {}, None, False),
    ("before", TRITON_STEPS, None, True),
    ("triton, experts as before", TRITON_STEPS, None, False),
    ("triton, biased experts on torch._grouped_mm", {**TRITON_STEPS, "expert_step": "triton"},
     0, False),
    ("triton", {**TRITON_STEPS, "expert_step": "triton"}, 1024, False),
)  # fmt: skip
# "triton" runs GPT-OSS's experts on the grouped Triton kernels up to 1,024 rows; the engine's
# default (DECODE_ROWS = 0) is the row before it, torch._grouped_mm (slower kernels at [E, in,
# out]: docs/performance-models.md "One decode step, measured")


def former_projections() -> ExitStack:
    """The Triton steps' projections as they ran before their one-launch kernels: MLA's
    q/latent ropes, latent norm and store, and the sink layers' ropes and K/V stores through
    the model's modules and indexed stores (layers/latent.py, layers/sink.py)."""
    from hybridflow.engine.layers import latent, sink

    def project_and_store(mixer, normed, cos, sin, cache, index, at):
        return latent._project_and_store(mixer, normed, cos, sin, cache, index, at)[0]

    def rope_store(mixer, normed, cos, sin, keys, values, at):
        q, k, v = mixer.project_qkv(normed, cos, sin)
        keys[at] = k
        values[at] = v
        return q

    stack = ExitStack()
    stack.enter_context(mock.patch.object(latent, "_project_and_store_fused", project_and_store))
    stack.enter_context(mock.patch.object(sink, "_rope_store", rope_store))
    return stack


H100_PEAK = 3.35e12


def step_case(preset: str, rows: int, max_seq_len: int, device: torch.device,
              dtype: torch.dtype):  # fmt: skip
    """(model, cache, rope) of a preset with random weights (none on meta)."""
    from hybridflow.engine.cache.kv_cache import route_spec
    from hybridflow.engine.cache.sizing import make_cache
    from hybridflow.engine.rope_table import RopeTable
    from hybridflow.models import build_model
    from hybridflow.models.llama import CausalLM
    from hybridflow.models.presets import preset_config

    config = preset_config(preset)
    if device.type == "meta":
        with torch.device("meta"):
            model = CausalLM(config).to(dtype)
        model.tie_weights()
        for layer in model.model.layers:  # CUDA bf16's backend (meta would pick the CPU loop)
            if getattr(layer.mlp, "expert_backend", None) is not None:
                layer.mlp.expert_backend = "grouped_mm"
    else:
        model = build_model(config, dtype=dtype, device=device)
    model.eval().requires_grad_(False)
    cache, _ = make_cache(config, rows, max_seq_len, None, None, 0, dtype, device,
                          route_spec(config))  # fmt: skip
    return model, cache, RopeTable(config, max_seq_len, dtype, device)


def step_inputs(model, rows: int, position: int, device: torch.device) -> dict:
    vocab = model.config.vocab_size
    tokens = (torch.arange(rows, device=device) * 7919) % vocab
    return dict(tokens=tokens, positions=torch.full((rows,), position, device=device),
                row_slots=torch.arange(rows, device=device))  # fmt: skip


def run_step(model, cache, rope, inputs: dict, arguments: dict, decode_rows: int | None = None,
             former: bool = False) -> torch.Tensor:  # fmt: skip
    from hybridflow.engine.layers.eager import decode_forward_torch

    rows = nullcontext() if decode_rows is None else mock.patch(
        "hybridflow.engine.layers.biased_moe.DECODE_ROWS", decode_rows)  # fmt: skip
    with rows, former_projections() if former else nullcontext():
        return decode_forward_torch(model, cache, rope, inputs["tokens"], inputs["positions"],
                                    inputs["row_slots"], cache.max_seq_len, **arguments)  # fmt: skip


def floor_bytes(model, rows: int, position: int) -> int:
    """Weights (an untied embedding's rows only) + each row's cached latent / K/V of its live
    positions (a sliding layer's window)."""
    unique = {id(p): p for p in model.parameters()}
    weights = sum(p.numel() * p.element_size() for p in unique.values())
    embed = model.model.embed_tokens.weight
    if model.lm_head.weight is not embed:
        weights -= embed.numel() * embed.element_size()
        weights += rows * embed.shape[1] * embed.element_size()
    config, element = model.config, embed.element_size()
    cached = 0
    for layer in model.model.layers:
        live = min(layer.spec.window or position + 1, position + 1)
        if layer.spec.cache == "latent":
            cached += rows * live * (config.kv_lora_rank + config.qk_rope_head_dim) * element
        else:
            heads, dim = config.num_key_value_heads, config.head_dim
            cached += 2 * rows * live * heads * dim * element
    return weights + cached


def layer_kind(index: int, layer) -> str:
    """A layer's kind in the tables: its mixer (and window) and its MLP."""
    spec = layer.spec
    mixer = spec.mixer + (f" (window {spec.window})" if spec.window else "")
    return f"{mixer} + {spec.mlp}"


def account(preset: str, rows: int, position: int) -> dict:
    """Per STEPS variant: {(layer kind, part, op): [launches, read, written]} of one step on
    meta tensors, and how many layers of each kind."""
    device = torch.device("meta")
    model, cache, rope = step_case(preset, rows, 2 * position, device, torch.bfloat16)
    inputs = step_inputs(model, rows, position, device)
    kinds = [layer_kind(i, layer) for i, layer in enumerate(model.model.layers)]
    out = {"layers": {kind: kinds.count(kind) for kind in dict.fromkeys(kinds)}, "steps": {},
           "floor_bytes": floor_bytes(model, rows, position)}  # fmt: skip
    for name, *variant in STEPS:
        counter = StepCounter(model, layer_kind)
        with kernel_stand_ins(counter, position + 1), counter:
            run_step(model, cache, rope, inputs, *variant)
        out["steps"][name] = {key: list(value) for key, value in counter.rows.items()}
    return out


def account_markdown(preset: str, counted: dict, rows: int) -> str:
    """Per layer kind and variant (torch, triton): one layer's ops by part; then the step's
    totals per variant against the floor."""
    lines = [f"### {preset}, one decode step at {rows} rows\n"]
    layers = counted["layers"]
    for kind, count in layers.items():
        for name in ("torch", "triton"):
            table = counted["steps"][name]
            lines += [f"**{kind}** (x{count}), {name} step: one layer\n",
                      "| part | op | launches | MB read | MB written |", "|---|---|---|---|---|"]  # fmt: skip
            parts = {}
            for (layer, part, op), (launches, read, written) in table.items():
                if layer == kind:
                    parts.setdefault(part, []).append((op, launches / count, read / count,
                                                      written / count))  # fmt: skip
            for part, ops in parts.items():
                for op, launches, read, written in sorted(ops, key=lambda o: -o[2]):
                    lines.append(f"| {part} | {op} | {launches:g} | {read / 1e6:,.2f} | "
                                 f"{written / 1e6:,.2f} |")  # fmt: skip
                total = [sum(o[i] for o in ops) for i in (1, 2, 3)]
                lines.append(f"| **{part}** | | **{total[0]:g}** | **{total[1] / 1e6:,.2f}** | "
                             f"**{total[2] / 1e6:,.2f}** |")  # fmt: skip
            lines.append("")
    floor = counted["floor_bytes"]
    lines += [f"Floor: {floor / 1e9:.2f} GB a step ({floor / H100_PEAK * 1e3:.2f} ms at "
              "H100's 3.35 TB/s)\n", "| step | launches | GB read | GB written | "
              "bytes / floor | bytes at 3.35 TB/s, ms |", "|---|---|---|---|---|---|"]  # fmt: skip
    for name, table in counted["steps"].items():
        launches, read, written = (sum(row[i] for row in table.values()) for i in range(3))
        lines.append(f"| {name} | {launches:,} | {read / 1e9:.2f} | {written / 1e9:.2f} | "
                     f"{(read + written) / floor:.2f} | "
                     f"{(read + written) / H100_PEAK * 1e3:.2f} |")  # fmt: skip
    return "\n".join(lines)


def timing(preset: str, rows: int, position: int, device: torch.device, peak) -> list[dict]:
    """Table 2's rows for one preset: each STEPS variant, eager and as a CUDA graph."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, cache, rope = step_case(preset, rows, 2 * position, device, dtype)
    inputs = step_inputs(model, rows, position, device)
    floor = floor_bytes(model, rows, position)
    out, first = [], None
    for name, *variant in STEPS:
        step = lambda v=variant: run_step(model, cache, rope, inputs, *v)  # noqa: E731
        logits = step().float()
        first = logits if first is None else first
        eager = timed_us(step, device, calls=3, graph=False)
        graph = timed_us(step, device, calls=3) if device.type == "cuda" else None
        floor_ms = None if peak is None else floor / peak * 1e3
        out.append({"preset": preset, "step": name, "eager_ms": eager / 1e3,
                    "graph_ms": None if graph is None else graph / 1e3, "floor_ms": floor_ms,
                    "of_floor": None if graph is None or floor_ms is None
                    else floor_ms / (graph / 1e3),
                    "max_logit_diff": (logits - first).abs().max().item()})  # fmt: skip
    return out


def timing_markdown(rows: list[dict]) -> str:
    lines = ["| preset | step | eager ms | graph ms | floor ms | of floor | max logit diff |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        lines.append(f"| {row['preset']} | {row['step']} | {number(row['eager_ms'], 2)} | "
                     f"{number(row['graph_ms'], 2)} | {number(row['floor_ms'], 2)} | "
                     f"{percent(row['of_floor'])} | {row['max_logit_diff']:.2e} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/moe_decode_step"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--account", action="store_true", help="table 1 only (meta tensors)")
    parser.add_argument("--quick", action="store_true",
                        help="the tiny presets, 3 rows (CPU smoke run, TRITON_INTERPRET=1)")  # fmt: skip
    parser.add_argument("--rows", type=int, default=None, help="rows (default 256; quick 3)")
    parser.add_argument("--position", type=int, default=256,
                        help="every row's position (128 + 256: the middle)")  # fmt: skip
    args = parser.parse_args()
    presets = QUICK_PRESETS if args.quick else PRESETS
    rows = args.rows or (3 if args.quick else 256)
    position = 5 if args.quick else args.position
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"account": {}, "timing": []}
    for preset in presets:
        counted = account(preset, rows, position)
        print(account_markdown(preset, counted, rows) + "\n", flush=True)
        result["account"][preset] = {name: {" / ".join(key): value for key, value in table.items()}
                                     for name, table in counted["steps"].items()}  # fmt: skip
    if not args.account:
        device = torch.device(args.device)
        name, peak = peak_bandwidth(device)
        print(f"device: {name}; HBM peak {number(peak and peak / 1e12, 2)} TB/s; {rows} rows "
              f"at position {position}\n")  # fmt: skip
        for preset in presets:  # one preset's weights on the device at a time
            result["timing"] += timing(preset, rows, position, device, peak)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(timing_markdown(result["timing"]))
    (out_dir / "moe_decode_step.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
