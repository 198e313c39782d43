"""GPT-OSS in our decoder: checkpoints transformers writes (sliding and full layers, sinks,
biased experts with a clamped SwiGLU) load with transformers' logits, padded and packed, and
ours load back into transformers (MXFP4 checkpoints: checkpoint_io/test_quantized_checkpoint.py)."""

import torch

from hybridflow.models.checkpoint_io.hf_checkpoint import load_model_from_dir
from hybridflow.models.mixers.sink_attention import sink_attention_rows
from tests.models.mla_moe_helpers import gpt_oss_transformers, packed_logits
from tests.models.qwen3_5_helpers import two_sequences


def _compare(reference, ours):
    ids, mask, packed, positions, cu_seqlens = two_sequences()  # 13 and 8 tokens, window 4
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask).logits
        padded = ours(ids, attention_mask=mask)
        flat = packed_logits(ours, packed, positions, cu_seqlens)
    keep = mask.bool()
    assert (padded[keep] - expected[keep]).abs().max() <= 1e-4
    assert (flat - expected[keep]).abs().max() <= 1e-4


def test_checkpoint_written_by_transformers_gives_its_logits(tmp_path):
    reference = gpt_oss_transformers()
    reference.save_pretrained(tmp_path)
    ours = load_model_from_dir(str(tmp_path)).eval()
    specs = [layer.spec for layer in ours.model.layers]
    assert [(s.mixer, s.mlp, s.window) for s in specs] == [
        ("sink_attention", "biased_experts", 4), ("sink_attention", "biased_experts", 0),
        ("sink_attention", "biased_experts", 4),
    ]  # fmt: skip
    assert sum(p.numel() for p in ours.parameters()) == ours.config.num_parameters()
    _compare(reference, ours)


def test_our_checkpoint_loads_in_transformers_with_our_logits(tmp_path):
    import transformers

    gpt_oss_transformers(seed=2).save_pretrained(tmp_path / "first")
    ours = load_model_from_dir(str(tmp_path / "first")).eval()
    ours.save_pretrained(str(tmp_path / "ours"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert reloaded.config.layer_types == list(ours.config.layer_types)
    _compare(reloaded, ours)


def test_the_clamp_and_the_window_matter_in_the_comparison(tmp_path):
    """The tiny config's limit (0.4) and window (4) are small enough to change the logits,
    so the comparisons above see them."""
    gpt_oss_transformers().save_pretrained(tmp_path)
    ours = load_model_from_dir(str(tmp_path)).eval()
    ids = two_sequences()[0][:1]
    with torch.no_grad():
        base = ours(ids)
        for layer in ours.model.layers:
            layer.mlp.activation.keywords["limit"] = 100.0
        unclamped = ours(ids)
        for layer in ours.model.layers:
            layer.self_attn.window = 0
        unwindowed = ours(ids)
    assert (base - unclamped).abs().max() > 1e-3
    assert (unclamped - unwindowed).abs().max() > 1e-3


def test_a_sink_takes_weight_from_the_keys():
    q, k, v = torch.randn(1, 3, 2, 4), torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4)
    plain = sink_attention_rows(q, k, v, torch.full((2,), -1e4), 0)
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).expand(1, 2, 3, 4),
        v.transpose(1, 2).expand(1, 2, 3, 4), is_causal=True,
    ).transpose(1, 2)  # fmt: skip
    assert torch.allclose(plain, reference, atol=1e-6)
    heavy = sink_attention_rows(q, k, v, torch.full((2,), 1e4), 0)
    assert heavy.abs().max() < 1e-6  # all weight on the sink: nothing read
