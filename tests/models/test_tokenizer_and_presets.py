import jinja2
import pytest
import torch
import transformers

from hybridflow.data.chat import as_token_list
from hybridflow.models import PRESETS, ModelArchitecture, load_model, load_tokenizer
from hybridflow.models.tokenizer import CHAR_VOCAB_SIZE


def test_char_tokenizer_round_trip_and_chat_template(tmp_path):
    tokenizer = load_tokenizer("char")
    text = "Q: 12*3=?\n\tA: 36"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tokenizer.decode(ids) == text
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>uhi<|im_end|><|im_start|>a"
    prompt_ids = tokenizer(prompt)["input_ids"]
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert im_start == 3
    u, h, i, a = (tokenizer.convert_tokens_to_ids(c) for c in "uhia")
    assert prompt_ids == [im_start, u, h, i, 4, im_start, a]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 4
    assert tokenizer.pad_token_id == PRESETS["tiny"].pad_token_id == 0
    assert tokenizer.eos_token_id == PRESETS["tiny"].eos_token_id
    assert len(tokenizer) == CHAR_VOCAB_SIZE <= PRESETS["tiny"].vocab_size

    tokenizer.save_pretrained(str(tmp_path))
    reloaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert reloaded(prompt)["input_ids"] == prompt_ids
    assert (
        reloaded.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
        == prompt
    )
    assert reloaded.eos_token_id == 4 and reloaded.pad_token_id == 0
    assert load_tokenizer(str(tmp_path))(text)["input_ids"] == ids


def test_char_chat_template_is_compact_and_closes_turns_with_eos():
    tokenizer = load_tokenizer("char")
    conversation = [
        {"role": "system", "content": "add"},
        {"role": "user", "content": "23+45="},
        {"role": "assistant", "content": "68"},
    ]
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert (
        text == "<|im_start|>sadd<|im_end|><|im_start|>u23+45=<|im_end|><|im_start|>a68<|im_end|>"
    )
    # The arithmetic prompt, as the data pipeline tokenises it (transformers 5: BatchEncoding).
    prompt_ids = as_token_list(
        tokenizer.apply_chat_template(conversation[1:2], add_generation_prompt=True, tokenize=True)
    )
    assert len(prompt_ids) == 11
    assert tokenizer.decode(prompt_ids) == "<|im_start|>u23+45=<|im_end|><|im_start|>a"
    assert tokenizer.decode(prompt_ids, skip_special_tokens=True) == "u23+45=a"
    # tool results (the calc task's episodes) are turns of their own, marked t
    tool = tokenizer.apply_chat_template([{"role": "tool", "content": "5535"}], tokenize=False)
    assert tool == "<|im_start|>t5535<|im_end|>"
    with pytest.raises(jinja2.TemplateError, match="unsupported role critic"):
        tokenizer.apply_chat_template([{"role": "critic", "content": "x"}], tokenize=False)


def test_unknown_names_fail_with_the_options():
    with pytest.raises(ValueError, match="qwen2.5-1.5b"):
        load_model("no-such-model")
    with pytest.raises(ValueError, match="char"):
        load_tokenizer("no-such-tokenizer")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_shapes_and_hf_round_trip(name):
    config = PRESETS[name]
    assert ModelArchitecture.from_hf(config.to_hf()) == config.replace(torch_dtype="float32")
    if name.startswith("tiny"):  # CPU-fast: what a token runs through
        assert config.num_parameters(active=True) < 1_000_000
    hf_config = transformers.AutoConfig.for_model(**config.to_hf())
    with torch.device("meta"):
        auto = (
            transformers.AutoModelForImageTextToText
            if config.vision
            else transformers.AutoModelForCausalLM
        )
        hf_model = auto.from_config(hf_config)
    assert sum(p.numel() for p in hf_model.parameters()) == config.num_parameters()


def test_preset_is_seeded_and_counts_parameters():
    first, second = load_model("tiny"), load_model("tiny")
    assert sum(p.numel() for p in first.parameters()) == PRESETS["tiny"].num_parameters()
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)
    assert first.lm_head.weight is first.model.embed_tokens.weight


def test_known_parameter_counts():
    # Published sizes: Qwen2.5-1.5B 1.54B, Qwen2.5-7B 7.62B, Llama-3-8B 8.03B.
    assert round(PRESETS["qwen2.5-1.5b"].num_parameters() / 1e9, 2) == 1.54
    assert round(PRESETS["qwen2.5-7b"].num_parameters() / 1e9, 2) == 7.62
    assert round(PRESETS["llama3-8b"].num_parameters() / 1e9, 2) == 8.03


# Total parameters on each model card (Hugging Face), in billions. Qwen's cards round the
# Qwen2.5 sizes down (the 32B has 32,763,876,352 weights, as other counters find too).
PUBLISHED_BILLIONS = {
    "qwen2.5-3b": 3.09,
    "qwen2.5-14b": 14.7,
    "qwen2.5-32b": 32.5,
    "qwen3-8b": 8.2,
    "qwen3-14b": 14.8,
    "llama3.1-8b": 8.03,
    "qwen3-30b-a3b": 30.5,
    "qwen2.5-vl-7b": 8.29,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_BILLIONS))
def test_preset_sizes_match_the_model_cards(name):
    billions = PRESETS[name].num_parameters() / 1e9
    assert abs(billions - PUBLISHED_BILLIONS[name]) / PUBLISHED_BILLIONS[name] < 0.01


def test_the_large_presets_need_the_decoder_features_they_name():
    assert PRESETS["qwen2.5-32b"].num_parameters() == 32_763_876_352
    assert PRESETS["qwen3-8b"].qk_norm and PRESETS["qwen3-14b"].qk_norm  # parity: test_parity
    assert PRESETS["llama3.1-8b"].rope_type == "llama3"
    assert not PRESETS["qwen3-8b"].tie_word_embeddings and PRESETS["qwen2.5-3b"].tie_word_embeddings
    # Qwen3-30B-A3B's card: 3.3 B activated (8 of 128 experts on each of its 48 layers)
    moe = PRESETS["qwen3-30b-a3b"]
    assert 3.3 <= moe.num_parameters(active=True) / 1e9 < 3.4
    assert moe.sparse_layer_indices() == list(range(48)) and moe.norm_topk_prob


def test_the_char_vl_tokenizer_has_the_tiny_vl_presets_vision_tokens():
    from hybridflow.models.presets import PRESETS
    from hybridflow.models.tokenizer import load_tokenizer
    from hybridflow.workers.model_loading import default_tokenizer_path

    spec = PRESETS["tiny-vl"].vision
    tokenizer = load_tokenizer("char-vl")
    ids = tokenizer.encode("a<|vision_start|><|image_pad|><|vision_end|>", add_special_tokens=False)
    assert ids[1:] == [spec.vision_start_token_id, spec.image_token_id, spec.vision_end_token_id]
    assert "<|image_pad|>" not in load_tokenizer("char").get_vocab()
    from hybridflow.config import ModelConfig

    assert default_tokenizer_path(ModelConfig(path="tiny-vl")) == "char-vl"
    assert default_tokenizer_path(ModelConfig(path="tiny")) == "char"
    assert default_tokenizer_path(ModelConfig(path="sft:shapes")) == "char-vl"
    assert default_tokenizer_path(ModelConfig(path="sft:arithmetic")) == "char"


def test_a_config_json_value_transformers_refuses_is_not_blamed_on_the_tokenizer_files(tmp_path):
    """AutoTokenizer reads config.json too: a torch_dtype torch lacks is config.json's fault."""
    import json

    from hybridflow.config import ConfigError
    from hybridflow.models.tokenizer import build_char_tokenizer, load_tokenizer

    build_char_tokenizer().save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen2", "torch_dtype": "float128"})
    )
    with pytest.raises(ConfigError) as error:
        load_tokenizer(str(tmp_path))
    text = str(error.value)
    assert f"{tmp_path}/config.json holds a value transformers refuses" in text
    assert "float128" in text and "copy the tokenizer files" not in text
