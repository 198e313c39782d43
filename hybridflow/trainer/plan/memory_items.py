"""The memory plan's vocabulary: the phases memory is held in, the options that decide the
allocations (:class:`PlanOptions`), one allocation (:class:`MemoryItem`) and the plan that
sums them (:class:`MemoryPlan`). The arithmetic: memory_plan.py and memory_rollout.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.models.architecture import ModelArchitecture

GIB = 2**30

GENERATE = "generation"
UPDATE = "actor update"
STEP = "optimizer step"
CRITIC = "critic update"
PHASES = (GENERATE, UPDATE, STEP, CRITIC)
"""When memory is held: generation; the actor's forward/backward over a micro-batch; its
optimizer step; the critic's forward/backward and step (GAE only)."""

ALWAYS = PHASES

HEADROOM_FRACTION = 0.05
HEADROOM_BYTES = 1 * GIB
"""Kept free by the fit check: the CUDA context (~0.5 GiB), cuBLAS and NCCL workspaces, and
the caching allocator's fragmentation, none of which max_memory_allocated counts."""

LORA_TARGET_SHAPES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class PlanOptions:
    """What decides the allocations; sizes are per GPU unless named otherwise."""

    master_bytes: int = 4
    """Bytes per element of the trained weights, their gradients and AdamW moments (fp32: 4)."""
    compute_bytes: int = 2
    """Bytes per element of the forward's weights and activations (bf16: 2)."""
    rollout_bytes: int = 2
    """Bytes per element of the rollout's weights and KV cache."""
    reference_bytes: int = 2
    """Bytes per element of the reference policy's weights."""
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = LORA_TARGET_SHAPES
    train_gpus: int = 1
    """Training GPUs of the actor: tensor parallelism splits each layer over ``tp`` of them,
    FSDP2 shards the rest over the others (``train_gpus // tp`` ranks; sharded when > 1)."""
    host_gpus: int | None = None
    """Training GPUs on one host (trainer.n_gpus_per_node, or train_gpus when fewer; None:
    every training GPU on one host): what a host holds of the offloaded state is its GPUs'
    shares, and the host column and check are one host's."""
    tp: int = 1
    """actor.tensor_parallel_size: each layer's heads, MLP columns and vocabulary split."""
    sp: int = 1
    """actor.sequence_parallel_size (Ulysses): each rank keeps its micro-batch budget."""
    ep: int = 1
    """actor.expert_parallel_size: each rank holds 1/ep of the experts (FSDP2 shards them)."""
    rollout_tp: int = 1
    """rollout.tensor_parallel_size: the engine's weights and KV heads split over tp ranks."""
    rollout_experts_whole: bool = False
    """rollout.expert_parallel_size=1 with rollout tp > 1: every rank holds every expert."""
    rollout_ep: int = 1
    """rollout.expert_parallel_size above rollout_tp: the experts spread over several
    replicas, E / rollout_ep a GPU (engine/expert_spread.py); else 1."""
    rollout_release_weights: bool = False
    """rollout.release_weights: the engine's own copy is freed after generation and comes
    back at the weight sync (workers/rollout.RolloutWorker.release_weights)."""
    param_offload: bool = False
    optimizer_offload: bool = False
    gradient_checkpointing: bool = False
    compiled_layers: bool = False
    """The decoder layers run under torch.compile (``model.compile``; auto: on CUDA), which
    keeps fewer activations (memory_activations.layer_activation_elements)."""
    micro_batch_tokens: int = 4096
    """Most tokens in one actor micro-batch (the token budget, or samples × max length)."""
    micro_batches: int = 1
    """Most micro-batches in one mini-batch on one GPU."""
    rollout_max_seqs: int = 1024
    rollout_max_seq_len: int = 2048
    kv_block_size: int | None = 64  # rollout.engine.kv_block_size: None is the slot cache
    cap_state_slots: bool = True
    """rollout.engine.cap_state_slots: a paged cache's per-sequence states get at most the
    slots whose states and blocks hold that many whole sequences (sizing.state_slots)."""
    gpu_memory_utilization: float = 0.4
    release_cache: bool = True
    fuse_projections: str = "all"
    """Fused decode weight copies: all | qkv | none (none off the triton decode path)."""
    rollout_fp8: bool = False  # rollout.dtype=fp8: e4m3 copies of the projections
    kv_cache_fp8: bool = False
    """rollout.engine.kv_cache_dtype=fp8: the paged cache's K/V in e4m3, 1 byte an element,
    with an fp32 scale a position and kv head (engine/cache/fp8_kv.py)."""
    max_prefill_tokens: int = 16384
    split: bool = False
    """Rollout on GPUs of its own (their items are planned separately)."""
    rollout_beside_update: bool = False  # async, staleness > 0 or partial: the engine's own weights
    lora_in_place: bool = False
    reference: str = "none"
    """none | own (a frozen copy) | actor (the LoRA actor with adapters off: no copy)."""
    reference_offload: bool = False
    critic: bool = False
    critic_micro_batch_tokens: int = 4096
    reward_model_parameters: int = 0
    """Elements of the reward model (reward.model.path); 0: none."""
    reward_model_bytes: int = 2
    """Bytes per element of the reward model's weights."""
    reward_model_offload: bool = False
    """reward.model.param_offload: its weights in host memory except while it scores."""
    gpu_bytes: int | None = None
    """Memory of one GPU; None: unknown (the KV cache is then planned at max_num_seqs)."""
    freeze_vision_tower: bool = True
    """actor.freeze_vision_tower: a vision-language model's encoder is not trained."""
    image_patches: int = 0
    """Most image patches in one actor micro-batch (vision-language models; 0: none)."""

    @property
    def gpus_per_host(self) -> int:
        """Training GPUs whose offloaded shares one host holds."""
        return min(self.host_gpus or self.train_gpus, self.train_gpus)

    @property
    def shard_ranks(self) -> int:
        """Ranks FSDP2 shards each tensor-parallel piece over."""
        return max(self.train_gpus // self.tp, 1)

    @property
    def sharded(self) -> bool:
        return self.shard_ranks > 1

    @property
    def layer_by_layer(self) -> bool:
        """FSDP2 gathers one layer at a time (ZeRO-3) instead of keeping the whole model
        gathered over a mini-batch: with ``param_offload`` (learners/core.TrainCore)."""
        return self.sharded and self.param_offload

    @property
    def mixed_precision(self) -> bool:
        return self.master_bytes > self.compute_bytes

    @property
    def host_step(self) -> bool:
        """``optimizer_offload`` on one GPU: masters and AdamW on the host (FSDP2 refuses it)."""
        return self.optimizer_offload and not self.sharded

    @property
    def trained_state_bytes(self) -> int:
        """Gradients and AdamW moments per trained element on the GPU: LoRA adapters are fp32."""
        return 4 if self.lora_rank > 0 else self.master_bytes

    @property
    def trained_weight_bytes(self) -> int:
        """Bytes per element of the trained weights on the GPU (and of their gradients)."""
        return self.compute_bytes if self.host_step else self.master_bytes


@dataclass(frozen=True)
class MemoryItem:
    name: str
    gpu_bytes: int
    """Per GPU, while one of ``phases`` runs."""
    phases: tuple[str, ...]
    host_bytes: int = 0
    """Host memory of one host (the controller's, with its GPUs' shares: PlanOptions.gpus_per_host),
    held for the whole run."""
    rollout_gpu: bool = False
    """On the rollout's own GPUs (split placement)."""
    note: str = ""


@dataclass
class MemoryPlan:
    model: str
    architecture: ModelArchitecture
    options: PlanOptions
    items: list[MemoryItem] = field(default_factory=list)
    kv_slots: int = 0
    """Sequences of max_seq_len the KV cache holds at once (its slots, or its blocks over the
    blocks of one sequence; the scratch slot or block excluded); 0: the engine refuses."""

    def phase_bytes(self, phase: str, rollout_gpu: bool = False) -> int:
        return sum(
            i.gpu_bytes for i in self.items if phase in i.phases and i.rollout_gpu == rollout_gpu
        )

    def peak(self, rollout_gpu: bool = False) -> tuple[str, int]:
        """(phase, bytes) of the largest per-GPU total on the training (or rollout) GPUs."""
        totals = [(self.phase_bytes(p, rollout_gpu), p) for p in PHASES]
        total, phase = max(totals)
        return phase, total

    def checked_peak(self, rollout_gpu: bool = False) -> tuple[str, int]:
        """(phase, bytes) the fit check compares with the GPU: generation without its KV
        cache, which the engine sizes from the memory then free (it fits whenever one
        sequence does); a cache kept through training (release_cache=false) counts in the others."""
        totals = []
        for phase in PHASES:
            total = self.phase_bytes(phase, rollout_gpu)
            if phase == GENERATE:
                total -= sum(i.gpu_bytes for i in self.items
                             if i.name.startswith("KV cache") and i.rollout_gpu == rollout_gpu)  # fmt: skip
            totals.append((total, phase))
        total, phase = max(totals)
        return phase, total

    def host_bytes(self) -> int:
        return sum(i.host_bytes for i in self.items)

    def largest(self, phase: str, count: int = 3, rollout_gpu: bool = False) -> list[MemoryItem]:
        held = [i for i in self.items if phase in i.phases and i.rollout_gpu == rollout_gpu]
        return sorted(held, key=lambda i: -i.gpu_bytes)[:count]


def dtype_name(element_bytes: int) -> str:
    return {4: "fp32", 2: "bf16"}.get(element_bytes, f"{element_bytes}-byte")
