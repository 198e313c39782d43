"""Training engines: actor, critic and reference on one data-parallel rank (FSDP2 when the
group has several), with packed token-budget micro-batches and LoRA.

    actor = ActorEngine(model, cfg.actor, total_steps=cfg.trainer.total_steps, device="cuda:0",
                        model_cfg=cfg.model, rollout_n=cfg.rollout.n)
    batch = batch.union(actor.compute_logprobs(batch))
    metrics = actor.update(batch)
"""

from hybridflow.training.actor import ActorEngine
from hybridflow.training.critic import CriticEngine
from hybridflow.training.micro_batch import (
    balanced_dp_order,
    karmarkar_karp,
    pack_by_token_budget,
    split_fixed,
)
from hybridflow.training.optim import lr_multiplier
from hybridflow.training.packing import balance_for_data_parallel
from hybridflow.training.ref import RefEngine

__all__ = [
    "ActorEngine",
    "CriticEngine",
    "RefEngine",
    "balance_for_data_parallel",
    "balanced_dp_order",
    "karmarkar_karp",
    "lr_multiplier",
    "pack_by_token_budget",
    "split_fixed",
]
