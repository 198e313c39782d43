"""`python benchmarks/delta_step.py --out DIR`: Gated DeltaNet's decode step at the Qwen3.5-4B
shape (256 rows, 16 key heads, 32 value heads of 128 x 128, a 4-tap conv), bf16.

Two tables:

1. The step between the projections (what runs after in_proj_qkv/a/b/z and before out_proj),
   each path on the same inputs and its output's error against the torch op
   (GatedDeltaNet.decode + its gated norm) on the same states: the former layout
   (kernels/delta_step_grouped.py, alone and with the gates and gated norm in torch as the
   engine ran them) and the two-kernel step (kernels/delta_step.py) over a sweep of its
   launch parameters (block_v x num_warps). GB/s counts the bytes the step must move (the
   fp32 state read and written, the conv state read and written, mixed/a/b/z read, the
   output written) over the time; "of peak" against the device's HBM peak (H100 3.35 TB/s,
   H200 4.8 TB/s) and against a measured device-to-device copy.
2. One whole decode step of the qwen3.5-4b preset (random weights) at 256 rows, each at
   position --position, through the engine's torch decode step (layers/eager.py, as the
   engine runs a hybrid model), eager and replayed as a CUDA graph: the step as it was (the
   grouped kernel, torch attention and norms), then the two-kernel step, then the attention
   kernel on the cache in place, then the fused residual adds and norms. The floor is the
   weights (a tied embedding once), the recurrent states read and written and the K/V read,
   over the HBM peak; "of floor" is the floor over the graph's time.

Table 1 times CUDA graphs of 10 calls, table 2 of 3 steps (the engine replays its decode step
as a graph); each median of 5 replays.

    python benchmarks/delta_step.py --out $OUT                  # H100/H200: ~3 min
    python benchmarks/delta_step.py --out $OUT --no-engine      # table 1 only
    TRITON_INTERPRET=1 python benchmarks/delta_step.py --device cpu --quick   # CPU smoke run
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path

import torch

SHAPE = dict(rows=256, hidden=2560, key_heads=16, value_heads=32, dk=128, dv=128, kernel=4)
QUICK_SHAPE = dict(rows=3, hidden=32, key_heads=2, value_heads=4, dk=16, dv=8, kernel=4)
PEAK_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}  # HBM3e / HBM3 (SXM)
SWEEP = dict(block_v=(16, 32, 64, 128), num_warps=(2, 4, 8))
QUICK_SWEEP = dict(block_v=(4, 8), num_warps=(2,))


def peak_bandwidth(device: torch.device) -> tuple[str, float | None]:
    """(device name, its HBM peak in bytes/s, None where unknown)."""
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    return name, next((peak for key, peak in PEAK_BYTES_PER_S.items() if key in name), None)


def copy_bandwidth(device: torch.device) -> float | None:
    """Bytes read + written per second by a 2 GiB device-to-device copy (None on CPU)."""
    if device.type != "cuda":
        return None
    src = torch.empty(2**31, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed_us(lambda: dst.copy_(src), device) / 1e6
    return 2 * src.numel() / seconds


def timed_us(fn, device: torch.device, calls: int = 10, replays: int = 5,
             graph: bool = True) -> float:  # fmt: skip
    """Median microseconds a call of fn(): `calls` calls captured in one CUDA graph (graph),
    or launched one by one, timed by CUDA events; on the CPU the host clock, once."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiled and warm before a capture (torch's recipe)
        fn()
    torch.cuda.current_stream().wait_stream(side)
    run = lambda: [fn() for _ in range(calls)]  # noqa: E731
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            run()
        run = captured.replay
    run()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def mixer_case(shape: dict, device: torch.device, dtype: torch.dtype):
    """A GatedDeltaNet at `shape` (random weights, HF's decay init) and the step's inputs:
    the projections of a random x, conv/ssm states of rows + 1 slots (the last: scratch)."""
    from hybridflow.models.mixers.gated_deltanet import GatedDeltaNet
    from hybridflow.models.presets import preset_config

    config = preset_config("tiny-hybrid")
    config.hidden_size, config.linear_conv_kernel_dim = shape["hidden"], shape["kernel"]
    config.linear_num_key_heads, config.linear_num_value_heads = (
        shape["key_heads"], shape["value_heads"])  # fmt: skip
    config.linear_key_head_dim, config.linear_value_head_dim = shape["dk"], shape["dv"]
    generator = torch.Generator(device).manual_seed(0)
    mixer = GatedDeltaNet(config).to(device, dtype).requires_grad_(False)
    for p in mixer.parameters():
        p.normal_(0, shape["hidden"] ** -0.5, generator=generator)
    mixer.init_state_parameters(generator)
    mixer.norm.weight.fill_(1.0)
    rows = shape["rows"]
    conv_dim = mixer.conv1d.weight.shape[0]
    x = torch.randn(rows, shape["hidden"], device=device, generator=generator).to(dtype)
    inputs = dict(
        mixed=mixer.in_proj_qkv(x), a=mixer.in_proj_a(x), b=mixer.in_proj_b(x),
        z=mixer.in_proj_z(x),
        conv=torch.randn(rows + 1, conv_dim, shape["kernel"] - 1, device=device,
                         generator=generator).to(dtype),
        ssm=torch.randn(rows + 1, shape["value_heads"], shape["dk"], shape["dv"], device=device,
                        generator=generator) * 0.1,
        slots=torch.arange(rows, device=device),
    )  # fmt: skip
    return mixer, inputs


def step_bytes(inputs: dict) -> int:
    """Bytes the step must move: the states read and written, mixed/a/b/z read, out written."""
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    rows = len(inputs["slots"])
    states = sum(size(inputs[name]) * rows // inputs[name].shape[0] for name in ("conv", "ssm"))
    reads = sum(size(inputs[name]) for name in ("mixed", "a", "b", "z"))
    return 2 * states + reads + size(inputs["z"])


def step_paths(mixer, inputs: dict, sweep: dict) -> dict:
    """name -> a call running the step between the projections (in place on the states)."""
    from hybridflow.engine.kernels.delta_step import DeltaParams, DeltaStepLaunch, gated_delta_step
    from hybridflow.engine.kernels.delta_step_grouped import delta_rule_step

    mixed, a, b, z, conv, ssm, slots = (inputs[k] for k in
                                        ("mixed", "a", "b", "z", "conv", "ssm", "slots"))  # fmt: skip
    params = DeltaParams.of(mixer)
    dv = ssm.shape[-1]

    def gates():  # GatedDeltaNet.gates after its two projections
        g = -mixer.A_log.float().exp() * torch.nn.functional.softplus(
            a.float() + mixer.dt_bias.float()
        )
        return g, torch.sigmoid(b)

    def grouped(g, beta):
        return delta_rule_step(mixed, conv, mixer.conv1d.weight, ssm, g, beta, slots, slots,
                               mixer.num_k_heads)  # fmt: skip

    def grouped_torch_around():
        core = grouped(*gates()).to(mixed.dtype)
        return mixer.norm(core, z.unflatten(-1, (-1, dv))).flatten(-2)

    fixed_gates = gates()
    paths = {"grouped kernel alone (before)": lambda: grouped(*fixed_gates),
             "grouped + torch gates and norm (before)": grouped_torch_around}  # fmt: skip
    for block_v, warps in itertools.product(sweep["block_v"], sweep["num_warps"]):
        launch = DeltaStepLaunch(block_v, warps)
        paths[f"two kernels, block_v {block_v}, {warps} warps"] = (
            lambda launch=launch: gated_delta_step(mixed, a, b, z, conv, ssm, slots, slots,
                                                   params, launch))  # fmt: skip
    return paths


def torch_reference(mixer, inputs: dict) -> torch.Tensor:
    """The torch op's output (decode's conv, gates, delta rule, then the gated norm) on copies
    of the states: what each path's output is checked against."""
    from hybridflow.models.mixers.gated_delta_rule import recurrent_gated_delta_rule

    mixed, conv, ssm = inputs["mixed"], inputs["conv"][:-1], inputs["ssm"][:-1]
    window = torch.cat([conv.to(mixed.dtype), mixed[..., None]], dim=-1)
    convolved = (window * mixer.conv1d.weight[:, 0, :].to(window.dtype)).sum(-1)
    q, k, v = mixer._heads(torch.nn.functional.silu(convolved))
    a, b = inputs["a"], inputs["b"]
    g = -mixer.A_log.float().exp() * torch.nn.functional.softplus(a.float() + mixer.dt_bias.float())
    core, _ = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None],
                                         torch.sigmoid(b)[:, None], ssm.clone())  # fmt: skip
    z = inputs["z"].unflatten(-1, (-1, v.shape[-1]))
    return mixer.norm(core[:, 0].to(v.dtype), z).flatten(-2)


def step_table(shape: dict, sweep: dict, device: torch.device, dtype: torch.dtype,
               peaks: dict) -> list[dict]:  # fmt: skip
    """Table 1's rows: each path timed, its GB/s and its error against the torch op."""
    mixer, inputs = mixer_case(shape, device, dtype)
    reference = torch_reference(mixer, inputs).float()
    moved = step_bytes(inputs)
    saved = {name: inputs[name].clone() for name in ("conv", "ssm")}
    rows = []
    for name, fn in step_paths(mixer, inputs, sweep).items():
        for key, tensor in saved.items():
            inputs[key].copy_(tensor)
        out = fn()
        if out.dim() == 3:  # the grouped kernel alone: its core, before the norm
            error = None
        else:
            error = ((out.float() - reference).norm() / reference.norm()).item()
        us = timed_us(fn, device)
        rows.append({"path": name, "us": us, "bytes": moved, "rel_err": error,
                     **bandwidth_columns(moved, us, peaks)})  # fmt: skip
    return rows


def bandwidth_columns(moved: int, us: float, peaks: dict) -> dict:
    rate = moved / (us / 1e6)
    share = {f"of_{name}": rate / peak for name, peak in peaks.items() if peak}
    return {"gb_per_s": rate / 1e9, **share}


def engine_case(preset: str, rows: int, max_seq_len: int, device: torch.device):
    """(model, engine) of a preset with random weights, its cache allocated."""
    from hybridflow.engine import Engine, EngineOptions
    from hybridflow.models import build_model
    from hybridflow.models.presets import preset_config

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(preset_config(preset), dtype=dtype, device=device).eval()
    model.requires_grad_(False)
    engine = Engine(model, rows, max_seq_len, options=EngineOptions(cuda_graphs=False))
    assert engine.num_slots >= rows  # allocates the cache
    return model, engine


def engine_floor_bytes(model, engine, rows: int, position: int) -> int:
    """Weights (a tied embedding once; an untied one's rows only), the recurrent states read
    and written, the K/V of positions 0..position read, for one step of `rows` rows."""
    unique = {id(p): p for p in model.parameters()}
    weights = sum(p.numel() * p.element_size() for p in unique.values())
    embed = model.model.embed_tokens.weight
    if model.lm_head.weight is not embed:
        weights -= embed.numel() * embed.element_size()
    states = engine.cache.states
    per_slot = states.nbytes() // states.conv.shape[1]
    kv = 0
    if engine.cache.keys is not None and engine.cache.keys.numel():
        keys = engine.cache.keys  # [kv layers, ..., nkv, D]
        kv = 2 * keys.shape[0] * rows * (position + 1) * keys.shape[-2] * keys.shape[-1]
        kv *= keys.element_size()
    return weights + 2 * rows * per_slot + kv


# (recurrent step, attention step, norm step): the engine's step before (the grouped kernel,
# the torch attention and norms), then each change on top of the one before
ENGINE_STEPS = (("triton-grouped", "torch", "torch"), ("triton", "torch", "torch"),
                ("triton", "triton", "torch"), ("triton", "triton", "triton"))  # fmt: skip


def engine_table(preset: str, rows: int, position: int, max_seq_len: int, device: torch.device,
                 peaks: dict) -> list[dict]:  # fmt: skip
    """Table 2's rows: the whole decode step per ENGINE_STEPS entry, eager and as a CUDA graph, and its logits' largest difference from the first row's (states zeroed
    before each check, so every variant steps from the same state)."""
    from hybridflow.engine.layers.eager import decode_forward_torch

    model, engine = engine_case(preset, rows, max_seq_len, device)
    cache, rope = engine.cache, engine.rope
    vocab = model.config.vocab_size
    tokens = torch.randint(vocab, (rows,), device=device, generator=torch.Generator(device))
    positions = torch.full((rows,), position, device=device)
    slots = torch.arange(rows, device=device)
    frozen = torch.zeros(rows, dtype=torch.bool, device=device)
    floor = engine_floor_bytes(model, engine, rows, position)
    out, first = [], None
    for recurrent, attention, norms in ENGINE_STEPS:
        step = lambda r=recurrent, a=attention, n=norms: decode_forward_torch(  # noqa: E731
            model, cache, rope, tokens, positions, slots, cache.max_seq_len, frozen=frozen,
            recurrent_step=r, attention_step=a, norm_step=n)  # fmt: skip
        cache.states.conv.zero_()
        cache.states.ssm.zero_()
        logits = step().float()
        first = logits if first is None else first
        eager = timed_us(step, device, calls=3, graph=False)
        graph = timed_us(step, device, calls=3) if device.type == "cuda" else None
        out.append({"recurrent": recurrent, "attention": attention, "norms": norms,
                    "eager_ms": eager / 1e3,
                    "graph_ms": None if graph is None else graph / 1e3, "floor_bytes": floor,
                    "max_logit_diff": (logits - first).abs().max().item(),
                    **{f"floor_ms_{k}": floor / peak * 1e3 for k, peak in peaks.items() if peak}})  # fmt: skip
    return out


def percent(value) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def number(value, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def step_markdown(rows: list[dict]) -> str:
    lines = ["| path | us | GB/s | of peak | of copy | rel. error |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        error = "n/a" if row["rel_err"] is None else f"{row['rel_err']:.1e}"
        lines.append(f"| {row['path']} | {number(row['us'])} | {number(row['gb_per_s'])} | "
                     f"{percent(row.get('of_peak'))} | {percent(row.get('of_copy'))} | {error} |")  # fmt: skip
    return "\n".join(lines)


def engine_markdown(rows: list[dict]) -> str:
    lines = ["| recurrent step | attention step | norm step | eager ms | graph ms | floor ms "
             "| of floor | max logit diff |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        floor = row.get("floor_ms_peak")
        share = None if floor is None or row["graph_ms"] is None else floor / row["graph_ms"]
        lines.append(f"| {row['recurrent']} | {row['attention']} | {row['norms']} "
                     f"| {number(row['eager_ms'], 2)} "
                     f"| {number(row['graph_ms'], 2)} | {number(floor, 2)} | {percent(share)} "
                     f"| {row['max_logit_diff']:.2e} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/delta_step"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny shape and tiny-hybrid (CPU smoke run, TRITON_INTERPRET=1)")  # fmt: skip
    parser.add_argument("--no-engine", action="store_true", help="table 1 only")
    parser.add_argument("--rows", type=int, default=None, help="rows (default 256; quick 3)")
    parser.add_argument("--position", type=int, default=256,
                        help="every row's position in the engine step (128 + 256: the middle)")  # fmt: skip
    args = parser.parse_args()
    device = torch.device(args.device)
    shape = dict(QUICK_SHAPE if args.quick else SHAPE)
    shape["rows"] = args.rows or shape["rows"]
    name, peak = peak_bandwidth(device)
    peaks = {"peak": peak, "copy": copy_bandwidth(device)}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"device: {name}; HBM peak {number(peak and peak / 1e12, 2)} TB/s, measured copy "
          f"{number(peaks['copy'] and peaks['copy'] / 1e12, 2)} TB/s; shape {shape}\n")  # fmt: skip
    with torch.no_grad():
        steps = step_table(shape, QUICK_SWEEP if args.quick else SWEEP, device, dtype, peaks)
        print(step_markdown(steps) + "\n")
        engine = []
        if not args.no_engine:
            preset = "tiny-hybrid" if args.quick else "qwen3.5-4b"
            position = min(args.position, 8) if args.quick else args.position
            engine = engine_table(preset, shape["rows"], position, 16 if args.quick else 384,
                                  device, peaks)  # fmt: skip
            print(f"{preset}, {shape['rows']} rows at position {position}:")
            print(engine_markdown(engine))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": name, "peaks": peaks, "shape": shape, "step": steps, "engine": engine}
    (out / "delta_step.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
