"""What the actor update keeps per token in a hybrid model (memory_activations.py): each
layer by its own mixer, Gated DeltaNet's tensors in its layers and attention's in the others."""

from __future__ import annotations

from hybridflow.models.presets import PRESETS
from hybridflow.trainer.plan.memory_activations import (
    activation_bytes_per_token,
    deltanet_mixer_elements,
    largest_layer_activation_elements,
    layer_activation_elements,
)


def test_deltanet_layers_keep_their_mixers_tensors_not_attentions():
    a = PRESETS["qwen3.5-4b"]  # 24 DeltaNet layers (16 key, 32 value heads of 128), 8 gated
    h, i = 2560, 9216
    key, value, heads = 16 * 128, 32 * 128, 32
    conv = 2 * key + value
    assert deltanet_mixer_elements(a) == 3 * conv + 2 * key + 3 * value + heads * (3 + 64)
    deltanet = 4 * h + deltanet_mixer_elements(a) + 4 * i
    q, kv = 16 * 256, 4 * 256  # gated attention: q, k, v, output, q/k-norm inputs, the gate
    gated = 4 * h + 2 * q + 2 * kv + (q + kv) + q + 4 * i
    assert layer_activation_elements(a, mixer="gated_deltanet") == deltanet
    assert layer_activation_elements(a, mixer="gated_attention") == gated
    assert activation_bytes_per_token(a, False) == 2 * (24 * deltanet + 8 * gated + 3 * h)
    assert largest_layer_activation_elements(a) == deltanet
    checkpointed = 32 * h + deltanet + 3 * h  # the layer inputs, one layer recomputed, head
    assert activation_bytes_per_token(a, True) == 2 * checkpointed


def test_attention_models_keep_what_they_kept():
    a = PRESETS["qwen2.5-0.5b"]
    assert largest_layer_activation_elements(a) == layer_activation_elements(a)
    moe = PRESETS["qwen3-30b-a3b"]
    assert largest_layer_activation_elements(moe) == layer_activation_elements(moe, True)


def test_compiled_layers_keep_three_mlp_intermediates_not_four():
    """Inductor's partitioner recomputes SiLU(gate) in the backward: a compiled dense layer
    keeps gate, up and their product (3i); experts keep theirs either way."""
    a = PRESETS["qwen2.5-0.5b"]
    h, i, q, kv = 896, 4864, 14 * 64, 2 * 64
    eager = 4 * h + 2 * q + 2 * kv + 4 * i
    assert layer_activation_elements(a) == eager
    assert layer_activation_elements(a, compiled=True) == eager - i
    assert activation_bytes_per_token(a, False, compiled=True) == 2 * (24 * (eager - i) + 3 * h)
    moe = PRESETS["qwen3-30b-a3b"]
    assert layer_activation_elements(moe, True, compiled=True) == layer_activation_elements(
        moe, True
    )


def test_the_plan_counts_compiled_layers_where_training_compiles_them():
    from hybridflow.config import load_config, validate
    from hybridflow.trainer.plan.memory_from_config import plan_for_config

    def activations(*overrides):
        cfg = load_config(None, ["model.path=qwen2.5-0.5b", *overrides])
        plan = plan_for_config(cfg, validate(cfg), 80 * 2**30)
        (item,) = [item for item in plan.items if item.name.startswith("activations")]
        return item

    on_gpu, eager, on_cpu = (activations("trainer.device=cuda"),
                             activations("trainer.device=cuda", "model.compile=false"),
                             activations("trainer.device=cpu"))  # fmt: skip
    assert "compiled" in on_gpu.name and "compiled" not in eager.name + on_cpu.name
    assert on_gpu.gpu_bytes < eager.gpu_bytes == on_cpu.gpu_bytes
