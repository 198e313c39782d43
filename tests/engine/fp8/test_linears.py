"""The fp8 rollout on the engine's eager passes (engine/fp8/linears.py): which projections of
each family's layers it quantizes, that a pass's projections compute through their e4m3
copies and the modules are the model's own again after it, and, for each family's tiny
preset (Qwen3.5 dense and MoE, DeepSeek-V3, GPT-OSS) on the CPU, an fp8 engine that samples
what the model-dtype engine samples over the weights its copies hold (dequantized: the
difference left is the activations' per-row e4m3 rounding) and that a weight sync
re-quantizes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.fp8.e4m3 import quantize_rows_reference
from hybridflow.engine.fp8.experts import dequantized
from hybridflow.engine.fp8.linears import eager_linears, fp8_projections
from hybridflow.engine.fp8.matmul import Fp8Matmul, scaled_linear
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config

PROMPTS = [[5, 17, 9, 33, 2, 71], [40, 41], [100, 3, 8, 19, 23, 60, 61, 62, 63, 7]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
FP8 = EngineOptions(cuda_graphs=False, weight_format="fp8", steps_per_sync=2)
MODEL_DTYPE = EngineOptions(cuda_graphs=False, steps_per_sync=2)


def _config(preset: str):
    if preset == "tiny-hybrid-moe":  # Qwen3.5-MoE: routed experts beside a shared expert
        return preset_config("tiny-hybrid").replace(
            model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=True,
        )  # fmt: skip
    if preset == "tiny-deepseek-v3":  # kv_a_proj_with_mqa: 40 + 8 rows, fp8-sized
        return preset_config(preset).replace(kv_lora_rank=40)
    return preset_config(preset)


def _model(preset: str):
    """The preset with std-0.1 weights (fp32; biases, sinks and the like zero-mean too)."""
    generator = torch.Generator().manual_seed(3)
    model = build_model(_config(preset), seed=3).eval().requires_grad_(False)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def _names(model) -> set[str]:
    """The quantized projections of the model's layers, as 'mixer.proj' names."""
    linears = {id(m) for m in eager_linears(model)}
    return {name.split(".", 1)[1] for name, m in model.model.layers.named_modules()
            if id(m) in linears}  # fmt: skip


ATTENTION = {f"self_attn.{p}_proj" for p in "qkvo"}
MLP = {f"mlp.{p}_proj" for p in ("gate", "up", "down")}
SHARED = {f"mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down")}
DELTANET = {"linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj"}
MLA = {"self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
       "self_attn.o_proj"}  # fmt: skip


@pytest.mark.parametrize(("preset", "expected"), [
    ("tiny-hybrid", DELTANET | ATTENTION | MLP),
    ("tiny-hybrid-moe", DELTANET | ATTENTION | SHARED),
    ("tiny-deepseek-v3", MLA | MLP | {f"mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down")}),
    ("tiny-gpt-oss", ATTENTION),
])  # fmt: skip
def test_the_projections_quantized_and_those_kept(preset, expected):
    """in_proj_a/b, shared_expert_gate and MLA's kv_b_proj stay in the model's dtype, and so
    do routers, experts (fp8/experts.py's) and the lm_head: no Linear of the list."""
    assert _names(_model(preset)) == expected


def test_a_pass_computes_through_the_copies_and_gives_the_modules_back():
    model = _model("tiny-hybrid")
    linears = eager_linears(model)
    fp8 = Fp8Matmul(model, None, linears=linears)
    proj = model.model.layers[0].linear_attn.in_proj_qkv
    x = torch.randn(3, 2, proj.in_features, generator=torch.Generator().manual_seed(0))
    plain = proj(x)
    _, weight8, scale = fp8.copies[proj.weight.data_ptr()]
    with fp8_projections(fp8, linears):
        got = proj(x)
    assert torch.equal(got, scaled_linear(x.reshape(6, -1), weight8, scale).view(3, 2, -1))
    assert not torch.equal(got, plain)
    assert torch.equal(proj(x), plain) and "forward" not in proj.__dict__
    with pytest.raises(RuntimeError), fp8_projections(fp8, linears):
        raise RuntimeError  # an error inside a pass gives the modules back too
    assert all("forward" not in linear.__dict__ for linear in linears)


def _rounded_rows(module, args):
    """A reference Linear's input as the fp8 matmul multiplies it: rounded per row to e4m3
    and widened back (fp8/e4m3.py)."""
    (x,) = args
    values, scale = quantize_rows_reference(x.reshape(-1, x.shape[-1]))
    return ((values.float() * scale).to(x.dtype).view_as(x),)


def _rounded_row_parts(parts: int):
    """_rounded_rows over each of ``parts`` column slices of the input with its own scale (a
    row-parallel projection's input as the ranks of a tensor-parallel group round it)."""

    def hook(module, args):
        (x,) = args
        pieces = x.chunk(parts, dim=-1)
        return (torch.cat([_rounded_rows(module, (piece,))[0] for piece in pieces], dim=-1),)

    return hook


def _emulated_model(model, engine, split_inputs: dict[str, int] | None = None):
    """A copy of model computing in the model's dtype what the engine's fp8 copies compute:
    its quantized weights widened back from the copies' e4m3 and scales, the inputs of those
    projections rounded per row (forward pre-hooks on the copy), or, for the modules named in
    split_inputs, per row of each of that many column slices; routed experts weight-only.
    What is left between the two: the order of the fp32 sums."""
    reference = copy.deepcopy(model)
    by_ptr = {weight.data_ptr(): (w8, scale) for weight, w8, scale in engine.fp8.copies.values()}
    split_inputs = split_inputs or {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.weight.data_ptr() in by_ptr:
            w8, scale = by_ptr[module.weight.data_ptr()]
            twin = reference.get_submodule(name)
            twin.weight.copy_((w8.float() * scale.view(-1, 1)).to(module.weight.dtype))
            parts = split_inputs.get(name)
            twin.register_forward_pre_hook(_rounded_rows if parts is None else
                                           _rounded_row_parts(parts))  # fmt: skip
    for index, copies in engine.fp8.experts.layers.items():
        experts = reference.model.layers[index].mlp.experts
        experts.gate_up_proj.copy_(dequantized(copies.gate_up, copies.gate_up_scale,
                                               experts.gate_up_proj.dtype))  # fmt: skip
        experts.down_proj.copy_(dequantized(copies.down, copies.down_scale,
                                            experts.down_proj.dtype))  # fmt: skip
    return reference


def _generate(engine_or_model, options=MODEL_DTYPE):
    engine = engine_or_model
    if not isinstance(engine, Engine):
        engine = Engine(engine_or_model, 4, 64, options=options)
    return engine, engine.generate(PROMPTS, GREEDY)


def _assert_same(got, expected, atol):
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=atol)


def _flip_outputs(model) -> None:
    """A training step in place: every layer's last projection of its mixer and MLP (and
    the routed experts' down projections) negated."""
    for layer in model.model.layers:
        mixer = getattr(layer, layer.mixer_name)
        getattr(mixer, "o_proj", getattr(mixer, "out_proj", None)).weight.mul_(-1.0)
        experts = getattr(layer.mlp, "experts", None)
        down = getattr(experts, "down_proj", None)
        if isinstance(down, torch.Tensor):
            down.mul_(-1.0)
        for mlp in (layer.mlp, getattr(layer.mlp, "shared_expert", None),
                    getattr(layer.mlp, "shared_experts", None)):  # fmt: skip
            if isinstance(getattr(mlp, "down_proj", None), nn.Linear):
                mlp.down_proj.weight.mul_(-1.0)


def _assert_copies_hold(model, engine) -> None:
    """Every e4m3 copy holds its live weight quantized (the engine's scales)."""
    for weight, w8, scale in engine.fp8.copies.values():
        values, row_scale = quantize_rows_reference(weight)
        assert torch.equal(w8.view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(scale, row_scale.view(1, -1))
    for index, copies in engine.fp8.experts.layers.items():
        experts = model.model.layers[index].mlp.experts
        for live, values in ((experts.gate_up_proj, copies.gate_up),
                             (experts.down_proj, copies.down)):  # fmt: skip
            want = quantize_rows_reference(live.flatten(0, 1)).values.view(live.shape)
            assert torch.equal(values.view(torch.uint8), want.view(torch.uint8))


PRESETS = ["tiny-hybrid", "tiny-hybrid-moe", "tiny-deepseek-v3", "tiny-gpt-oss"]


@pytest.mark.parametrize("preset", PRESETS)
def test_an_fp8_engine_computes_its_copies_and_a_sync_requantizes(preset):
    """Greedy tokens and log-probs (prefill, decode) of the fp8 engine are those of the model
    over the copies' weights and rounded inputs, within fp32 noise; and near the model's
    own (the e4m3 error). After a weight sync the copies hold the new weights."""
    model = _model(preset)
    engine, got = _generate(model, FP8)
    assert engine.fp8.linears and engine.fp8.copies
    assert bool(engine.fp8.experts.layers) == (preset in ("tiny-hybrid-moe", "tiny-deepseek-v3"))
    _assert_same(got, _generate(_emulated_model(model, engine))[1], atol=1e-4)
    _, plain = _generate(model)
    for a, b in zip(got, plain):  # the first token: the prompt alone, the same context
        assert abs(a.logprobs[0] - b.logprobs[0]) < 0.3
    assert any(a.logprobs != b.logprobs for a, b in zip(got, plain))

    _flip_outputs(model)
    engine.weights_updated()
    _, synced = _generate(engine)
    _assert_copies_hold(model, engine)
    assert [a.logprobs for a in synced] != [a.logprobs for a in got]
    _assert_same(synced, _generate(_emulated_model(model, engine))[1], atol=1e-4)


def test_a_released_engine_wraps_its_passes_once_again():
    """release() and the next cache: the eager passes are wrapped from the engine's own
    extend pass again, not around the last cache's wrapper."""
    model = _model("tiny-gpt-oss")
    engine, first = _generate(model, FP8)
    engine.release()
    _, again = _generate(engine)
    assert [c.token_ids for c in again] == [c.token_ids for c in first]
    assert not hasattr(engine.extend.eager_pass, "eager_pass")
