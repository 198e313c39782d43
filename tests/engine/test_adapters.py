"""LoRA adapters decoded unmerged (engine/adapters.py): AdapterMatmul's product is peft's own
layer output for every adapted projection, and an engine over a LoRA-injected model samples
what an engine over the merged weights samples."""

from __future__ import annotations

import sys

import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.adapters import AdapterMatmul, adapter_layers
from hybridflow.learners.lora import apply_lora, lora_scalings, merge_lora_stream
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(seed: int = 1):
    model = build_model(preset_config("tiny"), seed=seed).eval()
    apply_lora(model, rank=4, alpha=8, target_modules=TARGETS)
    generator = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # trained adapters: B is no longer 0
            p.data.normal_(0, 0.2, generator=generator)
    return model.requires_grad_(False)


def merged_copy(model):
    plain = build_model(preset_config("tiny"), seed=0).eval()
    state = dict(merge_lora_stream(model.state_dict().items(), lora_scalings(model)))
    plain.load_state_dict(state)
    return plain.requires_grad_(False)


def test_adapter_matmul_equals_each_peft_layer():
    model = lora_model()
    matmul = AdapterMatmul(model)
    layers = adapter_layers(model)
    assert len(layers) == 7 * len(model.model.layers)
    for layer in layers:
        x = torch.randn(5, layer.base_layer.in_features)
        got = matmul.linear(x, layer.weight, layer.bias)
        torch.testing.assert_close(got, layer(x))  # one rounding of the sum, not three
        # a plain weight (no adapter) is the base product alone
        torch.testing.assert_close(matmul.linear(x, layer.weight.clone()), layer.base_layer(x))


def test_disabled_adapters_decode_the_base_model():
    model = lora_model()
    layer = adapter_layers(model)[0]
    x = torch.randn(3, layer.base_layer.in_features)
    layer._disable_adapters = True
    torch.testing.assert_close(AdapterMatmul(model).linear(x, layer.weight, layer.bias),
                               layer.base_layer(x))  # fmt: skip


@pytest.mark.parametrize("n", [1, 3])
def test_engine_over_adapters_samples_as_over_merged_weights(n):
    model = lora_model()
    options = EngineOptions(decode_backend="torch", cuda_graphs=False)
    params = SamplingParams(n=n, temperature=0.9, max_new_tokens=12, seed=5, ignore_eos=True)
    prompts = [[5, 17, 9, 33, 2], [40, 41]]
    adapted = Engine(model, 8, 32, options=options)
    assert adapted.adapted and adapted.fuse_projections == "none"
    got = adapted.generate(prompts, params)
    want = Engine(merged_copy(model), 8, 32, options=options).generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   atol=1e-4, rtol=0)  # fmt: skip


def test_fp32_adapters_beside_a_bf16_base_are_read_in_bf16():
    model = lora_model()
    model.to(torch.bfloat16)
    for name, p in model.named_parameters():
        if "lora_" in name:  # fp32 adapters beside a bf16 base
            p.data = p.data.float()
    layer = adapter_layers(model)[0]
    x = torch.randn(4, layer.base_layer.in_features, dtype=torch.bfloat16)
    got = AdapterMatmul(model).linear(x, layer.weight, layer.bias)
    assert got.dtype == torch.bfloat16
    # peft's fp32 product, within bf16 rounding (a step of 2^-8 of values near 1)
    torch.testing.assert_close(got, layer(x), rtol=0.02, atol=4e-3)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    bf16 = (
        layer.base_layer(x) + layer.scaling["default"] * (x @ a.bfloat16().t()) @ b.bfloat16().t()
    )
    torch.testing.assert_close(got, bf16, rtol=0.02, atol=0.02)


class _RefusePeft:
    """A meta-path finder that records, and refuses, every import of peft."""

    def __init__(self):
        self.asked: list[str] = []

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "peft":
            self.asked.append(name)
            raise ImportError(f"{name} refused by the test")
        return None


def test_a_plain_model_is_answered_without_importing_peft(monkeypatch):
    for name in [n for n in sys.modules if n.split(".")[0] == "peft"]:
        monkeypatch.delitem(sys.modules, name)  # as in a process that never imported peft
    finder = _RefusePeft()
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    assert adapter_layers(build_model(preset_config("tiny"), seed=0)) == []
    assert finder.asked == []
