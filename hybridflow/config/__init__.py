"""Typed run configuration: one dataclass per section, YAML + dotted overrides, validate().

Precedence: dataclass defaults < YAML file (``--config run.yaml``) < dotted overrides
(``rollout.n=8 actor.lr=1e-6``). Values of overrides are parsed as YAML scalars/lists, so
``data.train_files=[a.parquet,b.parquet]`` and ``actor.lr=1e-6`` both work.

Batch sizes follow the semantics verl users know: ``data.train_batch_size`` counts prompts,
each prompt yields ``rollout.n`` samples; ``actor.ppo_mini_batch_size`` counts prompts per
optimizer step; per-GPU sizes are *derived* by :func:`validate` and never set by hand.

This module imports nothing heavy (no torch) so ``hybridflow config validate`` is instant.
"""

from hybridflow.config.loading import apply_mapping, field_docs, load_config, to_dict
from hybridflow.config.model_facts import model_context_length
from hybridflow.config.sections import (
    GROUP_ESTIMATORS,
    SECTIONS,
    ActorConfig,
    AlgorithmConfig,
    Config,
    ConfigError,
    CriticConfig,
    DataConfig,
    Derived,
    ModelConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    SFTConfig,
    TrainerConfig,
)
from hybridflow.config.validation import validate

__all__ = [
    "GROUP_ESTIMATORS",
    "SECTIONS",
    "ActorConfig",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "Derived",
    "ModelConfig",
    "RefConfig",
    "RewardConfig",
    "RolloutConfig",
    "SFTConfig",
    "TrainerConfig",
    "apply_mapping",
    "field_docs",
    "load_config",
    "model_context_length",
    "to_dict",
    "validate",
]
