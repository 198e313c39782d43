"""The ``rollout`` section: sampling, the generation engine's memory and layout, and the
agent loop."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.agents.options import AgentOptions
from hybridflow.engine.options import EngineOptions

KV_SHARE_ALONE = 0.9
"""rollout.gpu_memory_utilization=auto when generation has the GPU to itself: the engine's
own default; the other 10% of the free memory is for what the KV budget does not count
(CUDA graph pools, cuBLAS workspaces, fragmentation)."""
KV_SHARE_BESIDE_UPDATE = 0.4
"""rollout.gpu_memory_utilization=auto when the cache outlives a generation or an update
runs beside it on the same GPU: most of the free memory stays the update's."""


def kv_memory_share(rollout, trainer) -> float:
    """rollout.gpu_memory_utilization resolved: a number as given; auto by whether the
    generation has the GPU to itself (rollout.release_cache frees the cache after each one,
    and trainer.mode=async with max_staleness > 0 or partial rollouts runs the update beside
    it, partial rollouts with their cache kept)."""
    if rollout.gpu_memory_utilization != "auto":
        return float(rollout.gpu_memory_utilization)
    overlapped = trainer.mode == "async" and (trainer.max_staleness > 0 or trainer.partial_rollout)
    alone = rollout.release_cache and not overlapped
    return KV_SHARE_ALONE if alone else KV_SHARE_BESIDE_UPDATE


@dataclass
class RolloutConfig:
    n: int = 8
    """Samples per prompt (group size for GRPO/RLOO)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's log-probs use the same temperature."""
    top_k: int = -1
    """Keep the k most likely tokens; -1: off."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0: off."""
    min_p: float = 0.0
    """Drop tokens with p < min_p · p_max; 0: off."""
    ignore_eos: bool = False
    """Keep generating past EOS up to max_response_length (benchmarks)."""
    max_num_seqs: int = 1024
    """Most sequences decoded at once per engine (the slot cache's slots; with the paged
    cache, the rows one decode step may hold): an upper bound, as in verl. A model with a
    per-sequence state (Qwen3.5's recurrent layers, GPT-OSS's window rings) gets at most the
    slots whose states and K/V blocks hold that many whole sequences of max_prompt_length +
    max_response_length, logged when it caps (rollout.engine.cap_state_slots=false keeps
    every slot; docs/engine.md, How many slots)."""
    gpu_memory_utilization: float | str = "auto"
    """Share of the GPU memory free when generation starts that the KV cache may take (less
    the engine's reserve for decode logits and prefill; vLLM's is a share of all the
    memory). auto: 0.9 when generation has the GPU to itself (the cache is freed after each
    generation, rollout.release_cache, and no update runs beside it: not trainer.mode=async
    with max_staleness > 0 or partial rollouts), else 0.4, the rest left to the update that
    shares the GPU (kv_memory_share)."""
    release_cache: bool = True
    """Free the KV cache after each generate so training gets the memory back."""
    release_weights: bool = False
    """Free the engine's own weight copy after a step's generation, so the actor's passes
    and update get its memory; the weight sync after the update allocates it again and
    rewrites every weight (nothing is saved to the host: vLLM's sleep level 2, the sleep
    verl's hybrid engine runs). The engine's buffers (rotary tables, DeepSeek's score
    correction) stay. Nothing to free where the engine reads the actor's own tensors (one
    GPU, no FSDP, the rollout's dtype). Needs trainer.mode=sync and colocated placement;
    `hybridflow config plan` turns it on where nothing fits without it
    (engine/weights/release.py)."""
    lora_in_place: bool = False
    """LoRA: decode the actor's own base weights with the adapters added unmerged
    (engine/adapters.py) instead of a merged copy refreshed at each sync: no second copy of
    the model (61 GiB for a 32B model in bf16), for the split decode layer and two small
    matmuls a projection. Needs model.dtype=bfloat16 on a GPU (the base in the rollout's
    dtype), one training GPU, colocated placement, and no generation over an update."""
    dtype: str = "model"
    """Rollout matmuls: model (the policy's dtype) | fp8 (W8A8 float8 e4m3, quantized from
    the trainer's weights at every sync: faster decode on sm_89+ GPUs; turns on truncated
    importance sampling against the engine's log-probs, actor.rollout_is_cap=2.0, unless
    set). A mixture of experts' routed SwiGLU experts (Qwen3-MoE, Mixtral, Qwen3.5-MoE,
    DeepSeek-V3) are weight-only e4m3 (engine/fp8/experts.py); Qwen3.5's, DeepSeek-V3's and
    GPT-OSS's layers run fp8 on the engine's eager passes (engine/fp8/linears.py; GPT-OSS's
    experts stay in the model's dtype), on one rank or a tensor-parallel rollout. Same as
    rollout.engine.weight_format. With actor.precision=fp8 the weights are
    quantized with actor.fp8_recipe (rollout.engine.fp8_weight_scales, docs/fp8-training.md);
    it does not follow actor.precision: set both."""
    val_temperature: float = 1.0
    """Validation sampling temperature; 0: greedy (then val_n is 1). At the training
    temperature, mean@n is the expected score of the policy RL optimizes."""
    val_n: int = 4
    """Samples per validation prompt (mean@n / best@n / maj@n)."""
    tensor_parallel_size: int = 1
    """Ranks of one engine replica: its heads, MLP columns and KV cache are split over them
    (one all-reduce per attention and per MLP). The rollout runs world / this replicas.
    verl's rollout.tensor_model_parallel_size."""
    expert_parallel_size: int | None = None
    """Mixture-of-experts models with rollout.tensor_parallel_size > 1: unset or equal to
    it, each replica's ranks split the experts (rank r holds experts [r·E/tp, (r+1)·E/tp),
    whole; one all-reduce per sparse layer); 1, every rank holds every expert (tp times the
    experts' memory, no all-reduce after the sparse layers). A multiple of it (dividing the
    rollout's GPUs): the experts spread over ep / tp replicas, E / ep a rank, attention
    data-parallel over the replicas and the tokens dispatched to their experts by
    all-to-all (engine/expert_spread.py; DeepSeek-V3's layout, also with tp = 1).
    verl's rollout.expert_parallel_size."""
    agent: AgentOptions = field(default_factory=AgentOptions)
    """Multi-turn episodes with tools (hybridflow/agents/options.py): rollout.agent.loop=tools
    rollout.agent.tools=[calculator,python] trains on the model's turns, tool results masked
    out of the loss. Rows need chat messages as prompts."""
    engine: EngineOptions = field(default_factory=EngineOptions)
    """How the generation engine runs: decode path, fused projections, matmul choice, PDL,
    CUDA graphs, steps per sync, ... (every field documented in hybridflow/engine/options.py;
    e.g. rollout.engine.decode_layer=split). Its timing choices are pinned under
    rollout.engine.cache_dir (default: trainer.cache_dir); rollout.engine.retune=true times
    them again."""
