"""What actor, critic and reference share: sharding, precision, micro-batch plans, the
optimizer step, offload, full weights for export; sharded checkpoints through
``learners/sharded_checkpoint``.

A :class:`TrainCore` owns one ``nn.Module`` (a :class:`~hybridflow.learners.modules.PolicyModel`
or :class:`~hybridflow.learners.modules.ValueModel`). When ``torch.distributed`` is initialised
and the data-parallel group has more than one rank, the module is sharded with FSDP2
(``fully_shard``): one unit per decoder layer plus the root (embeddings, final norm, heads).
On CUDA, fp32 master weights compute in bf16 (FSDP2 ``MixedPrecisionPolicy`` with fp32
gradient reduction, or ``torch.autocast`` without FSDP). ``optimizer_offload`` (one device):
masters and AdamW on the host, the module holds bf16 copies (``learners/host_optimizer``).
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.learners.fp8_training import (
    Fp8Training,
    convert_to_fp8,
    gathers_in_fp8,
    plain_tensor,
    precompute_weight_scales,
)
from hybridflow.learners.host_optimizer import (
    BUCKET_ELEMENTS,
    HostAdamW,
    host_step,
    masters_by_name,
)
from hybridflow.learners.micro_batch import pack_by_token_budget, split_fixed
from hybridflow.learners.modules import decoder_layers
from hybridflow.learners.optim import (
    build_optimizer,
    build_scheduler,
    clip_grad_norm,
    move_optimizer_state,
)
from hybridflow.learners.sharded_checkpoint import (
    checkpoint_group,
    load_checkpoint,
    role_barrier,
    save_checkpoint,
)
from hybridflow.learners.sharding.expert_shard import (
    check_expert_options,
    distribute_experts,
    reduce_expert_grads,
    shard_experts,
)
from hybridflow.learners.sharding.train_groups import TrainGroups, distributed_on
from hybridflow.learners.state_writer import StateWriter

if TYPE_CHECKING:
    from hybridflow.parallel import RoleMesh


class TrainCore:
    """One module on one data-parallel rank, optionally FSDP2-sharded and trainable.

    Args:
        module: the model; its ``lm`` attribute is the CausalLM whose layers are sharded.
        device: where compute happens (``cuda:i`` or ``cpu``).
        dp_group: data-parallel process group; None: the default group (if initialised).
        mesh: the role's parallel layout (hybridflow.parallel); replaces ``dp_group``: data
            reductions run over its ``dp`` group, FSDP2 shards over ``fsdp`` (dp × sp), a
            Ulysses ``sp`` group splits each packed stream (see ``sequence_group``) and a
            ``tp`` group splits the layers (models/sharding/tensor_parallel.py; FSDP2 then shards the
            tensor-parallel parameters over ``fsdp``, a 2-D layout).
        fsdp: shard with FSDP2; None: when the group has more than one rank.
        mixed_precision: bf16 compute for fp32 weights on CUDA; None: on when the device is CUDA.
        param_offload: keep sharded parameters (and run the optimizer) on the CPU (FSDP2
            ``CPUOffloadPolicy``; only with FSDP: ignored on one device).
        optimizer_offload: master weights and AdamW state on the host, the step on the CPU,
            the device holding compute-dtype weights (one device only: with FSDP2 use
            ``param_offload``).
        fp8: the decoder's linears compute in FP8 (learners/fp8_training.py); None: bf16.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        device: torch.device | str,
        dp_group: dist.ProcessGroup | None = None,
        mesh: RoleMesh | None = None,
        fsdp: bool | None = None,
        mixed_precision: bool | None = None,
        param_offload: bool = False,
        optimizer_offload: bool = False,
        fp8: Fp8Training | None = None,
    ):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)
        self.groups = TrainGroups.of(mesh, dp_group)
        self.expert_params: list[nn.Parameter] = []
        self.experts_sharded = False  # FSDP2 over expert_fsdp (learners/sharding/expert_shard.py)
        if self.groups.expert is not None:
            check_expert_options(optimizer_offload=optimizer_offload)
            self.expert_params = distribute_experts(module.lm, mesh)
        self.fsdp = self.groups.shard_size > 1 if fsdp is None else fsdp
        if self.fsdp and optimizer_offload:
            raise ValueError(
                "optimizer_offload steps on the host on one device only; with FSDP2 use "
                "param_offload (FSDP2's CPUOffloadPolicy: sharded masters and AdamW on the host)"
            )
        if self.fsdp and not _dist_on():
            raise ValueError("fsdp=True needs torch.distributed to be initialised")
        params_fp32 = next(module.parameters()).dtype == torch.float32
        if mixed_precision is None:
            mixed_precision = self.device.type == "cuda"
        self.compute_dtype = torch.bfloat16 if mixed_precision and params_fp32 else None
        self.param_offload = param_offload and self.fsdp
        self.optimizer_offload = optimizer_offload
        if not self.param_offload:
            module.to(self.device)
        if self.groups.tensor is not None:
            from hybridflow.models.sharding.tensor_parallel import parallelize_decoder

            parallelize_decoder(module.lm, mesh.submesh("tp"))
        self.fp8_linears: list[str] = []  # names in module.lm of the Linears computing in FP8
        if fp8 is not None:
            if self.groups.tensor is not None:
                raise ValueError("FP8 training with tensor parallelism is not supported (its "
                                 "sharded Linears would need torchao's float8 TP styles): set "
                                 "tensor_parallel_size=1 or precision=bf16")  # fmt: skip
            self.fp8_linears = convert_to_fp8(module.lm, fp8, fsdp=self.fsdp)
        if self.fsdp:
            self._shard(module)
        elif self.compute_dtype is not None:
            # Autocast leaves embedding outputs in fp32; cast them so the residual stream, RoPE
            # and the packed attention kernel run in bf16 as under FSDP's mixed precision; not
            # outside autocast (an SFT accuracy check): there the fp32 weights need fp32 input.
            dtype, autocast_on = self.compute_dtype, torch.is_autocast_enabled
            module.lm.model.embed_tokens.register_forward_hook(
                lambda _m, _i, out: out.to(dtype) if autocast_on(out.device.type) else out
            )
        self.module = module
        self.optimizer: torch.optim.Optimizer | None = None
        self.host_optimizer: HostAdamW | None = None  # optimizer_offload: the masters' owner
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.offloaded = False
        # Within a mini-batch, keep parameters gathered and gradients unsharded (fp32) until
        # the last micro-batch: one all-gather and one reduce-scatter per optimizer step instead
        # of two all-gathers and a reduce-scatter per micro-batch. Costs one unsharded copy
        # of the bf16 weights and fp32 gradients during the update (and of the weights during
        # later log-prob passes, released at their end); False: pure ZeRO-3, one layer
        # gathered at a time, which param_offload asks for: it trades speed for memory, and
        # the memory plan (trainer/plan/memory_plan.py) prices it so.
        self.accumulate_unsharded = not self.param_offload
        self.state_writer = StateWriter(checkpoint_group(self.groups), distributed=_dist_on())
        self.fp8_scales_after_step = fp8 is not None and gathers_in_fp8(module)
        self.refresh_fp8_scales()  # the first forward's, as each step's

    # ------------------------------------------------------------------ setup

    def _shard(self, module: nn.Module) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        if self.groups.mesh is not None:
            mesh = self.groups.mesh.submesh("fsdp")
        else:
            mesh = DeviceMesh.from_group(self.groups.shard or dist.group.WORLD, self.device.type)
        options = {"mesh": mesh}
        if self.compute_dtype is not None:
            options["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=self.compute_dtype, reduce_dtype=torch.float32
            )
        if self.param_offload:
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
        if self.expert_params:  # split over the EP group (learners/sharding/expert_shard.py)
            self.experts_sharded = shard_experts(module.lm, self.groups.mesh, options)
            if not self.experts_sharded:
                options["ignored_params"] = set(self.expert_params)
        for layer in decoder_layers(module.lm):
            fully_shard(layer, **options)
        fully_shard(module, **options)

    def build_optimizer(
        self,
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        schedule: str,
        warmup_steps: int,
        total_steps: int,
        min_lr_ratio: float,
        bucket_elements: int = BUCKET_ELEMENTS,
    ) -> None:
        """AdamW and its LR schedule; ``bucket_elements``: parameters per bucket of the host
        step (optimizer_offload)."""
        if self.optimizer_offload:
            self.host_optimizer = HostAdamW(
                self.trainable_parameters,
                device=self.device,
                compute_dtype=self.compute_dtype or self.master_dtype(),
                lr=lr,
                weight_decay=weight_decay,
                betas=betas,
                bucket_elements=bucket_elements,
            )
            self.optimizer = self.host_optimizer.optimizer
        else:
            self.optimizer = build_optimizer(
                self.module.parameters(),
                lr=lr,
                weight_decay=weight_decay,
                betas=betas,
                device=self._optimizer_device,
                per_tensor=bool(self.expert_params),
            )
        self.rl_steps = total_steps
        self.schedule_steps = total_steps  # optimizer steps; sized by set_steps_per_update
        self.scheduler = build_scheduler(
            self.optimizer,
            schedule=schedule,
            warmup_steps=warmup_steps,
            total_steps=lambda: self.schedule_steps,
            min_lr_ratio=min_lr_ratio,
        )
        self._schedule_sized = False

    def set_steps_per_update(self, steps: int) -> None:
        """Size the LR schedule: ``total_steps`` RL steps × optimizer steps per update (taken
        from the first update; warm-up and decay count optimizer steps)."""
        if not self._schedule_sized:
            self.schedule_steps = self.rl_steps * steps
            self._schedule_sized = True

    @property
    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ compute helpers

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast for the unsharded CUDA path (FSDP2 casts through its policy)."""
        if self.compute_dtype is None or self.fsdp:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place sum/max over the data-parallel group (no-op on one rank)."""
        if self.groups.data_size > 1:
            reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
            dist.all_reduce(tensor, op=reduce_op, group=self.groups.data)
        return tensor

    def accumulation_phase(self, *, last: bool) -> None:
        """Before each micro-batch of a mini-batch: sync and reshard only after the last one
        (see ``accumulate_unsharded``). No-op without FSDP."""
        if not (self.fsdp and self.accumulate_unsharded):
            return
        self.module.set_reshard_after_forward(False)  # the backward right after reuses them
        self.module.set_requires_gradient_sync(last)
        self.module.set_reshard_after_backward(last)

    def comm_device(self) -> torch.device:
        """Where small reduction tensors live (NCCL needs CUDA tensors)."""
        return self.device

    def plan_micro_batches(
        self, attention_mask: torch.Tensor, micro_batch_size: int, max_tokens: int | None
    ) -> list[list[int]]:
        """Row indices of each micro-batch of these rows. Every rank gets the same number of
        micro-batches (FSDP runs collectives in each forward), some possibly empty.

        Under Ulysses the SP ranks split each micro-batch's packed stream. The token budget
        is per GPU, so the group's micro-batch holds SP times the tokens and each rank's slice
        at most ``max_tokens`` (plus < SP padding): a sequence longer than one GPU's budget
        trains. A fixed ``micro_batch_size`` counts the group's rows, as verl's does."""
        if max_tokens is not None:
            max_tokens *= self.groups.sequence_size
        num_rows = attention_mask.shape[0]
        if max_tokens is None:
            return split_fixed(num_rows, micro_batch_size)
        lengths = attention_mask.sum(-1).tolist()
        local = len(pack_by_token_budget(lengths, max_tokens)) if num_rows else 0
        count = torch.tensor([local], device=self.comm_device())
        count = int(self.all_reduce(count, op="max").item())
        return pack_by_token_budget(lengths, max_tokens, num_micro_batches=max(count, 1))

    # ------------------------------------------------------------------ optimizer step

    def finish_gradients(self) -> None:
        """After the last backward of a mini-batch: the experts' gradients reduced as FSDP
        reduces the others' (learners/sharding/expert_shard.py). No-op without expert parallelism."""
        if self.expert_params and not self.experts_sharded:
            reduce_expert_grads(self.expert_params, self.groups.shard_size)

    def optimizer_step(self, grad_clip: float) -> tuple[float, bool]:
        """Clip, then step unless the gradient norm is not finite. Returns (norm, skipped)."""
        assert self.optimizer is not None and self.scheduler is not None
        if self.host_optimizer is not None:
            return host_step(self.host_optimizer, self.trainable_parameters, grad_clip,
                             comm_device=self.comm_device())  # fmt: skip
        grad_norm = clip_grad_norm(
            self.trainable_parameters,
            grad_clip,
            group=self.groups.role if self.groups.mesh is not None else self.groups.shard,
            comm_device=self.comm_device(),
        )
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
            self.refresh_fp8_scales()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, skipped

    def scheduler_step(self) -> None:
        """Advance the LR schedule by one optimizer step (also a skipped one, so the schedule
        still ends with the run)."""
        with warnings.catch_warnings():
            # Torch warns when no optimizer.step() ran since the last call: expected after a
            # skipped (non-finite) step.
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()

    @property
    def _optimizer_device(self) -> torch.device:
        return torch.device("cpu") if self.param_offload else self.device

    # ------------------------------------------------------------------ offload

    def offload(self) -> None:
        """Move parameters, gradients and optimizer state to the CPU (colocated rollout then
        gets the GPU memory). No-op on CPU or when already offloaded."""
        if self.device.type == "cpu" or self.offloaded:
            return
        if not self.param_offload:
            self.module.to("cpu")
        if self.optimizer is not None:
            move_optimizer_state(self.optimizer, torch.device("cpu"))
        self.offloaded = True
        torch.cuda.empty_cache()

    def reload(self) -> None:
        """Undo :meth:`offload` (optimizer state stays on CPU with ``optimizer_offload``)."""
        if not self.offloaded:
            return
        if not self.param_offload:
            self.module.to(self.device)
        if self.optimizer is not None and not self.optimizer_offload:
            move_optimizer_state(self.optimizer, self._optimizer_device)
        self.offloaded = False

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """Parameters on the device for the block; offloaded again after if they were."""
        was_offloaded = self.offloaded
        self.reload()
        try:
            yield
        finally:
            if was_offloaded:
                self.offload()

    # ------------------------------------------------------------------ checkpoints

    def save(
        self,
        directory: str | os.PathLike,
        extra: dict,
        *,
        trainable_only: bool,
        background: bool = False,
    ) -> None:
        """Sharded model + optimizer and this rank's ``extra_rank{r}.pt``
        (learners/sharded_checkpoint.py); background: written on a thread,
        :meth:`save_finished` says when it is on disk."""
        save_checkpoint(
            self, directory, extra, trainable_only=trainable_only, background=background
        )

    def save_finished(self) -> bool:
        """Whether a background save is on disk (True when none is pending); raises its error."""
        return self.state_writer.finished()

    def load(self, directory: str | os.PathLike, *, trainable_only: bool) -> dict:
        """Inverse of :meth:`save` (same world size); returns the ``extra`` dict."""
        extra = load_checkpoint(self, directory, trainable_only=trainable_only)
        self.refresh_fp8_scales()  # of the loaded weights
        return extra

    def refresh_fp8_scales(self) -> None:
        """The float8 scales of the weights FSDP2 all-gathers in float8 (tensorwise FP8
        training), after the weights changed (fp8_training.precompute_weight_scales)."""
        if self.fp8_scales_after_step:
            with self.on_device():
                precompute_weight_scales(self.module, self.compute_dtype)

    # ------------------------------------------------------------------ full weights

    def iter_full_tensors(self, module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full tensor on the device)`` for each entry of ``module.state_dict()``, on
        every rank, in the same order (each DTensor is all-gathered in turn, so at most one
        full tensor is alive at a time). Unsharded tensors are yielded as they are (no copy)."""
        masters = masters_by_name(self.host_optimizer, module)
        with self.on_device():
            for name, tensor in module.state_dict().items():
                if name in masters:
                    yield name, masters[name]  # optimizer_offload: the host fp32 master
                elif hasattr(tensor, "full_tensor"):
                    # CPU-offloaded shards are gathered on the device (NCCL needs CUDA tensors).
                    yield name, plain_tensor(tensor.to(self.device).full_tensor())
                else:
                    yield name, plain_tensor(tensor)

    def master_dtype(self) -> torch.dtype:
        """dtype of the (sharded) parameters the optimizer updates (the host masters' with
        optimizer_offload)."""
        if self.host_optimizer is not None:
            return self.host_optimizer.masters[0].dtype
        return next(self.module.parameters()).dtype

    def gather_dtype(self) -> torch.dtype:
        """dtype of the tensors iter_unit_gathered yields (FSDP2 all-gathers in param_dtype)."""
        return self.compute_dtype or self.master_dtype()

    def iter_unit_gathered(self, module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full parameter)`` of ``module`` (a submodule of the sharded one, e.g. the
        causal LM), one FSDP2 unit at a time: one all-gather per decoder layer and one for
        the root's own parameters (``FSDPModule.unshard``), in ``gather_dtype()``, instead of
        one collective per tensor (measured: 0.205 s for qwen2.5-0.5b's ~290 tensors on 2
        H200s, nearly all per-call overhead). Parameters only (no buffers), named like
        ``state_dict`` (a tied head under both names).
        A yielded tensor is valid until the generator advances past its unit; every rank
        must iterate to the end."""
        from torch.distributed.fsdp import FSDPModule

        if not self.fsdp:
            raise ValueError("iter_unit_gathered needs an FSDP2-sharded module")
        names = {id(m): name for name, m in module.named_modules()}
        units = [m for m in module.modules() if isinstance(m, FSDPModule) and m is not module]
        prefixes = tuple(names[id(unit)] + "." for unit in units)
        with self.on_device():
            for unit, prefix in zip(units, prefixes):
                unit.unshard()
                for name, param in unit.named_parameters(remove_duplicate=False):
                    # a weight all-gathered in float8 (fp8 tensorwise) arrives dequantized: the
                    # weights the FP8 forward computed with
                    yield (
                        prefix + name,
                        plain_tensor(_whole(param.detach())).to(self.gather_dtype()),
                    )
                self._release_gathered(unit)
            root = self.module  # its own parameters: embeddings, final norm, untied head
            root.unshard()
            for name, param in module.named_parameters(remove_duplicate=False):
                if not name.startswith(prefixes):  # a tied head under both names, like state_dict
                    yield name, plain_tensor(_whole(param.detach()))
            self._release_gathered(root)

    def _release_gathered(self, unit) -> None:
        # The consumer's copies out of the gathered buffer are queued on this stream; let them
        # finish before FSDP frees (and another all-gather reuses) the buffer.
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        unit.reshard()

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Unsharded CPU copies of ``module``'s tensors on rank 0 (empty dict elsewhere); every
        rank must call it."""
        out: dict[str, torch.Tensor] = {}
        for name, full in self.iter_full_tensors(module):
            if self.groups.role_rank == 0:
                out[name] = full.detach().to("cpu", copy=True)
        return out

    def _barrier(self) -> None:
        role_barrier(self.groups)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A gathered FSDP2 unit holds tensor-parallel parameters as DTensors split over the TP
    group: all-gather those too (a plain tensor is returned as it is)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _dist_on() -> bool:
    return distributed_on()
