"""Rewards: rule scorers, a data_source -> scorer registry, custom scoring functions, and
reward managers that score in parallel worker processes with a per-sample timeout.

Importing this package does not import torch (scoring workers import it cheaply);
`hybridflow.rewards.placement` holds the tensor helpers.
"""

from hybridflow.rewards.custom import CustomRewardError, load_function
from hybridflow.rewards.managers import (
    MANAGER_MODES,
    RewardManager,
    RewardResult,
    build_reward_manager,
)
from hybridflow.rewards.scorer_registry import (
    ScorerRegistry,
    ScorerSpec,
    UnknownDataSource,
    default_registry,
)

__all__ = [
    "MANAGER_MODES",
    "CustomRewardError",
    "RewardManager",
    "RewardResult",
    "ScorerRegistry",
    "ScorerSpec",
    "UnknownDataSource",
    "build_reward_manager",
    "default_registry",
    "load_function",
]
