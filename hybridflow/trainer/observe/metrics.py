"""Training metrics as pure functions of tensors and numbers, plus a stage timer.

Key names (what `metrics.jsonl` and the console show):
  response_length/{mean,max,min,clip_ratio}   clip_ratio: fraction that hit the max length
  prompt_length/{mean,max,min,clip_ratio}
  score/{mean,max,min,std}   sequence score (sum of token_level_scores)
  reward/{mean,max,min,std}  sequence reward after KL / shaping (sum of token_level_rewards)
  advantage/…, return/…, value/…   over valid response tokens
  perf/{total_tokens,tokens_per_s,tokens_per_s_per_gpu,mfu,max_memory_allocated_gb,…}
  timing_s/<stage>, timing_per_token_ms/<stage>
"""

from __future__ import annotations

import functools
import math
import subprocess
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext

import torch

# Dense bf16 tensor-core peak per device, FLOP/s, from the vendors' data sheets. Used only
# for the MFU estimate; an unknown device gives no MFU rather than a wrong one.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "RTX 4090": 165e12,
}
# Dense FP8 (e4m3) tensor-core peak, FLOP/s, same data sheets: the GPUs with float8 tensor
# cores (compute capability >= 8.9) whose rate with fp32 accumulation is published.
PEAK_FP8_FLOPS = {
    "H200": 1979e12,
    "H100": 1979e12,
    "H800": 1979e12,
    "L40S": 733e12,
}


def _stats(values: torch.Tensor, prefix: str) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    values = values.detach().float()
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def length_metrics(mask: torch.Tensor, max_length: int | None, prefix: str) -> dict[str, float]:
    """Lengths of the rows of a [B, T] 0/1 mask; clip_ratio = fraction with length >= max_length."""
    lengths = mask.sum(dim=-1).float()  # [B]
    limit = mask.shape[-1] if max_length is None else max_length
    metrics = _stats(lengths, prefix)
    metrics[f"{prefix}/clip_ratio"] = (lengths >= limit).float().mean().item()
    return metrics


def response_length_metrics(
    response_mask: torch.Tensor, max_response_length: int | None = None
) -> dict[str, float]:
    """`response_length/*` from response_mask [B, R]; the limit defaults to R."""
    return length_metrics(response_mask, max_response_length, "response_length")


def prompt_length_metrics(
    prompt_mask: torch.Tensor, max_prompt_length: int | None = None
) -> dict[str, float]:
    """`prompt_length/*` from the prompts' attention mask [B, P]."""
    return length_metrics(prompt_mask, max_prompt_length, "prompt_length")


def masked_token_stats(values: torch.Tensor, mask: torch.Tensor, prefix: str) -> dict[str, float]:
    """mean/max/min of values [B, R] over tokens where mask [B, R] is 1."""
    return _stats(values[mask.bool()], prefix)


def data_metrics(
    tensors: Mapping[str, torch.Tensor], max_response_length: int | None = None
) -> dict[str, float]:
    """Score, reward, advantage, return, value and length statistics of a step's batch.

    `tensors` holds `response_mask` [B, R] and whichever of `token_level_scores`,
    `token_level_rewards`, `advantages`, `returns`, `values` ([B, R]) exist; the
    optional `attention_mask` of the prompts ([B, P]) adds prompt lengths.
    """
    mask = tensors["response_mask"]
    metrics = response_length_metrics(mask, max_response_length)
    for key, prefix in (("token_level_scores", "score"), ("token_level_rewards", "reward")):
        if key in tensors:
            per_sequence = (tensors[key] * mask).sum(dim=-1).float()  # [B]
            metrics.update(_stats(per_sequence, prefix))
            # the spread the report shades (population std: the batch is all there is)
            metrics[f"{prefix}/std"] = per_sequence.std(correction=0).item()
    for key, prefix in (("advantages", "advantage"), ("returns", "return"), ("values", "value")):
        if key in tensors:
            metrics.update(masked_token_stats(tensors[key], mask, prefix))
    if "prompt_mask" in tensors:
        metrics.update(prompt_length_metrics(tensors["prompt_mask"]))
    if "old_logprobs" in tensors and "rollout_logprobs" in tensors:
        metrics.update(
            rollout_gap_metrics(tensors["old_logprobs"], tensors["rollout_logprobs"], mask)
        )
    return metrics


def rollout_gap_metrics(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the trainer's log-probs of the sampled tokens are from the engine's (same
    weights, other kernels; a mixture of experts' routing flips add to it, which
    actor.router_replay=rollout removes): the mean and tails of |log π_trainer − log π_rollout|
    over response tokens, and the share of importance ratios outside [0.8, 1.25]."""
    gap = (old_logprobs - rollout_logprobs)[mask.bool()].double().abs()  # [tokens]
    if gap.numel() == 0:
        return {}
    return {
        "rollout_gap/abs_logprob_diff_mean": gap.mean().item(),
        "rollout_gap/abs_logprob_diff_p99": torch.quantile(gap, 0.99).item(),
        "rollout_gap/abs_logprob_diff_p999": torch.quantile(gap, 0.999).item(),
        "rollout_gap/abs_logprob_diff_max": gap.max().item(),
        "rollout_gap/ratio_outside_0.8_1.25": (gap > math.log(1.25)).double().mean().item(),
    }


def throughput_metrics(num_tokens: int, step_time_s: float, n_gpus: int) -> dict[str, float]:
    """Tokens (prompt + response, all samples) processed per second, overall and per GPU."""
    tokens_per_s = num_tokens / max(step_time_s, 1e-9)
    return {
        "perf/total_tokens": float(num_tokens),
        "perf/tokens_per_s": tokens_per_s,
        "perf/tokens_per_s_per_gpu": tokens_per_s / max(n_gpus, 1),
    }


def forward_flops_per_token(
    num_params: int, num_layers: int = 0, hidden_size: int = 0, context_length: float = 0
) -> float:
    """FLOPs of one token's forward pass: 2N for the matmuls plus 4·L·H·ctx for attention
    (QKᵀ and AV over `context_length` earlier tokens); Kaplan et al. 2020, table 1."""
    return 2.0 * num_params + 4.0 * num_layers * hidden_size * context_length


def rl_step_flops(
    flops_per_token: float, total_tokens: int, forward_passes: int = 1, train_passes: int = 1
) -> float:
    """FLOPs of one RL step over `total_tokens` (prompt + response, all samples).

    Generation is counted as one forward over every token (prefill + one decode per
    generated token); each scoring pass (old / ref log-probs, values) is one forward;
    each training pass (PPO epoch, actor or critic) is forward + backward = 3 forwards.
    """
    return flops_per_token * total_tokens * (1 + forward_passes + 3 * train_passes)


def peak_flops_per_gpu(device_name: str | None = None) -> float | None:
    """Dense bf16 peak of this machine's (or the named) CUDA device, None if unknown."""
    return _peak(PEAK_BF16_FLOPS, device_name)


def peak_fp8_flops_per_gpu(device_name: str | None = None) -> float | None:
    """Dense FP8 peak of this machine's (or the named) CUDA device, None if unknown or
    without float8 tensor cores."""
    return _peak(PEAK_FP8_FLOPS, device_name)


def _peak(table: dict[str, float], device_name: str | None) -> float | None:
    if device_name is None:
        device_name = cuda_device_name()
    if device_name is None:
        return None
    for key, flops in table.items():
        if key in device_name:
            return flops
    return None


@functools.lru_cache(maxsize=1)
def cuda_device_name() -> str | None:
    """Name of GPU 0, without creating a CUDA context in a process that has none: the
    controller of the local and ray backends computes no tensors, and a context there would
    hold ~0.5 GB of GPU 0 that rank 0's KV cache then lacks. nvidia-smi answers instead."""
    if torch.cuda.is_initialized():
        return torch.cuda.get_device_name()
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "--id=0"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    name = out.stdout.strip().splitlines()[0].strip() if out.stdout.strip() else ""
    return name if out.returncode == 0 and name else None


def estimate_mfu(
    flops: float, step_time_s: float, n_gpus: int, peak_flops: float | None
) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the devices' peak (None if unknown)."""
    if not peak_flops or step_time_s <= 0:
        return None
    return flops / (step_time_s * n_gpus * peak_flops)


def memory_metrics() -> dict[str, float]:
    """Peak CUDA memory since the last reset (GiB) and this process's resident memory."""
    metrics: dict[str, float] = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gib = 1024**3
        metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / gib
        metrics["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved() / gib
    try:
        import psutil

        metrics["perf/cpu_memory_used_gb"] = psutil.Process().memory_info().rss / 1024**3
    except ImportError:  # psutil is a dependency, but metrics must never stop training
        pass
    return metrics


def mean_metrics(per_call: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Average each key over a list of metric dicts (e.g. micro-batches or ranks)."""
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for metrics in per_call:
        for key, value in metrics.items():
            sums[key] += float(value)
            counts[key] += 1
    return {key: sums[key] / counts[key] for key in sums}


class Timer:
    """Wall-clock time per stage, as `timing_s/<stage>`; repeated stages add up.

        timer = Timer()
        with timer("gen"):
            ...
        metrics.update(timer.metrics())

    CUDA work is asynchronous, so by default the current CUDA stream is synchronised at both
    ends of a stage (cheap at stage granularity) to charge the kernels to the right stage.
    ``on_stage(stage)``, if given, returns a context manager entered around each stage (the
    run's progress status and profiler range: trainer/loop/stages.py, stage_scope).
    """

    def __init__(self, sync_cuda: bool = True, on_stage=None):
        self.sync_cuda, self.on_stage = sync_cuda, on_stage
        self.seconds: dict[str, float] = defaultdict(float)

    def _sync(self) -> None:
        # this thread's stream, not the whole device: a rollout service decoding on a stream
        # of its own (EngineOptions.service_stream) runs on through the trainer's stages
        if self.sync_cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()

    @contextmanager
    def __call__(self, stage: str, sync: str = "both") -> Iterator[None]:
        """sync: at which ends the stream is synchronised, "both", "start", "end" or "none"
        (host work, or a stage timed in pieces: kernels launched before it run on beside it)."""
        # the hook's scope holds the syncs: a profile charges the stage's kernels to its range
        with self.on_stage(stage) if self.on_stage is not None else nullcontext():
            if sync in ("both", "start"):
                self._sync()
            start = time.perf_counter()
            try:
                yield
            finally:
                if sync in ("both", "end"):
                    self._sync()
                self.seconds[stage] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{stage}": seconds for stage, seconds in self.seconds.items()}

    def per_token_metrics(self, num_tokens: int) -> dict[str, float]:
        """Milliseconds per token of each stage (comparable across batch sizes)."""
        return {
            f"timing_per_token_ms/{stage}": 1000 * seconds / max(num_tokens, 1)
            for stage, seconds in self.seconds.items()
        }

    def reset(self) -> None:
        self.seconds.clear()


def validation_metrics(
    data_sources: Sequence[str],
    uids: Sequence[object],
    scores: Sequence[float],
    predictions: Sequence[str | None] | None = None,
) -> dict[str, float]:
    """Per data source `val/<source>/mean@n`, `best@n` and (with predictions) `maj@n`.

    Samples sharing a uid are the n answers to one prompt. mean@n averages every score;
    best@n averages each prompt's best score; maj@n averages, per prompt, the score of the
    most frequent prediction (ties: the one seen first; None predictions do not vote).
    """
    groups: dict[tuple[str, object], list[int]] = defaultdict(list)
    for position, (source, uid) in enumerate(zip(data_sources, uids)):
        groups[(source, uid)].append(position)
    per_source: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    sizes: dict[str, set[int]] = defaultdict(set)
    for (source, _), positions in groups.items():
        sizes[source].add(len(positions))
        group_scores = [float(scores[p]) for p in positions]
        per_source[source]["mean"] += group_scores
        per_source[source]["best"].append(max(group_scores))
        if predictions is not None:
            per_source[source]["maj"].append(_majority_score(positions, predictions, scores))
    metrics = {}
    for source, values in per_source.items():
        n = max(sizes[source])  # prompts normally all have n samples
        for kind, numbers in values.items():
            metrics[f"val/{source}/{kind}@{n}"] = sum(numbers) / len(numbers)
    return metrics


def _majority_score(positions, predictions, scores) -> float:
    votes: dict[str, int] = {}
    first_position: dict[str, int] = {}
    for position in positions:
        prediction = predictions[position]
        if prediction is None:
            continue
        votes[prediction] = votes.get(prediction, 0) + 1
        first_position.setdefault(prediction, position)
    if not votes:
        return 0.0
    winner = max(votes, key=lambda p: (votes[p], -first_position[p]))
    return float(scores[first_position[winner]])
