import pytest
import torch
from learner_helpers import actor_config, flat_params, make_batch, max_abs_diff, tiny_model
from torch.distributed.checkpoint import FileSystemReader

from hybridflow.config import CriticConfig, ModelConfig, RefConfig
from hybridflow.learners import ActorLearner, CriticLearner, RefPolicy
from hybridflow.models import load_model


def _logprobs(model, batch):
    learner = ActorLearner(model, actor_config(), total_steps=1, device="cpu")
    return learner.compute_logprobs(batch)["old_logprobs"]


def test_lora_trains_only_adapters_ref_is_base_and_export_merges(tmp_path):
    batch = make_batch(seed=11)
    model_cfg = ModelConfig(path="tiny", lora_rank=4, lora_alpha=8, lora_dropout=0.0)
    actor = ActorLearner(
        tiny_model(), actor_config(lr=5e-2), total_steps=2, device="cpu", model_cfg=model_cfg
    )
    before = flat_params(actor.model)
    actor.update(batch)
    actor.update(batch)
    after = flat_params(actor.model)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(".lora_" in n for n in changed)
    assert any(".lora_B." in n for n in changed)  # B starts at 0, so the adapter now acts

    base_logprobs = _logprobs(tiny_model(), batch)
    ref = RefPolicy.from_actor(actor, RefConfig())
    ref_logprobs = ref.compute_ref_logprobs(batch)["ref_logprobs"]
    torch.testing.assert_close(ref_logprobs, base_logprobs, atol=1e-6, rtol=0)
    actor_logprobs = actor.compute_logprobs(batch)["old_logprobs"]  # adapters back on
    assert (actor_logprobs - base_logprobs).abs().max() > 1e-3

    actor.export_hf(tmp_path / "hf")
    merged = load_model(str(tmp_path / "hf"))
    assert not any("lora" in n or "base_layer" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(_logprobs(merged, batch), actor_logprobs, atol=1e-5, rtol=1e-5)

    actor.save(tmp_path / "ckpt")  # adapter-only checkpoint
    saved = FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys)
    fresh = ActorLearner(
        tiny_model(), actor_config(lr=5e-2), total_steps=2, device="cpu", model_cfg=model_cfg
    )
    fresh.load(tmp_path / "ckpt")
    assert max_abs_diff(flat_params(fresh.model), after) == 0.0


def test_ref_policy_is_frozen_initial_policy():
    batch = make_batch(seed=12)
    ref = RefPolicy(tiny_model(), RefConfig(max_tokens_per_gpu=16), device="cpu")
    assert not any(p.requires_grad for p in ref.policy.parameters())
    out = ref.compute_ref_logprobs(batch)
    torch.testing.assert_close(out["ref_logprobs"], _logprobs(tiny_model(), batch))
    with pytest.raises(ValueError, match="LoRA"):
        RefPolicy.from_actor(
            ActorLearner(tiny_model(), actor_config(), total_steps=1, device="cpu"), RefConfig()
        )


def _critic(**cfg):
    base = dict(lr=1e-2, ppo_mini_batch_size=4, micro_batch_size_per_gpu=4, cliprange_value=10.0)
    base.update(cfg)
    return CriticLearner(tiny_model(), CriticConfig(**base), total_steps=10, device="cpu")


def test_critic_learns_returns_and_micro_batching_is_invariant():
    batch = make_batch(seed=13)
    critic = _critic()
    values = critic.compute_values(batch)["values"]
    assert values.shape == batch["responses"].shape and values.abs().max() == 0  # zero head
    returns = 2.0 * batch["response_mask"]
    batch.tensors["returns"] = returns
    losses = []
    for _ in range(6):
        batch.tensors["values"] = critic.compute_values(batch)["values"]
        losses.append(critic.update(batch)["vf_loss"])
    assert losses[-1] < 0.5 * losses[0]
    # Same update with token-budget micro-batches of a fresh critic: same weights.
    batch.tensors["values"] = torch.zeros_like(returns)
    a, b = _critic(), _critic(max_tokens_per_gpu=12)
    ma, mb = a.update(batch), b.update(batch)
    assert ma["vf_loss"] == pytest.approx(mb["vf_loss"], rel=1e-6)
    assert max_abs_diff(flat_params(a.value_model), flat_params(b.value_model)) < 1e-5


def test_lora_adapters_of_a_bf16_base_train_in_fp32():
    """A small learning rate moves fp32 adapters; in bf16 most of lora_A's steps (1e-4 of
    weights ~0.1) round away."""
    batch = make_batch(seed=5)
    model_cfg = ModelConfig(path="tiny", lora_rank=4, lora_alpha=8, lora_dropout=0.0)
    actor = ActorLearner(load_model("tiny", dtype=torch.bfloat16), actor_config(lr=1e-5),
                         total_steps=4, device="cpu", model_cfg=model_cfg)  # fmt: skip
    adapters = {n: p for n, p in actor.model.named_parameters() if ".lora_" in n}
    assert adapters and all(p.dtype == torch.float32 for p in adapters.values())
    assert all(p.dtype == torch.bfloat16 for n, p in actor.model.named_parameters()
               if ".lora_" not in n)  # fmt: skip
    before = {n: p.detach().clone() for n, p in adapters.items() if ".lora_A." in n}
    for _ in range(3):  # B leaves 0 at the first step; A gets gradients from the second
        actor.update(batch)
    moved = [float((adapters[n] != before[n]).float().mean()) for n in before]
    assert min(moved) > 0.5  # most of every A moved


def test_the_reference_model_compiles_its_layers_as_the_actor_does_when_asked():
    """model.compile=true: each decoder layer of the reference copy is torch.compiled (the
    compile itself happens at the first forward, not run here: minutes on a CPU)."""
    compiled = RefPolicy(tiny_model(), RefConfig(), device="cpu", compile=True)
    layers = compiled.policy.lm.model.layers
    assert len(layers) > 0 and all(layer._compiled_call_impl is not None for layer in layers)
    eager = RefPolicy(tiny_model(), RefConfig(), device="cpu")
    assert all(layer._compiled_call_impl is None for layer in eager.policy.lm.model.layers)
