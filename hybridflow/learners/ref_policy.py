"""The reference policy: frozen log-probs for the KL loss / KL-in-reward.

Two forms: its own frozen (optionally sharded, optionally CPU-offloaded) copy of the initial
weights, or — with LoRA — the actor's own module with the adapters switched off, which is the
initial policy exactly and costs no second copy of the weights.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.config import RefConfig
from hybridflow.learners import lora
from hybridflow.learners.actor_learner import ActorLearner, compile_layers
from hybridflow.learners.core import TrainCore
from hybridflow.learners.modules import PolicyModel
from hybridflow.learners.response_forward import forward_response_tokens
from hybridflow.learners.sharding.shared_rows import gather_rows, own_rows
from hybridflow.learners.sharding.train_groups import sequence_group_of
from hybridflow.protocol import Batch

if TYPE_CHECKING:
    from hybridflow.parallel import RoleMesh


class RefPolicy:
    """``compute_ref_logprobs(batch) -> Batch(ref_logprobs [B, R])``.

    Args:
        model: the reference CausalLM (its weights are frozen here).
        ref_cfg: the ``ref`` config section (micro-batching, parameter offload).
        device, dp_group, mesh, fsdp: as for :class:`~hybridflow.learners.actor_learner.ActorLearner`.
        compile: ``torch.compile`` each decoder layer (``model.compile`` resolved to true).
        fused_head: the fused log-prob head (``model.fused_logprob_head``).
    Use :meth:`from_actor` for the LoRA form.
    """

    def __init__(
        self,
        model: nn.Module,
        ref_cfg: RefConfig,
        *,
        device: torch.device | str,
        dp_group: dist.ProcessGroup | None = None,
        mesh: RoleMesh | None = None,
        fsdp: bool | None = None,
        compile: bool = False,
        fused_head: bool = True,
    ):
        model.requires_grad_(False)
        if compile:  # model.compile: the same fused layers as the actor's forward passes
            compile_layers(model)
        self.cfg = ref_cfg
        self.policy = PolicyModel(
            model, sequence_group=sequence_group_of(mesh), fused_head=fused_head
        )
        self.core = TrainCore(
            self.policy,
            device=device,
            dp_group=dp_group,
            mesh=mesh,
            fsdp=fsdp,
            param_offload=ref_cfg.param_offload,
        )
        self._actor: ActorLearner | None = None

    @classmethod
    def from_actor(cls, actor: ActorLearner, ref_cfg: RefConfig) -> RefPolicy:
        """The actor's own weights with LoRA adapters disabled (needs a LoRA actor)."""
        if not actor.lora:
            raise ValueError(
                "RefPolicy.from_actor needs an actor with LoRA (model.lora_rank > 0); without "
                "LoRA the actor's weights move, so build RefPolicy(initial_model, ref_cfg, ...)"
            )
        ref = cls.__new__(cls)
        ref.cfg = ref_cfg
        ref.policy = actor.policy
        ref.core = actor.core
        ref._actor = actor
        return ref

    def compute_ref_logprobs(self, batch: Batch, *, temperature: float | None = None) -> Batch:
        """``ref_logprobs [B, R]`` at the rollout temperature (``batch.meta["temperature"]``
        when ``temperature`` is None, else 1.0)."""
        if temperature is None:
            temperature = float(batch.meta.get("temperature", 1.0))

        def run(packed):
            return (self.policy(packed, temperature, False)[0],)

        adapters_off = lora.adapters_disabled(self.policy.lm) if self._actor else nullcontext()
        groups = self.core.groups.replica
        with adapters_off:
            (logprobs,) = forward_response_tokens(
                self.core,
                gather_rows(batch, groups),
                micro_batch_size=self.cfg.micro_batch_size_per_gpu,
                max_tokens=self.cfg.max_tokens_per_gpu,
                run=run,
            )
        return own_rows(Batch({"ref_logprobs": logprobs}), groups)

    def offload(self) -> None:
        if self._actor is None:
            self.core.offload()

    def reload(self) -> None:
        if self._actor is None:
            self.core.reload()
