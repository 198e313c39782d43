"""verl's reward_model.* keys become reward.model.*: the path, batching, offload and strategy
where it maps; a megatron reward model stops naming it."""

import pytest

from hybridflow.config import ConfigError
from hybridflow.config.verl import load_with_verl_keys


def _load(items):
    return load_with_verl_keys(None, items, log=lambda text: None)


def test_reward_model_keys_become_reward_model_options():
    cfg = _load(["reward_model.enable=True", "reward_model.model.path=/models/rm",
                 "reward_model.micro_batch_size_per_gpu=4", "reward_model.use_dynamic_bsz=True",
                 "reward_model.forward_max_token_len_per_gpu=8192", "reward_model.strategy=fsdp2",
                 "reward_model.model.fsdp_config.param_offload=True"])  # fmt: skip
    model = cfg.reward.model
    assert (model.path, model.micro_batch_size_per_gpu, model.max_tokens_per_gpu) == (
        "/models/rm", 4, 8192)  # fmt: skip
    assert model.param_offload is True


def test_a_disabled_reward_model_leaves_the_rule_reward():
    cfg = _load(["reward_model.enable=False", "reward_model.model.path=/models/rm"])
    assert cfg.reward.model.path is None


def test_a_megatron_reward_model_is_named_as_missing():
    with pytest.raises(ConfigError, match="megatron"):
        _load(["reward_model.enable=True", "reward_model.model.path=/m",
               "reward_model.strategy=megatron"])  # fmt: skip
