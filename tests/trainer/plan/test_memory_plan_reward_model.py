"""The memory plan counts the reward model: a full copy of its weights on each training GPU,
or in host memory with reward.model.param_offload."""

from reward_model_helpers import write_reward_model

from hybridflow.config import load_config, validate
from hybridflow.trainer.plan import memory_check as mc
from hybridflow.trainer.plan import memory_from_config as mfc
from hybridflow.trainer.plan.memory_plan import GIB


def _plan(directory, *overrides):
    cfg = load_config(None, ["model.path=qwen2.5-0.5b", f"reward.model.path={directory}",
                             *overrides])  # fmt: skip
    return mfc.plan_for_config(cfg, validate(cfg), 80 * GIB)


def test_the_reward_model_weights_are_on_each_training_gpu_or_on_the_host(tmp_path):
    import torch
    from transformers import AutoModelForSequenceClassification

    directory = write_reward_model(tmp_path / "rm")
    model = AutoModelForSequenceClassification.from_pretrained(str(directory))
    parameters = sum(p.numel() for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    (item,) = [i for i in _plan(directory).items if i.name.startswith("reward model")]
    assert item.name == "reward model weights (bf16)"  # auto: bf16 on a GPU
    assert item.gpu_bytes == parameters * 2 and item.host_bytes == 0
    (offloaded,) = [i for i in _plan(directory, "reward.model.param_offload=true").items
                    if i.name.startswith("reward model")]  # fmt: skip
    assert offloaded.gpu_bytes == 0 and offloaded.host_bytes == parameters * 2


def _reward_items(directory, *overrides):
    return [i for i in _plan(directory, *overrides).items if i.name.startswith("reward model")]


def test_a_reward_model_on_devices_of_its_own_is_not_on_the_training_gpus(tmp_path):
    directory = write_reward_model(tmp_path / "rm")
    assert _reward_items(directory, "trainer.backend=local", "reward.model.n_gpus_per_node=1") == []


def test_offloading_frees_nothing_while_partial_rollouts_decode(tmp_path):
    # the service's thread decodes with the KV cache held while the reward model scores
    directory = write_reward_model(tmp_path / "rm")
    partial = ("reward.model.param_offload=true", "trainer.mode=async",
               "trainer.partial_rollout=true")  # fmt: skip
    (item,) = _reward_items(directory, *partial)
    assert item.gpu_bytes > 0 and item.host_bytes == 0


def test_a_reward_model_must_fit_one_of_its_own_gpus(tmp_path):
    from hybridflow.trainer.lifecycle.preflight import model_architecture
    from hybridflow.trainer.plan.memory_reward_model import (
        reward_model_gpu,
        reward_model_gpu_problems,
    )

    directory = write_reward_model(tmp_path / "rm")
    cfg = load_config(None, ["model.path=qwen2.5-0.5b", f"reward.model.path={directory}",
                             "trainer.backend=local", "reward.model.n_gpus_per_node=1",
                             "reward.model.max_tokens_per_gpu=4096", "trainer.gpu_memory_gib=80"])  # fmt: skip
    need, weights = reward_model_gpu(cfg, validate(cfg))
    assert weights == model_architecture(str(directory)).num_parameters() * 2  # bf16
    assert need > weights  # and a forward of 4096 tokens
    assert reward_model_gpu_problems(cfg, (need, weights), 80 * GIB) == []
    (problem,) = reward_model_gpu_problems(cfg, (need, weights), need)  # no headroom left
    assert "does not fit on a" in problem and "reward.model.max_tokens_per_gpu" in problem
    lines = []
    mc.check_memory(cfg, validate(cfg), log=lines.append)
    assert any("per reward-model GPU" in line for line in lines)


def test_config_plan_prints_the_reward_models_own_gpu(tmp_path):
    from hybridflow.trainer.plan.plan_command import plan_command

    directory = write_reward_model(tmp_path / "rm")
    cfg = load_config(None, ["model.path=qwen2.5-0.5b", f"reward.model.path={directory}",
                             "trainer.backend=local", "reward.model.n_gpus_per_node=1"])  # fmt: skip
    lines = []
    assert plan_command(cfg, "80GB", out=lines.append) == 0
    assert any(line.startswith("  per reward-model GPU: ") for line in lines)
