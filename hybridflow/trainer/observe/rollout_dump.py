"""A step's samples written to ``<trainer.rollout_data_dir>/<step>.jsonl``, as verl's
``trainer.rollout_data_dir`` writes them: one JSON line a sample with ``input`` (the prompt's
text), ``output`` (the response's), ``gts`` (the ground truth), ``score`` and ``step``, the
text decoded without special tokens. What a run sampled can then be compared across runs
(two layouts draw the same samples, docs/parallelism.md)."""

from __future__ import annotations

import json
from pathlib import Path

from hybridflow.protocol import Batch
from hybridflow.rewards.placement import decode_responses


def rollout_lines(batch: Batch, tokenizer, step: int) -> list[str]:
    """One JSON line a row of a scored batch (prompts [B, P] left-padded, the first P columns
    of attention_mask theirs; responses [B, R] with response_mask)."""
    prompts = batch.tensors["prompts"]
    prompt_mask = batch.tensors["attention_mask"][:, : prompts.shape[1]]
    inputs = decode_responses(tokenizer, prompts, prompt_mask)
    outputs = decode_responses(tokenizer, batch.tensors["responses"],
                               batch.tensors["response_mask"])  # fmt: skip
    truths = batch.arrays.get("ground_truth")
    scores = batch.arrays["scores"]
    lines = []
    for i in range(len(batch)):
        gts = None if truths is None else _plain(truths[i])
        row = {"input": inputs[i], "output": outputs[i], "gts": gts,
               "score": float(scores[i]), "step": step}  # fmt: skip
        lines.append(json.dumps(row, ensure_ascii=False))
    return lines


def dump_rollouts(directory: str, step: int, tokenizer, batch: Batch) -> Path:
    """Write ``batch``'s samples to ``<directory>/<step>.jsonl``; returns the file."""
    path = Path(directory).expanduser() / f"{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(rollout_lines(batch, tokenizer, step)) + "\n", encoding="utf-8")
    return path


def _plain(value):
    """A ground truth as JSON takes it (numpy scalars and arrays as Python values)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value
