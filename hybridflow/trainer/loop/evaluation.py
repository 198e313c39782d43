"""Validation: generate on the held-out prompts, score, report mean@n / best@n / maj@n.

``rollout.val_n`` samples per prompt at ``rollout.val_temperature`` (0: greedy, then n = 1
is all that makes sense). Metrics per data source: ``val/<source>/mean@<n>`` (average score),
``best@<n>`` (best of the n per prompt) and ``maj@<n>`` (score of the majority answer).
When a reward model or a judge makes the score, the validation says what the score is (no
accuracy) and ``val/reward/<part>/mean`` gives each part's own mean.
"""

from __future__ import annotations

import re

import numpy as np

from hybridflow.protocol import Batch
from hybridflow.rewards.combine import PARTS
from hybridflow.trainer.loop.stages import SCORED_FOR, RunContext, generate, score

VALIDATION_SEED = 12345


def run_validation(run: RunContext) -> dict[str, float]:
    """Validation metrics of the current policy over the whole validation set."""
    from hybridflow.data.dataset import make_prompt_batch
    from hybridflow.rewards.answers import extract_prediction
    from hybridflow.trainer.observe.metrics import validation_metrics

    cfg, dataset = run.cfg, run.val_dataset
    if dataset is None or len(dataset) == 0:
        return {}
    n, temperature = cfg.rollout.val_n, cfg.rollout.val_temperature
    if temperature == 0:
        n = 1  # greedy answers are all the same
    pad = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else 0
    sources, uids, scores, predictions, lengths = [], [], [], [], []
    size = cfg.data.val_batch_size
    run.progress.print(validation_header(run.step, len(dataset), n, size, score_name(run)))
    part_sums: dict[str, float] = {}
    with run.progress.task("validation", total=len(dataset), unit="prompts") as task:
        for start in range(0, len(dataset), size):
            if run.stop.requested:  # a part of the set would read as a different score
                run.log(f"validation at step {run.step} ended early: not reported")
                return {}
            items = [dataset[i] for i in range(start, min(start + size, len(dataset)))]
            prompts: Batch = make_prompt_batch(items, pad, images=dataset.images)
            prompts.arrays["uid"] = np.asarray([item.index for item in items])
            seed = VALIDATION_SEED + start
            batch = generate(run, prompts, n=n, temperature=temperature, seed=seed)
            batch.meta[SCORED_FOR] = "validation"  # its reward failures do not stop the run
            batch, scored = score(run, batch)
            for part in PARTS:  # each part's own mean, when the score is not the rule alone
                if f"reward/{part}/mean" in scored:
                    part_sums[part] = part_sums.get(part, 0.0) + (
                        scored[f"reward/{part}/mean"] * len(batch.arrays["scores"])
                    )
            sources += list(batch.arrays["data_source"])
            uids += list(batch.arrays["uid"])
            scores += list(batch.arrays["scores"])
            predictions += [
                extract_prediction(source, text)
                for source, text in zip(batch.arrays["data_source"], batch.arrays["response_text"])
            ]
            lengths += batch.tensors["response_mask"].sum(-1).tolist()
            task.advance(len(items))
    metrics = validation_metrics(sources, uids, scores, predictions)
    metrics["val/response_length/mean"] = float(np.mean(lengths))
    for part, total in part_sums.items():
        metrics[f"val/reward/{part}/mean"] = total / len(scores)
    return metrics


def score_name(run: RunContext) -> str | None:
    """What the validation score is when it is not the rule reward alone (a reward model's or
    a judge's score is no accuracy); None for the rule reward."""
    from hybridflow.rewards.combine import ANY_SOURCE
    from hybridflow.rewards.parts import describe_weights, rule_reward_alone

    if rule_reward_alone(run.reward_weights):
        return None
    return describe_weights(run.reward_weights[ANY_SOURCE])


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """The ``mean@n``, ``maj@n`` and ``best@n`` entries of each data source, and each reward
    part's mean (``val/reward/<part>/mean``, when the score is not the rule alone), for the
    summary."""
    kinds = ("/mean@", "/maj@", "/best@")
    return {k: v for k, v in metrics.items() if k.startswith("val/")
            and (any(x in k for x in kinds) or PART_MEAN.fullmatch(k))}  # fmt: skip


PART_MEAN = re.compile(rf"val/reward/({'|'.join(PARTS)})/mean")


def validation_header(step: int, prompts: int, n: int, batch_size: int,
                      score: str | None = None) -> str:  # fmt: skip
    """The line a validation pass starts with, e.g. ``validation at step 0: 8 prompts × 4
    samples (1 batch of data.val_batch_size=8)``; ``score``: what the score is when it is not
    the rule reward (``the reward-model score``), said with it."""
    batches = -(-prompts // batch_size)
    scored = f"; its score is {score}, not an accuracy" if score is not None else ""
    return (
        f"validation at step {step}: {prompts} prompt{'s' * (prompts != 1)} × {n} "
        f"sample{'s' * (n != 1)} ({batches} batch{'es' * (batches != 1)} of "
        f"data.val_batch_size={batch_size}){scored}"
    )
