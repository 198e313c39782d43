"""What the scheduler serves: submissions of requests, and the requests it is decoding.

A Submission is requests submitted together under one SamplingParams: a generate() call
(every prompt, n samples each), or one server request (n samples of one prompt). Its
requests are numbered prompt-major (request = prompt * n + sample) and finish in any order;
the submission is done when all have. A LiveRequest is one request from admission (its
prompt prefilled, first token sampled) to retirement: the tokens read back so far and the
policy version that sampled each span of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from hybridflow.engine.sampling import SamplingParams, split_seed

if TYPE_CHECKING:
    from hybridflow.engine.images import ImageFeatures


class PromptTable:
    """A call's prompts as one flat int64 array, with their lengths checked up front and their
    token ids flattened and range-checked in pieces: the first admission's prompts before its
    prefill, the rest while the GPU runs it (1024 prompts x 128 tokens take ~3 ms on the CPU
    machine: host time that used to sit in front of the first kernel)."""

    def __init__(self, prompts: list[list[int]], vocab_size: int, max_seq_len: int):
        self.prompts, self.vocab_size = prompts, vocab_size
        lengths = np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts))
        if (lengths == 0).any():
            raise ValueError(f"prompt {int(np.argmax(lengths == 0))} is empty")
        if (lengths >= max_seq_len).any():
            i = int(np.argmax(lengths >= max_seq_len))
            raise ValueError(
                f"prompt {i} has {lengths[i]} tokens; max_seq_len={max_seq_len} "
                "leaves no room to generate: raise max_seq_len"
            )
        self.lengths = lengths
        self.offsets = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(lengths)])
        self.flat = np.empty(int(self.offsets[-1]), dtype=np.int64)
        self.checked = 0  # prompts [0, checked) are flattened and in range

    def check(self, upto: int | None = None) -> None:
        """Flatten and range-check prompts [checked, upto) (all by default); ValueError names
        the first prompt with an id outside the vocabulary."""
        upto = len(self.prompts) if upto is None else upto
        if upto <= self.checked:
            return
        begin, end = int(self.offsets[self.checked]), int(self.offsets[upto])
        piece = np.fromiter(
            itertools.chain.from_iterable(self.prompts[self.checked : upto]),
            dtype=np.int64,
            count=end - begin,
        )
        bad = (piece < 0) | (piece >= self.vocab_size)
        if bad.any():
            at = begin + int(np.argmax(bad))
            i = int(np.searchsorted(self.offsets, at, side="right")) - 1
            raise ValueError(f"prompt {i} has token ids outside [0, {self.vocab_size})")
        self.flat[begin:end] = piece
        self.checked = upto

    def tokens(self, first: int, last: int) -> torch.Tensor:
        """Prompts [first, last) concatenated (int64, CPU)."""
        self.check(last)
        return torch.from_numpy(self.flat[self.offsets[first] : self.offsets[last]])


@dataclass
class Completion:
    """One finished request."""

    token_ids: list[int]
    """Generated tokens; a stop token that ended the sample is included."""
    logprobs: list[float]
    """log_softmax(logits / T) at each token, before top-k/top-p/min-p (T = 1 when greedy)."""
    finish_reason: str
    """'stop' (a stop token was emitted), 'length' (max_new_tokens or max_seq_len reached)
    or 'abort' (aborted: the tokens generated until then)."""
    kv_handle: int | None = None
    """With keep=True: the kept slot's handle, for `reuse` by the next turn (kept.py)."""
    version_spans: tuple[tuple[int, int], ...] = ((0, 0),)
    """(first token index, policy version) for each run of tokens one version of the weights
    sampled: a request that decoded across a weight update has two spans."""
    routed_experts: np.ndarray | None = None
    """Mixture-of-experts models (routing replay): [prompt + tokens - 1, L_sparse, k], the
    experts each sparse layer chose for each token that went through the model (the prompt,
    then every generated token but the last); uint8 up to 256 experts, else int16
    (routes.py). None for a dense model or with EngineOptions.record_routes off."""

    def token_versions(self) -> list[int]:
        """The policy version that sampled each token."""
        versions = []
        bounds = [start for start, _ in self.version_spans[1:]] + [len(self.token_ids)]
        for (start, version), end in zip(self.version_spans, bounds):
            versions += [version] * (end - start)
        return versions


class Submission:
    """Requests submitted together (module docstring). listener(request, token_ids,
    logprobs), if given, hears each request's new tokens as they are read back (streaming);
    on_finish(request, result) each request's end; both are called on the scheduler's
    thread and must be quick."""

    def __init__(self, table: PromptTable, params: SamplingParams, seeds: torch.Tensor | list,
                 max_new: list[int], stop_ids: list[int], keep: bool = False,
                 reuse: list | None = None, listener: Callable | None = None,
                 on_finish: Callable | None = None):  # fmt: skip
        self.table, self.params, self.n = table, params, params.n
        self.prompts = table.prompts
        if isinstance(seeds, list):  # Python ints (sampling.prompt_seed_values)
            self.seed_lo = [seed & 0xFFFFFFFF for seed in seeds]
            self.seed_hi = [(seed >> 32) & 0xFFFFFFFF for seed in seeds]
        else:
            seed_lo, seed_hi = split_seed(seeds)
            self.seed_lo, self.seed_hi = seed_lo.tolist(), seed_hi.tolist()
        self.max_new = max_new
        self.stop_ids = frozenset(stop_ids)
        self.mode = params.mode_key()
        self.keep = keep
        if reuse is not None and (params.n != 1 or len(reuse) != len(self.prompts)):
            raise ValueError("reuse: one handle (or None) per prompt, with n = 1")
        self.reuse = reuse
        self.listener, self.on_finish = listener, on_finish
        self.on_error: Callable | None = None  # the service's: the submission failed
        self.results: list[Completion | None] = [None] * len(max_new)
        self.remaining = len(max_new)
        self.aborted: set[int] = set()  # requests to end early (abort)
        self.error: BaseException | None = None
        self.queued_at = 0  # the scheduler's step count when it was added
        # prompts with images (engine/images.py): their checked images and encoder features
        self.images: ImageFeatures | None = None

    @property
    def done(self) -> bool:
        return self.remaining == 0 or self.error is not None

    def prompt_of(self, request: int) -> list[int]:
        return self.prompts[request // self.n]

    def finish(self, request: int, result: Completion) -> None:
        self.results[request] = result
        self.remaining -= 1
        if self.on_finish is not None:
            self.on_finish(request, result)


_live_ids = itertools.count()


class LiveRequest:
    """One admitted request (module docstring); `key` orders nothing, it names the request
    in shared-prefix groups."""

    __slots__ = ("sub", "request", "slot", "tokens", "logprobs", "spans", "done", "key",
                 "overran")  # fmt: skip

    def __init__(self, sub: Submission, request: int, slot: int, version: int):
        self.sub, self.request, self.slot = sub, request, slot
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.spans: list[tuple[int, int]] = [(0, version)]
        self.done = False
        self.key = next(_live_ids)
        # the device decoded past its end (a stop id only the host checks; the surplus cut)
        self.overran = False


def padded_tensors(results: list[Completion], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Completions -> right-padded CPU tensors, through numpy: one
    flat conversion of all the numbers and a masked scatter (1024 x ~256 tokens: ~15 ms on
    a 2-core CPU host, against ~50 ms for torch.tensor on padded nested lists)."""
    count = len(results)
    lengths = np.fromiter((len(r.token_ids) for r in results), dtype=np.int64, count=count)
    width = int(lengths.max()) if count else 0
    total = int(lengths.sum())
    tokens = np.fromiter(
        itertools.chain.from_iterable(r.token_ids for r in results), np.int64, total
    )
    logprobs = np.fromiter(
        itertools.chain.from_iterable(r.logprobs for r in results), np.float32, total
    )
    filled = np.arange(width)[None, :] < lengths[:, None]  # row-major: the flat order
    responses = np.full((count, width), pad_token_id, dtype=np.int64)
    responses[filled] = tokens
    padded_logprobs = np.zeros((count, width), dtype=np.float32)
    padded_logprobs[filled] = logprobs
    return {"responses": torch.from_numpy(responses),
            "rollout_logprobs": torch.from_numpy(padded_logprobs),
            "response_lengths": torch.from_numpy(lengths)}  # fmt: skip
