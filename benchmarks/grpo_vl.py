"""The vision-language workload of benchmarks/grpo_vs_trl.py: a random-weight Qwen2.5-VL
directory TRL can read offline, and the same prompts with images for both sides.

The directory holds, beside the weights, the word-level tokenizer of grpo_vs_trl.py with
the vision tokens under their own names (``<|vision_start|>``, ``<|image_pad|>``, ...) at
the ids the config names, a chat template that writes an image part as Qwen2.5-VL's does
(``<|vision_start|><|image_pad|><|vision_end|>``) and text parts as they are, and the PIL
Qwen2-VL image processor (preprocessor_config.json) with Qwen2.5-VL's published size limits
in merged patches: a Geometry3K-sized image keeps its size.

hybridflow gets the ids and pixels made once, as its data path makes them (images first,
then the text); TRL gets the same PIL images in an ``images`` column beside conversational
prompts of the same text, and its processor (tokenizer + that image processor) expands the
image-pad token per merged patch as ours does: both sides train on the same token ids.
"""

from __future__ import annotations

from hybridflow.bench.image_prompts import (  # noqa: F401  (grpo_vs_trl.py's arguments)
    GEO3K_IMAGE_SIZES,
    format_image_sizes,
    images_per_prompt,
    parse_image_sizes,
)

CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
)


def vision_token_names(vision) -> dict[int, str]:
    """The vision tokens' ids -> the names Qwen2.5-VL's tokenizer gives them."""
    return {vision.vision_start_token_id: "<|vision_start|>",
            vision.vision_end_token_id: "<|vision_end|>",
            vision.image_token_id: "<|image_pad|>",
            vision.video_token_id: "<|video_pad|>"}  # fmt: skip


def write_image_processor(model_dir: str, vision) -> None:
    """preprocessor_config.json: transformers' PIL Qwen2-VL processor for the encoder, with
    the size limits `hybridflow bench rollout` gives a preset (bench/image_prompts.py)."""
    from hybridflow.bench.image_prompts import bench_image_processor

    bench_image_processor(model_dir, vision).processor.save_pretrained(model_dir)


def vision_of(model_dir: str):
    """The VisionSpec of a model directory's config.json (None for a text model)."""
    from hybridflow.trainer.plan.architecture import model_architecture

    architecture = model_architecture(model_dir)
    return None if architecture is None else architecture.vision


def image_prompts(model_dir: str, texts: list[list[int]], count: int, sizes):
    """The prompts with images both sides get (bench/image_prompts.py's ImagePrompts),
    preprocessed by the directory's own image processor."""
    from hybridflow.bench.image_prompts import bench_image_processor, with_images

    vision = vision_of(model_dir)
    processor = bench_image_processor(model_dir, vision)
    return with_images(texts, count, sizes, processor, vision)


def trl_processor(model_dir: str):
    """The processor TRL's GRPOTrainer takes for a vision-language model: transformers'
    Qwen2_5_VLProcessor of the directory's tokenizer and image processor (torchvision's
    where it is installed, as hybridflow's data path picks it), without the video
    processor: transformers' video processors need torchvision, which a CPU torch from
    local disk lacks, and this workload has no video."""
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLProcessor

    from hybridflow.data.images import ImageProcessor

    class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template)

    # left: TRL pads prompts so, and the processor's mm_token_type_ids must line up with
    # them (TRL loads a processor itself with padding_side="left")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir, padding_side="left")
    image_processor = ImageProcessor.from_model_dir(model_dir).processor
    return ImageOnlyQwen2_5_VLProcessor(image_processor, tokenizer, chat_template=CHAT_TEMPLATE)


def trl_dataset(texts: list[str], pictures: list[list], steps: int):
    """TRL's dataset: conversational prompts of the texts, the images of each in an
    ``images`` column (TRL puts them before the text, as ours are), ``steps`` times over."""
    from datasets import Dataset

    prompts = [[{"role": "user", "content": text}] for text in texts]
    return Dataset.from_dict({"prompt": prompts * steps, "images": pictures * steps})


def load_trl_model(model_dir: str, dtype):
    """transformers' Qwen2_5_VLForConditionalGeneration of the directory, its vision tower
    frozen as hybridflow's is by default (actor.freeze_vision_tower, verl's)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="sdpa"
    )
    model.model.visual.requires_grad_(False)
    return model


def describe(made, sizes) -> str:
    """``1 image a prompt (256x256,...), 81-315 image tokens (mean 198)``."""
    info = made.summary()
    tokens = info["image_tokens_per_prompt"]
    return (f"{info['images_per_prompt']} image(s) a prompt ({format_image_sizes(sizes)} px), "
            f"{tokens['min']}-{tokens['max']} image tokens (mean {tokens['mean']:.0f})")  # fmt: skip
