"""The ``sft`` section's values (``hybridflow sft``, and the ``model.path=sft:<task>`` warm
start of ``train``): counts, rates and the learning rate, checked before any example is made
or any step runs, one line a key."""

from __future__ import annotations

import math

from hybridflow.config.sections import MAX_BUILTIN_PROMPTS, SFTConfig

_WHOLE_AT_LEAST = {"total_steps": 1, "batch_size": 1, "builtin_size": 1, "max_length": 1,
                   "eval_every": 1, "eval_size": 1, "warmup_steps": 0}  # fmt: skip
_FRACTIONS = ("min_lr_ratio", "carry_error_rate", "miscopy_rate")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def sft_problems(sft: SFTConfig) -> list[str]:
    """One line per bad value, naming the key and what it must be."""
    problems = [
        f"sft.{key} = {getattr(sft, key)!r} must be a whole number >= {least}"
        for key, least in _WHOLE_AT_LEAST.items()
        if not (isinstance(getattr(sft, key), int) and getattr(sft, key) >= least)
    ]
    problems += [
        f"sft.{key} = {getattr(sft, key)} must be at most {MAX_BUILTIN_PROMPTS:,} (the "
        "problems the built-in task makes in memory before the run)"
        for key in ("builtin_size", "eval_size")
        if isinstance(getattr(sft, key), int) and getattr(sft, key) > MAX_BUILTIN_PROMPTS
    ]
    if sft.lr_decay_steps is not None and not (
        isinstance(sft.lr_decay_steps, int) and sft.lr_decay_steps >= 1
    ):
        problems.append(f"sft.lr_decay_steps = {sft.lr_decay_steps!r} must be a whole number "
                        ">= 1, or null (at sft.total_steps)")  # fmt: skip
    for key in ("lr", "weight_decay"):
        value = getattr(sft, key)
        if not (
            _is_number(value) and math.isfinite(value) and value >= 0 and (value or key != "lr")
        ):
            least = "> 0" if key == "lr" else ">= 0"
            problems.append(f"sft.{key} = {value!r} must be a finite number {least}")
    problems += [
        f"sft.{key} = {getattr(sft, key)!r} must be a fraction between 0 and 1"
        for key in _FRACTIONS
        if not (_is_number(getattr(sft, key)) and 0 <= getattr(sft, key) <= 1)
    ]
    target = sft.stop_at_accuracy
    if target is not None and not (_is_number(target) and 0 < target <= 1):
        problems.append(f"sft.stop_at_accuracy = {target!r} must be a fraction in (0, 1] of "
                        "right greedy answers, or null (always sft.total_steps)")  # fmt: skip
    return problems


SFT_READS = frozenset({
    "model.path", "model.tokenizer_path", "model.dtype", "data.builtin_val_size",
    "trainer.run_dir", "trainer.seed", "trainer.device", "trainer.save_freq",
    "trainer.keep_last_k", "trainer.resume", "trainer.loggers", "trainer.progress_interval_s",
    "trainer.cpu_threads", "trainer.project_name", "trainer.experiment_name",
})  # fmt: skip
"""The keys outside the ``sft`` section that ``hybridflow sft`` reads."""

SFT_COUNTERPARTS = {
    "trainer.total_steps": "sft.total_steps", "trainer.total_epochs": "sft.total_steps",
    "data.train_files": "sft.train_files", "data.train_batch_size": "sft.batch_size",
    "data.max_prompt_length": "sft.max_length", "data.max_response_length": "sft.max_length",
    "data.builtin_train_size": "sft.builtin_size", "actor.lr": "sft.lr",
    "actor.weight_decay": "sft.weight_decay", "actor.lr_warmup_steps": "sft.warmup_steps",
    "actor.min_lr_ratio": "sft.min_lr_ratio", "actor.max_tokens_per_gpu": "sft.max_tokens_per_gpu",
}  # fmt: skip
"""An RL key given to ``hybridflow sft`` -> the sft key that does what it was meant to."""


def unread_key_problems(keys: list[str]) -> list[str]:
    """The keys of ``keys`` (dotted, as given on the command line) that ``hybridflow sft``
    never reads: one line for each that has an sft counterpart, one line for the rest."""
    unread = [key for key in dict.fromkeys(keys)
              if not key.startswith("sft.") and key not in SFT_READS]  # fmt: skip
    problems = [
        f"{key}: hybridflow sft does not read it; set {SFT_COUNTERPARTS[key]} instead"
        for key in unread
        if key in SFT_COUNTERPARTS
    ]
    rest = [key for key in unread if key not in SFT_COUNTERPARTS]
    if rest:
        problems.append(
            f"{', '.join(rest)}: hybridflow sft does not read {'it' if len(rest) == 1 else 'them'}"
            f"; remove {'it' if len(rest) == 1 else 'them'} (besides the sft section it reads "
            f"{', '.join(sorted(SFT_READS))})"
        )
    return problems


def task_problems(model_path: str, sft: SFTConfig) -> list[str]:
    """``model.path = sft:<task>`` beside ``sft.train_files`` of other built-in tasks only:
    ``hybridflow sft`` trains ``sft.preset`` on the files, so the task named would be
    ignored."""
    task = model_path.removeprefix("sft:") if model_path.startswith("sft:") else None
    files = list(sft.train_files) if isinstance(sft.train_files, list) else []
    builtin = [f for f in files if isinstance(f, str) and f.startswith("builtin:")]
    if task is None or not files or len(builtin) < len(files) or f"builtin:{task}" in builtin:
        return []
    return [f"model.path = sft:{task} names the task {task}, but sft.train_files = {files}: "
            f"hybridflow sft trains sft.preset on sft.train_files; set "
            f"sft.train_files=[builtin:{task}]"]  # fmt: skip
