"""DeepSeek-V3 in our decoder: checkpoints transformers writes load with transformers'
logits (padded batch of two lengths and packed), ours load back into transformers, the
grouped router and its replay, the multi-token-prediction layers skipped."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridflow.models.checkpoint_io.hf_checkpoint import load_model_from_dir
from hybridflow.models.mlps.grouped_experts import grouped_topk, grouped_weights
from tests.models.mla_moe_helpers import deepseek_transformers, edit_config, packed_logits
from tests.models.qwen3_5_helpers import two_sequences


def _compare(reference, ours, vocab=96):
    ids, mask, packed, positions, cu_seqlens = two_sequences(vocab)
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask).logits
        padded = ours(ids, attention_mask=mask)
        flat = packed_logits(ours, packed, positions, cu_seqlens)
    keep = mask.bool()
    assert (padded[keep] - expected[keep]).abs().max() <= 1e-4
    assert (flat - expected[keep]).abs().max() <= 1e-4


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_checkpoint_written_by_transformers_gives_its_logits(tmp_path, q_lora_rank):
    reference = deepseek_transformers(q_lora_rank=q_lora_rank)
    reference.save_pretrained(tmp_path)
    # fewer kv heads than heads: MLA expands every head's k/v, so the weights are the same;
    # transformers' own attention breaks on this config, ours must not
    edit_config(tmp_path, num_key_value_heads=2)
    ours = load_model_from_dir(str(tmp_path)).eval()
    layers = [(layer.spec.mixer, layer.spec.mlp) for layer in ours.model.layers]
    assert layers == [("mla", "dense")] + [("mla", "grouped_experts_shared")] * 2
    assert ours.config.q_lora_rank == q_lora_rank and ours.config.n_group == 4
    assert sum(p.numel() for p in ours.parameters()) == ours.config.num_parameters()
    _compare(reference, ours)


def test_our_checkpoint_loads_in_transformers_with_our_logits(tmp_path):
    import transformers

    first = tmp_path / "first"
    deepseek_transformers(seed=1, rope_interleave=False).save_pretrained(first)
    ours = load_model_from_dir(str(first)).eval()
    ours.save_pretrained(str(tmp_path / "ours"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert not reloaded.config.rope_interleave
    _compare(reloaded, ours)


def test_multi_token_prediction_layers_are_skipped_with_one_line(tmp_path, capsys):
    reference = deepseek_transformers(num_nextn_predict_layers=1)
    reference.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    for name in [n for n in weights if n.startswith("model.layers.2.")]:
        weights[name.replace("model.layers.2.", "model.layers.3.")] = weights[name].clone()
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = load_model_from_dir(str(tmp_path)).eval()
    lines = [line for line in capsys.readouterr().err.splitlines() if "multi-token" in line]
    assert len(lines) == 1 and "model.layers.3.*" in lines[0]
    _compare(reference, ours)


def test_grouped_topk_keeps_to_the_best_groups_and_the_bias_only_chooses():
    # 4 experts in 2 groups; group 0 = experts 0, 1; group 1 = experts 2, 3
    scores = torch.tensor([[0.9, 0.1, 0.6, 0.6]])
    correction = torch.zeros(4)
    # one group allowed: group 1 (0.6 + 0.6) beats group 0 (0.9 + 0.1)
    assert grouped_topk(scores, correction, 2, 2, 1).sort().values.tolist() == [[2, 3]]
    correction = torch.tensor([0.0, 0.5, 0.0, 0.0])  # group 0 now scores 1.5
    ids = grouped_topk(scores, correction, 2, 2, 1)
    assert ids.sort().values.tolist() == [[0, 1]]
    weights = grouped_weights(scores, ids.sort().values, True, 2.0)
    assert torch.allclose(weights, torch.tensor([[1.8, 0.2]]))  # the bias weighs nothing


def test_replayed_routes_give_the_recorded_experts_and_train_the_router(tmp_path):
    deepseek_transformers().save_pretrained(tmp_path)
    model = load_model_from_dir(str(tmp_path))
    _, _, packed, positions, cu_seqlens = two_sequences()
    trace = []
    with torch.no_grad():
        free = model.forward_packed(packed, positions, cu_seqlens, 13, router_trace=trace)
    assert len(trace) == len(model.config.sparse_layer_indices()) == 2
    recorded = torch.stack([ids for _, ids in trace], dim=1)  # [N, L_sparse, k]
    replayed = model.forward_packed(packed, positions, cu_seqlens, 13, routed_experts=recorded)
    assert torch.allclose(replayed, free, atol=1e-6)
    other = (recorded + 1) % model.config.num_experts  # routes the router would not pick
    moved = model.forward_packed(packed, positions, cu_seqlens, 13, routed_experts=other)
    assert not torch.allclose(moved, free, atol=1e-3)
    moved.sum().backward()
    assert model.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_checkpoints_give_transformers_logits_both_ways(tmp_path, topk_method):
    import transformers

    from tests.models.mla_moe_helpers import deepseek_v2_transformers

    reference = deepseek_v2_transformers(topk_method=topk_method, q_lora_rank=None)
    reference.save_pretrained(tmp_path / "first")
    ours = load_model_from_dir(str(tmp_path / "first")).eval()
    assert ours.config.model_type == "deepseek_v2" and ours.config.topk_method == topk_method
    _compare(reference, ours)
    ours.save_pretrained(str(tmp_path / "ours"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert reloaded.config.topk_method == topk_method
    _compare(reloaded, ours)


def test_expanded_heads_through_a_one_width_kernel_give_mlas_attention():
    """The flash varlen kernel takes one head width and scales by its inverse square root:
    q/k (24 wide here) and v (12) padded to one width with q pre-scaled give the scores
    of MLA's own scale."""
    from hybridflow.models.attention import sdpa_loop_attention
    from hybridflow.models.mixers.mla import attend_expanded

    def one_width_kernel(q, k, v):
        assert q.shape[-1] == k.shape[-1] == v.shape[-1]
        return sdpa_loop_attention(q, k, v, lengths=[5, 3])

    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, 2, 24, generator=generator), torch.randn(8, 2, 24, generator=generator)
    v, scale = torch.randn(8, 2, 12, generator=generator), 0.37
    out = attend_expanded(q, k, v, scale, one_width_kernel)
    assert out.shape == (8, 2, 12)
    for rows in (slice(0, 5), slice(5, 8)):
        scores = torch.einsum("qhd,khd->hqk", q[rows], k[rows]) * scale
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        expected = torch.einsum("hqk,khd->qhd", probs, v[rows])
        assert torch.allclose(out[rows], expected, atol=1e-5)


def test_a_built_model_routes_with_a_zero_correction_bias():
    """build_model materialises the model from meta: the router's correction bias (a buffer)
    starts at zero as HF's does, not at whatever the memory held."""
    from hybridflow.models import build_model
    from hybridflow.models.presets import preset_config

    model = build_model(preset_config("tiny-deepseek-v3"), seed=0)
    biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    assert biases and all(torch.equal(b, torch.zeros_like(b)) for b in biases)
