"""MLA's absorbed decode op (models/mixers/mla_absorbed.py) against the expanded form the
mixer's forward runs: in fp32 the same per-head outputs to 1e-5, under YaRN's mscale, with
rows that see different prefixes, and with an unmerged LoRA adapter on kv_b_proj."""

from __future__ import annotations

import pytest
import torch

from hybridflow.models.mixers.mla import MultiHeadLatentAttention
from hybridflow.models.mixers.mla_absorbed import absorbed_attention, absorbed_decode
from hybridflow.models.presets import preset_config
from hybridflow.models.rope import rope_cos_sin

YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip


def _mixer(rope_scaling=None, interleave=True, seed=0):
    config = preset_config("tiny-deepseek-v3").replace(rope_scaling=rope_scaling,
                                                       rope_interleave=interleave)  # fmt: skip
    torch.manual_seed(seed)
    mixer = MultiHeadLatentAttention(config).eval().requires_grad_(False)
    for p in mixer.parameters():
        p.normal_(0, 0.3)
    return config, mixer


def _expanded(mixer, q, latent, k_rope, visible):
    """The expanded form: per-head k/v from the latents, masked softmax(q k^T * scale) v."""
    k, v = mixer.expand(latent, k_rope)  # [B, T, nh, qk], [B, T, nh, v]
    scores = torch.einsum("bhd,bthd->bht", q, k) * mixer.scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return torch.einsum("bht,bthv->bhv", scores.softmax(-1), v)


def _inputs(config, mixer, rows=3, length=11):
    x = torch.randn(rows, length, config.hidden_size)
    cos, sin = rope_cos_sin(config, torch.arange(length), torch.float32)
    latent, k_rope = mixer.project_latent(x, cos, sin)
    q = mixer.project_q(x[:, -1], cos[-1], sin[-1])  # the last token of each row decodes
    visible = torch.arange(length)[None] < torch.tensor([length, 4, 1])[:rows, None]
    return q, latent, k_rope, visible


@pytest.mark.parametrize("rope_scaling, interleave", [(None, True), (YARN, True), (YARN, False)])
def test_absorbed_decode_equals_the_expanded_attention(rope_scaling, interleave):
    config, mixer = _mixer(rope_scaling, interleave)
    if rope_scaling:
        assert mixer.scale > 1.5 * (16 + 8) ** -0.5  # mscale^2 is folded into the scale
    q, latent, k_rope, visible = _inputs(config, mixer)
    got = absorbed_decode(mixer, q, latent, k_rope, visible)
    expected = _expanded(mixer, q, latent, k_rope, visible)
    assert got.shape == (3, config.num_attention_heads, config.v_head_dim)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_the_mixers_forward_is_the_absorbed_decode_of_its_last_token():
    """A sequence through the mixer's own forward (expanded, causal): its last token's
    output equals o_proj of the absorbed decode over the sequence's latents."""
    config, mixer = _mixer(YARN)
    x = torch.randn(1, 9, config.hidden_size)
    cos, sin = rope_cos_sin(config, torch.arange(9), torch.float32)

    def attend(q, k, v):  # [T, nh, d] one causal sequence
        mask = torch.ones(9, 9, dtype=torch.bool).tril()
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
        ).transpose(0, 1)

    full = mixer(x[0], cos, sin, attend)
    latent, k_rope = mixer.project_latent(x, cos, sin)
    q = mixer.project_q(x[:, -1], cos[-1], sin[-1])
    out = absorbed_decode(mixer, q, latent, k_rope, torch.ones(1, 9, dtype=torch.bool))
    torch.testing.assert_close(mixer.o_proj(out.flatten(-2))[0], full[-1], rtol=0, atol=1e-5)


def test_a_row_that_sees_nothing_gets_zeros():
    out = absorbed_attention(torch.randn(1, 2, 4), torch.randn(1, 2, 2), torch.randn(1, 3, 4),
                             torch.randn(1, 3, 2), torch.zeros(1, 3, dtype=torch.bool), 0.5)  # fmt: skip
    assert torch.equal(out, torch.zeros(1, 2, 4))


def test_an_unmerged_lora_adapter_on_kv_b_proj_is_absorbed():
    peft = pytest.importorskip("peft")
    config, mixer = _mixer(YARN)
    wrapped = peft.get_peft_model(
        _Holder(mixer), peft.LoraConfig(r=2, target_modules=["kv_b_proj"])
    )
    layer = wrapped.base_model.model.mixer.kv_b_proj
    torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.3)
    inner = wrapped.base_model.model.mixer
    q, latent, k_rope, visible = _inputs(config, inner)
    got = absorbed_decode(inner, q, latent, k_rope, visible)
    torch.testing.assert_close(got, _expanded(inner, q, latent, k_rope, visible), rtol=0,
                               atol=1e-5)  # fmt: skip
    with wrapped.disable_adapter():  # the base weight alone: a different output
        assert not torch.allclose(absorbed_decode(inner, q, latent, k_rope, visible), got)


class _Holder(torch.nn.Module):
    def __init__(self, mixer):
        super().__init__()
        self.mixer = mixer
