"""The critic: a value head on a causal-LM backbone, trained with the clipped value loss.

Batch keys: ``prompts``, ``responses``, ``attention_mask`` (as for the actor),
``response_mask``, and for :meth:`CriticLearner.update` ``values`` (from
:meth:`CriticLearner.compute_values` at collection time) and ``returns`` (advantage estimator).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.algos import value_loss
from hybridflow.config import ActorConfig, CriticConfig
from hybridflow.learners.core import TrainCore
from hybridflow.learners.fp8_training import FP8_TILE, fp8_options
from hybridflow.learners.metric_sums import MetricSums
from hybridflow.learners.modules import ValueModel
from hybridflow.learners.packing import PackedRows, to_device
from hybridflow.learners.response_forward import check_keys, forward_response_tokens
from hybridflow.learners.sharding.shared_rows import gather_rows, own_rows
from hybridflow.learners.sharding.train_groups import sequence_group_of
from hybridflow.learners.step import accumulate_and_step, mini_batch_count, mini_batch_plan
from hybridflow.protocol import Batch

if TYPE_CHECKING:
    from hybridflow.parallel import RoleMesh

UPDATE_INPUTS = ("prompts", "responses", "attention_mask", "response_mask", "values", "returns")


class CriticLearner:
    """Value-function training on one rank.

    Args:
        model: the backbone CausalLM (from ``critic.path``, or the actor's initial weights);
            a zero-initialised ``Linear(hidden, 1)`` value head is added unless given.
        critic_cfg: the ``critic`` config section.
        total_steps: RL steps (``lr_warmup_steps`` counts optimizer steps, as for the actor).
        actor_cfg: fallbacks for ``ppo_mini_batch_size`` / ``ppo_epochs`` left as None, and the
            AdamW betas / weight decay.
        rollout_n, max_response_length, device, dp_group, mesh, fsdp, fp8_emulate: as for
            the actor.
    """

    def __init__(
        self,
        model: nn.Module,
        critic_cfg: CriticConfig,
        *,
        total_steps: int,
        device: torch.device | str,
        dp_group: dist.ProcessGroup | None = None,
        mesh: RoleMesh | None = None,
        actor_cfg: ActorConfig | None = None,
        rollout_n: int = 1,
        max_response_length: int | None = None,
        fsdp: bool | None = None,
        value_head: nn.Linear | None = None,
        fp8_emulate: bool = False,
    ):
        fp8 = fp8_options(critic_cfg.precision, critic_cfg.fp8_recipe, device,
                          emulate=fp8_emulate, key="critic.precision")  # fmt: skip
        actor_cfg = actor_cfg or ActorConfig()
        self.cfg = critic_cfg
        self.mini_batch_prompts = critic_cfg.ppo_mini_batch_size or actor_cfg.ppo_mini_batch_size
        self.ppo_epochs = critic_cfg.ppo_epochs or actor_cfg.ppo_epochs
        self.rollout_n = rollout_n
        self.max_response_length = max_response_length
        self.value_model = ValueModel(model, value_head, sequence_group=sequence_group_of(mesh),
                                      token_multiple=FP8_TILE if fp8 is not None else 1)  # fmt: skip
        self.core = TrainCore(
            self.value_model, device=device, dp_group=dp_group, mesh=mesh, fsdp=fsdp, fp8=fp8
        )
        self.core.build_optimizer(
            lr=critic_cfg.lr,
            weight_decay=actor_cfg.weight_decay,
            betas=tuple(actor_cfg.betas),
            schedule="constant",
            warmup_steps=critic_cfg.lr_warmup_steps,
            total_steps=total_steps,
            min_lr_ratio=0.0,
        )
        self.update_count = 0
        self.total_skipped_steps = 0

    @property
    def mini_batch_size(self) -> int:
        return max(self.mini_batch_prompts * self.rollout_n // self.core.groups.data_size, 1)

    def compute_values(self, batch: Batch) -> Batch:
        """Batch with ``values [B, R]`` (0 off the response)."""
        groups = self.core.groups.replica
        (values,) = forward_response_tokens(
            self.core,
            gather_rows(batch, groups),
            micro_batch_size=self.cfg.micro_batch_size_per_gpu,
            max_tokens=self.cfg.max_tokens_per_gpu,
            run=lambda packed: (self.value_model(packed),),
        )
        return own_rows(Batch({"values": values}), groups)

    def update(self, batch: Batch) -> dict[str, float]:
        """ppo_epochs × mini-batches × micro-batches of value-loss steps. Metrics: vf_loss,
        vf_clipfrac, vpred_mean, grad_norm, lr, skipped_steps."""
        check_keys(batch, UPDATE_INPUTS, "CriticLearner.update")
        cfg = self.cfg
        batch = gather_rows(batch, self.core.groups.replica)
        num_rows = len(batch)
        mini_size = min(self.mini_batch_size, num_rows)
        num_minis = mini_batch_count(num_rows, mini_size)
        self.core.set_steps_per_update(self.ppo_epochs * num_minis)
        sums = MetricSums(self.core)
        skipped_before = self.total_skipped_steps

        def micro_loss(micro: Batch, packed: PackedRows, counts: dict):
            values = packed.scatter(self.value_model(packed))  # [b, R] fp32
            take = {k: to_device(micro.tensors[k], values.device) for k in UPDATE_INPUTS[3:]}
            loss, metrics = value_loss(
                values,
                take["values"],
                take["returns"],
                take["response_mask"],
                cliprange_value=cfg.cliprange_value,
                loss_agg_mode=cfg.loss_agg_mode,
                **counts,
            )
            return loss, {"vf_loss": loss.detach()}, metrics

        self.core.module.train()
        with self.core.on_device():
            for _ in range(self.ppo_epochs):
                plan = mini_batch_plan(
                    num_rows, mini_size, self.core.groups.replica_size, torch.arange
                )
                for rows in plan:
                    self.total_skipped_steps += int(
                        accumulate_and_step(
                            self.core,
                            batch.index(rows),
                            micro_batch_size=cfg.micro_batch_size_per_gpu,
                            max_tokens=cfg.max_tokens_per_gpu,
                            grad_clip=cfg.grad_clip,
                            norm_length=self.max_response_length
                            or batch.tensors["responses"].shape[1],
                            micro_loss=micro_loss,
                            sums=sums,
                        )
                    )
        self.update_count += 1
        metrics = sums.result()
        metrics["lr"] = sums.last_lr
        metrics["skipped_steps"] = float(self.total_skipped_steps - skipped_before)
        return metrics

    def save(self, directory: str | os.PathLike, background: bool = False) -> None:
        extra = {"update_count": self.update_count, "total_skipped_steps": self.total_skipped_steps}
        self.core.save(directory, extra, trainable_only=False, background=background)

    def save_finished(self) -> bool:
        """Whether a background save is on disk; raises its error (learners/state_writer.py)."""
        return self.core.save_finished()

    def load(self, directory: str | os.PathLike) -> None:
        extra = self.core.load(directory, trainable_only=False)
        self.update_count = extra["update_count"]
        self.total_skipped_steps = extra["total_skipped_steps"]

    def offload(self) -> None:
        self.core.offload()

    def reload(self) -> None:
        self.core.reload()
