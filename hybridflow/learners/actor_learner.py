"""The actor: log-probs of the policy and its PPO-family update (epochs × mini-batches ×
micro-batches), on one data-parallel rank of an SPMD group.

Batch keys (all [B, R] unless noted): ``prompts [B, P]`` left-padded, ``responses`` right-padded,
``attention_mask [B, P+R]``, ``response_mask``, ``old_logprobs``, ``advantages``; optional
``ref_logprobs`` (KL loss) and ``rollout_logprobs`` (truncated importance weights).

Gradient accumulation follows ``hybridflow.algos.aggregation``: every micro-batch loss is
normalised by the token (or sequence) count of the *whole* mini-batch over all ranks, losses are
back-propagated as they are (times the DP size, since FSDP averages gradients over ranks), so
one optimizer step equals the whole mini-batch computed at once.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.algos import agg_loss, kl_penalty, policy_loss, rollout_is_weights
from hybridflow.config import ActorConfig, ModelConfig
from hybridflow.config.sections import UNPLANNED_UPDATE_BUDGET
from hybridflow.learners import lora
from hybridflow.learners.core import TrainCore
from hybridflow.learners.fp8_training import FP8_TILE, fp8_options
from hybridflow.learners.metric_sums import MetricSums
from hybridflow.learners.modules import PolicyModel
from hybridflow.learners.packing import PackedRows, to_device
from hybridflow.learners.response_forward import check_keys, forward_response_tokens
from hybridflow.learners.router_terms import router_terms
from hybridflow.learners.sharding.shared_rows import gather_rows, own_rows
from hybridflow.learners.sharding.train_groups import sequence_group_of
from hybridflow.learners.step import accumulate_and_step, mini_batch_count, mini_batch_plan
from hybridflow.protocol import Batch

if TYPE_CHECKING:
    from hybridflow.parallel import RoleMesh

UPDATE_INPUTS = (
    "prompts",
    "responses",
    "attention_mask",
    "response_mask",
    "old_logprobs",
    "advantages",
)
LOSS_INPUTS = ("response_mask", "old_logprobs", "advantages", "ref_logprobs", "rollout_logprobs")


class ActorLearner:
    """Policy training on one rank. See the module docstring for the batch contract.

    Args:
        model: a CausalLM (fp32 weights recommended; on CUDA compute runs in bf16).
        actor_cfg: the ``actor`` config section.
        total_steps: RL steps of the run. The LR schedule advances once per optimizer step;
            its length is ``total_steps`` × the optimizer steps of the first :meth:`update`
            (ppo_epochs × mini-batches), so ``lr_warmup_steps`` counts optimizer steps.
        device: compute device of this rank.
        dp_group: data-parallel group (default: the whole world when distributed is on).
        mesh: the actor's parallel layout instead of ``dp_group`` (learners/core.TrainCore);
            with a Ulysses ``sp`` group each rank receives its own rows from the controller,
            the group works on the union and each rank returns its rows' results.
        model_cfg: the ``model`` config section (LoRA, gradient checkpointing); None: no LoRA.
        rollout_n: samples per prompt; ``ppo_mini_batch_size`` counts prompts.
        max_response_length: ``T`` of ``seq-mean-token-sum-norm``; None: the batch's width.
        fsdp: force FSDP2 on/off; None: on when the DP group has more than one rank.
        seed: seeds the mini-batch shuffle and the LoRA initialisation.
        fp8_emulate: with actor.precision=fp8, torchao's emulation (runs on the CPU; tests).
    """

    def __init__(
        self,
        model: nn.Module,
        actor_cfg: ActorConfig,
        *,
        total_steps: int,
        device: torch.device | str,
        dp_group: dist.ProcessGroup | None = None,
        mesh: RoleMesh | None = None,
        model_cfg: ModelConfig | None = None,
        rollout_n: int = 1,
        max_response_length: int | None = None,
        fsdp: bool | None = None,
        seed: int = 0,
        fp8_emulate: bool = False,
    ):
        fp8 = fp8_options(actor_cfg.precision, actor_cfg.fp8_recipe, device,
                          emulate=fp8_emulate, key="actor.precision")  # fmt: skip
        if actor_cfg.max_tokens_per_gpu == "auto":
            # resolved at run start (trainer/memory_check.memory_defaults); unresolved (a
            # learner built outside `hybridflow train`), what a run without a GPU size gets
            actor_cfg = dataclasses.replace(actor_cfg, max_tokens_per_gpu=UNPLANNED_UPDATE_BUDGET)
        self.cfg = actor_cfg
        self.rollout_n = rollout_n
        self.max_response_length = max_response_length
        self.seed = seed
        self.lora = model_cfg is not None and model_cfg.lora_rank > 0
        if self.lora:
            lora.apply_lora(
                model,
                rank=model_cfg.lora_rank,
                alpha=model_cfg.lora_alpha,
                target_modules=model_cfg.lora_target_modules,
                dropout=model_cfg.lora_dropout,
                seed=seed,
            )
        if actor_cfg.freeze_vision_tower and getattr(model, "visual", None) is not None:
            model.visual.requires_grad_(False)  # no gradient, no optimizer state
        # "auto" is resolved at run start (trainer/memory_check.memory_defaults and
        # trainer/compile_policy.compile_defaults); unresolved, it means off, as on the CPU.
        if model_cfg is not None and model_cfg.gradient_checkpointing is True:
            model.enable_gradient_checkpointing(True)
        if model_cfg is not None and model_cfg.compile is True:
            compile_layers(model)
        self.moe = _has_our_router(model)
        replay = actor_cfg.router_replay == "rollout" and self.moe
        if actor_cfg.router_replay == "rollout" and not self.moe:  # as verl: nothing to patch
            print(
                "hybridflow: actor.router_replay=rollout has no effect: the model has no experts "
                "in hybridflow's decoder (a dense model, or one loaded through transformers)",
                file=sys.stderr,
            )
        self.router_aux_loss_coef = (
            actor_cfg.router_aux_loss_coef
            if actor_cfg.router_aux_loss_coef is not None
            else getattr(model.config, "router_aux_loss_coef", 0.0)
        )
        self.policy = PolicyModel(
            model,
            replay_routes=replay,
            sequence_group=sequence_group_of(mesh),
            fused_head=model_cfg is None or model_cfg.fused_logprob_head,
            token_multiple=FP8_TILE if fp8 is not None else 1,
        )
        self.core = TrainCore(
            self.policy,
            device=device,
            dp_group=dp_group,
            mesh=mesh,
            fsdp=fsdp,
            param_offload=actor_cfg.param_offload,
            optimizer_offload=actor_cfg.optimizer_offload,
            fp8=fp8,
        )
        self.core.build_optimizer(
            lr=actor_cfg.lr,
            weight_decay=actor_cfg.weight_decay,
            betas=tuple(actor_cfg.betas),
            schedule=actor_cfg.lr_scheduler,
            warmup_steps=actor_cfg.lr_warmup_steps,
            total_steps=total_steps,
            min_lr_ratio=actor_cfg.min_lr_ratio,
        )
        self.update_count = 0
        self.total_skipped_steps = 0

    @property
    def model(self) -> nn.Module:
        """The (possibly sharded, possibly LoRA-injected) CausalLM."""
        return self.policy.lm

    @property
    def mini_batch_size(self) -> int:
        """Samples per optimizer step on this rank (on its sequence-parallel group)."""
        return max(self.cfg.ppo_mini_batch_size * self.rollout_n // self.core.groups.data_size, 1)

    # ------------------------------------------------------------------ log-probs

    def compute_logprobs(
        self, batch: Batch, *, temperature: float | None = None, with_entropy: bool = False
    ) -> Batch:
        """Batch with ``old_logprobs [B, R]`` (+ ``entropy [B, R]``), 0 off the response.

        ``temperature`` None: ``batch.meta["temperature"]`` if set, else 1.0 (must equal the
        rollout's so the ratio is 1 on-policy). Micro-batches hold up to
        ``log_prob_max_tokens_per_gpu`` tokens (no autograd: larger than the update's)."""
        temperature = _temperature(batch, temperature)
        self._check_routes(batch)
        groups = self.core.groups.replica

        def run(packed):
            logprobs, entropy = self.policy(packed, temperature, with_entropy)
            return (logprobs, entropy) if with_entropy else (logprobs,)

        outputs = forward_response_tokens(
            self.core,
            gather_rows(batch, groups),
            micro_batch_size=self.cfg.micro_batch_size_per_gpu,
            max_tokens=self.cfg.log_prob_max_tokens_per_gpu or self.cfg.max_tokens_per_gpu,
            run=run,
        )
        tensors = {"old_logprobs": outputs[0]}
        if with_entropy:
            tensors["entropy"] = outputs[1]
        return own_rows(Batch(tensors), groups)

    # ------------------------------------------------------------------ update

    def update(self, batch: Batch, *, temperature: float | None = None) -> dict[str, float]:
        """ppo_epochs × mini-batches × micro-batches of policy-gradient steps. Returns metrics
        averaged over the optimizer steps (and ranks); ``lr`` is the last step's."""
        keys = UPDATE_INPUTS + (("ref_logprobs",) if self.cfg.use_kl_loss else ())
        on_policy = "old_logprobs" not in batch.tensors
        check_keys(batch, tuple(k for k in keys if k != "old_logprobs"), "ActorLearner.update")
        self._check_routes(batch)
        temperature = _temperature(batch, temperature)
        batch = gather_rows(batch, self.core.groups.replica)
        num_rows = len(batch)
        mini_size = min(self.mini_batch_size, num_rows)
        num_minis = mini_batch_count(num_rows, mini_size)
        if on_policy and (self.cfg.ppo_epochs != 1 or num_minis != 1):
            raise KeyError(
                "ActorLearner.update without old_logprobs is only exact on-policy (one epoch, one "
                f"mini-batch); got ppo_epochs={self.cfg.ppo_epochs} and {num_minis} mini-batches: "
                "compute old_logprobs first (compute_logprobs)"
            )
        self.core.set_steps_per_update(self.cfg.ppo_epochs * num_minis)
        sums = MetricSums(self.core)
        skipped_before = self.total_skipped_steps
        self.core.module.train()
        with self.core.on_device():
            for epoch in range(self.cfg.ppo_epochs):
                plan = mini_batch_plan(num_rows, mini_size, self.core.groups.replica_size,
                                       lambda n, epoch=epoch: self._row_order(n, epoch))  # fmt: skip
                for rows in plan:
                    self._mini_batch_step(batch.index(rows), temperature, sums)
        self.update_count += 1
        metrics = sums.result()
        metrics["lr"] = sums.last_lr
        metrics["skipped_steps"] = float(self.total_skipped_steps - skipped_before)
        return metrics

    def _row_order(self, num_rows: int, epoch: int) -> torch.Tensor:
        if not self.cfg.shuffle:
            return torch.arange(num_rows)
        seed = (self.seed * 1_000_003 + self.update_count * 1_009 + epoch) % 2**31
        generator = torch.Generator().manual_seed(seed)
        return torch.randperm(num_rows, generator=generator)

    def _mini_batch_step(self, mini: Batch, temperature: float, sums: MetricSums) -> None:
        cfg = self.cfg

        def micro_loss(micro: Batch, packed: PackedRows, counts: dict):
            trace = [] if self.moe else None  # each sparse layer's routing
            logprobs_m, entropy_m = self.policy(
                packed, temperature, cfg.entropy_coeff != 0, router_trace=trace
            )
            loss, terms, token_means = self._micro_loss(
                micro, packed, logprobs_m, entropy_m, counts
            )
            if trace:
                share = float(micro.tensors["response_mask"].sum()) / max(
                    counts["global_token_count"], 1.0
                )
                router_loss, router_log, router_means = router_terms(
                    trace,
                    self.model.config.num_experts,
                    aux_loss_coef=self.router_aux_loss_coef,
                    z_loss_coef=cfg.router_z_loss_coef,
                    share=share,
                    expert_group=self.core.groups.expert,
                )
                loss = loss + router_loss
                terms.update(router_log)
                token_means.update(router_means)
            if self.policy.replay_routes:  # tokens routed as the rollout did (the rest: free)
                recorded = packed.routed_experts[:, 0, 0] >= 0
                token_means["moe/replayed_token_fraction"] = recorded.float().mean()
            return loss, terms, token_means

        skipped = accumulate_and_step(
            self.core,
            mini,
            micro_batch_size=cfg.micro_batch_size_per_gpu,
            max_tokens=cfg.max_tokens_per_gpu,
            grad_clip=cfg.grad_clip,
            norm_length=self.max_response_length or mini.tensors["responses"].shape[1],
            micro_loss=micro_loss,
            sums=sums,
        )
        self.total_skipped_steps += int(skipped)

    def _micro_loss(self, micro, packed, logprobs_m, entropy_m, counts):
        """Loss of one micro-batch (already its share of the mini-batch), its loss terms and
        its token-mean metrics."""
        cfg = self.cfg
        logprobs = packed.scatter(logprobs_m)  # [b, R]
        device = logprobs.device
        take = {k: to_device(micro.tensors[k], device) for k in LOSS_INPUTS if k in micro.tensors}
        response_mask = take["response_mask"]
        if "old_logprobs" not in take:
            # On-policy (one epoch, one mini-batch): the policy that sampled is the one being
            # differentiated, so old = sg(current) and the ratio is exactly 1; this saves the
            # separate old-log-prob forward pass (the same shortcut TRL takes with
            # num_iterations=1). The gradient equals that of a recomputed old_logprobs.
            take["old_logprobs"] = logprobs.detach()
        is_weights = None
        token_means: dict[str, torch.Tensor] = {}
        if cfg.rollout_is_cap is not None and "rollout_logprobs" in take:
            is_weights, is_metrics = rollout_is_weights(
                take["old_logprobs"], take["rollout_logprobs"], response_mask, cfg.rollout_is_cap
            )
            token_means.update(is_metrics)
        pg_loss, pg_metrics = policy_loss(
            cfg.policy_loss,
            old_logprobs=take["old_logprobs"],
            logprobs=logprobs,
            advantages=take["advantages"],
            response_mask=response_mask,
            loss_agg_mode=cfg.loss_agg_mode,
            clip_ratio_low=cfg.clip_ratio_low,
            clip_ratio_high=cfg.clip_ratio_high,
            clip_ratio_c=cfg.clip_ratio_c,
            rollout_is_weights=is_weights,
            **counts,
            **cfg.policy_loss_kwargs,
        )
        token_means.update(pg_metrics)
        loss = pg_loss
        terms = {"pg_loss": pg_loss.detach()}
        if entropy_m is not None:
            entropy = packed.scatter(entropy_m)
            entropy_loss = agg_loss(entropy, response_mask, cfg.loss_agg_mode, **counts)
            loss = loss - cfg.entropy_coeff * entropy_loss
            terms["entropy"] = entropy_loss.detach()
        if cfg.use_kl_loss:
            kl = kl_penalty(logprobs, take["ref_logprobs"], cfg.kl_loss_type)
            kl_loss = agg_loss(kl, response_mask, cfg.loss_agg_mode, **counts)
            loss = loss + cfg.kl_loss_coef * kl_loss
            terms["kl_loss"] = kl_loss.detach()
        return loss, terms, token_means

    def _check_routes(self, batch: Batch) -> None:
        if self.policy.replay_routes and "routed_experts" not in batch.tensors:
            raise KeyError(
                "actor.router_replay=rollout needs the batch's routed_experts [B, P+R, L, k] "
                "(the rollout engine records them: rollout.engine.record_routes)"
            )

    # ------------------------------------------------------------------ state

    def save(self, directory: str | os.PathLike, background: bool = False) -> None:
        """Sharded training state (model or LoRA adapters only, optimizer, scheduler, RNG)."""
        extra = {"update_count": self.update_count, "total_skipped_steps": self.total_skipped_steps}
        self.core.save(directory, extra, trainable_only=self.lora, background=background)

    def save_finished(self) -> bool:
        """Whether a background save is on disk; raises its error (learners/state_writer.py)."""
        return self.core.save_finished()

    def load(self, directory: str | os.PathLike) -> None:
        extra = self.core.load(directory, trainable_only=self.lora)
        self.update_count = extra["update_count"]
        self.total_skipped_steps = extra["total_skipped_steps"]

    def offload(self) -> None:
        self.core.offload()

    def reload(self) -> None:
        self.core.reload()

    def hf_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, full tensor on the device)`` of the current policy, LoRA merged, one
        tensor at a time, on every rank (all ranks must iterate it to the end: each sharded
        tensor is all-gathered). For weight sync to a rollout engine and for export. Without
        FSDP and LoRA the tensors are the parameters themselves (no copy). A tied lm_head is
        not repeated (HF checkpoints omit it)."""
        core = self.core
        wanted = dtype or core.master_dtype()  # None: the fp32 masters (export)
        if core.fsdp and not self.lora and wanted == core.gather_dtype():
            # One all-gather per layer, already in the rollout's dtype (weight sync).
            for name, tensor in core.iter_unit_gathered(self.model):
                if not (self.model.config.tie_word_embeddings and name == "lm_head.weight"):
                    yield name, tensor
            # the buffers a checkpoint holds (DeepSeek's score correction), never sharded
            saved = self.model.state_dict().keys()
            for name, buffer in self.model.named_buffers():
                if name in saved:
                    yield name, buffer.detach().to(wanted)
            return
        stream = core.iter_full_tensors(self.model)
        if self.lora:
            stream = lora.merge_lora_stream(stream, lora.lora_scalings(self.model))
        tied = self.model.config.tie_word_embeddings
        for name, tensor in stream:
            if tied and name == "lm_head.weight":
                continue
            yield name, (tensor.detach().to(dtype) if dtype is not None else tensor.detach())

    def export_hf(self, directory: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
        """Full Hugging Face checkpoint (LoRA merged) written by rank 0; all ranks must call."""
        full = {}
        for name, tensor in self.hf_weights(dtype):
            if self.core.groups.role_rank == 0:
                full[name] = tensor.to("cpu", copy=True)
        if self.core.groups.role_rank == 0:
            export_causal_lm(self.model.config, full, directory)
        self.core._barrier()


def export_causal_lm(config, state_dict: dict[str, torch.Tensor], directory) -> None:
    """Rebuild a plain CausalLM from full CPU tensors (HF names) and ``save_pretrained`` it."""
    from hybridflow.models import CausalLM

    with torch.device("meta"):
        plain = CausalLM(config)
    result = plain.load_state_dict(state_dict, strict=False, assign=True)
    plain.tie_weights()
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - allowed_missing or result.unexpected_keys:
        raise ValueError(
            f"export: missing {result.missing_keys}, unexpected {result.unexpected_keys}"
        )
    Path(directory).mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(str(directory))


def _has_our_router(model: nn.Module) -> bool:
    """A mixture of experts in our decoder (the transformers fallback keeps its routing)."""
    from hybridflow.models.llama import CausalLM

    return isinstance(model, CausalLM) and model.config.is_moe


def _temperature(batch: Batch, temperature: float | None) -> float:
    if temperature is not None:
        return float(temperature)
    return float(batch.meta.get("temperature", 1.0))


def compile_layers(model: nn.Module) -> None:
    """``torch.compile`` each decoder layer (``model.compile``): fuses the norms, RoPE and
    SwiGLU around the matmuls (+11% tokens/s on an H200: docs/performance.md, Training
    throughput (MFU)). Dynamic
    shapes, because packed micro-batches change length every call. The rollout engine reads
    the same parameters and is unaffected."""
    for layer in model.model.layers:
        layer.compile(dynamic=True)
