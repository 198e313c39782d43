"""The reward model in the memory plan: its PlanOptions fields when it shares the training
GPUs (trainer/plan/memory_plan.py prices them), and what one of its own GPUs holds when it has some
(reward.model.n_gpus_per_node)."""

from __future__ import annotations

from hybridflow.config import Config, Derived
from hybridflow.trainer.plan import memory_choices as choices
from hybridflow.trainer.plan.memory_render import gib, usable_bytes

WEIGHT_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}
"""reward.model.dtype -> bytes of a weight on a GPU (auto: bf16 there, as the reference)."""


def reward_model_options(cfg: Config) -> dict[str, object]:
    """The reward model's PlanOptions fields: its size from the safetensors headers; nothing
    when it is on devices of its own (reward.model.n_gpus_per_node)."""
    rm, t = cfg.reward.model, cfg.trainer
    if rm.path is None or rm.n_gpus_per_node:
        return {}
    from hybridflow.config.reward_checks import stored_parameter_count

    # partial rollouts decode on the service's thread while the reward model scores: its
    # weights share the GPU with the held KV cache, so offloading frees nothing the plan uses
    decoding_meanwhile = t.mode == "async" and t.partial_rollout
    return {
        "reward_model_parameters": stored_parameter_count(rm.path) or 0,
        "reward_model_bytes": WEIGHT_BYTES.get(rm.dtype, 2),
        "reward_model_offload": rm.param_offload and not decoding_meanwhile,
    }


def reward_model_gpu(cfg: Config, derived: Derived) -> tuple[int, int] | None:
    """(bytes, of them its weights) on one of the reward model's own GPUs
    (reward.model.n_gpus_per_node): a full copy of its weights and one no-grad forward of its
    token budget; None when it shares the training GPUs or its shape is unknown."""
    from hybridflow.trainer.plan.architecture import model_architecture

    rm = cfg.reward.model
    if rm.path is None or not rm.n_gpus_per_node:
        return None
    architecture = model_architecture(rm.path)
    if architecture is None:
        return None
    weights = architecture.num_parameters() * WEIGHT_BYTES.get(rm.dtype, 2)
    tokens = rm.max_tokens_per_gpu or rm.micro_batch_size_per_gpu * derived.max_sequence_length
    # the score head reads the last tokens only: no vocabulary-sized logits
    forward = tokens * choices.forward_bytes_per_token(architecture)
    return weights + forward, weights


def reward_model_gpu_problems(cfg: Config, need: tuple[int, int] | None, gpu_bytes: int,
                              source: str = "") -> list[str]:  # fmt: skip
    """A problem when the reward model does not fit one of its own GPUs (it is not sharded)."""
    if need is None or need[0] <= usable_bytes(gpu_bytes):
        return []
    total, weights = need
    where = f"a {gib(gpu_bytes)} GPU" + (f" ({source})" if source else "")
    return [f"reward.model.path = {cfg.reward.model.path} does not fit on {where} of its own "
            f"(reward.model.n_gpus_per_node): {gib(weights)} of weights and a forward of "
            f"{gib(total - weights)} against {gib(usable_bytes(gpu_bytes))} usable; a copy is "
            f"whole on each of its GPUs: lower reward.model.max_tokens_per_gpu, or use a smaller "
            f"reward model"]  # fmt: skip
