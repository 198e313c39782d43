"""Value converters of the verl mapping table: verl's value -> ours, or :class:`NotHere`."""

from __future__ import annotations

from typing import Any

from hybridflow.config.verl.rules import NotHere

OUR_LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
SCHEDULES = ("constant", "linear", "cosine")
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class KeepOurs(Exception):
    """Raised by a converter: verl's value means "unset"; our key keeps its value."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


def as_bool(value: Any) -> bool:
    """Hydra's booleans: True/False/true/false (YAML already made most of them bools)."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return bool(value)


def torch_compile(value: Any) -> bool | str:
    """verl's use_torch_compile: True compiles where verl trains, on GPUs: our auto (on CUDA,
    off on the CPU)."""
    return "auto" if as_bool(value) else False


def as_number(value: Any) -> float:
    """YAML 1.1 reads ``1e-6`` (no dot) as a string; Hydra reads it as a float."""
    return float(value) if isinstance(value, str) else value


# verl's "file" logger writes one JSON line of metrics a step (VERL_FILE_LOGGER_PATH): ours
# writes them to <run_dir>/metrics.jsonl.
VERL_LOGGERS = {"file": "jsonl"}


def loggers(value: Any) -> list[str]:
    names = [value] if isinstance(value, str) else list(value)
    names = [VERL_LOGGERS.get(name, name) for name in names]
    for name in names:
        if name not in OUR_LOGGERS:
            raise NotHere(f"the {name!r} logger (hybridflow logs to {', '.join(OUR_LOGGERS)})")
    return list(dict.fromkeys(names))


def lr_schedule(value: Any) -> str:
    if value not in SCHEDULES:
        raise NotHere(f"the {value!r} learning-rate schedule (known: {', '.join(SCHEDULES)})")
    return value


def lora_targets(value: Any) -> list[str]:
    if value == "all-linear":
        return list(ALL_LINEAR)
    return [value] if isinstance(value, str) else list(value)


def device(value: Any) -> str:
    if value not in ("cuda", "cpu", "auto"):
        raise NotHere(f"the {value!r} device (Ascend NPUs and others; hybridflow runs on CUDA)")
    return value


def enforce_eager(value: Any) -> bool | None:
    return False if as_bool(value) else None  # None: the engine's default (graphs on CUDA)


def rollout_expert_parallel(value: Any) -> int:
    """verl's 1 (its default) leaves vLLM splitting each expert's width over the
    tensor-parallel ranks; ours then splits whole experts over them (the same bytes a rank):
    rollout.expert_parallel_size stays unset. Larger values as given."""
    if int(value) == 1:
        raise KeepOurs("1: the experts split over the rollout's tensor-parallel ranks")
    return int(value)


def gen_rounds(value: Any) -> int:
    if int(value) <= 0:
        raise NotHere("unbounded generation rounds (filter_groups.max_num_gen_batches <= 0)")
    return int(value)


def keep_checkpoints(value: Any) -> int:
    if value is None:
        raise KeepOurs("null keeps every checkpoint in verl; hybridflow keeps trainer.keep_last_k")
    return int(value)


def save_freq(value: Any) -> int:
    # verl saves only when save_freq > 0 (then also after the last step); ours: 0 = only at the
    # end, -1 = never.
    return int(value) if int(value) > 0 else -1


def val_batch_size(value: Any) -> int:
    if value is None:
        raise KeepOurs("null validates all prompts in one batch in verl; here data.val_batch_size")
    return int(value)


def recompute(value: Any) -> bool:
    """Megatron's recompute_granularity (full | selective | null) -> gradient checkpointing:
    hybridflow recomputes every layer whole."""
    return value not in (None, "null", "None", "", False)


def fp8_precision(value: Any) -> str:
    """Megatron's override_transformer_config.fp8 (Transformer Engine's format: e4m3 |
    hybrid, null: off) -> our precision. The gradient's format follows our fp8_recipe."""
    if value in (None, "null", "None", "", False, "false", "False"):
        raise KeepOurs("null: the matmuls train in bf16")
    if str(value).lower() not in ("e4m3", "hybrid"):
        raise NotHere(f"the fp8 format {value!r} (Transformer Engine's e4m3 or hybrid)")
    return "fp8"


# Transformer Engine's recipe -> the nearest of torchao's: delayed (an amax history) becomes
# current scaling, blockwise (1x128 activation and 128x128 weight blocks) a scale per row.
FP8_RECIPES = {"tensorwise": "tensorwise", "delayed": "tensorwise", "blockwise": "rowwise"}


def fp8_recipe(value: Any) -> str:
    if value not in FP8_RECIPES:
        raise NotHere(f"the fp8 recipe {value!r} (known: {', '.join(FP8_RECIPES)}; MXFP8 and "
                      "NVFP4 need Blackwell GPUs)")  # fmt: skip
    return FP8_RECIPES[value]
