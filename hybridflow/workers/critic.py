"""The critic role (GAE only): values of the response tokens and the clipped value update."""

from __future__ import annotations

import os

from hybridflow.config import Config
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.protocol import Batch
from hybridflow.workers.model_loading import (
    load_causal_lm,
    set_cpu_threads,
    training_dtype,
    training_mesh,
)


class CriticWorker(Worker):
    """Value model on ``critic.path`` or the actor's initial weights, fresh value head."""

    def __init__(self, config: Config):
        from hybridflow.learners import CriticLearner

        set_cpu_threads(config, self.device)
        dtype = training_dtype(config.model)
        model = load_causal_lm(config.critic.path or config.model.path, dtype, self.device)
        actor = self.context.colocated.get("actor")
        self.learner = CriticLearner(
            model,
            config.critic,
            total_steps=max(config.trainer.total_steps, 1),
            device=self.device,
            mesh=training_mesh(
                config,
                "critic",
                self.world_size,
                self.device,
                reuse=actor.learner.core.groups.mesh if actor is not None else None,
            ),
            actor_cfg=config.actor,
            rollout_n=config.rollout.n,
            max_response_length=config.data.max_response_length,
        )

    @register(dispatch=Dispatch.DP_SPLIT)
    def compute_values(self, batch: Batch) -> Batch:
        return self.learner.compute_values(batch)

    @register(dispatch=Dispatch.DP_SPLIT)
    def update(self, batch: Batch) -> dict[str, float]:
        return {f"critic/{k}": v for k, v in self.learner.update(batch).items()}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save(self, directory: str, background: bool = False) -> None:
        """background: stage the state to host memory, write it on a thread (poll
        :meth:`save_finished`)."""
        self.learner.save(os.path.join(directory, "critic"), background=background)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_finished(self) -> bool:
        """Whether this rank's background save is on disk; raises the error it failed with."""
        return self.learner.save_finished()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load(self, directory: str) -> None:
        self.learner.load(os.path.join(directory, "critic"))
