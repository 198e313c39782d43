"""Geometry3K-shaped files for tests: figures drawn with PIL, rows as the Hub's parquet
holds them (`images`, `problem`, `answer`), never downloaded."""

from __future__ import annotations

import io
from pathlib import Path

from hybridflow.data.schema import write_rows

PROBLEMS = [("<image>Find x.", r"2 \sqrt { 3 }"), ("<image>Find y.", "60"),
            ("<image>Find the area.", r"\frac { 5 } { 2 }"), ("<image>Find z.", "12.5")]  # fmt: skip


def figure(width: int = 64, height: int = 48) -> bytes:
    """A labelled right triangle as PNG bytes (geo3k's figures are line drawings)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.polygon([(4, height - 4), (width - 4, height - 4), (4, 4)], outline="black")
    draw.text((width // 2, height - 14), "x", fill="black")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def hub_row(problem: str = "<image>Find x.", answer: str = r"2 \sqrt { 3 }", images=None) -> dict:
    images = [{"bytes": figure(), "path": "figure.png"}] if images is None else images
    return {"images": images, "problem": problem, "answer": answer}


def write_hub_parquet(path: Path, rows: int = 4) -> Path:
    """`rows` Hub-shaped rows (the problems above, in turn, each with a figure)."""
    chosen = [PROBLEMS[i % len(PROBLEMS)] for i in range(rows)]
    return write_rows([hub_row(problem, answer) for problem, answer in chosen], path)


def write_tiny_qwen2_5_vl(directory: Path) -> Path:
    """A random Qwen2.5-VL of a few hundred thousand parameters written by transformers, with
    the char tokenizer and its vision tokens (the ids its config names) and the PIL image
    processor: a model directory as a user has one, small enough for a CPU."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from hybridflow.models.tokenizer import CHAR_VISION_TOKENS, build_char_tokenizer

    tokenizer = build_char_tokenizer(vision=True)
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope,
                max_position_embeddings=4096, bos_token_id=None,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                  window_size=112, fullatt_block_indexes=[1])  # fmt: skip
    ids = {f"{name}_token_id": CHAR_VISION_TOKENS[token] for name, token in (
        ("image", "<|image_pad|>"), ("video", "<|video_pad|>"),
        ("vision_start", "<|vision_start|>"), ("vision_end", "<|vision_end|>"))}  # fmt: skip
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                              **ids)  # fmt: skip
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56).save_pretrained(directory)
    return Path(directory)
