"""HF checkpoint round trips: ours -> transformers, transformers -> ours, sharded, fallback."""

import json
import os

import pytest
import torch
import transformers
from model_helpers import randomized_model, small_config
from test_parity import to_transformers

from hybridflow.model_config_values import ModelConfigError
from hybridflow.models import CausalLM, load_model, load_tokenizer
from hybridflow.models.checkpoint_io.hf_fallback import HFCausalLM


def _ids(vocab=97):
    return torch.randint(3, vocab, (2, 21))


@pytest.mark.parametrize("model_type,tied", [("qwen2", True), ("llama", False), ("qwen3", True)])
def test_saved_checkpoint_loads_in_transformers(tmp_path, model_type, tied):
    model = randomized_model(small_config(model_type, tie_word_embeddings=tied))
    model.save_pretrained(str(tmp_path), tokenizer=load_tokenizer("char"))
    assert os.path.exists(tmp_path / "model.safetensors")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    input_ids = _ids()
    with torch.no_grad():
        assert (hf_model(input_ids).logits - model(input_ids)).abs().max() <= 1e-5
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert tokenizer.decode(tokenizer("a+b")["input_ids"]) == "a+b"


def test_transformers_checkpoint_loads_here(tmp_path):
    reference = randomized_model(small_config("qwen3", tie_word_embeddings=False))
    hf_model = to_transformers(reference)
    hf_model.save_pretrained(str(tmp_path))
    model = load_model(str(tmp_path))
    assert isinstance(model, CausalLM)
    assert not any(p.is_meta for p in model.parameters())
    input_ids = _ids()
    with torch.no_grad():
        assert (hf_model(input_ids).logits - model(input_ids)).abs().max() <= 1e-5


def test_sharded_round_trip_and_dtype(tmp_path):
    model = randomized_model(small_config("qwen2", tie_word_embeddings=True))
    model.save_pretrained(str(tmp_path), max_shard_size=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard_files = set(index["weight_map"].values())
    assert len(shard_files) > 1 and not (tmp_path / "model.safetensors").exists()
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once

    loaded = load_model(str(tmp_path))
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)

    half = load_model(str(tmp_path), dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        input_ids = _ids()
        assert (hf_model(input_ids).logits - model(input_ids)).abs().max() <= 1e-5


def test_missing_tensor_is_reported(tmp_path):
    from safetensors.torch import load_file, save_file

    model = randomized_model(small_config("llama"))
    model.save_pretrained(str(tmp_path))
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelConfigError, match="lack 1 tensors .* model.layers.1.mlp.up_proj"):
        load_model(str(tmp_path))  # the words of config validate, before a weight is read


def test_unsupported_architecture_uses_hf_fallback(tmp_path):
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(str(tmp_path))
    model = load_model(str(tmp_path))
    assert isinstance(model, HFCausalLM)
    assert "lm_head.weight" in dict(model.named_parameters()) or model.config.tie_word_embeddings
    model.eval()
    sequences = [torch.randint(0, 97, (n,)) for n in (4, 9)]
    cu_seqlens = torch.tensor([0, 4, 13], dtype=torch.int32)
    positions = torch.cat([torch.arange(4), torch.arange(9)])
    with torch.no_grad():
        hidden = model.forward_packed(torch.cat(sequences), positions, cu_seqlens, 9)
        packed_logits = model.lm_head(hidden)
        one_by_one = torch.cat([model(s[None])[0] for s in sequences])
    torch.testing.assert_close(packed_logits, one_by_one, atol=1e-5, rtol=1e-5)

    model.save_pretrained(str(tmp_path / "copy"))
    again = load_model(str(tmp_path / "copy"))
    with torch.no_grad():
        torch.testing.assert_close(again(sequences[1][None]), model(sequences[1][None]))


def test_hf_fallback_trains_with_gradient_checkpointing(tmp_path):
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(str(tmp_path))
    model = load_model(str(tmp_path), backend="hf").train()
    model.enable_gradient_checkpointing(True)
    hf_model = model.hf_model  # transformers 5 renamed the property (the old name warns)
    assert (
        getattr(hf_model, "is_activation_checkpointing", None) or hf_model.is_gradient_checkpointing
    )
    cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32)
    positions = torch.cat([torch.arange(5), torch.arange(7)])
    hidden = model.forward_packed(torch.randint(0, 97, (12,)), positions, cu_seqlens, 7)
    model.lm_head(hidden).logsumexp(-1).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def _with_header(path, mutate):
    """model.safetensors of one 2x2 and one 4-value tensor, its header changed by ``mutate``."""
    import struct

    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2, 2), "b": torch.zeros(4)}, str(path))
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = mutate(json.loads(raw[8 : 8 + length]))
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])


def _set(name, key, value):
    def mutate(header):
        header[name][key] = value
        return header

    return mutate


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda header: [1, 2], "its header is a JSON list"),
        (lambda header: b"[" * 100_000 + b"]" * 100_000, "maximum recursion depth"),
        (_set("b", "data_offsets", None), "expected a tuple of size 2"),
        (_set("b", "data_offsets", [0, 16]), "invalid offset"),  # overlaps a's bytes
        (_set("a", "dtype", "F128"), "F128"),
        (_set("a", "shape", [-4]), "invalid"),
        (_set("a", "shape", "4"), "invalid"),
        (lambda header: {**header, "__metadata__": {"format": ["pt"]}}, "invalid type"),
    ],
    ids=["list", "nested", "no-offsets", "overlap", "dtype", "negative-shape", "shape-text",
         "metadata"],
)  # fmt: skip
def test_a_header_the_library_refuses_is_named_before_a_load(tmp_path, mutate, words):
    """Each was a traceback (KeyError, AttributeError, SafetensorError) in validate or serve."""
    from hybridflow.models.checkpoint_io.hf_checkpoint import safetensors_problem

    path = tmp_path / "model.safetensors"
    _with_header(path, mutate)
    problem = safetensors_problem(path)
    assert problem.startswith(f"{path} cannot be read as safetensors") and words in problem
