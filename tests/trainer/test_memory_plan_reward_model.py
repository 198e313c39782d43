"""The memory plan counts the reward model: a full copy of its weights on each training GPU,
or in host memory with reward.model.param_offload."""

from reward_model_helpers import write_reward_model

from hybridflow.config import load_config, validate
from hybridflow.trainer import memory_check as mc
from hybridflow.trainer.memory_plan import GIB


def _plan(directory, *overrides):
    cfg = load_config(None, ["model.path=qwen2.5-0.5b", f"reward.model.path={directory}",
                             *overrides])  # fmt: skip
    return mc.plan_for_config(cfg, validate(cfg), 80 * GIB)


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
