"""The rollout worker's side of a tensor-parallel engine (rollout.tensor_parallel_size > 1),
or of experts spread over several replicas (rollout.expert_parallel_size above it:
engine/expert_spread.py; each rank holds E / ep experts, and a replica of one rank is a
"group" of one for the prompts below).

The ranks of a tensor-parallel group run one engine together (engine/tensor_parallel.py):

- **Prompts**: the controller splits a generate batch over every rank as usual; the members
  of a group exchange their chunks (token ids, a few KB), generate all of them together on
  the shared engine and each returns the rows of its own chunk. The controller and its
  dispatch stay unaware of the layout, and a sample's tokens follow its sample_index, so they
  are the tokens any other layout draws.
- **Weights**: with a colocated actor, each sync is the 3D-HybridEngine reshard
  (engine/reshard.py) from the actor's training shards (FSDP2, and tensor parallel when the
  actor is) straight into this rank's engine shard, over a process group of its own; the
  plan is made once. With split placement the controller's whole tensors are sliced.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridflow.protocol import Batch


def training_sources(model, names) -> tuple[dict, dict]:
    """(HF name -> the trainer's parameter, HF name -> its LoRA adapter) for the engine's
    parameter ``names``: a LoRA layer's base weight sits under ``base_layer`` (peft,
    learners/lora.py) and is merged with its adapter as it moves; a mixture of experts'
    packed expert tensor is merged with its per-expert factors (models/moe.ExpertLoRA:
    ``...experts.lora.gate_up_A`` [E, r, in] and ``_B`` [E, out, r])."""
    from hybridflow.engine.reshard import Adapter
    from hybridflow.learners.lora import ADAPTER, lora_scalings

    params = dict(model.named_parameters())
    scalings = lora_scalings(model)
    sources, adapters = {}, {}
    for name in names:
        module, _, leaf = name.rpartition(".")
        if f"{module}.lora" in scalings and leaf.endswith("_proj"):  # packed experts
            sources[name] = params[name]
            factor = f"{module}.lora.{leaf.removesuffix('_proj')}"
            adapters[name] = Adapter(params[f"{factor}_A"], params[f"{factor}_B"],
                                     scalings[f"{module}.lora"])  # fmt: skip
            continue
        if module not in scalings:
            sources[name] = params[name]
            continue
        sources[name] = params[f"{module}.base_layer.{leaf}"]
        if leaf == "weight":
            adapters[name] = Adapter(params[f"{module}.lora_A.{ADAPTER}.weight"],
                                     params[f"{module}.lora_B.{ADAPTER}.weight"],
                                     scalings[module])  # fmt: skip
    return sources, adapters


def _fallback_refusal(size: int, path: str, why: str) -> str:
    return (f"rollout.tensor_parallel_size={size}: the model at {path} runs on the "
            f"transformers fallback ({why}), which the tensor-parallel engine does not split: "
            "set rollout.tensor_parallel_size=1")  # fmt: skip


def _check_native(model, size: int, path: str) -> None:
    from hybridflow.models.llama import CausalLM

    if not isinstance(model, CausalLM):
        raise ValueError(_fallback_refusal(size, path, "not our decoder"))


class TensorParallelRollout:
    """The group, the engine's model shard and the reshard of one rank.

    Args:
        architecture: the policy's ModelArchitecture (our decoder's).
        tensor_parallel_size: rollout.tensor_parallel_size (divides the world).
        actor: the colocated actor role (None: split placement, weights from the
            controller), whose ``model`` holds the training parameters.
        split_experts: a mixture of experts' experts are split over the group (each rank
            receives only its own), else every rank holds all of them
            (rollout.expert_parallel_size=1).
        expert_parallel_size: above tensor_parallel_size, the experts are spread over that
            many ranks, several replicas (engine/expert_spread.py).
    """

    def __init__(self, architecture, tensor_parallel_size: int, dtype: torch.dtype,
                 device: str, actor=None, split_experts: bool = True,
                 expert_parallel_size: int | None = None, own_group: bool = False):  # fmt: skip
        from hybridflow.engine.expert_spread import expert_parallel_model
        from hybridflow.engine.tensor_parallel import tensor_parallel_model
        from hybridflow.parallel.layout import build_mesh, rollout_layout

        world = dist.get_world_size()
        ep = expert_parallel_size or 1
        self.spread = architecture.is_moe and ep > tensor_parallel_size
        self.layout = rollout_layout(world, tp=tensor_parallel_size, ep=ep if self.spread else 1)
        mesh = build_mesh(self.layout, "cuda" if str(device).startswith("cuda") else "cpu")
        self.group = mesh.group("tp")
        if own_group:  # a rollout service decodes while the actor's collectives run
            self.group = _subgroup(self.layout, None)
        self.size, self.rank_in_group = tensor_parallel_size, mesh.rank_in("tp")
        self.architecture = architecture
        self.split_experts = split_experts and architecture.is_moe
        if self.spread:
            self.ep, self.ep_rank = ep, mesh.rank_in("ep")
            replica = self.group if tensor_parallel_size > 1 else None
            experts = _subgroup(self.layout, None, "ep") if own_group else mesh.group("ep")
            self.model = expert_parallel_model(architecture, experts, replica, dtype, device)
        else:
            self.model = tensor_parallel_model(architecture, self.group, dtype, device,
                                               self.split_experts)  # fmt: skip
        self.resharder = None
        if actor is not None:
            # a group of its own: a sync never queues behind (or between) the actor's
            # collectives
            self.reshard_group = dist.new_group(list(range(dist.get_world_size())))
            frozen = set(frozen_encoder(actor.model))
            moving = [name for name, _ in self.model.named_parameters() if name not in frozen]
            self.resharder = self._resharder(actor, moving)

    @classmethod
    def from_actor(cls, actor, size: int, dtype: torch.dtype, device: str, path: str,
                   split_experts: bool = True, expert_parallel_size: int | None = None,
                   own_group: bool = False):  # fmt: skip
        """Its shard of the colocated actor's model, resharded from the actor's shards.
        own_group: the engine talks over a group of its own (the mesh's may be the default
        group, which the actor's collectives use from another thread)."""
        _check_native(actor.model, size, path)
        tensor = cls(actor.model.config, size, dtype, device, actor, split_experts,
                     expert_parallel_size, own_group)  # fmt: skip
        tensor.sync(actor)
        tensor.copy_frozen_encoder(actor)
        tensor.copy_buffers(actor.model.named_buffers())
        return tensor

    @classmethod
    def from_checkpoint(cls, path: str, size: int, dtype: torch.dtype, device: str,
                        split_experts: bool = True, expert_parallel_size: int | None = None,
                        own_group: bool = False):  # fmt: skip
        """Its shard of the model at ``path`` (split placement): a checkpoint directory is
        read one tensor at a time, each sliced, so no whole model is ever on the host; a
        preset is built whole once (its random weights are made whole)."""
        from hybridflow.models import PRESETS
        from hybridflow.workers.model_loading import load_causal_lm

        if path in PRESETS:
            whole = load_causal_lm(path, dtype, "cpu")
            _check_native(whole, size, path)
            tensor = cls(whole.config, size, dtype, device, split_experts=split_experts,
                         expert_parallel_size=expert_parallel_size, own_group=own_group)  # fmt: skip
            tensor.copy_in(whole.state_dict().items())
            return tensor
        from hybridflow.models import native_support_problem
        from hybridflow.models.architecture import ModelArchitecture
        from hybridflow.models.checkpoint_io.hf_checkpoint import (
            iter_checkpoint_tensors,
            read_hf_config,
        )
        from hybridflow.models.families import read_tensor

        config = read_hf_config(path)
        problem = native_support_problem(config)
        if problem is not None:
            raise ValueError(_fallback_refusal(size, path, problem))
        architecture = ModelArchitecture.from_hf(config)
        tensor = cls(architecture, size, dtype, device, split_experts=split_experts,
                     expert_parallel_size=expert_parallel_size, own_group=own_group)  # fmt: skip
        # under our names, as the one-process loader reads them (a multimodal checkpoint's
        # prefix dropped, Qwen3-Next's fused DeltaNet projections split: models/families)
        named = (pair for name, stored in iter_checkpoint_tensors(path, dtype)
                 for pair in read_tensor(architecture, name, stored))  # fmt: skip
        tensor.copy_in(named, path)
        return tensor

    @torch.no_grad()
    def copy_in(self, named_tensors, path: str | None = None) -> None:
        """Each whole tensor's slice into the engine shard (a tied lm_head is the embedding;
        unused extras, like old checkpoints' rotary buffers, are skipped). A checkpoint's
        per-expert tensors (models/checkpoint_io/expert_checkpoint.py) are read for this rank's experts
        only; the others are dropped as they are read."""
        from hybridflow.models.checkpoint_io.expert_checkpoint import (
            memory_name,
            place_expert_slice,
        )

        params = {**self.persistent_buffers(), **dict(self.model.named_parameters())}
        filled, slices = set(), set()
        first, count = self._expert_range()
        for name, tensor in named_tensors:
            packed, expert, part = memory_name(name)
            if expert is None:
                packed, piece = self.local_slice(packed, tensor)
                if packed in params:
                    params[packed].copy_(piece)
                    filled.add(packed)
            elif packed in params and first <= expert < first + count:
                place_expert_slice(params[packed], expert - first, part, tensor)
                slices.add((packed, expert, part))
        for packed in {name for name, _, _ in slices}:  # every part of every expert held
            parts = ("down",) if packed.endswith("down_proj") else ("gate", "up")
            if all((packed, e, p) in slices for e in range(first, first + count) for p in parts):
                filled.add(packed)
        missing = sorted(set(params) - filled)
        if missing:
            raise ValueError(f"checkpoint {path!r} lacks {len(missing)} tensors, e.g. "
                             f"{missing[:5]}")  # fmt: skip

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """The engine model's buffers a checkpoint holds (DeepSeek's router correction bias):
        the model was allocated empty, and the reshard moves parameters only."""
        saved = set(self.model.state_dict())
        return {name: buf for name, buf in self.model.named_buffers() if name in saved}

    @torch.no_grad()
    def copy_buffers(self, named_tensors) -> None:
        """The trainer's buffers (whole on every rank) into the engine's persistent ones."""
        buffers = self.persistent_buffers()
        for name, tensor in named_tensors:
            if name in buffers:
                buffers[name].copy_(self.local_slice(name, tensor)[1])

    def _expert_range(self) -> tuple[int, int]:
        """(first expert, experts) this rank holds of each sparse layer."""
        experts = self.architecture.num_experts
        if self.spread:
            share = experts // self.ep
            return self.ep_rank * share, share
        if not self.split_experts:
            return 0, experts
        share = experts // self.size
        return self.rank_in_group * share, share

    def _resharder(self, actor, names: list[str]):
        """The Resharder of the engine's parameters ``names`` from the actor's (collective)."""
        from hybridflow.engine.reshard import Resharder
        from hybridflow.parallel.blocks import deltanet_sections
        from hybridflow.parallel.reshard_plan import rollout_blocks

        rank = dist.get_rank()
        params = dict(self.model.named_parameters())
        targets = {name: params[name] for name in names}
        sources, _ = training_sources(actor.model, targets)
        # the full shapes, read off the trainer's parameters (a DTensor's shape is the whole
        # tensor's), so every layer kind the model has is covered (MLA's projections too)
        shapes = {name: tuple(source.shape) for name, source in sources.items()}
        sections = deltanet_sections(self.architecture)
        blocks = {name: rollout_blocks(name, shapes[name], self.layout, self.split_experts,
                                       sections)[rank] for name in targets}  # fmt: skip
        return Resharder(sources, targets, blocks, self.reshard_group)

    def sync(self, actor):
        """The actor's current weights (LoRA merged) into the engine shard ->
        engine/reshard.ReshardStats. A frozen vision encoder is not among them
        (copy_frozen_encoder)."""
        names = {entry.name for entry in self.resharder.parameters}
        return self.resharder.run(*training_sources(actor.model, names))

    def copy_frozen_encoder(self, actor) -> None:
        """A frozen vision encoder (actor.freeze_vision_tower; LoRA leaves it out of its
        adapters too) never changes: copied once, whole to every rank (its parameters have no
        split: parallel/blocks.shard_dim), and left out of every sync, as the memory plan
        prices a sync (parallel/reshard_plan.parameter_shapes)."""
        names = frozen_encoder(actor.model)
        if names:
            self._resharder(actor, names).run(*training_sources(actor.model, names))

    def service_group(self):
        """A gloo group of this rank's tensor-parallel group for its LockstepService's thread
        alone (engine/serving/lockstep.py): its rounds never interleave with the decode's
        all-reduces or the calls' collectives. Every rank calls this (the groups are made
        collectively)."""
        return _subgroup(self.layout, "gloo")

    def lockstep_services(self, engine):
        """-> a maker of LockstepServices of ``engine`` for this rollout's layout
        (engine/serving/lockstep.py): its tensor-parallel group's ranks in lockstep, and with
        experts over several replicas the expert group's rounds (spread_rounds.py). Its
        groups are made now, once (every rank calls this: they are made collectively)."""
        from functools import partial

        from hybridflow.engine.serving.lockstep import LockstepService
        from hybridflow.engine.serving.spread_rounds import spread_rounds

        group = self.service_group() if self.size > 1 else None
        rounds = None
        if self.spread:  # the beats' gloo group of this rank's expert group
            rounds = spread_rounds(engine, _subgroup(self.layout, "gloo", "ep"))
        return partial(LockstepService, engine, group, rounds=rounds)

    def local_slice(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """(name, this rank's slice) of a whole in-memory tensor (split placement's weights;
        packed experts: this rank's experts)."""
        from hybridflow.engine.expert_spread import spread_shard
        from hybridflow.engine.tensor_parallel import local_shard
        from hybridflow.parallel.blocks import deltanet_sections

        sections = deltanet_sections(self.architecture)
        if self.spread:
            return name, spread_shard(name, tensor, self.ep_rank, self.ep, self.rank_in_group,
                                      self.size, sections)  # fmt: skip
        return name, local_shard(name, tensor, self.rank_in_group, self.size,
                                 self.split_experts, sections)  # fmt: skip

    def local_slices(self, named_tensors):
        """(name, this rank's slice) of whole in-memory tensors."""
        for name, tensor in named_tensors:
            yield self.local_slice(name, tensor)

    def gather_rows(self, batch: Batch) -> tuple[Batch, int, int]:
        """The group's chunks of a generate batch, in rank order (every member gets the
        same rows and meta) -> (rows, this rank's chunk index, chunk rows). A missing seed
        is drawn once, by the first member, so the members sample alike. A row's images
        (pixels, grids, mRoPE rows: data/image_batch.py) travel with it, so every member
        encodes the same features for it."""
        from hybridflow.data.image_batch import IMAGE_GRID_THW, MROPE_POSITIONS, PIXEL_VALUES

        tensors = {key: batch.tensors[key] for key in ("prompts", "attention_mask",
                                                       "sample_index", MROPE_POSITIONS)
                   if key in batch.tensors}  # fmt: skip
        arrays = {key: batch.arrays[key] for key in (PIXEL_VALUES, IMAGE_GRID_THW)
                  if key in batch.arrays}  # fmt: skip
        meta = dict(batch.meta)
        if meta.get("seed") is None:
            meta["seed"] = int(torch.randint(0, 2**62, (1,)).item())
        chunks: list = [None] * self.size
        dist.all_gather_object(chunks, (tensors, arrays, meta, len(batch)), group=self.group)
        sizes = {rows for *_, rows in chunks}
        if len(sizes) != 1:
            raise RuntimeError(f"tensor-parallel members got chunks of {sorted(sizes)} rows: "
                               "the controller must split a generate batch evenly")  # fmt: skip
        merged = Batch.concat([Batch(dict(t), dict(a)) for t, a, _, _ in chunks])
        merged.meta = dict(chunks[0][2])
        return merged, self.rank_in_group, len(batch)


def frozen_encoder(model) -> list[str]:
    """The names of a vision-language model's vision encoder parameters when the trainer does
    not train them (none when it does, or the model has no encoder)."""
    from hybridflow.parallel.blocks import VISION_PREFIX

    visual = getattr(model, "visual", None)
    if visual is None or any(p.requires_grad for p in visual.parameters()):
        return []
    return [VISION_PREFIX + name for name, _ in visual.named_parameters()]


def _subgroup(layout, backend: str | None, name: str = "tp"):
    """A new process group of this rank's ``name`` group of the layout (every rank calls
    this)."""
    from hybridflow.parallel.layout import group_ranks

    mine, _ = dist.new_subgroups_by_enumeration(group_ranks(layout, name), backend=backend)
    return mine
