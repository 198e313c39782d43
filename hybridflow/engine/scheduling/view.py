"""What the scheduling steps know of the engine (EngineView: the parts of the Engine they use)
and of a prompt being prefilled a chunk per step (PrefillJob), apart from the scheduler's
state (state.py) so that the steps state.py builds (static_step.py) can name them too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from hybridflow.engine.requests import LiveRequest, Submission

if TYPE_CHECKING:
    from hybridflow.engine.cache.blocks import BlockPool
    from hybridflow.engine.cache.kv_cache import KVCache
    from hybridflow.engine.graphs import DecodeRunner
    from hybridflow.engine.options import EngineOptions
    from hybridflow.engine.scheduling.kept import KeptKV
    from hybridflow.engine.state import DecodeState


class EngineView(Protocol):
    """The parts of the Engine (engine.py) the scheduling steps use: its cache and decode
    state, its forward passes and the options they follow."""

    device: torch.device
    options: EngineOptions
    state: DecodeState  # the device's rows: tokens, positions, slots, sampling
    runner: DecodeRunner  # decode steps (graphs) and first-token sampling
    cache: KVCache
    blocks: BlockPool | None  # a paged cache's block pool
    kept: KeptKV  # slots kept for a conversation's next turn
    model: torch.nn.Module
    rope: object
    prefill: object  # the prefill pass (prefill.py): packed prompts into their slots
    extend: object  # the extend pass: new tokens after a cached prefix
    config: object  # the model's config
    decode_backend: str
    vision: bool  # a vision-language model: prompts may hold images (images.py)
    steps_per_sync: int
    sync_lag: int
    max_prefill_tokens: int
    prefill_tokens: int  # a counter the steps add the tokens they prefill to
    speculation: object  # speculative.verify.Speculation, or None (EngineOptions.speculative)

    def shares_prefixes(self, n: int) -> bool: ...


@dataclass
class PrefillJob:
    """One prompt (its n samples) or one continuation, being prefilled a chunk per step."""

    requests: list[tuple[Submission, int]]  # the samples of one prompt, in order
    slots: list[int]  # theirs: the first holds the K/V as it is computed, the rest a copy
    sequence: list[int]  # the token ids whose K/V the first slot must hold
    done: int  # positions [0, done) are in the cache (a kept prefix, earlier chunks)
    copies: tuple | None = None  # a paged cache's partial blocks to copy at the end
    resumed: LiveRequest | None = None  # a preempted request's recompute (preemption.py)

    @property
    def left(self) -> int:
        return len(self.sequence) - self.done
