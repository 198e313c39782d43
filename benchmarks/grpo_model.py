"""The workload model of benchmarks/grpo_vs_trl.py (and async_rl.py): a random-weight
checkpoint of a preset's shape with a word-level tokenizer that spells every id, and random
prompts of its ids."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import grpo_vl  # noqa: E402


def build_hf_model_dir(preset: str, out_dir: str, seed: int = 0) -> str:
    """Random-weight HF checkpoint of the preset's shape, plus a word-level tokenizer whose
    vocabulary covers every id (token i is spelled ``w{i}``), so text round-trips exactly.
    A vision-language preset's vision tokens keep their own names, and the directory gets
    a chat template and an image processor (grpo_vl.py)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, PreTrainedTokenizerFast

    from hybridflow.models import load_model

    torch.manual_seed(seed)
    # on a GPU: drawn there and written in bf16, what both sides train in (a 7B model's
    # fp32 draw and write on the host take minutes)
    cuda = torch.cuda.is_available()
    model = load_model(preset, dtype=torch.bfloat16 if cuda else torch.float32,
                       device="cuda" if cuda else "cpu")  # fmt: skip
    model.save_pretrained(out_dir)
    vocab_size = model.config.vocab_size
    vision = getattr(model.config, "vision", None)
    names = grpo_vl.vision_token_names(vision) if vision is not None else {}
    below = min(names, default=vocab_size)  # eos and pad: the last plain ids
    vocab = {names.get(i, f"w{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {"additional_special_tokens": list(names.values())} if names else {}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=f"w{below - 1}", pad_token=f"w{below - 2}", **special
    )
    if vision is not None:
        fast.chat_template = grpo_vl.CHAT_TEMPLATE
        grpo_vl.write_image_processor(out_dir, vision)
    fast.save_pretrained(out_dir)
    # sanity: transformers reads what we wrote
    AutoConfig.from_pretrained(out_dir)
    del model
    if cuda:
        torch.cuda.empty_cache()
    return out_dir


def load_word_tokenizer(model_dir: str):
    """The word-level tokenizer written by build_hf_model_dir. (AutoTokenizer would pick the
    model type's own tokenizer class, which re-tokenizes ``w123`` differently.)"""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(model_dir)


def random_prompts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # avoid the last ids (eos / pad of the word-level tokenizer)
    return [[rng.randrange(10, vocab_size - 10) for _ in range(length)] for _ in range(n)]
