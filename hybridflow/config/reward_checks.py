"""Checks of the model-based reward parts (reward.model, reward.judge, the weights) that
``validate()`` runs before any model loads. Reads config.json and safetensors headers only
(no torch)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hybridflow.safetensors_headers import stored_shapes

SCORE_WEIGHT = "score.weight"
RESPONSE_SLOT = "{response}"
JUDGE_ENGINES = ("rollout", "url")


def stored_score_rows(model_dir: str | Path) -> int | None:
    """Rows of ``score.weight`` (num_labels) in the safetensors headers of ``model_dir``;
    None when no header holds it or a header cannot be read."""
    shape = (stored_shapes(model_dir) or {}).get(SCORE_WEIGHT)
    return int(shape[0]) if shape is not None and len(shape) == 2 else None


def stored_parameter_count(model_dir: str | Path) -> int | None:
    """Elements of every tensor in the checkpoint (for the memory plan), quantized ones
    counted as they load, dequantised; None if unreadable."""
    import json

    from hybridflow.models.checkpoint_io.quantized_checkpoint import (
        loaded_shapes,
        weight_quantization,
    )

    shapes = stored_shapes(model_dir)
    if shapes is None:
        return None
    try:
        quantization = weight_quantization(
            json.loads((Path(model_dir) / "config.json").read_text())
        )
    except (OSError, ValueError, AttributeError):
        quantization = None  # unreadable or a format not read: said by the checks
    return sum(math.prod(shape) for shape in loaded_shapes(shapes, quantization).values())


def reward_model_problems(path: str) -> list[str]:
    """reward.model.path is a local sequence-classification checkpoint ([] if so)."""
    directory = Path(path).expanduser()
    if not (directory / "config.json").is_file():
        return [f"reward.model.path = {path!r} is not a model directory (no config.json there): "
                f"point it to a local *ForSequenceClassification checkpoint"]  # fmt: skip
    if stored_score_rows(directory) is None:
        return [f"reward.model.path = {path!r} holds no {SCORE_WEIGHT} head in its safetensors "
                f"files, so it is not a reward model (a *ForSequenceClassification "
                f"checkpoint, e.g. LlamaForSequenceClassification, scores a conversation; a "
                f"causal LM does not): use a reward model, or a generative judge "
                f"(reward.judge.template) to score with a causal LM"]  # fmt: skip
    return []


def judge_problems(judge: Any) -> list[str]:
    """reward.judge: the template file exists and holds the response slot; the engine is
    known and has what it needs."""
    problems = []
    path = Path(judge.template).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = "it does not exist" if isinstance(error, FileNotFoundError) else str(error)
        problems.append(f"reward.judge.template = {judge.template!r} cannot be read ({reason}): "
                        f"point it to a text file holding the judge's prompt")  # fmt: skip
        text = None
    if text is not None and RESPONSE_SLOT not in text:
        problems.append(f"reward.judge.template {judge.template!r} has no {RESPONSE_SLOT} slot, "
                        f"so the judge would never see the response: write {RESPONSE_SLOT} "
                        f"where it goes (also {{prompt}} and {{ground_truth}} if wanted)")  # fmt: skip
    if judge.engine not in JUDGE_ENGINES:
        problems.append(f"reward.judge.engine = {judge.engine!r} is unknown: use rollout (the "
                        f"policy's own rollout service) or url (a second model's server)")  # fmt: skip
    if judge.engine == "url" and not judge.url:
        problems.append("reward.judge.engine = url needs reward.judge.url (an OpenAI-compatible "
                        "server, e.g. http://127.0.0.1:8000/v1)")  # fmt: skip
    import re

    try:
        re.compile(judge.score_pattern)
    except re.error as error:
        problems.append(f"reward.judge.score_pattern = {judge.score_pattern!r} is not a regular "
                        f"expression ({error})")  # fmt: skip
    if judge.timeout_s <= 0 or judge.concurrency < 1 or judge.max_tokens < 1:
        problems.append("reward.judge.timeout_s, concurrency and max_tokens must be positive")
    return problems


def reward_part_problems(cfg: Any) -> list[str]:
    """Every problem of the reward parts of ``cfg`` (a Config), one line each."""
    from hybridflow.rewards.combine import weights_problems

    reward = cfg.reward
    model, judge = reward.model.path is not None, reward.judge.template is not None
    problems = weights_problems(reward.weights, reward.source_weights, model=model, judge=judge)
    if model:
        problems += reward_model_problems(reward.model.path)
        if reward.model.dtype not in ("auto", "bfloat16", "float32", "float16"):
            problems.append(f"reward.model.dtype = {reward.model.dtype!r} is unknown: use auto, "
                            f"bfloat16, float32 or float16")  # fmt: skip
        if reward.model.micro_batch_size_per_gpu < 1:
            problems.append("reward.model.micro_batch_size_per_gpu must be >= 1")
        budget, longest = reward.model.max_tokens_per_gpu, max_sequence_tokens(cfg)
        if budget is not None and budget < longest:
            problems.append(f"reward.model.max_tokens_per_gpu = {budget} is below the longest "
                            f"conversation, data.max_prompt_length + data.max_response_length = "
                            f"{longest} tokens: set it to at least {longest}")  # fmt: skip
    problems += reward_pool_problems(cfg)
    if judge:
        problems += judge_problems(reward.judge)
    return problems


def max_sequence_tokens(cfg: Any) -> int:
    return cfg.data.max_prompt_length + cfg.data.max_response_length


def reward_pool_problems(cfg: Any) -> list[str]:
    """reward.model.n_gpus_per_node: a pool of devices of its own needs a reward model and a
    backend that starts one process per device."""
    devices, t = cfg.reward.model.n_gpus_per_node, cfg.trainer
    if not isinstance(devices, int) or devices < 0:
        return [f"reward.model.n_gpus_per_node = {devices!r} must be an integer >= 0 (0: the "
                f"reward model shares the training devices)"]  # fmt: skip
    if devices == 0:
        return []
    if cfg.reward.model.path is None:
        return [f"reward.model.n_gpus_per_node = {devices} gives devices to a reward model, but "
                f"reward.model.path is not set: set it, or reward.model.n_gpus_per_node=0"]  # fmt: skip
    if t.backend == "inprocess":
        return [f"reward.model.n_gpus_per_node = {devices} puts the reward model on devices of "
                f"its own, but trainer.backend = inprocess runs on one device: set "
                f"trainer.backend=local (one node) or ray"]  # fmt: skip
    return []
