"""RL math as pure functions: advantages, policy/value losses, KL, aggregation.

Tensors and scalars in, ``(tensor, metrics)`` out; no config objects, no model, and
nothing above ``algos`` in the project is imported. Everything is device-agnostic.
"""

from hybridflow.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantage,
    register_advantage,
    sequence_scores,
)
from hybridflow.algos.aggregation import LOSS_AGG_MODES, agg_loss
from hybridflow.algos.dapo import overlong_penalty
from hybridflow.algos.entropy import entropy_from_logits
from hybridflow.algos.groups import group_stats, groups_with_signal
from hybridflow.algos.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    build_kl_controller,
    kl_penalty,
)
from hybridflow.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten
from hybridflow.algos.policy_losses import POLICY_LOSSES, policy_loss, register_policy_loss
from hybridflow.algos.registry import Registry
from hybridflow.algos.rollout_correction import rollout_is_weights
from hybridflow.algos.value_loss import value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "Registry",
    "agg_loss",
    "apply_kl_in_reward",
    "build_kl_controller",
    "compute_advantage",
    "entropy_from_logits",
    "group_stats",
    "groups_with_signal",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "policy_loss",
    "register_advantage",
    "register_policy_loss",
    "rollout_is_weights",
    "sequence_scores",
    "value_loss",
]
