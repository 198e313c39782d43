"""Learners: the models that are trained (actor, critic) and the frozen reference, on one
data-parallel rank (FSDP2 when the group has several), with packed token-budget micro-batches
and LoRA. The RL loop that drives them through worker groups is ``hybridflow.trainer``.

    actor = ActorLearner(model, cfg.actor, total_steps=cfg.trainer.total_steps, device="cuda:0",
                         model_cfg=cfg.model, rollout_n=cfg.rollout.n)
    batch = batch.union(actor.compute_logprobs(batch))
    metrics = actor.update(batch)
"""

from hybridflow.learners.actor_learner import ActorLearner
from hybridflow.learners.critic_learner import CriticLearner
from hybridflow.learners.micro_batch import (
    balanced_dp_order,
    karmarkar_karp,
    pack_by_token_budget,
    split_fixed,
)
from hybridflow.learners.optim import lr_multiplier
from hybridflow.learners.packing import balance_for_data_parallel
from hybridflow.learners.ref_policy import RefPolicy

__all__ = [
    "ActorLearner",
    "CriticLearner",
    "RefPolicy",
    "balance_for_data_parallel",
    "balanced_dp_order",
    "karmarkar_karp",
    "lr_multiplier",
    "pack_by_token_budget",
    "split_fixed",
]
