"""Typed run configuration: one dataclass per section, YAML + dotted overrides, validate().

Precedence: dataclass defaults < YAML file (``--config run.yaml``) < dotted overrides
(``rollout.n=8 actor.lr=1e-6``). Values of overrides are parsed as YAML scalars/lists, so
``data.train_files=[a.parquet,b.parquet]`` and ``actor.lr=1e-6`` both work.

Batch sizes follow the semantics verl users know: ``data.train_batch_size`` counts prompts,
each prompt yields ``rollout.n`` samples; ``actor.ppo_mini_batch_size`` counts prompts per
optimizer step; per-GPU sizes are *derived* by :func:`validate` and never set by hand.

This module imports nothing heavy (no torch) so ``hybridflow config validate`` is instant.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GROUP_ESTIMATORS = (
    "grpo",
    "grpo_passk",
    "rloo",
    "reinforce_plus_plus_baseline",
    "opo",
    "gpg",
)


class ConfigError(ValueError):
    """A configuration problem a user can act on. ``problems`` lists every one found."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} configuration problem(s):\n{lines}")


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
    gradient_checkpointing: bool = False
    """Recompute each decoder layer in the backward pass (less memory, ~30% more compute)."""
    compile: bool = False
    """torch.compile the decoder layers for training."""
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
    max_tokens_per_gpu: int | None = None
    """Token budget per micro-batch (dynamic batching of packed sequences). None: off."""
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
    """Keep parameters on CPU between uses (FSDP CPU offload)."""
    optimizer_offload: bool = False
    """Keep optimizer state on CPU between updates."""


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
    """Most sequences decoded at once per engine (KV slots)."""
    gpu_memory_utilization: float = 0.4
    """Fraction of free GPU memory the KV cache may take while generating."""
    release_cache: bool = True
    """Free the KV cache after each generate so training gets the memory back."""
    val_temperature: float = 1.0
    """Validation sampling temperature; 0: greedy (then val_n is 1). At the training
    temperature, mean@n is the expected score of the policy RL optimizes."""
    val_n: int = 4
    """Samples per validation prompt (mean@n / best@n / maj@n)."""


@dataclass
class RefConfig:
    path: str | None = None
    """Reference policy weights; default: the initial policy (with LoRA: adapters disabled)."""
    micro_batch_size_per_gpu: int = 16
    """Samples per reference forward on one GPU."""
    max_tokens_per_gpu: int | None = None
    """Token budget per reference micro-batch; None: use micro_batch_size_per_gpu."""
    param_offload: bool = False
    """Keep the reference weights on CPU between uses."""


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


@dataclass
class RewardConfig:
    manager: str = "naive"
    """naive (one call per sample) | batch (custom_fn gets lists) | dapo (adds overlong shaping)."""
    custom_fn: str | None = None
    """``path/to/file.py:function`` scoring (data_source, solution_str, ground_truth, extra_info)."""
    num_workers: int = 0
    """Parallel scoring processes; 0: score in the controller process."""
    timeout_s: float = 10.0
    """Per-sample scoring timeout; a timeout or exception scores 0 and is counted."""
    overlong_buffer_len: int = 0
    """DAPO overlong shaping buffer B in tokens; 0: off."""
    overlong_penalty_factor: float = 1.0
    """DAPO overlong penalty factor."""


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
    """RL steps to run."""
    run_dir: str = "runs/demo"
    """Where metrics.jsonl, checkpoints and exports go."""
    cache_dir: str = "~/.cache/hybridflow"
    """Cache for built-in SFT warm-start models."""
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
    test_freq: int = 10
    """Validate every k steps (0: only before and after training)."""
    val_before_train: bool = True
    """Validate once before the first step."""
    resume: str = "auto"
    """auto (continue the latest checkpoint in run_dir) | disable | path to a checkpoint."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """console | jsonl | tensorboard | wandb."""
    project_name: str = "hybridflow"
    """Project name for W&B / TensorBoard."""
    experiment_name: str = "demo"
    """Run name for W&B / TensorBoard."""
    call_timeout_s: float = 3600.0
    """Timeout of each remote call on a worker group."""
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
    total_steps: int = 400
    """Optimizer steps of supervised fine-tuning (the demo's warm start stops while the model
    is still partly wrong, 70% greedy accuracy at trainer.seed=1, so RL has room to improve
    it; where the tiny model "gets" addition is seed-dependent: seed 2 is at ~15% here)."""
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


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


# ---------------------------------------------------------------- loading


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """Defaults < YAML file < dotted overrides. Raises ConfigError naming the bad keys."""
    cfg = Config()
    problems: list[str] = []
    if path is not None:
        problems += _apply_mapping(cfg, _read_yaml(path), source=str(path))
    for item in overrides:
        if "=" not in item:
            problems.append(
                f"override {item!r} is not of the form section.key=value (e.g. rollout.n=8)"
            )
            continue
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) != 2:
            problems.append(f"override key {key!r} must be section.key (e.g. actor.lr=1e-6)")
            continue
        problems += _apply_mapping(
            cfg, {parts[0]: {parts[1]: _parse_scalar(raw)}}, source="command line"
        )
    if problems:
        raise ConfigError(problems)
    return cfg


def _read_yaml(path: str | Path) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"config file {str(p)!r} does not exist"])
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError([f"config file {str(p)!r} is not valid YAML: {e}"]) from None
    if not isinstance(data, dict):
        raise ConfigError(
            [f"config file {str(p)!r} must hold a mapping of sections, got {type(data).__name__}"]
        )
    return data


def _parse_scalar(raw: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        return raw


def _suggest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(sorted(known))}"


def _apply_mapping(cfg: Config, data: dict, source: str) -> list[str]:
    problems = []
    for section, values in data.items():
        if section not in SECTIONS:
            problems.append(
                f"unknown section {section!r} ({source}){_suggest(str(section), list(SECTIONS))}"
            )
            continue
        if not isinstance(values, dict):
            problems.append(f"section {section!r} ({source}) must be a mapping, got {values!r}")
            continue
        sec = getattr(cfg, section)
        hints = typing.get_type_hints(type(sec))
        for key, value in values.items():
            if key not in hints:
                problems.append(
                    f"unknown key {section}.{key} ({source}){_suggest(str(key), list(hints))}"
                )
                continue
            ok, coerced = _coerce(value, hints[key])
            if not ok:
                problems.append(
                    f"{section}.{key} ({source}) expects {_type_name(hints[key])}, got {value!r} "
                    f"({type(value).__name__})"
                )
                continue
            setattr(sec, key, coerced)
    return problems


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """Check ``value`` against annotation ``tp``; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return True, None
                continue
            ok, v = _coerce(value, arg)
            if ok:
                return True, v
        return False, value
    if tp is Any:
        return True, value
    if origin is list:
        if isinstance(value, str):  # a single path given where a list is expected
            value = [value]
        if not isinstance(value, (list, tuple)):
            return False, value
        (item_tp,) = typing.get_args(tp) or (Any,)
        out = []
        for v in value:
            ok, c = _coerce(v, item_tp)
            if not ok:
                return False, value
            out.append(c)
        return True, out
    if origin is dict:
        return isinstance(value, dict), value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
            try:
                return True, float(value)
            except ValueError:
                pass
        return False, value
    if tp is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, str(value)  # e.g. model.path=7b parsed as a number-like string
        return isinstance(value, str), value
    return isinstance(value, tp), value


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def field_docs(section_cls: type) -> dict[str, str]:
    """Docstrings written under each dataclass field (read from the source)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(section_cls)))
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr):
            if isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())  # type: ignore[attr-defined]
    return docs


# ---------------------------------------------------------------- validation


def _known_names() -> tuple[set[str], set[str], set[str], set[str]]:
    """Registered estimator, policy-loss, aggregation and KL names (user registrations too)."""
    try:
        from hybridflow import algos

        def names(registry) -> set[str]:
            return set(registry.names()) if hasattr(registry, "names") else set(registry)

        return (
            names(algos.ADVANTAGE_ESTIMATORS),
            names(algos.POLICY_LOSSES),
            names(algos.LOSS_AGG_MODES),
            names(algos.KL_KINDS),
        )
    except (ImportError, AttributeError):  # algos not importable: fall back to the built-ins
        adv = {"gae", "remax", "reinforce_plus_plus", *GROUP_ESTIMATORS}
        pl = {"vanilla", "gspo", "cispo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean"}
        agg = {"token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"}
        kl = {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+", "low_var_kl+"}
        return adv, pl, agg, kl


def model_context_length(path: str) -> int | None:
    """Max positions of the model at ``path`` without loading weights; None if unknown."""
    import json

    p = Path(path).expanduser()
    if (p / "config.json").is_file():
        try:
            return int(json.loads((p / "config.json").read_text()).get("max_position_embeddings"))
        except (ValueError, TypeError):
            return None
    try:
        from hybridflow.models.presets import PRESETS

        preset = PRESETS.get(path)
        if preset is not None:
            cfg = preset() if callable(preset) else preset
            return int(cfg.max_position_embeddings)
    except ImportError:
        pass
    return None


def validate(cfg: Config, *, gpus_available: int | None = None) -> Derived:
    """Check every rule at once; return the derived per-device sizes or raise ConfigError."""
    d, a, r, c, t, alg = cfg.data, cfg.actor, cfg.rollout, cfg.critic, cfg.trainer, cfg.algorithm
    problems: list[str] = []
    add = problems.append

    # ---- devices and placement
    world = t.nnodes * t.n_gpus_per_node
    if t.nnodes < 1 or t.n_gpus_per_node < 1:
        add(
            f"trainer.nnodes = {t.nnodes} and trainer.n_gpus_per_node = {t.n_gpus_per_node} must both be >= 1"
        )
        world = max(world, 1)
    if t.backend not in ("inprocess", "local", "ray"):
        add(f"trainer.backend = {t.backend!r} is unknown: use inprocess, local or ray")
    if t.backend == "inprocess" and world != 1:
        add(
            f"trainer.backend = inprocess runs on one device but trainer.nnodes × trainer.n_gpus_per_node "
            f"= {t.nnodes} × {t.n_gpus_per_node} = {world}: set trainer.backend=local (one node) or ray"
        )
    if t.backend == "local" and t.nnodes != 1:
        add(
            f"trainer.backend = local runs on one node but trainer.nnodes = {t.nnodes}: use trainer.backend=ray"
        )
    if gpus_available is not None and t.device != "cpu" and t.n_gpus_per_node > gpus_available > 0:
        add(
            f"trainer.n_gpus_per_node = {t.n_gpus_per_node} but this node has {gpus_available} GPU(s): "
            f"set trainer.n_gpus_per_node <= {gpus_available}"
        )
    if t.placement not in ("colocate", "split"):
        add(f"trainer.placement = {t.placement!r} is unknown: use colocate or split")
    train_dp, rollout_dp = world, world
    if t.placement == "split":
        if not 0 < t.rollout_gpus < world:
            add(
                f"trainer.placement = split needs 0 < trainer.rollout_gpus < {world} (all devices), "
                f"got trainer.rollout_gpus = {t.rollout_gpus}: give the rollout some devices and "
                f"leave the rest for training"
            )
        else:
            train_dp, rollout_dp = world - t.rollout_gpus, t.rollout_gpus

    # ---- batch sizes
    n = r.n
    if n < 1:
        add(f"rollout.n = {n} must be >= 1")
        n = 1
    if alg.adv_estimator in GROUP_ESTIMATORS and n < 2:
        add(
            f"algorithm.adv_estimator = {alg.adv_estimator} normalises within groups of rollout.n samples "
            f"but rollout.n = {n}: set rollout.n >= 2 (e.g. 8)"
        )
    if d.train_batch_size < 1:
        add(f"data.train_batch_size = {d.train_batch_size} must be >= 1")
    samples = d.train_batch_size * n
    splits = [(train_dp, "data-parallel ranks")]
    if rollout_dp != train_dp:
        splits.append((rollout_dp, "rollout engines"))
    for dp, what in splits:
        if dp > 0 and samples % dp:
            need = dp // math.gcd(n, dp)
            add(
                f"data.train_batch_size × rollout.n = {d.train_batch_size} × {n} = {samples} samples cannot be "
                f"split over {dp} {what}: make data.train_batch_size a multiple of {need}"
            )
    mini = a.ppo_mini_batch_size
    mini_per_gpu = 0
    if mini < 1 or mini > d.train_batch_size:
        add(
            f"actor.ppo_mini_batch_size = {mini} must be between 1 and data.train_batch_size = "
            f"{d.train_batch_size}"
        )
    else:
        if d.train_batch_size % mini:
            add(
                f"data.train_batch_size = {d.train_batch_size} is not a multiple of actor.ppo_mini_batch_size "
                f"= {mini}: the last mini-batch would be partial; pick a divisor of {d.train_batch_size}"
            )
        if (mini * n) % train_dp:
            need = train_dp // math.gcd(n, train_dp)
            add(
                f"actor.ppo_mini_batch_size × rollout.n = {mini} × {n} = {mini * n} samples cannot be split "
                f"over {train_dp} data-parallel ranks: make actor.ppo_mini_batch_size a multiple of {need}"
            )
        mini_per_gpu = mini * n // max(train_dp, 1)
    micro_per_mini = None
    if a.max_tokens_per_gpu is None:
        mb = a.micro_batch_size_per_gpu
        if mb < 1:
            add(
                f"actor.micro_batch_size_per_gpu = {mb} must be >= 1 (or set actor.max_tokens_per_gpu)"
            )
        elif mini_per_gpu and mini_per_gpu % mb:
            add(
                f"actor mini-batch per GPU = actor.ppo_mini_batch_size × rollout.n / ranks = {mini} × {n} / "
                f"{train_dp} = {mini_per_gpu} samples is not a multiple of actor.micro_batch_size_per_gpu = "
                f"{mb}: pick a divisor of {mini_per_gpu}"
            )
        elif mini_per_gpu:
            micro_per_mini = mini_per_gpu // mb
    max_len = d.max_prompt_length + d.max_response_length
    for key, budget in (
        ("actor.max_tokens_per_gpu", a.max_tokens_per_gpu),
        ("ref.max_tokens_per_gpu", cfg.ref.max_tokens_per_gpu),
        ("critic.max_tokens_per_gpu", c.max_tokens_per_gpu),
    ):
        if budget is not None and budget < max_len:
            add(
                f"{key} = {budget} is smaller than one full sequence, data.max_prompt_length + "
                f"data.max_response_length = {d.max_prompt_length} + {d.max_response_length} = {max_len}: "
                f"raise it to at least {max_len} (2-4× that packs better)"
            )
    if a.ppo_epochs < 1:
        add(f"actor.ppo_epochs = {a.ppo_epochs} must be >= 1")
    if d.max_prompt_length < 1 or d.max_response_length < 1:
        add(
            f"data.max_prompt_length = {d.max_prompt_length} and data.max_response_length = "
            f"{d.max_response_length} must both be >= 1"
        )
    if d.overlong_prompts not in ("filter", "error", "truncate"):
        add(
            f"data.overlong_prompts = {d.overlong_prompts!r} is unknown: use filter, error or truncate"
        )

    # ---- critic (GAE)
    use_critic = alg.adv_estimator == "gae"
    critic_mini_per_gpu = 0
    if use_critic:
        cmini = c.ppo_mini_batch_size or mini
        if cmini < 1 or d.train_batch_size % cmini or (cmini * n) % train_dp:
            add(
                f"critic.ppo_mini_batch_size = {cmini} must divide data.train_batch_size = {d.train_batch_size} "
                f"and × rollout.n = {n} split evenly over {train_dp} ranks"
            )
        else:
            critic_mini_per_gpu = cmini * n // train_dp
            if c.max_tokens_per_gpu is None and critic_mini_per_gpu % max(
                c.micro_batch_size_per_gpu, 1
            ):
                add(
                    f"critic mini-batch per GPU = {critic_mini_per_gpu} samples is not a multiple of "
                    f"critic.micro_batch_size_per_gpu = {c.micro_batch_size_per_gpu}"
                )
        if c.ppo_epochs is not None and c.ppo_epochs < 1:
            add(f"critic.ppo_epochs = {c.ppo_epochs} must be >= 1")

    # ---- names
    adv_names, loss_names, agg_names, kl_names = _known_names()
    for key, value, known in (
        ("algorithm.adv_estimator", alg.adv_estimator, adv_names),
        ("actor.policy_loss", a.policy_loss, loss_names),
        ("actor.loss_agg_mode", a.loss_agg_mode, agg_names),
        ("critic.loss_agg_mode", c.loss_agg_mode, agg_names),
        ("actor.kl_loss_type", a.kl_loss_type, kl_names),
        ("algorithm.kl_penalty", alg.kl_penalty, kl_names),
    ):
        if value not in known:
            add(f"{key} = {value!r} is unknown{_suggest(value, sorted(known))}")
    if a.lr_scheduler not in ("constant", "linear", "cosine"):
        add(f"actor.lr_scheduler = {a.lr_scheduler!r} is unknown: use constant, linear or cosine")
    if alg.kl_ctrl_type not in ("fixed", "adaptive"):
        add(f"algorithm.kl_ctrl_type = {alg.kl_ctrl_type!r} is unknown: use fixed or adaptive")
    if cfg.reward.manager not in ("naive", "batch", "dapo"):
        add(f"reward.manager = {cfg.reward.manager!r} is unknown: use naive, batch or dapo")
    if cfg.reward.custom_fn is not None and ":" not in cfg.reward.custom_fn:
        add(
            f"reward.custom_fn = {cfg.reward.custom_fn!r} must look like path/to/file.py:function_name"
        )

    # ---- sampling and algorithm knobs
    if r.temperature < 0:
        add(f"rollout.temperature = {r.temperature} must be >= 0 (0 = greedy)")
    if not 0 < r.top_p <= 1:
        add(f"rollout.top_p = {r.top_p} must be in (0, 1]")
    if not 0 <= r.min_p < 1:
        add(f"rollout.min_p = {r.min_p} must be in [0, 1)")
    if r.top_k == 0 or r.top_k < -1:
        add(f"rollout.top_k = {r.top_k} must be -1 (off) or >= 1")
    if not 0 < r.gpu_memory_utilization <= 0.95:
        add(f"rollout.gpu_memory_utilization = {r.gpu_memory_utilization} must be in (0, 0.95]")
    if a.clip_ratio_c <= 1:
        add(f"actor.clip_ratio_c = {a.clip_ratio_c} must be > 1 (dual clip; 3.0 is standard)")
    if alg.dynamic_sampling and alg.adv_estimator not in GROUP_ESTIMATORS:
        add(
            f"algorithm.dynamic_sampling filters groups but algorithm.adv_estimator = {alg.adv_estimator} "
            f"is not a group estimator ({', '.join(GROUP_ESTIMATORS)})"
        )
    if alg.dynamic_sampling and alg.max_gen_rounds < 1:
        add(f"algorithm.max_gen_rounds = {alg.max_gen_rounds} must be >= 1")
    if cfg.model.lora_rank < 0:
        add(f"model.lora_rank = {cfg.model.lora_rank} must be >= 0")
    if cfg.model.dtype not in ("auto", "bfloat16", "float32", "float16"):
        add(f"model.dtype = {cfg.model.dtype!r} is unknown: use auto, bfloat16 or float32")
    if t.total_steps < 0:
        add(f"trainer.total_steps = {t.total_steps} must be >= 0")

    # ---- lengths vs the model's context
    ctx = model_context_length(cfg.model.path)
    if ctx is not None and max_len > ctx:
        add(
            f"data.max_prompt_length + data.max_response_length = {d.max_prompt_length} + "
            f"{d.max_response_length} = {max_len} exceeds the context of model.path = {cfg.model.path!r} "
            f"({ctx} tokens): shorten one of them"
        )

    if problems:
        raise ConfigError(problems)
    return Derived(
        world_size=world,
        train_dp_size=train_dp,
        rollout_dp_size=rollout_dp,
        samples_per_step=samples,
        mini_batches_per_step=d.train_batch_size // max(mini, 1),
        mini_batch_samples_per_gpu=mini_per_gpu,
        micro_batches_per_mini_batch=micro_per_mini,
        critic_mini_batch_samples_per_gpu=critic_mini_per_gpu,
        use_reference=a.use_kl_loss or alg.use_kl_in_reward,
        use_critic=use_critic,
        max_sequence_length=max_len,
    )
