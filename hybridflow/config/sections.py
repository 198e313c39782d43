"""The config sections: one dataclass per section, a docstring under every field.

This module holds ``data``, ``model``, ``algorithm``, ``trainer`` and ``sft``, the
:class:`Config` that gathers every section and the :class:`Derived` sizes; the larger sections
live beside it and are imported from here: ``actor``, ``ref`` and ``critic`` in
actor_sections.py, ``rollout`` in rollout_section.py, ``reward`` in reward_section.py.

Batch sizes follow the semantics verl users know: ``data.train_batch_size`` counts prompts,
each prompt yields ``rollout.n`` samples; ``actor.ppo_mini_batch_size`` counts prompts per
optimizer step; per-GPU sizes are *derived* by ``validate`` and never set by hand.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybridflow.config.actor_sections import ActorConfig, CriticConfig, RefConfig
from hybridflow.config.reward_section import (  # noqa: F401 (this module's names too)
    JudgeOptions,
    RewardConfig,
    RewardModelOptions,
)
from hybridflow.config.rollout_section import RolloutConfig
from hybridflow.errors import UserError
from hybridflow.trainer.observe.profile_options import ProfileOptions

if TYPE_CHECKING:
    from hybridflow.parallel.layout import RoleLayouts

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


MAX_BUILTIN_PROMPTS = 1_000_000
"""The most prompts a ``builtin:`` task generates (data.builtin_*_size, sft.builtin_size,
sft.eval_size): they are made in memory up front, so 10**30 of them grew without bound."""


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
    """What to do with prompts longer than ``max_prompt_length``: filter | error | truncate.
    A prompt with more characters than that many tokens can stand for (data/char_limits.py)
    is handled so as its row is read, before it is tokenized: memory stays bounded."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch (deterministic given ``trainer.seed``)."""
    builtin_train_size: int = 4000
    """Number of prompts generated for a ``builtin:`` training task."""
    builtin_val_size: int = 200
    """Number of prompts generated for a ``builtin:`` validation task."""
    prompt_key: str = "prompt"
    """Column holding the chat messages (a list of ``{role, content}``) or a plain string."""
    image_key: str | None = None
    """Column holding each row's images (verl's schema: a list of encoded bytes, paths, or
    ``{bytes, path}`` dicts, one ``<image>`` in the prompt where each goes). null: verl's
    ``images`` for a vision-language model (Qwen2.5-VL), none for a text-only model, which
    refuses the key."""


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
    fused_logprob_head: bool = True
    """Log-probs and entropy of the actor's and reference's passes through the fused head
    (models/heads/fused_head.py: lm_head matmul, log-softmax, target and entropy in tiles of tokens
    x vocabulary, no logits block wider than 8,192 entries); false: the token-chunked head
    (one [4096, vocabulary] logits block at a time). Both give the same values."""
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
    total_steps: int = 80
    """RL steps to run (unless ``total_epochs`` is set). The demo's 80: with a CPU's AVX-512
    and AVX2 kernels, 60 GRPO steps gained +20.8 and +17.5 points of val mean@4 and were still
    climbing, 80 gained +24.0 and +23.1 (docs/performance-host.md, Demo)."""
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
    (trainer/lifecycle/save_policy.py)."""
    test_freq: int = 10
    """Validate every k steps (0: only before and after training)."""
    val_before_train: bool = True
    """Validate once before the first step."""
    resume: str = "auto"
    """auto (continue the latest checkpoint in run_dir) | disable | path to a checkpoint."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """console | jsonl | tensorboard | wandb."""
    rollout_data_dir: str | None = None
    """Write each step's samples to ``<dir>/<step>.jsonl`` (verl's format: one line a sample
    with its input, output, gts and score text and the step; trainer/observe/rollout_dump.py).
    None: nothing is written."""
    progress_interval_s: float = 10.0
    """Output that is not a terminal (log files, CI): after this many seconds without output,
    a line says what the run is doing (a terminal shows progress bars instead)."""
    profile: ProfileOptions = field(default_factory=ProfileOptions)
    """Profile chosen steps: trainer.profile.steps=[2] trainer.profile.tool=torch|nvtx (every
    field documented in hybridflow/trainer/observe/profile_options.py; docs/observability.md)."""
    project_name: str = "hybridflow"
    """Project name for W&B / TensorBoard."""
    experiment_name: str = "demo"
    """Run name for W&B / TensorBoard."""
    call_timeout_s: float = 3600.0
    """Timeout of each remote call on a worker group (and of each wait of the async mode)."""
    mode: str = "sync"
    """sync: each step generates its rollouts, then trains. async: the next steps' rollouts
    are generated while this one trains (trainer/loop/async_rollout.py; docs/async.md)."""
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
    loads (trainer/plan/memory_check.py); None: the first visible GPU's, and no check on a machine
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
    total_steps: int = 2000
    """Optimizer steps of supervised fine-tuning; for the ``sft:<task>`` warm start, the cap on
    steps when ``sft.stop_at_accuracy`` is set (reached only where the target is not: the
    demo's SFT stopped after 350-400 steps on every float path measured)."""
    stop_at_accuracy: float | None = 0.5
    """``sft:<task>`` warm start only: stop SFT as soon as the greedy accuracy on
    ``sft.eval_size`` problems of the built-in task (outside its validation split), checked
    every ``sft.eval_every`` steps, reaches this fraction; None: always ``sft.total_steps``.
    Why: the tiny model learns addition abruptly at a step that moves with the seed and with
    the host's float math (after 400 fixed steps, 70% greedy at trainer.seed=1 but ~15% at
    seed 2), so a step count leaves RL with either little to gain or little to start from.
    Stopping partly right leaves RL room (docs/troubleshooting.md, The demo learns)."""
    eval_every: int = 25
    """Steps between the greedy-accuracy checks of ``sft.stop_at_accuracy``."""
    eval_size: int = 128
    """Built-in task problems in the greedy-accuracy check of ``sft.stop_at_accuracy``."""
    batch_size: int = 64
    """Examples per optimizer step."""
    lr: float = 3e-3
    """Peak AdamW learning rate (a linear warm-up, then a cosine decay to a floor)."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    lr_decay_steps: int | None = 800
    """Step at which the cosine decay reaches its floor, ``sft.min_lr_ratio`` × ``sft.lr``,
    held after it; None: at ``sft.total_steps``. Why not the cap: the warm start stops at a
    step no one knows ahead, and a decay over the cap left a late learner (one host's rounding
    was enough) at a tenth of the rate, where it never reached the target."""
    min_lr_ratio: float = 0.3
    """Floor of the cosine decay as a fraction of ``sft.lr``."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay. Measured on the demo's warm start: the target reached
    after 350-500 steps over four seeds with it, 400-775 without."""
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
