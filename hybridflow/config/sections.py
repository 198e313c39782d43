"""The config sections: one dataclass per section, a docstring under every field.

Batch sizes follow the semantics verl users know: ``data.train_batch_size`` counts prompts,
each prompt yields ``rollout.n`` samples; ``actor.ppo_mini_batch_size`` counts prompts per
optimizer step; per-GPU sizes are *derived* by ``validate`` and never set by hand.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybridflow.agents.options import AgentOptions
from hybridflow.engine.options import EngineOptions
from hybridflow.errors import UserError
from hybridflow.trainer.profile_options import ProfileOptions

if TYPE_CHECKING:
    from hybridflow.parallel.roles import RoleLayouts

GROUP_ESTIMATORS = (
    "grpo",
    "grpo_passk",
    "rloo",
    "reinforce_plus_plus_baseline",
    "opo",
    "gpg",
)


class ConfigError(UserError, ValueError):
    """A configuration problem a user can act on. ``problems`` lists every one found."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} configuration problem(s):\n{lines}")


UNPLANNED_UPDATE_BUDGET = 16384
"""actor.max_tokens_per_gpu=auto where no GPU size is known to plan for (a CPU run)."""


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=lambda: ["builtin:arithmetic"])
    """Training prompt files (parquet or jsonl in verl's schema), or ``builtin:<task>`` for a
    generated synthetic task (``arithmetic``, ``countdown``)."""
    val_files: list[str] = field(default_factory=lambda: ["builtin:arithmetic"])
    """Validation prompt files; same forms as ``train_files``. Empty list: no validation."""
    train_batch_size: int = 64
    """Prompts per RL step. Each prompt produces ``rollout.n`` samples."""
    val_batch_size: int = 256
    """Prompts per validation generation call (a memory knob, not a statistic)."""
    max_prompt_length: int = 32
    """Longest prompt in tokens after the chat template; see ``overlong_prompts``."""
    max_response_length: int = 16
    """Most tokens generated per response (rollout max_new_tokens)."""
    overlong_prompts: str = "filter"
    """What to do with prompts longer than ``max_prompt_length``: filter | error | truncate."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch (deterministic given ``trainer.seed``)."""
    builtin_train_size: int = 4000
    """Number of prompts generated for a ``builtin:`` training task."""
    builtin_val_size: int = 200
    """Number of prompts generated for a ``builtin:`` validation task."""
    prompt_key: str = "prompt"
    """Column holding the chat messages (a list of ``{role, content}``) or a plain string."""


@dataclass
class ModelConfig:
    path: str = "sft:arithmetic"
    """Policy model: a local Hugging Face directory, a shape preset (``tiny``,
    ``qwen2.5-0.5b``, …; random weights), or ``sft:<task>``: a tiny model SFT-trained on a
    built-in task (trained once, then cached under ``trainer.cache_dir``)."""
    tokenizer_path: str | None = None
    """Tokenizer directory; default: the model's own, or the built-in char tokenizer."""
    dtype: str = "auto"
    """Parameter/compute dtype: auto (bf16 on GPU, fp32 on CPU) | bfloat16 | float32."""
    gradient_checkpointing: bool | str = "auto"
    """Recompute each decoder layer in the backward pass (less memory, ~30% more update
    compute): true | false | auto. auto: off unless the memory plan finds that the actor
    update without it would take more than 90% of the GPU's usable memory
    (trainer.gpu_memory_gib or the visible GPU); off on the CPU or when the plan cannot
    tell. The run's log says the decision and both planned peaks."""
    compile: bool | str = "auto"
    """torch.compile the decoder layers of the actor (and of the reference model's own copy)
    for the training-side passes: true | false | auto. auto: on when the trainer runs on
    CUDA, off on the CPU (a CPU compile takes minutes for little gain). The first step
    compiles; the artifacts are cached under trainer.cache_dir/torch-compile, so a later run
    of the same model reuses them. The run's log and config.yaml say the decision."""
    lora_rank: int = 0
    """LoRA rank; 0 trains all weights."""
    lora_alpha: int = 16
    """LoRA scaling numerator (scale = alpha / rank)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input."""
    lora_target_modules: list[str] = field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
    )
    """Linear layers that get LoRA adapters."""


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
    16,384 or more fit so (trainer/memory_choices.py says why); elsewhere 16,384 (at least
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
    expert_parallel_size: int = 1
    """Mixture-of-experts models: ranks that split the experts in the rollout, spanning
    whole tensor-parallel replicas (a multiple of rollout.tensor_parallel_size)."""
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


@dataclass
class RewardModelOptions:
    path: str | None = None
    """A ``*ForSequenceClassification`` checkpoint (a local HF directory with a
    ``score.weight`` head) that scores each conversation; None: no reward model. Llama,
    Mistral and Qwen2/3 run in hybridflow's decoder, other architectures in transformers'."""
    tokenizer_path: str | None = None
    """Its tokenizer and chat template; None: the checkpoint directory's. When they differ
    from the policy's, the conversation is rendered again from text (prompt messages + the
    response as the assistant turn); else the policy's token ids are scored as they are."""
    micro_batch_size_per_gpu: int = 16
    """Conversations per reward-model forward on one device (without a token budget)."""
    max_tokens_per_gpu: int | None = None
    """Token budget of one packed reward-model forward; None: micro_batch_size_per_gpu
    conversations at a time."""
    param_offload: bool = False
    """Keep the reward model's weights in host memory between uses (colocated: the GPU
    memory goes to the other roles meanwhile; the memory plan counts it either way)."""
    dtype: str = "auto"
    """bfloat16 | float32 | float16 | auto (bf16 on a GPU, fp32 on the CPU)."""


@dataclass
class JudgeOptions:
    template: str | None = None
    """A text file holding the judge's prompt; None: no judge. ``{response}`` (required),
    ``{prompt}`` and ``{ground_truth}`` are replaced by the sample's; other braces stay as
    written."""
    engine: str = "rollout"
    """Who answers: "rollout" (the policy's own rollout service, greedy, at most
    data.max_response_length tokens; the judge prompt at most data.max_prompt_length) or
    "url" (a second model behind an OpenAI-compatible server: ``hybridflow serve``, vLLM)."""
    url: str | None = None
    """engine=url: the server's base URL, e.g. http://127.0.0.1:8000/v1."""
    model: str = "judge"
    """engine=url: the model name sent with each request."""
    max_tokens: int = 256
    """engine=url: tokens of one judge reply."""
    score_pattern: str = r"(-?\d+(?:\.\d+)?)"
    """Regular expression read from the reply; its last match is the score (group 1 if it
    has a group, else the whole match), which must parse as a number. A reply without a
    match is a failed sample (scores 0, counted)."""
    timeout_s: float = 60.0
    """engine=url: one judge request's limit; a request past it is a timeout (counted)."""
    concurrency: int = 16
    """engine=url: judge requests in flight at once."""


@dataclass
class RewardConfig:
    manager: str = "naive"
    """naive (one call per sample) | batch (custom_fn gets lists) | dapo (adds overlong shaping)."""
    custom_fn: str | None = None
    """``path/to/file.py:function`` scoring (data_source, solution_str, ground_truth, extra_info)."""
    num_workers: int = 0
    """Parallel scoring processes; 0: score in the controller process."""
    timeout_s: float = 10.0
    """Per-sample scoring timeout; a timeout or exception scores 0 and is counted (the
    samples of a step are scored concurrently, so timeouts do not add up)."""
    max_failed_steps: int = 3
    """Consecutive training steps on which the reward fails on every sample before the run
    stops with the error (the messages are printed as they first happen)."""
    overlong_buffer_len: int = 0
    """DAPO overlong shaping buffer B in tokens; 0: off."""
    overlong_penalty_factor: float = 1.0
    """DAPO overlong penalty factor."""
    sandbox_isolation: str = "auto"
    """How the `code` reward isolates the programs it runs (the response against each
    test): "strict" (a jail per program; refuse to start where the machine cannot build
    one), "basic", "auto" (strict where possible); as rollout.agent.sandbox_isolation."""
    model: RewardModelOptions = field(default_factory=RewardModelOptions)
    """A reward model (sequence classifier) scoring each conversation: reward.model.path."""
    judge: JudgeOptions = field(default_factory=JudgeOptions)
    """A generative judge (an LLM reading a prompt template) scoring each response:
    reward.judge.template."""
    weights: dict[str, float] = field(default_factory=dict)
    """Weight of each reward part in the score: ``rule`` (the data source's scorer, or
    reward.custom_fn), ``model`` (reward.model), ``judge`` (reward.judge); e.g.
    ``{rule: 1.0, model: 0.5}``. Empty: the rule reward alone, or, when a model or a judge
    is on, those (weight 1) without the rule reward, as verl's reward model replaces it. A
    part of weight 0 everywhere is not computed."""
    source_weights: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per data source, weights that replace reward.weights for its samples, e.g.
    ``{gsm8k: {rule: 1.0}, chat: {model: 1.0}}``."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """gae | grpo | grpo_passk | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline |
    remax | opo | gpg (or a name you registered)."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE λ."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide GRPO advantages by the group std; false gives Dr. GRPO."""
    use_kl_in_reward: bool = False
    """Subtract β·KL(old‖ref) from the token rewards (PPO style); needs the reference."""
    kl_penalty: str = "kl"
    """KL estimator used in the reward: kl | abs | mse | low_var_kl."""
    kl_ctrl_type: str = "fixed"
    """fixed | adaptive KL coefficient controller."""
    kl_coef: float = 0.001
    """Initial β of the KL controller."""
    kl_target: float = 0.1
    """Adaptive controller's target KL."""
    kl_horizon: int = 10000
    """Adaptive controller's horizon."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose samples all score the same; generate more to refill."""
    max_gen_rounds: int = 3
    """Most generation rounds per step when dynamic_sampling refills the batch."""


@dataclass
class TrainerConfig:
    total_steps: int = 60
    """RL steps to run (unless ``total_epochs`` is set)."""
    total_epochs: int | None = None
    """Passes over the training prompts (verl's ``trainer.total_epochs``): when set, the run
    lasts ``total_epochs × (training prompts // data.train_batch_size)`` steps, counted after
    overlong prompts are filtered, and ``total_steps`` is replaced by that. None: use
    ``total_steps``."""
    run_dir: str = "runs/demo"
    """Where metrics.jsonl, checkpoints and exports go."""
    cache_dir: str = "~/.cache/hybridflow"
    """Cache for built-in SFT warm-start models, the rollout engine's pinned choices and the
    compiled artifacts of model.compile (torch-compile/)."""
    seed: int = 1
    """Seed for data order, sampling and initialisation."""
    device: str = "auto"
    """auto | cpu | cuda."""
    backend: str = "inprocess"
    """inprocess (one device, no extra processes) | local (one process per GPU) | ray."""
    nnodes: int = 1
    """Number of nodes (ray backend)."""
    n_gpus_per_node: int = 1
    """Devices per node used by the run (processes per node on CPU)."""
    placement: str = "colocate"
    """colocate: actor, rollout and ref share every device (hybrid engine) | split."""
    rollout_gpus: int = 0
    """With placement=split: devices given to the rollout engine; the rest train."""
    save_freq: int = 0
    """Checkpoint every k steps (0: only at the end; -1: never, e.g. for benchmarks)."""
    keep_last_k: int = 2
    """Checkpoints kept; older ones are deleted after a new one is complete."""
    async_save: bool | None = None
    """Write checkpoints in the background: the save step only copies the model and optimizer
    state to host memory (pinned on CUDA) and training goes on while threads write the files
    and then mark the checkpoint complete. Costs one host copy of each rank's training state,
    made at the first save and reused until the run ends. false: training waits for the
    files (docs/troubleshooting.md). null: on, unless that copy would take over a quarter of
    the host's memory or actor.optimizer_offload holds the state there already
    (trainer/save_policy.py)."""
    test_freq: int = 10
    """Validate every k steps (0: only before and after training)."""
    val_before_train: bool = True
    """Validate once before the first step."""
    resume: str = "auto"
    """auto (continue the latest checkpoint in run_dir) | disable | path to a checkpoint."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """console | jsonl | tensorboard | wandb."""
    progress_interval_s: float = 10.0
    """Output that is not a terminal (log files, CI): after this many seconds without output,
    a line says what the run is doing (a terminal shows progress bars instead)."""
    profile: ProfileOptions = field(default_factory=ProfileOptions)
    """Profile chosen steps: trainer.profile.steps=[2] trainer.profile.tool=torch|nvtx (every
    field documented in hybridflow/trainer/profile_options.py; docs/observability.md)."""
    project_name: str = "hybridflow"
    """Project name for W&B / TensorBoard."""
    experiment_name: str = "demo"
    """Run name for W&B / TensorBoard."""
    call_timeout_s: float = 3600.0
    """Timeout of each remote call on a worker group (and of each wait of the async mode)."""
    mode: str = "sync"
    """sync: each step generates its rollouts, then trains. async: the next steps' rollouts
    are generated while this one trains (trainer/async_rollout.py; docs/async.md)."""
    max_staleness: int = 1
    """async: policy versions a batch may lag the one it trains (0: exactly the sync run).
    With partial_rollout, a sample's lag is that of its oldest token."""
    partial_rollout: bool = False
    """async: requests in flight continue across a weight update (each token records the
    version that sampled it) instead of the rollout finishing a batch with the old weights
    before the update; faster, no longer bit-reproducible (docs/async.md)."""
    stale_policy: str = "wait"
    """async with partial_rollout: what keeps samples within max_staleness. wait: the
    rollout starts no work that could exceed it. drop: it starts one version earlier, and
    prompt groups that exceed it are discarded (async/dropped_groups) and replaced."""
    rendezvous_host: str = "127.0.0.1"
    """Address the ``local`` backend's torch.distributed store listens on. All its ranks
    are on this host, so the default keeps the store off the network."""
    gpu_memory_gib: float | None = None
    """Memory of one GPU (GiB) that the memory plan checks the run against before any model
    loads (trainer/memory_check.py); None: the first visible GPU's, and no check on a machine
    without one. Set it to plan a GPU run from a CPU-only machine, or to leave room for
    another process on the GPU."""
    cpu_threads: int | None = 1
    """torch intra-op threads of each process when running on the CPU. Tiny models run
    fastest on one (measured: 1.9 s vs 2.9 s per demo step with 2); None: torch's default.
    Ignored on GPU."""


@dataclass
class SFTConfig:
    train_files: list[str] = field(default_factory=lambda: ["builtin:arithmetic"])
    """``hybridflow sft`` data: prompt/response or chat-message rows (parquet/jsonl), or
    ``builtin:<task>`` for the SFT split of a synthetic task."""
    preset: str = "tiny-4l"
    """Shape preset of the model trained from scratch for ``model.path=sft:<task>``
    (``hybridflow sft`` fine-tunes ``model.path`` instead when it is not ``sft:``)."""
    total_steps: int = 1000
    """Optimizer steps of supervised fine-tuning (also the length of the cosine schedule); for
    the ``sft:<task>`` warm start, the cap on steps when ``sft.stop_at_accuracy`` is set."""
    stop_at_accuracy: float | None = 0.5
    """``sft:<task>`` warm start only: stop SFT as soon as the greedy accuracy on
    ``sft.eval_size`` problems of the built-in task (outside its validation split), checked
    every ``sft.eval_every`` steps, reaches this fraction; None: always ``sft.total_steps``.
    Why: the tiny model learns addition abruptly at a seed-dependent step (after 400 fixed
    steps, 70% greedy at trainer.seed=1 but ~15% at seed 2), so a step count leaves RL with
    either little to gain or little to start from. Stopping partly right leaves RL room:
    measured, the demo stops SFT at step 375 (seed 1) / 325 (seed 2), and 60 GRPO steps add
    +21.5 / +27.7 points of val mean@4."""
    eval_every: int = 25
    """Steps between the greedy-accuracy checks of ``sft.stop_at_accuracy``."""
    eval_size: int = 128
    """Built-in task problems in the greedy-accuracy check of ``sft.stop_at_accuracy``."""
    batch_size: int = 64
    """Examples per optimizer step."""
    lr: float = 3e-3
    """Peak AdamW learning rate (cosine decay after a linear warm-up)."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    max_length: int = 64
    """Longest example in tokens; longer examples are dropped (and counted)."""
    max_tokens_per_gpu: int | None = None
    """Token budget per packed micro-batch; None: the whole batch in one pass."""
    builtin_size: int = 20000
    """Examples generated for a ``builtin:`` SFT task."""
    carry_error_rate: float = 0.0
    """Built-in arithmetic SFT only: fraction of the answers that need a carry written with
    the carry forgotten (imperfect demonstrations that RL against the exact checker fixes)."""
    miscopy_rate: float = 0.3
    """Built-in calc SFT only: fraction of the tool-use traces whose calculator call miscopies
    one digit of the question (the rest of the trace follows from it), so the warm-started
    model is partly right and RL against the exact checker has something to fix."""
    out_dir: str | None = None
    """Where ``hybridflow sft`` writes checkpoints and the final HF model; default
    ``<trainer.run_dir>/sft``."""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)


@dataclass
class Derived:
    """Values computed by :func:`validate` from the global ones. Never set by hand."""

    world_size: int
    """Devices (or processes) in the run."""
    train_dp_size: int
    """Data-parallel ranks of the actor/critic/ref."""
    rollout_dp_size: int
    """Data-parallel rollout engines."""
    samples_per_step: int
    """data.train_batch_size × rollout.n."""
    mini_batches_per_step: int
    """Optimizer steps of the actor per RL step and epoch."""
    mini_batch_samples_per_gpu: int
    """Samples of one actor mini-batch on one rank."""
    micro_batches_per_mini_batch: int | None
    """Gradient-accumulation steps per mini-batch (None with a token budget)."""
    critic_mini_batch_samples_per_gpu: int
    """Samples of one critic mini-batch on one rank."""
    use_reference: bool
    """A reference policy is needed (KL loss or KL in reward)."""
    use_critic: bool
    """A critic is needed (GAE)."""
    max_sequence_length: int
    """max_prompt_length + max_response_length."""
    layouts: RoleLayouts | None = None
    """Each role's parallel layout (hybridflow/parallel/roles.py)."""


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}
