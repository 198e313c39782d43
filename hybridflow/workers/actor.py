"""The actor and reference roles: remote-callable wrappers of the learners.

Each method is one coarse call from the controller (DESIGN.md §1). ``DP_SPLIT`` methods get
this rank's share of the batch; the learners do the data-parallel reductions themselves.
"""

from __future__ import annotations

import os

import torch

from hybridflow.config import Config
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.protocol import Batch
from hybridflow.workers.model_loading import (
    load_causal_lm,
    resolve_dtype,
    set_cpu_threads,
    training_dtype,
    training_mesh,
)


class ActorWorker(Worker):
    """Policy training on this rank: log-probs, PPO-family update, checkpoints, export.

    Args:
        config: the run config with ``model.path`` already resolved to a directory or preset.
    """

    def __init__(self, config: Config):
        from hybridflow.learners import ActorLearner

        set_cpu_threads(config, self.device)
        self.config = config
        self.compile_artifacts = None
        """Where to save the compiled artifacts after the first update (model.compile)."""
        if config.model.compile is True:  # auto is resolved at run start (compile_policy.py)
            from hybridflow.workers.compile_cache import prepare_compile_cache

            self.compile_artifacts = prepare_compile_cache(
                config.trainer.cache_dir, config.model.path, self.device
            )
        torch.manual_seed(config.trainer.seed)
        dtype = training_dtype(config.model)
        model = load_causal_lm(config.model.path, dtype, self.device)
        self.learner = ActorLearner(
            model,
            config.actor,
            total_steps=max(config.trainer.total_steps, 1),
            device=self.device,
            mesh=training_mesh(config, "actor", self.world_size, self.device),
            model_cfg=config.model,
            rollout_n=config.rollout.n,
            max_response_length=config.data.max_response_length,
            seed=config.trainer.seed,
        )

    @property
    def model(self) -> torch.nn.Module:
        """The trained CausalLM (FSDP2-sharded when the group has several ranks)."""
        return self.learner.model

    @register(dispatch=Dispatch.DP_SPLIT)
    def compute_logprobs(self, batch: Batch) -> Batch:
        """``old_logprobs`` and ``entropy`` [b, R] of the responses under the current policy."""
        return self.learner.compute_logprobs(batch, with_entropy=True)

    @register(dispatch=Dispatch.DP_SPLIT)
    def update(self, batch: Batch) -> dict[str, float]:
        """One PPO-family update; metrics are already reduced over ranks (same on each)."""
        metrics = {f"actor/{k}": v for k, v in self.learner.update(batch).items()}
        if self.compile_artifacts is not None:  # the first update: both passes now compiled
            from hybridflow.workers.compile_cache import save_artifacts

            if self.local_rank == 0:  # one writer per host; the ranks compile the same graphs
                save_artifacts(self.compile_artifacts)
            self.compile_artifacts = None
        return metrics

    @register(dispatch=Dispatch.RANK_ZERO)
    def full_weights(self) -> dict[str, torch.Tensor]:
        """Unsharded HF-named CPU weights (LoRA merged), for a rollout engine elsewhere.
        Every rank takes part in the gathers; rank 0's copy is returned."""
        keep = self.learner.core.groups.role_rank == 0
        return {
            name: tensor.to("cpu", copy=True) for name, tensor in self.learner.hf_weights() if keep
        }

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save(self, directory: str, background: bool = False) -> None:
        """background: stage the state to host memory, write it on a thread (poll
        :meth:`save_finished`)."""
        self.learner.save(os.path.join(directory, "actor"), background=background)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_finished(self) -> bool:
        """Whether this rank's background save is on disk; raises the error it failed with."""
        return self.learner.save_finished()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load(self, directory: str) -> None:
        self.learner.load(os.path.join(directory, "actor"))

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def export_hf(self, directory: str) -> None:
        self.learner.export_hf(directory)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def device_memory(self, reset: bool = False) -> dict[str, float]:
        """Peak GPU memory of this rank's process since the last reset, GiB (empty on CPU):
        every role of a fused worker shares the process, so this is the whole rank's peak.
        ``reset=True`` starts a new peak after reading."""
        if not str(self.device).startswith("cuda"):
            return {}
        stats = {
            "max_allocated_gib": torch.cuda.max_memory_allocated(self.device) / 2**30,
            "max_reserved_gib": torch.cuda.max_memory_reserved(self.device) / 2**30,
        }
        if reset:
            torch.cuda.reset_peak_memory_stats(self.device)
        return stats

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def offload(self) -> None:
        self.learner.offload()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def reload(self) -> None:
        self.learner.reload()


class RefWorker(Worker):
    """Frozen reference policy: ``ref.path`` or the initial policy; with LoRA, the colocated
    actor with its adapters switched off (no second copy of the weights)."""

    def __init__(self, config: Config):
        from hybridflow.learners import RefPolicy

        actor = self.context.colocated.get("actor")
        if config.model.lora_rank > 0 and config.ref.path is None and actor is not None:
            self.policy = RefPolicy.from_actor(actor.learner, config.ref)
            return
        dtype = resolve_dtype(config.model, self.device)
        model = load_causal_lm(config.ref.path or config.model.path, dtype, self.device)
        mesh = training_mesh(config, "ref", self.world_size, self.device,
                             reuse=actor.learner.core.groups.mesh if actor is not None else None)  # fmt: skip
        # model.compile's "auto" is resolved at run start (trainer/loop/compile_policy.py)
        self.policy = RefPolicy(model, config.ref, device=self.device, mesh=mesh,
                                compile=config.model.compile is True,
                                fused_head=config.model.fused_logprob_head)  # fmt: skip

    @register(dispatch=Dispatch.DP_SPLIT)
    def compute_ref_logprobs(self, batch: Batch) -> Batch:
        return self.policy.compute_ref_logprobs(batch)
