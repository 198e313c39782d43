"""The FP8 trainer's weights are the rollout's: a one-device trainer with fp32 masters under
bf16 autocast quantizes each projection into the e4m3 bytes and scales the FP8 rollout makes
from the bf16 weights it is synced (torchao emulated on the CPU)."""

import copy

import pytest
import torch
from learner_helpers import tiny_model

pytest.importorskip("torchao.float8")

from hybridflow.engine.fp8.matmul import Fp8Matmul  # noqa: E402
from hybridflow.engine.weights.fused import FusedProjections  # noqa: E402
from hybridflow.learners.fp8_training import Fp8Training, convert_to_fp8  # noqa: E402

QKV = ("q_proj", "k_proj", "v_proj")


def _trainer_weight_casts(model, monkeypatch, autocast: bool = True) -> dict:
    """{linear name: (e4m3 [N, K], scale [N]) its forward multiplies by}, recorded in one
    forward of ``model`` under bf16 autocast on its device (the one-device trainer's) or
    without."""
    import torchao.float8.float8_linear as float8_linear
    from torchao.float8.float8_training_tensor import GemmInputRole

    cast, current, seen = float8_linear.hp_tensor_to_float8_dynamic, [], {}

    def recording(tensor, *args, **kwargs):
        out = cast(tensor, *args, **kwargs)
        if kwargs.get("gemm_input_role") is GemmInputRole.WEIGHT:
            seen[current[-1]] = out
        return out

    hooks = [
        module.register_forward_pre_hook(lambda _m, _i, name=name: current.append(name))
        for name, module in model.named_modules()
        if name.endswith("_proj")
    ]
    with monkeypatch.context() as patch:
        patch.setattr(float8_linear, "hp_tensor_to_float8_dynamic", recording)
        device = next(model.parameters()).device
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            model(torch.arange(16, device=device).view(2, 8))
    for hook in hooks:
        hook.remove()
    # the forward casts weight.t() [K, N]; its matmul multiplies by 1 / torchao's multiplier
    return {
        name: (out._data.t(), out._scale.reciprocal().reshape(-1).expand(out._data.shape[1]))
        for name, out in seen.items()
    }


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _device(name: str) -> torch.device:
    """The CPU (torchao emulated), or a GPU with float8 tensor cores (torchao's kernels)."""
    if name == "cuda" and not (
        torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    ):
        pytest.skip("needs a GPU of compute capability >= 8.9")
    return torch.device(name)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_the_rollouts_fp8_weights_are_the_bytes_and_scales_of_the_trainers_forward(
    recipe, device, monkeypatch
):
    device = _device(device)
    trainer = tiny_model(seed=3)
    for param in trainer.parameters():  # fp32 values that bf16 rounds
        param.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(param.numel()))
    trainer.to(device)
    assert next(trainer.parameters()).dtype == torch.float32
    rollout = copy.deepcopy(trainer).to(torch.bfloat16).requires_grad_(False)  # the weight sync
    emulate = device.type == "cpu"
    convert_to_fp8(trainer, Fp8Training(recipe=recipe, emulate=emulate), fsdp=False)
    casts = _trainer_weight_casts(trainer, monkeypatch)
    fused = FusedProjections(rollout, gate_up=True, fold=False)
    matmul = Fp8Matmul(rollout, fused, weight_scales=recipe)
    compared = 0
    for index, layer in enumerate(rollout.model.layers):
        prefix = f"model.layers.{index}"
        _, qkv8, qkv_scale = matmul.copies[fused.qkv_weight[index].data_ptr()]
        rows = 0
        for proj in QKV:
            values, scale = casts[f"{prefix}.self_attn.{proj}"]
            part = slice(rows, rows + values.shape[0])
            assert _same_bits(qkv8[part], values), f"{prefix}.{proj}"
            assert torch.equal(qkv_scale[0, part], scale), f"{prefix}.{proj}"
            rows, compared = rows + values.shape[0], compared + 1
        _, pairs8, pairs_scale = matmul.copies[fused.gate_up_weight[index].data_ptr()]
        for offset, proj in enumerate(("gate_proj", "up_proj")):  # interleaved rows
            values, scale = casts[f"{prefix}.mlp.{proj}"]
            assert _same_bits(pairs8[offset::2], values), f"{prefix}.{proj}"
            assert torch.equal(pairs_scale[0, offset::2], scale), f"{prefix}.{proj}"
            compared += 1
        for module in (layer.self_attn.o_proj, layer.mlp.down_proj):
            name = next(n for n, m in rollout.named_modules() if m is module)
            _, weight8, weight_scale = matmul.copies[module.weight.data_ptr()]
            values, scale = casts[name]
            assert _same_bits(weight8, values) and torch.equal(weight_scale[0], scale), name
            compared += 1
    assert compared == len(casts) == 7 * len(rollout.model.layers)


def test_outside_autocast_the_fp32_weight_is_quantized_as_it_is(monkeypatch):
    """An fp32 forward (no autocast: an accuracy check) keeps torchao's cast of the fp32
    master; under autocast the bf16 copy's cast is differentiable: the masters get gradients."""
    from hybridflow.engine.fp8.weight_scales import quantize_weight

    model = tiny_model(seed=3)
    convert_to_fp8(model, Fp8Training(recipe="rowwise", emulate=True), fsdp=False)
    name = "model.layers.0.self_attn.q_proj"
    weight = model.get_submodule(name).weight
    values, scale = _trainer_weight_casts(model, monkeypatch, autocast=False)[name]
    expected_values, expected_scale = quantize_weight(weight.detach(), "rowwise")
    assert _same_bits(values, expected_values) and torch.equal(scale, expected_scale[:, 0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(torch.arange(12).view(2, 6))
    logits.float().square().mean().backward()
    assert weight.grad is not None and weight.grad.dtype == torch.float32
    assert weight.grad.abs().sum() > 0


def test_a_lora_rollout_quantizes_the_merged_weight_not_the_trainers_frozen_base(monkeypatch):
    """LoRA: the trainer's FP8 linear quantizes the frozen base W and adds the bf16 adapters'
    s·B(A x) beside it; the rollout receives W + s·BA merged (the sync folds the adapters in)
    and quantizes that. While B = 0 (peft's initialisation) the bytes and scales are the
    trainer's; once the adapters have trained, those of the adapted projections are not (the
    others stay equal). Equal bytes would need the rollout to decode the adapters unmerged,
    which the fp8 engine refuses (engine/fp8/matmul.check_fp8_engine)."""
    from learner_helpers import actor_config, make_batch

    from hybridflow.config import ModelConfig
    from hybridflow.engine.fp8.weight_scales import quantize_weight
    from hybridflow.learners import ActorLearner

    lora = ModelConfig(path="tiny", lora_rank=4, lora_alpha=8,
                       lora_target_modules=["q_proj", "v_proj"])  # fmt: skip
    actor = ActorLearner(tiny_model(seed=3), actor_config(precision="fp8", ppo_mini_batch_size=8),
                         total_steps=1, device="cpu", model_cfg=lora, fp8_emulate=True)  # fmt: skip

    def projections_that_differ() -> list[str]:
        casts = _trainer_weight_casts(actor.model, monkeypatch)  # bf16 autocast: one GPU's
        assert len(casts) == 14  # 7 projections in each of 2 layers
        synced = dict(actor.hf_weights(torch.bfloat16))  # what the rollout receives
        differ = []
        for name, (values, scale) in casts.items():
            rollout_values, rollout_scale = quantize_weight(synced[f"{name}.weight"], "rowwise")
            if not (_same_bits(values, rollout_values) and torch.equal(scale, rollout_scale[:, 0])):
                differ.append(name.split(".", 2)[2])  # 0.self_attn.q_proj
        return sorted(differ)

    assert projections_that_differ() == []
    actor.update(make_batch(seed=3))
    adapted = [f"{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    assert projections_that_differ() == adapted
