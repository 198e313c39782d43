"""The sections of the models the trainer runs forward and backward: ``actor`` (the policy's
optimizer, loss and parallel layout), ``ref`` (the reference policy) and ``critic``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ActorConfig:
    lr: float = 2e-4
    """Peak learning rate of AdamW. The default suits the built-in tiny demo model; LLMs of
    0.5B+ parameters use about 1e-6."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    lr_scheduler: str = "constant"
    """constant | linear | cosine (after the warm-up)."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to ``lr``."""
    min_lr_ratio: float = 0.0
    """Floor of the cosine/linear decay as a fraction of ``lr``."""
    grad_clip: float = 1.0
    """Max global grad norm; a step with a non-finite norm is skipped and counted."""
    ppo_mini_batch_size: int = 32
    """Prompts per optimizer step (× rollout.n samples, split over data-parallel ranks)."""
    micro_batch_size_per_gpu: int = 8
    """Samples per forward/backward on one GPU (ignored when max_tokens_per_gpu is set)."""
    max_tokens_per_gpu: int | str | None = None
    """Token budget per micro-batch (dynamic batching of packed sequences). None: off. auto:
    the memory plan picks it on a GPU of known size: the most tokens (up to 65,536) whose
    update fits, without gradient checkpointing when model.gradient_checkpointing=auto and
    16,384 or more fit so (trainer/plan/memory_choices.py says why); elsewhere 16,384 (at least
    one whole sequence)."""
    log_prob_max_tokens_per_gpu: int | None = None
    """Token budget per micro-batch of the old-log-prob pass (a forward without autograd,
    packed by tokens). None: derived from the memory plan on a GPU of known size (the most
    tokens whose forward fits beside what stays resident, at most 4× the update's budget and
    the whole batch on one GPU, never below the update's budget); elsewhere the update's
    batching (max_tokens_per_gpu or micro_batch_size_per_gpu)."""
    ppo_epochs: int = 1
    """Passes over each RL batch."""
    shuffle: bool = False
    """Shuffle samples between mini-batches within an RL step."""
    policy_loss: str = "vanilla"
    """Policy loss: vanilla | gspo | cispo | sapo | gpg | clip_cov | kl_cov | geo_mean | …"""
    policy_loss_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of the chosen policy loss (e.g. clip_cov_ratio)."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm."""
    clip_ratio_low: float = 0.2
    """PPO lower clip ε_low: ratio ≥ 1 − ε_low."""
    clip_ratio_high: float = 0.2
    """PPO upper clip ε_high (DAPO's clip-higher uses 0.28)."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant c > 1 for negative advantages."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient (loss −= coeff · entropy)."""
    use_kl_loss: bool = False
    """Add ``kl_loss_coef · KL(π‖π_ref)`` to the loss (GRPO style); needs the reference."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator for the loss: kl | abs | mse | low_var_kl | k1+ | k3+ …"""
    skip_old_logprob_on_policy: bool = True
    """When each RL batch is exactly one optimizer step (ppo_epochs = 1, one mini-batch) and
    the KL is not in the reward, skip the old-log-prob forward pass and use the detached
    current log-probs (ratio exactly 1, same gradient). Turn off to log entropy/ratios of a
    separate pass."""
    rollout_is_cap: float | None = None
    """Truncated importance weight cap C for rollout/trainer log-prob mismatch; None: off."""
    param_offload: bool = False
    """FSDP2 CPU offload (several training GPUs): sharded masters, gradients and AdamW state on
    the host, the step there. Does nothing on one GPU (use optimizer_offload)."""
    optimizer_offload: bool = False
    """One training GPU: fp32 masters and AdamW state on the host for the whole run, the step
    on the CPU bucket by bucket, bf16 weights on the GPU (docs/memory.md, Optimizer offload)."""
    freeze_vision_tower: bool = True
    """Vision-language models: the vision encoder is not trained (its weights get no
    gradient and no optimizer state); false trains it with the language model. verl's
    actor.freeze_vision_tower (which is off by default there)."""
    router_replay: str = "off"
    """Mixture-of-experts models: off | rollout. rollout: the old-log-prob and update passes
    send each token to the experts the rollout engine chose for it (gate weights recomputed
    from the current router, so it keeps learning), so a routing flip between the engine's
    and the trainer's numerics does not move the log-probs (verl's router_replay R3)."""
    router_aux_loss_coef: float | None = None
    """Mixture-of-experts models: weight of the load-balancing loss (Switch Transformer, as
    transformers computes it). None: the model's config.json router_aux_loss_coef."""
    router_z_loss_coef: float = 0.0
    """Mixture-of-experts models: weight of the router z-loss (ST-MoE: the mean squared
    logsumexp of the router logits), which keeps the logits small; 0: off."""
    tensor_parallel_size: int = 1
    """Ranks that split each layer's heads, MLP columns and vocabulary (docs/parallelism.md).
    The actor's ranks are data × sequence × tensor parallel; FSDP2 shards over the rest."""
    sequence_parallel_size: int = 1
    """Ranks that split each packed sequence (Ulysses: an all-to-all around attention), for
    sequences too long for one GPU's activations. verl's ulysses_sequence_parallel_size."""
    expert_parallel_size: int = 1
    """Mixture-of-experts models: ranks that split the experts of each sparse layer (tokens
    dispatched and combined by all-to-all); a multiple of sequence_parallel_size."""
    precision: str = "bf16"
    """Matmuls of training: bf16 | fp8. fp8: the decoder layers' linear projections compute in
    float8 (torchao's float8 training, `pip install -e '.[fp8]'`; a GPU of compute capability
    >= 8.9); masters and AdamW state stay fp32, the embedding, LM head and router bf16
    (learners/fp8_training.py). verl's megatron.override_transformer_config.fp8."""
    fp8_recipe: str = "rowwise"
    """Scales of precision=fp8: rowwise (one per row of each operand, e4m3 gradients: the more
    accurate) | tensorwise (one per tensor, e5m2 gradients: the fastest; under FSDP2 the
    weights are all-gathered in float8)."""


@dataclass
class RefConfig:
    path: str | None = None
    """Reference policy weights; default: the initial policy (with LoRA: adapters disabled)."""
    micro_batch_size_per_gpu: int = 16
    """Samples per reference forward on one GPU."""
    max_tokens_per_gpu: int | None = None
    """Token budget per reference micro-batch (a forward without autograd). None: derived
    from the memory plan on a GPU of known size, as actor.log_prob_max_tokens_per_gpu;
    elsewhere micro_batch_size_per_gpu samples."""
    param_offload: bool = False
    """Keep the reference weights on CPU between uses."""
    tensor_parallel_size: int | None = None
    """As actor.tensor_parallel_size, for the reference model; None: the actor's."""
    sequence_parallel_size: int | None = None
    """As actor.sequence_parallel_size, for the reference model; None: the actor's."""
    expert_parallel_size: int | None = None
    """As actor.expert_parallel_size, for the reference model; None: the actor's."""


@dataclass
class CriticConfig:
    path: str | None = None
    """Critic backbone; default: the actor's initial weights with a fresh value head."""
    lr: float = 1e-5
    """Critic learning rate."""
    ppo_mini_batch_size: int | None = None
    """Prompts per critic optimizer step; default: actor.ppo_mini_batch_size."""
    micro_batch_size_per_gpu: int = 8
    """Samples per critic forward/backward on one GPU."""
    max_tokens_per_gpu: int | None = None
    """Token budget per critic micro-batch; None: off."""
    ppo_epochs: int | None = None
    """Critic passes per RL batch; default: actor.ppo_epochs."""
    cliprange_value: float = 0.5
    """Value clip c: v̂ = clip(v, v_old − c, v_old + c)."""
    grad_clip: float = 1.0
    """Max global grad norm of the critic."""
    loss_agg_mode: str = "token-mean"
    """Aggregation of the value loss."""
    lr_warmup_steps: int = 0
    """Critic warm-up steps."""
    tensor_parallel_size: int | None = None
    """As actor.tensor_parallel_size, for the critic; None: the actor's."""
    sequence_parallel_size: int | None = None
    """As actor.sequence_parallel_size, for the critic; None: the actor's."""
    expert_parallel_size: int | None = None
    """As actor.expert_parallel_size, for the critic; None: the actor's."""
    precision: str = "bf16"
    """As actor.precision, for the critic (its value head stays bf16)."""
    fp8_recipe: str = "rowwise"
    """As actor.fp8_recipe, for the critic."""
