"""Tiny sequence-classification checkpoints (reward models) written by transformers with
random weights, for the reward-model tests."""

from __future__ import annotations

from pathlib import Path

import torch

SIZES = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def write_reward_model(directory: Path, family: str = "llama", vocab_size: int = 128,
                       pad_token_id: int = 0, seed: int = 0, tokenizer=None) -> Path:  # fmt: skip
    """A ``{Llama,Qwen2}ForSequenceClassification`` of one label, random weights (the score
    head large enough that scores differ by whole units), saved with ``tokenizer``."""
    import transformers

    config_class = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
    model_class = {"llama": "LlamaForSequenceClassification",
                   "qwen2": "Qwen2ForSequenceClassification",
                   "qwen3": "Qwen3ForSequenceClassification"}  # fmt: skip
    config = getattr(transformers, config_class[family])(
        vocab_size=vocab_size, num_labels=1, pad_token_id=pad_token_id, eos_token_id=4,
        bos_token_id=3, tie_word_embeddings=False, **SIZES,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = getattr(transformers, model_class[family])(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)
        model.score.weight.normal_(0.0, 2.0)
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.fill_(1.0)
    model.save_pretrained(str(directory))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    return Path(directory)


def transformers_score(directory: Path, ids: list[int]) -> float:
    """A direct transformers forward of one unpadded sequence: its score."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(directory)).eval()
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def byte_bpe_tokenizer(texts: list[str], vocab_size: int = 300):
    """A byte-level BPE trained on ``texts`` with a ChatML template unlike the char
    tokenizer's (full role names, newlines): conversations must be rendered again for it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    backend.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")  # fmt: skip
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}"
    )
    return tokenizer
