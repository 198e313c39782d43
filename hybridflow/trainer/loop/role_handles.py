"""What the RL loop calls on each role's worker group, as typed ``Protocol``s.

``roles.actor`` is a ``WorkerGroup`` role view (``group.actor``): calling a method runs the
worker method of the same name on every rank and combines the per-rank results by the
method's ``Dispatch`` mode (hybridflow/controller/dispatch.py). The return types below are
what the controller gets back: a ``Batch`` (``DP_SPLIT`` with Batch results, concatenated in
rank order), one value per rank (``ONE_TO_ALL``, or ``DP_SPLIT`` with other results), or rank
0's value (``RANK_ZERO``). Each method names the worker code that runs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from hybridflow.protocol import Batch

if TYPE_CHECKING:
    import torch


class ActorHandle(Protocol):
    """The actor's group; runs :class:`hybridflow.workers.actor.ActorWorker`."""

    def compute_logprobs(self, batch: Batch) -> Batch:
        """``old_logprobs`` and ``entropy`` [B, R]: ``ActorWorker.compute_logprobs`` ->
        ``ActorLearner.compute_logprobs`` (hybridflow/learners/actor_learner.py)."""
        ...

    def update(self, batch: Batch) -> list[dict[str, float]]:
        """One PPO-family update; ``actor/*`` metrics per rank (already reduced, equal):
        ``ActorWorker.update`` -> ``ActorLearner.update``."""
        ...

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Unsharded HF-named CPU weights for a rollout group elsewhere (split placement):
        ``ActorWorker.full_weights``."""
        ...

    def save(self, directory: str, background: bool = False) -> list[None]:
        """Model, optimizer, scheduler and RNG under ``directory/actor``: ``ActorWorker.save``
        (background: copied to host memory, written on a thread)."""
        ...

    def save_finished(self) -> list[bool]:
        """Whether each rank's background save is on disk (raises its write error):
        ``ActorWorker.save_finished`` -> ``StateWriter.finished``
        (hybridflow/learners/state_writer.py)."""
        ...

    def load(self, directory: str) -> list[None]:
        """Inverse of :meth:`save`: ``ActorWorker.load``."""
        ...

    def device_memory(self, reset: bool = False) -> list[dict[str, float]]:
        """Peak GPU memory of each rank, GiB (empty dicts on CPU): ``ActorWorker.device_memory``."""
        ...


class RolloutHandle(Protocol):
    """The rollout's group; runs :class:`hybridflow.workers.rollout.RolloutWorker`."""

    def generate(self, batch: Batch) -> Batch:
        """``meta["n"]`` samples of each ``prompts`` row: ``responses``, ``response_mask``,
        ``rollout_logprobs`` and ``token_versions`` [B*n, R]: ``RolloutWorker.generate``."""
        ...

    def start_generate(self, batch: Batch) -> None:
        """Partial rollouts: begin ``generate(batch)`` without waiting for it:
        ``RolloutWorker.start_generate``."""
        ...

    def generated(self, ticket: int, wait_s: float) -> list[Batch | None]:
        """Each rank's rows of a started generation, None where not done within wait_s:
        ``RolloutWorker.generated``."""
        ...

    def sync_from_actor(self, version: int | None = None) -> list[None]:
        """Colocated: the engine takes the actor's current weights (nothing to do when it
        shares them) and starts policy `version`: ``RolloutWorker.sync_from_actor``."""
        ...

    def release_weights(self) -> list[int]:
        """rollout.release_weights: the engine's own weight copy freed until the next sync,
        bytes per rank: ``RolloutWorker.release_weights``."""
        ...

    def load_weights(self, weights: dict[str, torch.Tensor],
                     version: int | None = None) -> list[None]:  # fmt: skip
        """Split placement: load the weights sent by the controller:
        ``RolloutWorker.load_weights``."""
        ...

    def engine_choices(self) -> dict:
        """The engine's timing choices, for the checkpoint: ``RolloutWorker.engine_choices``
        -> ``Engine.pinned_choices`` (hybridflow/engine/engine.py)."""
        ...

    def pin_engine_choices(self, recorded: dict) -> list[bool]:
        """Run with the choices a checkpoint recorded: ``RolloutWorker.pin_engine_choices``."""
        ...


class RefHandle(Protocol):
    """The reference policy's group; runs :class:`hybridflow.workers.actor.RefWorker`."""

    def compute_ref_logprobs(self, batch: Batch) -> Batch:
        """``ref_logprobs`` [B, R]: ``RefWorker.compute_ref_logprobs`` ->
        ``RefPolicy.compute_ref_logprobs`` (hybridflow/learners/ref_policy.py)."""
        ...


class RewardModelHandle(Protocol):
    """The reward model's group; runs :class:`hybridflow.workers.reward_model.RewardModelWorker`."""

    def compute_rm_scores(self, batch: Batch) -> Batch:
        """``rm_scores`` [B], one per conversation: ``RewardModelWorker.compute_rm_scores`` ->
        ``RewardModelScorer.compute_rm_scores`` (hybridflow/learners/reward_model.py)."""
        ...


class CriticHandle(Protocol):
    """The critic's group (GAE); runs :class:`hybridflow.workers.critic.CriticWorker`."""

    def compute_values(self, batch: Batch) -> Batch:
        """``values`` [B, R]: ``CriticWorker.compute_values`` -> ``CriticLearner.compute_values``
        (hybridflow/learners/critic_learner.py)."""
        ...

    def update(self, batch: Batch) -> list[dict[str, float]]:
        """Clipped value-loss update; ``critic/*`` metrics per rank: ``CriticWorker.update``."""
        ...

    def save(self, directory: str, background: bool = False) -> list[None]:
        """Critic state under ``directory/critic``: ``CriticWorker.save``."""
        ...

    def save_finished(self) -> list[bool]:
        """Whether each rank's background save is on disk: ``CriticWorker.save_finished``."""
        ...

    def load(self, directory: str) -> list[None]:
        """Inverse of :meth:`save`: ``CriticWorker.load``."""
        ...


class GroupHandle(Protocol):
    """A worker group as the loop holds it: only to be shut down at the end."""

    def shutdown(self) -> None: ...
