"""Tokenizers: a local HF directory (with its chat template), or the built-in character-level
tokenizer used with the tiny presets for synthetic tasks.

The char tokenizer is a standard `tokenizers` BPE model without merges (so every character is
one token), wrapped in transformers' PreTrainedTokenizerFast: `save_pretrained(dir)` writes an
ordinary tokenizer directory that `AutoTokenizer.from_pretrained(dir)` reads back.

Ids: 0 `<pad>`, 1 `<unk>`, 2 `<|endoftext|>`, 3 `<|im_start|>`, 4 `<|im_end|>` (= eos, the
tiny presets' eos_token_id), then tab, newline and printable ASCII 32..126, one id each.

Chat format (compact ChatML: prompt length is what bounds CPU demo speed). Each message is
`<|im_start|>` + the first letter of its role (`s`ystem, `u`ser, `a`ssistant) + content +
`<|im_end|>`, with no newlines; `add_generation_prompt` appends `<|im_start|>a`:

    <|im_start|>u23+45=<|im_end|><|im_start|>a          (11 tokens)
    ... then the model writes `68<|im_end|>`; eos closes the assistant turn.

Other roles are rejected by the template (a "tool" turn would otherwise read as `t`).
"""

from __future__ import annotations

import os

from hybridflow.config import ConfigError

# Compact ChatML (see module docstring): <|im_start|>{role[0]}{content}<|im_end|>
CHAR_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('char tokenizer chat template: unsupported role ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'][0] + message['content'] + '<|im_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>a' }}{% endif %}"
)

# Fixed ids (the tiny presets' pad/eos ids refer to them).
CHAR_SPECIAL_TOKENS = ["<pad>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAR_ALPHABET = ["\t", "\n"] + [chr(c) for c in range(32, 127)]
CHAR_VOCAB_SIZE = len(CHAR_SPECIAL_TOKENS) + len(CHAR_ALPHABET)  # 102 <= tiny vocab 128

# The vision tokens of the char-vl tokenizer, at the ids the tiny-vl preset's config names
# (image_token_id 124 ... vision_end_token_id 127); ids 102..123 are unused.
CHAR_VISION_TOKENS = {"<|image_pad|>": 124, "<|video_pad|>": 125, "<|vision_start|>": 126,
                      "<|vision_end|>": 127}  # fmt: skip

# Names that resolve to the built-in char tokenizer, and to it with the vision tokens.
CHAR_TOKENIZER_NAMES = ("char", "tiny", "tiny-4l", "char-vl", "tiny-vl")
CHAR_VISION_NAMES = ("char-vl", "tiny-vl")


def build_char_tokenizer(vision: bool = False):
    """Character-level tokenizer: printable ASCII + tab/newline, ChatML special tokens,
    eos = <|im_end|> (end of an assistant turn), pad = <pad>, the compact chat template.
    vision: with Qwen2-VL's vision tokens (CHAR_VISION_TOKENS), for the tiny-vl preset."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(CHAR_SPECIAL_TOKENS + CHAR_ALPHABET)}
    if vision:
        vocab.update(CHAR_VISION_TOKENS)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()  # join characters without separators
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
        chat_template=CHAR_CHAT_TEMPLATE,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    special = ["<|endoftext|>", "<|im_start|>"] + (list(CHAR_VISION_TOKENS) if vision else [])
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    return tokenizer


def load_tokenizer(name_or_path: str):
    """Built-in char tokenizer for "char"/tiny presets, else AutoTokenizer on a local directory."""
    if name_or_path in CHAR_TOKENIZER_NAMES:
        return build_char_tokenizer(vision=name_or_path in CHAR_VISION_NAMES)
    if not os.path.isdir(name_or_path):
        raise ConfigError(
            [
                f"no tokenizer for {name_or_path!r}: pass a local HF directory or one of "
                f"{CHAR_TOKENIZER_NAMES} (the large presets come without a tokenizer)"
            ]
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    except Exception as error:  # transformers raises anything from KeyError to OSError here
        config_problem = _config_json_problem(name_or_path)
        if config_problem:  # the tokenizer reads config.json too: its files are not at fault
            raise ConfigError([config_problem]) from error
        raise ConfigError(
            [
                f"the tokenizer in {name_or_path} cannot be loaded ({type(error).__name__}: "
                f"{error}): copy the tokenizer files (tokenizer.json, tokenizer_config.json, "
                f"...) of the model again, or set model.tokenizer_path to a directory that has them"
            ]
        ) from error
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token  # batching needs some pad id
    return tokenizer


def _config_json_problem(directory: str) -> str | None:
    """Why transformers cannot read ``directory``'s config.json (a value its own checks
    refuse, such as an unknown torch_dtype), or None when it reads it or there is none."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(directory, "config.json")):
        return None
    try:
        AutoConfig.from_pretrained(directory)
    except Exception as error:  # as above: any kind, for any value it refuses
        text = " ".join(str(error).split())
        return (
            f"{directory}/config.json holds a value transformers refuses ({type(error).__name__}: "
            f"{text[:400]}): correct the value in config.json, or copy the model directory again"
        )
    return None
