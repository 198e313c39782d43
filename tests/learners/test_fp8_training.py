"""FP8 training (actor.precision=fp8) on the CPU through torchao's emulation: which linears
convert, one update against bf16's, and that checkpoints and weight sync stay plain tensors."""

import dataclasses
import importlib.util

import pytest
import torch
from learner_helpers import (
    actor_config,
    flat_params,
    make_batch,
    max_abs_diff,
    record_float8_token_counts,
    tiny_model,
)
from torch import nn

from hybridflow.config import CriticConfig, ModelConfig
from hybridflow.errors import UserError
from hybridflow.learners import ActorLearner, CriticLearner
from hybridflow.learners.fp8_training import (
    fp8_device_problem,
    fp8_linear_names,
    import_torchao_float8,
    plain_tensor,
)
from hybridflow.learners.lora import apply_lora
from hybridflow.models import load_model
from hybridflow.protocol import Batch

PROJECTIONS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]  # fmt: skip


def _actor(precision="fp8", model=None, **cfg):
    return ActorLearner(
        model or tiny_model(),
        actor_config(precision=precision, **cfg),
        total_steps=4,
        device="cpu",
        fp8_emulate=precision == "fp8",
    )


def test_the_decoder_projections_convert_not_the_embedding_head_or_odd_dims():
    model = tiny_model()
    # a projection whose output (200) is not a multiple of 16 stays bf16
    model.model.layers[1].mlp.up_proj = nn.Linear(64, 200, bias=False)
    names = fp8_linear_names(model)
    expected = [f"model.layers.{i}.{p}" for i in range(2) for p in PROJECTIONS]
    assert names == [n for n in expected if n != "model.layers.1.mlp.up_proj"]


def test_routers_and_lora_adapters_stay_bf16_lora_base_layers_convert():
    moe = load_model("tiny-moe")
    # transformers' mixtures of experts route with a Linear named gate (ours: a TopKRouter)
    moe.model.layers[1].mlp.gate = nn.Linear(128, 16, bias=False)
    sparse = [n for n in fp8_linear_names(moe) if n.startswith("model.layers.1.")]
    # the experts are grouped Parameters, not Linears: only the attention converts
    assert sparse == [f"model.layers.1.{p}" for p in PROJECTIONS[:4]]
    model = tiny_model()
    apply_lora(model, rank=4, alpha=8, target_modules=["q_proj", "v_proj"], dropout=0.0, seed=0)
    names = fp8_linear_names(model)
    assert "model.layers.0.self_attn.q_proj.base_layer" in names
    assert not any("lora_" in n for n in names)


def test_fp8_on_the_cpu_without_emulation_is_refused_naming_the_key():
    assert "compute capability >= 8.9" in fp8_device_problem(torch.device("cpu"))
    assert fp8_device_problem(torch.device("cpu"), emulate=True) is None
    with pytest.raises(UserError, match=r"actor.precision = fp8: .*8\.9.*set actor.precision=bf16"):
        ActorLearner(tiny_model(), actor_config(precision="fp8"), total_steps=1, device="cpu")


def test_a_gpu_without_float8_tensor_cores_is_named_with_its_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100")
    problem = fp8_device_problem(torch.device("cuda", 0))
    assert "cuda:0 (NVIDIA A100) has 8.0" in problem and ">= 8.9" in problem
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert fp8_device_problem(torch.device("cuda", 0)) is None


def test_a_missing_torchao_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "torchao.float8", None)
    with pytest.raises(UserError, match=r"torchao.*\[fp8\]"):
        import_torchao_float8()


needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None,
    reason="torchao (the fp8 extra: pip install -e '.[fp8]') is not installed",
)


@needs_torchao
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_one_update_in_fp8_stays_near_bf16s_and_keeps_fp32_masters(recipe):
    batch = make_batch(seed=3)
    # one optimizer step over the 8 rows: later steps of this random batch sit on PPO's clip
    # boundary, where a token flipping in or out of the clip changes the gradient whole
    one_step = dict(ppo_mini_batch_size=8)
    reference = _actor("bf16", **one_step)
    before = flat_params(reference.model)
    expected = reference.update(batch)
    actor = _actor(fp8_recipe=recipe, **one_step)
    from torchao.float8.float8_linear import Float8Linear

    converted = [n for n, m in actor.model.named_modules() if isinstance(m, Float8Linear)]
    assert converted == actor.core.fp8_linears == fp8_linear_names(tiny_model())
    metrics = actor.update(batch)
    # e4m3 keeps 3 mantissa bits: a relative step of 2^-4 per operand; measured here: the
    # loss within 1e-4 relative, the gradient norm within 1% (rowwise and tensorwise)
    assert metrics["pg_loss"] == pytest.approx(expected["pg_loss"], rel=1e-2)
    assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=0.1)
    assert metrics["grad_norm"] != expected["grad_norm"]  # the fp8 rounding did happen
    update_bf16 = max_abs_diff(flat_params(reference.model), before)
    update_fp8 = max_abs_diff(flat_params(actor.model), before)
    assert 0.5 * update_bf16 < update_fp8 < 2 * update_bf16  # lr 1e-2: Adam's step, both
    for param in actor.model.parameters():
        assert type(param) is nn.Parameter and param.dtype == torch.float32
    state = actor.core.optimizer.state_dict()["state"]
    assert all(t.dtype == torch.float32 for s in state.values() for t in s.values() if t.dim())


@needs_torchao
def test_checkpoint_and_weight_sync_hold_plain_tensors_and_resume_across_precision(tmp_path):
    actor = _actor()
    actor.update(make_batch(seed=4))
    params = dict(actor.model.named_parameters())
    for name, tensor in actor.hf_weights():  # what the rollout reads on one device: in place
        assert type(tensor) in (torch.Tensor, nn.Parameter)
        assert tensor.data_ptr() == params[name].data_ptr()
    for name, tensor in actor.model.state_dict().items():
        assert type(tensor) is torch.Tensor, name
    actor.save(tmp_path / "fp8")
    # the checkpoint of an fp8 run resumes in bf16, and back
    bf16 = _actor("bf16", model=tiny_model(seed=5))
    bf16.load(tmp_path / "fp8")
    assert max_abs_diff(flat_params(bf16.model), flat_params(actor.model)) == 0.0
    bf16.update(make_batch(seed=5))
    bf16.save(tmp_path / "bf16")
    again = _actor(model=tiny_model(seed=6))
    again.load(tmp_path / "bf16")
    assert max_abs_diff(flat_params(again.model), flat_params(bf16.model)) == 0.0


@needs_torchao
@pytest.mark.parametrize("role", ["actor", "lora actor", "critic"])
def test_every_float8_matmul_runs_a_multiple_of_16_tokens(role):
    """torch._scaled_mm needs each dim divisible by 16 and the weight gradient's inner dim is
    the token count: every FP8 linear's input (update and log-probs) holds a multiple of 16
    tokens, though the batch's micro-batches do not (the pad is a sequence of its own)."""
    batch = make_batch(seed=3)
    micro_batch_tokens = batch["attention_mask"].view(2, 4, -1).sum((1, 2)).tolist()
    assert any(n % 16 for n in micro_batch_tokens)  # the case that needs padding
    if role == "critic":
        critic_cfg = CriticConfig(precision="fp8", micro_batch_size_per_gpu=4)
        learner = CriticLearner(tiny_model(), critic_cfg, total_steps=1, device="cpu",
                                fp8_emulate=True)  # fmt: skip
        counts = record_float8_token_counts(learner.value_model)
        learner.compute_values(batch)
        returns = batch["response_mask"]
        learner.update(batch.union(Batch({"values": 0.5 * returns, "returns": returns})))
    else:
        lora = ModelConfig(path="tiny", lora_rank=4, lora_alpha=8) if role == "lora actor" else None
        learner = ActorLearner(tiny_model(), actor_config(precision="fp8"), total_steps=1,
                               device="cpu", model_cfg=lora, fp8_emulate=True)  # fmt: skip
        counts = record_float8_token_counts(learner.model)
        learner.compute_logprobs(batch)
        learner.update(batch)
    assert counts and all(n % 16 == 0 for n in counts), sorted(set(counts))


@needs_torchao
def test_the_critic_trains_in_fp8_with_its_value_head_in_bf16():
    critic = CriticLearner(tiny_model(), CriticConfig(precision="fp8"), total_steps=1,
                           device="cpu", fp8_emulate=True)  # fmt: skip
    assert critic.core.fp8_linears == fp8_linear_names(tiny_model())
    assert type(critic.value_model.value_head) is nn.Linear


@needs_torchao
def test_plain_tensor_unwraps_torchaos_float8_training_subclasses():
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    weight = torch.randn(32, 64)
    wrapped = WeightWithDynamicFloat8CastTensor(weight, LinearMMConfig(), torch.float8_e4m3fn)
    assert plain_tensor(wrapped) is weight
    fp8 = hp_tensor_to_float8_dynamic(weight, torch.float8_e4m3fn, LinearMMConfig())
    unwrapped = plain_tensor(fp8)
    assert type(unwrapped) is torch.Tensor and unwrapped.dtype == torch.float32
    assert torch.allclose(unwrapped, weight, rtol=2**-3, atol=1e-2)  # e4m3 rounding
    assert plain_tensor(weight) is weight


@needs_torchao
def test_conversion_keeps_state_dict_names_and_dtypes():
    model = tiny_model()
    names = {k: v.dtype for k, v in model.state_dict().items()}
    fp8 = _actor(model=model)
    assert {k: v.dtype for k, v in fp8.model.state_dict().items()} == names
    assert dataclasses.is_dataclass(fp8.cfg) and fp8.cfg.precision == "fp8"


@pytest.mark.gpu
@needs_torchao
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fp8_on_a_gpu_runs_float8_matmuls_near_bf16(recipe):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU of compute capability >= 8.9")
    batch = make_batch(seed=3)
    results = {}
    for precision in ("bf16", "fp8"):
        actor = ActorLearner(tiny_model(), actor_config(precision=precision, fp8_recipe=recipe,
                             ppo_mini_batch_size=8), total_steps=1, device="cuda")  # fmt: skip
        results[precision] = actor.update(batch)
    assert results["fp8"]["pg_loss"] == pytest.approx(results["bf16"]["pg_loss"], rel=2e-2)
    assert results["fp8"]["grad_norm"] == pytest.approx(results["bf16"]["grad_norm"], rel=0.15)
