"""How far behind the trained policy the samples of an async batch are (docs/async.md).

``token_versions [B, R]``: the policy version that sampled each response token (-1 after the
end; ``RolloutWorker.generate``). With partial rollouts one sample may span versions; its
staleness is that of its oldest token:

    staleness(sample) = trained_version - min(token_versions[sample])

A prompt group is as stale as its stalest sample (its advantages compare its samples, so it
is kept or dropped whole).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from hybridflow.algos.kl import LOG_RATIO_CLAMP
from hybridflow.data.image_batch import MROPE_POSITIONS
from hybridflow.protocol import Batch

NO_TOKEN = torch.iinfo(torch.long).max
"""oldest_versions of a sample without response tokens: never stale."""


def oldest_versions(token_versions: Tensor, response_mask: Tensor) -> Tensor:
    """[B] int64: the version of each sample's oldest token (NO_TOKEN if it has none)."""
    masked = token_versions.masked_fill(~response_mask.bool(), NO_TOKEN)  # [B, R]
    return masked.min(dim=-1).values


def staleness_metrics(token_versions: Tensor, response_mask: Tensor,
                      trained_version: int) -> dict[str, float]:  # fmt: skip
    """Staleness of the samples (mean, max) and the share of response tokens that lag the
    trained version by 0, 1 and 2 or more versions."""
    mask = response_mask.bool()  # [B, R]
    oldest = oldest_versions(token_versions, response_mask)  # [B]
    has_tokens = oldest != NO_TOKEN
    sample_lag = (trained_version - oldest[has_tokens]).double()
    token_lag = trained_version - token_versions[mask]  # [tokens]
    tokens = max(int(token_lag.numel()), 1)
    return {
        "async/staleness_mean": float(sample_lag.mean()) if sample_lag.numel() else 0.0,
        "async/staleness_max": float(sample_lag.max()) if sample_lag.numel() else 0.0,
        "async/token_lag_0": float((token_lag <= 0).sum()) / tokens,
        "async/token_lag_1": float((token_lag == 1).sum()) / tokens,
        "async/token_lag_2+": float((token_lag >= 2).sum()) / tokens,
    }


def importance_ratio_max(old_logprobs: Tensor, rollout_logprobs: Tensor,
                         response_mask: Tensor) -> float:  # fmt: skip
    """The largest pi_old / pi_rollout over the response tokens [B, R], before
    actor.rollout_is_cap truncates it (the learner logs the truncated weights' mean and the
    capped fraction: actor/rollout_is/*)."""
    log_ratio = (old_logprobs - rollout_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    mask = response_mask.bool()
    return float(log_ratio[mask].max().exp()) if mask.any() else 1.0


def stale_group_rows(uids: np.ndarray, oldest: Tensor, min_version: int) -> np.ndarray:
    """[B] bool: rows of the prompt groups (same uid) with a sample older than min_version."""
    stale_uids = {uid for uid, version in zip(uids, oldest.tolist()) if version < min_version}
    return np.fromiter((uid in stale_uids for uid in uids), dtype=bool, count=len(uids))


def drop_stale_groups(batch: Batch, min_version: int) -> tuple[Batch, int]:
    """The batch without the prompt groups that have a token older than min_version, and
    how many groups went."""
    oldest = oldest_versions(batch.tensors["token_versions"], batch.tensors["response_mask"])
    stale = stale_group_rows(batch.arrays["uid"], oldest, min_version)
    dropped = len(set(batch.arrays["uid"][stale]))
    return batch.index(np.flatnonzero(~stale)), dropped


def first_groups(batch: Batch, count: int) -> Batch:
    """The rows of the first `count` prompt groups (uids in order of appearance)."""
    uids = batch.arrays["uid"]
    wanted = set(list(dict.fromkeys(uids))[:count])
    return batch.index(np.flatnonzero([uid in wanted for uid in uids]))


def concat_rollouts(batches: list[Batch], pad_token_id: int) -> Batch:
    """Batch.concat of rollout batches whose prompts were padded to different widths: the
    narrower ones get more left padding (``prompts``, ``prompt_mask``, ``attention_mask``,
    and prompts with images' ``mrope_positions`` [B, 3, P+R], which line up with
    attention_mask)."""
    batches = [batch for batch in batches if len(batch)]
    width = max(batch.tensors["prompts"].shape[1] for batch in batches)
    widened = []
    for batch in batches:
        extra = width - batch.tensors["prompts"].shape[1]
        if extra:
            batch = Batch(dict(batch.tensors), batch.arrays, batch.meta)
            pad = {"prompts": pad_token_id, "prompt_mask": 0, "attention_mask": 0,
                   MROPE_POSITIONS: 0}  # fmt: skip
            for key, value in pad.items():
                if key in batch.tensors:
                    batch.tensors[key] = torch.nn.functional.pad(batch.tensors[key], (extra, 0),
                                                                 value=value)  # fmt: skip
        widened.append(batch)
    return Batch.concat(widened)
