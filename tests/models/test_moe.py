"""Mixture-of-experts models: logits equal transformers' (Qwen3-MoE, Mixtral), checkpoints in
both expert layouts, and the routers we do not implement going to the transformers fallback."""

import json

import pytest
import torch
import transformers
from model_helpers import randomized_model, small_moe_config
from safetensors.torch import save_file
from test_parity import TOLERANCE, to_transformers

from hybridflow.models import CausalLM, load_model
from hybridflow.models.checkpoint_io.hf_fallback import HFCausalLM
from hybridflow.models.checkpoint_io.loadability import config_problems

CASES = {
    # norm_topk_prob off, a dense layer among sparse ones (mlp_only_layers=[1])
    "qwen3_moe": small_moe_config("qwen3_moe"),
    "qwen3_moe-renormalised-sparse-step-2": small_moe_config(
        "qwen3_moe", norm_topk_prob=True, mlp_only_layers=(), decoder_sparse_step=2
    ),
    "qwen3_moe-tied": small_moe_config("qwen3_moe", tie_word_embeddings=True),
    "mixtral": small_moe_config("mixtral"),
}


def _ids(vocab=97):
    return torch.randint(3, vocab, (2, 19))


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case):
    model = randomized_model(CASES[case])
    hf_model = to_transformers(model)
    input_ids = _ids()
    with torch.no_grad():
        ours, theirs = model(input_ids), hf_model(input_ids).logits
    assert (ours - theirs).abs().max().item() <= TOLERANCE


def test_sparse_layers_follow_transformers_rule():
    config = CASES["qwen3_moe-renormalised-sparse-step-2"]
    model = randomized_model(config)
    assert [layer.sparse for layer in model.model.layers] == [False, True, False]
    assert config.sparse_layer_indices() == [1]
    assert CASES["qwen3_moe"].sparse_layer_indices() == [0, 2]  # layer 1 is mlp_only


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_transformers_checkpoint_loads_here_and_ours_loads_there(tmp_path, case):
    """transformers 5 writes one tensor per expert (Mixtral's block_sparse_moe/w1-w3 names);
    we read it, and write the same names back."""
    reference = randomized_model(CASES[case])
    hf_model = to_transformers(reference)
    hf_model.save_pretrained(str(tmp_path / "hf"))
    assert config_problems(tmp_path / "hf") == []  # the check before a run reads the headers
    model = load_model(str(tmp_path / "hf"))
    assert isinstance(model, CausalLM) and model.config.is_moe
    input_ids = _ids()
    with torch.no_grad():
        assert (hf_model(input_ids).logits - model(input_ids)).abs().max() <= TOLERANCE

    model.save_pretrained(str(tmp_path / "ours"))
    assert _tensor_names(tmp_path / "ours") == _tensor_names(tmp_path / "hf")
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours")).eval()
    with torch.no_grad():
        assert (again(input_ids).logits - model(input_ids)).abs().max() <= TOLERANCE


def _tensor_names(directory) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_packed_expert_checkpoint_loads_here_and_in_transformers(tmp_path, case):
    """The packed tensors transformers 5 holds in memory, written as they are."""
    model = randomized_model(CASES[case])
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(name.endswith("experts.gate_up_proj") for name in state)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_hf()))
    assert config_problems(tmp_path) == []
    loaded = load_model(str(tmp_path))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    input_ids = _ids()
    with torch.no_grad():
        expected = model(input_ids)
        assert (loaded(input_ids) - expected).abs().max() <= TOLERANCE
        assert (theirs(input_ids).logits - expected).abs().max() <= TOLERANCE


def test_missing_expert_is_reported(tmp_path):
    from safetensors.torch import load_file

    model = randomized_model(CASES["mixtral"])
    model.save_pretrained(str(tmp_path))
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.2.block_sparse_moe.experts.4.w3.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="expert 4 up"):
        load_model(str(tmp_path))
    del state["model.layers.2.block_sparse_moe.gate.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    assert "block_sparse_moe.gate.weight" not in str(config_problems(tmp_path))
    assert "model.layers.2.mlp.gate.weight" in str(config_problems(tmp_path))


def _tiny_hf_checkpoint(tmp_path, config):
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(tmp_path))
    return model


UNSUPPORTED_ROUTERS = {
    "shared experts": lambda: transformers.Qwen2MoeConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
    ),
    "router_jitter_noise": lambda: transformers.MixtralConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        router_jitter_noise=0.1,
    ),
}


@pytest.mark.parametrize("what", sorted(UNSUPPORTED_ROUTERS))
def test_unsupported_router_gets_a_notice_and_the_fallback(tmp_path, capsys, what):
    hf_model = _tiny_hf_checkpoint(tmp_path, UNSUPPORTED_ROUTERS[what]()).eval()
    capsys.readouterr()
    model = load_model(str(tmp_path))
    assert isinstance(model, HFCausalLM)
    # ours, beside transformers' own progress bars
    notice = [line for line in capsys.readouterr().err.splitlines() if "hybridflow" in line]
    assert len(notice) == 1 and what in notice[0] and "transformers" in notice[0], notice
    input_ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids), hf_model(input_ids).logits)


def test_experts_of_no_tokens_give_no_rows():
    """A rank with no tokens (an idle replica of the wide-EP rollout, a rank no token was sent
    to) still runs the layer: [0, H] out, not a reshape error."""
    from hybridflow.models.moe import moe_experts

    gate_up, down = torch.randn(4, 2 * 6, 8), torch.randn(4, 8, 6)
    out = moe_experts(torch.zeros(0, 8), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2),
                      gate_up, down, "loop")  # fmt: skip
    assert out.shape == (0, 8)


def test_the_capturable_grouped_linear_equals_the_split_loop():
    """masked_grouped_linear (what an fp32 CUDA graph captures: no host read of the counts)
    gives each row its own expert's product, and zeros past the last run, as the loop does."""
    from hybridflow.models.moe import grouped_linear, masked_grouped_linear

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 6, 5, generator=generator)
    counts = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    offsets = counts.cumsum(0).to(torch.int32)
    rows = torch.randn(8, 5, generator=generator)  # 2 rows past the runs (another rank's)
    expected = grouped_linear(rows, weight, counts, offsets, "loop")
    got = masked_grouped_linear(rows, weight, offsets)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert got[6:].abs().sum() == 0
