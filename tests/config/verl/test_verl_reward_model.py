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


def test_a_resource_pool_gives_the_reward_model_devices_of_its_own():
    cfg = _load(["reward_model.enable=True", "reward_model.model.path=/m",
                 "reward_model.enable_resource_pool=True", "reward_model.n_gpus_per_node=2",
                 "reward_model.nnodes=1", "trainer.n_gpus_per_node=1"])  # fmt: skip
    assert cfg.reward.model.n_gpus_per_node == 2
    assert cfg.trainer.backend == "local"  # one training device, but two processes or more


def test_a_pool_without_devices_or_over_nodes_stops():
    base = ["reward_model.enable=True", "reward_model.model.path=/m",
            "reward_model.enable_resource_pool=True"]  # fmt: skip
    with pytest.raises(ConfigError, match="needs reward_model.n_gpus_per_node >= 1"):
        _load([*base, "reward_model.n_gpus_per_node=0"])
    with pytest.raises(ConfigError, match="several nodes"):
        _load([*base, "reward_model.n_gpus_per_node=1", "reward_model.nnodes=2"])


def test_pool_sizes_without_the_pool_leave_the_reward_model_colocated():
    cfg = _load(["reward_model.enable=True", "reward_model.model.path=/m",
                 "reward_model.n_gpus_per_node=2"])  # fmt: skip
    assert cfg.reward.model.n_gpus_per_node == 0 and cfg.trainer.backend == "inprocess"
