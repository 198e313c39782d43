"""Qwen3.5 (dense and MoE) in our decoder: checkpoints written by transformers load with
equal logits (packed and padded), ours load back into transformers, multimodal checkpoints
load their language model."""

import json

import pytest
import torch
from qwen3_5_helpers import transformers_model, two_sequences
from safetensors.torch import load_file, save_file

from hybridflow.models import load_model
from hybridflow.models.architecture import ModelArchitecture
from hybridflow.models.checkpoint_io.hf_checkpoint import load_model_from_dir
from hybridflow.models.checkpoint_io.loadability import config_problems

pytest.importorskip("transformers")
TOLERANCE = 1e-4


def _logits_both_ways(ours, ids, mask, packed, positions, cu_seqlens):
    """Our padded logits [2, T, V] and packed logits split per row."""
    with torch.no_grad():
        padded = ours(ids, attention_mask=mask)
        hidden = ours.forward_packed(packed, positions, cu_seqlens, int(mask.sum(1).max()))
        flat = ours.lm_head(hidden)
    lengths = mask.sum(1).tolist()
    return padded, flat.split(lengths)


VARIANTS = {"dense": (False, False), "moe": (True, False), "next": (True, True)}
MLPS = {"dense": ["dense"] * 4, "moe": ["experts_shared"] * 4,
        "next": ["dense", "experts_shared"] * 2}  # fmt: skip


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_transformers_checkpoint_gives_equal_logits_in_our_decoder(tmp_path, variant):
    reference = transformers_model(*VARIANTS[variant][:1], next_=VARIANTS[variant][1])
    reference.save_pretrained(tmp_path)
    ours = load_model_from_dir(str(tmp_path)).eval()
    mixers = ["gated_deltanet"] * 3 + ["gated_attention"]
    assert [layer.spec.mixer for layer in ours.model.layers] == mixers
    assert [layer.spec.mlp for layer in ours.model.layers] == MLPS[variant]
    ids, mask, packed, positions, cu_seqlens = two_sequences()
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
    padded, rows = _logits_both_ways(ours, ids, mask, packed, positions, cu_seqlens)
    real = mask.bool()
    assert (padded[real] - expected[real]).abs().max() <= TOLERANCE
    for row, logits in enumerate(rows):
        assert (logits - expected[row, : len(logits)]).abs().max() <= TOLERANCE


ARCHITECTURES = {"dense": "Qwen3_5ForCausalLM", "moe": "Qwen3_5MoeForCausalLM",
                 "next": "Qwen3NextForCausalLM"}  # fmt: skip


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_our_checkpoint_gives_equal_logits_in_transformers(tmp_path, variant):
    import transformers

    moe, next_ = VARIANTS[variant]
    transformers_model(moe, next_=next_).save_pretrained(tmp_path / "source")
    ours = load_model_from_dir(str(tmp_path / "source")).eval()
    ours.save_pretrained(str(tmp_path / "saved"))
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURES[variant]]
    assert config_problems(tmp_path / "saved") == []  # the headers fit the config
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    ids, mask, packed, positions, cu_seqlens = two_sequences()
    with torch.no_grad():
        expected = reloaded(input_ids=ids, attention_mask=mask).logits
    padded, rows = _logits_both_ways(ours, ids, mask, packed, positions, cu_seqlens)
    real = mask.bool()
    assert (padded[real] - expected[real]).abs().max() <= TOLERANCE
    for row, logits in enumerate(rows):
        assert (logits - expected[row, : len(logits)]).abs().max() <= TOLERANCE


def test_multimodal_checkpoint_loads_its_language_model(tmp_path, capsys):
    """A Qwen3_5ForConditionalGeneration layout without its encoder (a language-model-only
    export): config under text_config, weights under model.language_model., an MTP head
    skipped, one line saying so. With its encoder: tests/models/test_qwen3_5_vision.py."""
    text_dir, multimodal_dir = tmp_path / "text", tmp_path / "multimodal"
    transformers_model(moe=False).save_pretrained(text_dir)
    text = load_model_from_dir(str(text_dir)).eval()
    text_config = json.loads((text_dir / "config.json").read_text())
    multimodal_dir.mkdir()
    config = {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text_config,
        "tie_word_embeddings": False,
    }
    (multimodal_dir / "config.json").write_text(json.dumps(config))
    tensors = {
        name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name: t
        for name, t in load_file(text_dir / "model.safetensors").items()
    }
    tensors["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(tensors, multimodal_dir / "model.safetensors")
    assert config_problems(multimodal_dir) == []  # what `config validate` checks
    capsys.readouterr()
    loaded = load_model(str(multimodal_dir)).eval()
    assert "its language model is loaded" in capsys.readouterr().err
    assert loaded.config.model_type == "qwen3_5_text"
    ids, mask, *_ = two_sequences()
    with torch.no_grad():
        assert torch.equal(loaded(ids, attention_mask=mask), text(ids, attention_mask=mask))


def test_layer_types_default_to_every_fourth_layer_attention_and_counts_add_up():
    hf = {"model_type": "qwen3_5_moe_text", "vocab_size": 96, "hidden_size": 32,
          "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
          "linear_key_head_dim": 8, "linear_value_head_dim": 8, "num_experts": 4,
          "num_experts_per_tok": 2, "moe_intermediate_size": 16,
          "shared_expert_intermediate_size": 24}  # fmt: skip
    arch = ModelArchitecture.from_hf(hf)
    assert [spec.cache for spec in arch.layer_specs()] == ["recurrent"] * 3 + ["kv"] + [
        "recurrent"
    ] * 3 + ["kv"]
    assert arch.partial_rotary_factor == 0.25 and arch.rotary_dim == 4
    from hybridflow.models import build_model

    model = build_model(arch)
    assert arch.num_parameters() == sum(p.numel() for p in model.parameters())
    assert ModelArchitecture.from_hf(arch.to_hf()) == arch.replace(torch_dtype="float32")


def test_value_heads_must_group_over_key_heads():
    hf = {"model_type": "qwen3_5_text", "vocab_size": 96, "hidden_size": 32,
          "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
          "head_dim": 16, "linear_num_key_heads": 3, "linear_num_value_heads": 4}  # fmt: skip
    with pytest.raises(ValueError, match="linear_num_value_heads = 4 must be a multiple"):
        ModelArchitecture.from_hf(hf)


def test_left_padding_leaves_the_recurrent_state_untouched(tmp_path):
    """The engine's slow path left-pads prompts: padding enters the DeltaNet as zeros, so a
    row's logits equal those of the same tokens unpadded."""
    transformers_model(moe=False).save_pretrained(tmp_path)
    ours = load_model_from_dir(str(tmp_path)).eval()
    tokens = torch.randint(1, 96, (1, 7), generator=torch.Generator().manual_seed(5))
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), tokens], dim=1)
    mask = torch.cat([torch.zeros(1, 5), torch.ones(1, 7)], dim=1).long()
    with torch.no_grad():
        alone = ours(tokens)
        left = ours(padded, attention_mask=mask)[:, 5:]
    assert (alone - left).abs().max() <= TOLERANCE


def test_an_ungated_attention_config_goes_to_the_fallback_with_its_reason():
    from hybridflow.models import native_support_problem

    hf = {"model_type": "qwen3_5_text", "vocab_size": 96, "hidden_size": 32,
          "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
          "head_dim": 16, "attn_output_gate": False}  # fmt: skip
    assert "attn_output_gate=false" in native_support_problem(hf)
    assert native_support_problem({**hf, "attn_output_gate": True}) is None


def test_moe_routes_are_traced_and_replayed_with_the_shared_expert(tmp_path):
    """Routing replay reaches Qwen3.5-MoE's layers: the traced routes replayed give the same
    hidden states; other routes give others (the shared expert runs either way)."""
    transformers_model(moe=True).save_pretrained(tmp_path)
    ours = load_model_from_dir(str(tmp_path)).eval()
    _, mask, packed, positions, cu_seqlens = two_sequences()
    trace = []
    with torch.no_grad():
        free = ours.forward_packed(packed, positions, cu_seqlens, 13, router_trace=trace)
        routes = torch.stack([ids for _, ids in trace], dim=1)  # [N, L_sparse, k]
        assert routes.shape == (len(packed), 4, 2)
        replayed = ours.forward_packed(packed, positions, cu_seqlens, 13, routed_experts=routes)
        other = ours.forward_packed(packed, positions, cu_seqlens, 13,
                                    routed_experts=(routes + 1) % 4)  # fmt: skip
    assert torch.equal(replayed, free)
    assert not torch.allclose(other, free)
