"""The ``rollout`` section: sampling, the generation engine's memory and layout, and the
agent loop."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.agents.options import AgentOptions
from hybridflow.engine.options import EngineOptions


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
    cache, the rows one decode step may hold)."""
    gpu_memory_utilization: float = 0.4
    """Fraction of free GPU memory the KV cache may take while generating."""
    release_cache: bool = True
    """Free the KV cache after each generate so training gets the memory back."""
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
    set). Same as rollout.engine.weight_format."""
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
    experts' memory, no all-reduce after the sparse layers). Experts spread over several
    replicas (other values) are not built yet. verl's rollout.expert_parallel_size."""
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
