"""LoRA on a mixture of experts: per-expert adapters beside peft's, the reference = adapters
off, and merged weights that equal the adapted model."""

import pytest
import torch
from learner_helpers import actor_config, make_batch

from hybridflow.config import ModelConfig, RefConfig
from hybridflow.learners import ActorLearner
from hybridflow.learners.lora import (
    adapters_disabled,
    apply_lora,
    expert_adapters,
    lora_scalings,
    merge_lora_stream,
)
from hybridflow.learners.ref_policy import RefPolicy
from hybridflow.models import CausalLM, load_model
from hybridflow.models.moe import moe_experts, select_experts

LORA = ModelConfig(path="tiny-moe", lora_rank=4, lora_alpha=8)


def test_adapters_cover_attention_dense_mlp_and_every_expert():
    model = apply_lora(load_model("tiny-moe"), rank=4, alpha=8,
                       target_modules=LORA.lora_target_modules)  # fmt: skip
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "model.layers.1.mlp.experts.lora.gate_up_A" in trainable
    assert "model.layers.1.mlp.experts.lora.down_B" in trainable
    assert "model.layers.0.mlp.gate_proj.lora_A.default.weight" in trainable  # the dense layer
    assert "model.layers.1.self_attn.q_proj.lora_B.default.weight" in trainable
    assert all(".lora" in name for name in trainable)  # router and base experts frozen
    assert len(expert_adapters(model)) == 3
    untied = load_model("tiny-moe")
    untied.config.tie_word_embeddings = False
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    apply_lora(untied, rank=4, alpha=8, target_modules=["q_proj", "experts"])
    assert not untied.lm_head.weight.requires_grad
    ids = torch.randint(5, 128, (2, 9))
    with torch.no_grad():  # B = 0: the adapted model starts as its base
        torch.testing.assert_close(model(ids), load_model("tiny-moe")(ids))


def test_grouped_gemm_adapters_equal_the_loop_and_merged_weights():
    model = apply_lora(load_model("tiny-moe"), rank=4, alpha=8, target_modules=["experts"])
    adapters = expert_adapters(model)[0]
    with torch.no_grad():
        for p in (adapters.gate_up_B, adapters.down_B):
            p.normal_(0, 0.1)
    experts = model.model.layers[1].mlp.experts
    x = torch.randn(13, 128)
    ids, weights = select_experts(torch.randn(13, 8), 2, norm_topk_prob=True)
    args = (x, ids, weights, experts.gate_up_proj, experts.down_proj)
    loop = moe_experts(*args, backend="loop", adapters=adapters)
    grouped = moe_experts(*args, backend="grouped_mm", adapters=adapters)
    torch.testing.assert_close(grouped, loop)
    merged = moe_experts(x, ids, weights, experts.gate_up_proj + adapters.delta("gate_up"),
                         experts.down_proj + adapters.delta("down"), backend="loop")  # fmt: skip
    torch.testing.assert_close(loop, merged, atol=1e-5, rtol=1e-5)


def test_lora_update_merges_into_plain_weights_and_the_reference_is_the_base():
    batch = make_batch(seed=6)
    actor = ActorLearner(load_model("tiny-moe"), actor_config(lr=5e-2), total_steps=1,
                         device="cpu", model_cfg=LORA)  # fmt: skip
    base = actor.compute_logprobs(batch)["old_logprobs"]
    actor.update(batch)
    trained = actor.compute_logprobs(batch)["old_logprobs"]
    assert (trained - base).abs().max() > 1e-4

    ref = RefPolicy.from_actor(actor, RefConfig())
    torch.testing.assert_close(ref.compute_ref_logprobs(batch)["ref_logprobs"], base)

    with torch.device("meta"):
        plain = CausalLM(actor.model.config)
    plain.load_state_dict(dict(actor.hf_weights()), strict=False, assign=True)
    plain.tie_weights()
    merged = ActorLearner(plain, actor_config(), total_steps=1, device="cpu")
    torch.testing.assert_close(merged.compute_logprobs(batch)["old_logprobs"], trained,
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    with adapters_disabled(actor.model):
        assert all(a.disabled for a in expert_adapters(actor.model))
    assert not any(a.disabled for a in expert_adapters(actor.model))


def test_merge_runs_on_the_base_device_when_the_adapters_live_elsewhere():
    # actor.optimizer_offload with LoRA: the frozen base is on the GPU, the adapters' fp32
    # masters on the host. The base stands on "meta" here (a second device the CPU has);
    # mixing it with a CPU tensor fails as cuda + cpu does.
    model = apply_lora(load_model("tiny-moe", dtype=torch.bfloat16), rank=4, alpha=8,
                       target_modules=LORA.lora_target_modules)  # fmt: skip
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or name.endswith(("gate_up_B", "down_B")):
                p.normal_(0, 0.1)
    state, scalings = model.state_dict(), lora_scalings(model)
    on_cpu = dict(merge_lora_stream(state.items(), scalings))
    split = [(n, t if ".lora" in n else t.to("meta")) for n, t in state.items()]
    on_base_device = dict(merge_lora_stream(split, scalings))
    assert on_base_device.keys() == on_cpu.keys()
    for name, tensor in on_base_device.items():
        assert (tensor.device.type, tensor.dtype, tensor.shape) == (
            "meta", on_cpu[name].dtype, on_cpu[name].shape), name  # fmt: skip
    # the values (computed on the CPU): W + scale · B @ A for peft's layers and the experts'
    q = "model.layers.1.self_attn.q_proj"
    a, b = state[f"{q}.lora_A.default.weight"], state[f"{q}.lora_B.default.weight"]
    want = (state[f"{q}.base_layer.weight"].float() + scalings[q] * (b @ a)).bfloat16()
    torch.testing.assert_close(on_cpu[f"{q}.weight"], want)
    experts = "model.layers.1.mlp.experts"
    a, b = state[f"{experts}.lora.down_A"], state[f"{experts}.lora.down_B"]
    delta = scalings[f"{experts}.lora"] * torch.bmm(b, a)
    want = (state[f"{experts}.down_proj"].float() + delta).bfloat16()
    torch.testing.assert_close(on_cpu[f"{experts}.down_proj"], want)


def _deepseek(**changes):
    """tiny-deepseek-v3 with as many KV heads as heads in config.json (MLA ignores them;
    transformers' sdpa path does not)."""
    from hybridflow.models import build_model
    from hybridflow.models.presets import PRESETS

    return build_model(PRESETS["tiny-deepseek-v3"].replace(num_key_value_heads=4, **changes))


FAMILY_MODELS = {
    "tiny-gpt-oss": lambda: load_model("tiny-gpt-oss"),
    "tiny-deepseek-v3": _deepseek,
    "deepseek-v3-direct-q": lambda: _deepseek(q_lora_rank=None),  # q in one projection
}
ADAPTED = {  # per layer kind: the projections peft adapts; every routed expert gets ours
    "tiny-gpt-oss": {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj", "mlp.experts"},
    "tiny-deepseek-v3": {"self_attn.q_a_proj", "self_attn.q_b_proj",
                         "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.o_proj",
                         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.experts",
                         "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
                         "mlp.shared_experts.down_proj"},
    "deepseek-v3-direct-q": {"self_attn.q_proj", "self_attn.kv_a_proj_with_mqa",
                             "self_attn.kv_b_proj", "self_attn.o_proj", "mlp.gate_proj",
                             "mlp.up_proj", "mlp.down_proj", "mlp.experts",
                             "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
                             "mlp.shared_experts.down_proj"},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(FAMILY_MODELS))
def test_gpt_oss_and_mla_lora_starts_as_the_base_trains_adapters_and_exports_merged(tmp_path, name):
    """LoRA with the default targets on GPT-OSS (biased q/k/v/o, biased experts stored
    [E, in, out]) and DeepSeek-V3 (MLA's projections, dense and shared MLPs, routed experts):
    the base's logits at init, gradients on the adapters only, and merged weights that
    transformers loads with the adapted model's logits."""
    import transformers

    from hybridflow.learners.actor_learner import export_causal_lm

    model = apply_lora(FAMILY_MODELS[name](), rank=4, alpha=8,
                       target_modules=LORA.lora_target_modules)  # fmt: skip
    adapted = {n.split(".", 3)[3].split(".lora")[0] for n, p in model.named_parameters()
               if p.requires_grad}  # fmt: skip
    assert adapted == ADAPTED[name]
    ids = torch.randint(5, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), FAMILY_MODELS[name]()(ids))
        generator = torch.Generator().manual_seed(1)
        for param in model.parameters():  # the zero factors drawn: the merge changes weights
            if param.requires_grad and not param.any():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    logits = model(ids)
    logits.square().mean().backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad == {n for n, p in model.named_parameters() if p.requires_grad}
    merged = dict(merge_lora_stream(model.state_dict().items(), lora_scalings(model)))
    assert not any(".lora" in n or ".base_layer." in n for n in merged)
    export_causal_lm(model.config, merged, tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    with torch.no_grad():
        assert (reference(ids).logits - logits).abs().max() < 1e-4
        # the adapters moved the logits: the comparison sees the merged factors
        assert (reference(ids).logits - FAMILY_MODELS[name]()(ids)).abs().max() > 1e-3
