"""Everything ``hybridflow train`` can check before it loads a model; ``hybridflow config
validate`` runs the same checks.

In order: the config rules (``validate``), the GPU memory plan (trainer/plan/memory_check.py),
the host memory a step's data needs (trainer/plan/host_memory.py), then the machine
(machine.py: devices, a writable run directory with room for a checkpoint, the logger
packages), the model directory (config.json, complete safetensors files, a tokenizer), a
writable ``trainer.cache_dir`` when the run will write there (an uncached warm start), the
reward function, and every data file (readable, and still holding a batch after overlong
prompts are dropped). All problems of one kind are
reported together, each with the key or file it is about and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.config import Config, ConfigError, Derived, validate
from hybridflow.errors import UserError
from hybridflow.trainer.lifecycle.machine import (
    MIN_FREE_BYTES,
    logger_problems,
    machine_problems,
    runs_here,
    writable_dir_problems,
)
from hybridflow.trainer.plan.architecture import model_architecture

DATA_SEED = 0
"""Seed of the built-in tasks' problems: the validation set is the same whatever trainer.seed."""


@dataclass
class Preflight:
    """What the checks built on the way, so ``setup`` does not build it twice."""

    derived: Derived
    tokenizer: Any
    reward: Any
    """A RewardManager (its worker pool starts on first use); the caller closes it."""
    train_set: Any
    val_set: Any
    host_need: Any = None
    """The host memory the run needs (plan/host_memory.HostNeed)."""


def check_run(cfg: Config, log=lambda *a, **k: None) -> list[str]:
    """Run every check; raises a UserError (ConfigError, DataSchemaError, …) on the first
    kind of problem found. ``config validate`` calls this. On a machine that cannot be the
    run's (trainer.device=cuda, no GPU visible: a cluster's config checked on a login node)
    the config is checked whole, and the machine's own checks (a visible GPU, host memory
    and the run directory's room) are left to ``train`` on the run's machine: returned as
    notes naming them, with the host memory the run needs a node."""
    here = runs_here(cfg.trainer.device)
    preflight = prepare_run(cfg, log, machine_checks=here)
    preflight.reward.close()
    if here:
        return []
    from hybridflow.trainer.plan.host_memory import gib

    need = preflight.host_need
    return [f"not checked here, as no CUDA GPU is visible: a GPU on each node, {gib(need.total)} "
            f"of host memory a node ({need.model_what} and a step's data), and room in "
            f"trainer.run_dir for a checkpoint; hybridflow train checks them at start"]  # fmt: skip


def prepare_run(cfg: Config, log=lambda *a, **k: None, machine_checks: bool = True) -> Preflight:
    """The checks of :func:`check_run`; returns what they built (the caller closes reward).
    ``machine_checks``: also the machine's (runs_here); ``train`` always runs them."""
    from hybridflow.models import load_tokenizer
    from hybridflow.rewards import build_reward_manager
    from hybridflow.trainer.plan.host_memory import check_host_memory, host_need_for
    from hybridflow.trainer.plan.memory_check import check_memory
    from hybridflow.workers.model_loading import default_tokenizer_path

    derived = validate(cfg, gpus_available=_gpu_count() if cfg.trainer.device == "cuda" else None)
    plan = check_memory(cfg, derived, log)  # the GPU memory plan, printed; exit 2 if too big
    if machine_checks:  # a step's data (and a CPU run's model) on the host
        host = check_host_memory(cfg, derived, plan)
        problems = machine_problems(cfg, cfg.trainer.run_dir)
    else:
        host = host_need_for(cfg, derived, plan)
        problems = logger_problems(cfg.trainer.loggers)
    problems += sandbox_problems(cfg, log)
    problems += model_problems(cfg.model.path, cfg.model.tokenizer_path)
    problems += other_checkpoint_problems(cfg, derived)
    if problems:
        raise ConfigError(problems)
    problems = cache_dir_problems(cfg)  # needs the tokenizer that model_problems checked
    if problems:
        raise ConfigError(problems)
    tokenizer = load_tokenizer(default_tokenizer_path(cfg.model))
    reward = build_reward_manager(cfg.reward, cfg.data.max_response_length)
    try:
        train_set, val_set = _datasets(cfg, tokenizer, reward)
    except BaseException:
        reward.close()
        raise
    return Preflight(derived, tokenizer, reward, train_set, val_set, host)


def sandbox_problems(cfg: Config, log=lambda *a, **k: None) -> list[str]:
    """Where the run will execute programs the model writes (the python tool), say which
    isolation the code sandbox gives on this machine; where strict isolation is asked for
    (the tool's or the code reward's) and the machine cannot build the jail, a problem."""
    agent = cfg.rollout.agent
    uses_tool = agent.loop == "tools" and "python" in agent.tools
    asked = [("reward.sandbox_isolation", cfg.reward.sandbox_isolation)]
    asked += [("rollout.agent.sandbox_isolation", agent.sandbox_isolation)] if uses_tool else []
    if not uses_tool and cfg.reward.sandbox_isolation != "strict":
        return []  # no program runs, or the code reward says so itself if it runs one
    from hybridflow.agents.sandbox import jail_unavailable

    why = jail_unavailable()
    if uses_tool:
        level = f"basic isolation only ({why})" if why else "strict isolation (a jail per program)"
        log(f"code sandbox: {level}")
    return [
        f"{key} = strict, but this machine cannot build the code sandbox's jail ({why}): run "
        f"as root with CAP_SYS_ADMIN or where unprivileged user namespaces are allowed, or "
        f"set {key}=auto to accept basic isolation (docs/troubleshooting.md)"
        for key, level in asked
        if level == "strict" and why
    ]


def _datasets(cfg: Config, tokenizer, reward):
    from hybridflow.config.model_facts import image_key, trained_model
    from hybridflow.data.dataset import build_prompt_datasets
    from hybridflow.data.images import ImageProcessor
    from hybridflow.rewards.combine import used_parts
    from hybridflow.rewards.parts import weights_table

    # without the rule part (a reward model or judge alone), any data source is scored
    rule = "rule" in used_parts(weights_table(cfg.reward))
    key = image_key(cfg)  # a vision-language model's rows hold images
    train_set, val_set = build_prompt_datasets(
        cfg.data,
        tokenizer,
        seed=DATA_SEED,
        known_data_sources=reward.known_data_sources() if rule else None,
        image_key=key,
        images=None if key is None else ImageProcessor.for_model(trained_model(cfg)),
    )
    if len(train_set) < cfg.data.train_batch_size:
        dropped = (
            f" after dropping {train_set.num_filtered} prompts longer than "
            f"data.max_prompt_length = {cfg.data.max_prompt_length}"
            if train_set.num_filtered
            else ""
        )
        raise ConfigError(
            [
                f"data.train_files hold {len(train_set)} usable prompts{dropped}, fewer than "
                f"one batch (data.train_batch_size = {cfg.data.train_batch_size}): lower "
                f"data.train_batch_size, add prompts, or raise data.max_prompt_length"
            ]
        )
    return train_set, val_set


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cache_dir_problems(cfg: Config) -> list[str]:
    """``trainer.cache_dir`` is writable, with room, when the run will write there: an
    ``sft:<task>`` warm start not cached yet (checked now, not after its SFT), or a GPU run
    (the rollout engine pins its timing choices there, model.compile its artifacts). A
    read-only cache that already holds the warm-start model is fine."""
    from hybridflow.trainer.loop.device import resolve_device
    from hybridflow.trainer.loop.warm_start import needs_warm_start

    t = cfg.trainer
    if needs_warm_start(cfg):
        preset = model_architecture(cfg.sft.preset)
        # the fp32 model and the saved progress of a stopped SFT (weights + AdamW moments)
        need = max(MIN_FREE_BYTES, 16 * preset.num_parameters()) if preset else MIN_FREE_BYTES
        what = f"the {cfg.model.path} warm-start model"
        return writable_dir_problems("trainer.cache_dir", t.cache_dir, need, what)
    if resolve_device(t.device) == "cuda":
        what = "the rollout engine's timing choices"
        return writable_dir_problems("trainer.cache_dir", t.cache_dir, MIN_FREE_BYTES, what)
    return []


def parameter_count(architecture) -> int:
    """Weights a token's forward pass multiplies by: the decoder layers' projections (attention,
    SwiGLU MLP; a mixture of experts' router and top-k experts) and the lm_head (vocab ×
    hidden, tied to the embedding or not; the embedding itself is a lookup). For stored bytes
    use ModelArchitecture.num_parameters()."""
    a = architecture
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    attention = a.num_hidden_layers * a.hidden_size * (2 * q + 2 * kv)
    return attention + a.mlp_parameters(active=True) + a.vocab_size * a.hidden_size


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def model_problems(model_path: str, tokenizer_path: str | None) -> list[str]:
    """A local model directory holds config.json, complete safetensors and a tokenizer."""
    from hybridflow.models.presets import PRESETS

    if model_path.startswith("sft:") or model_path in PRESETS:
        return _tokenizer_problems(tokenizer_path) if tokenizer_path else []
    problems = checkpoint_problems("model.path", model_path)
    if problems and not Path(model_path).expanduser().is_dir():
        return problems  # no directory: not a missing tokenizer too
    return problems + _tokenizer_problems(tokenizer_path or str(Path(model_path).expanduser()))


def checkpoint_problems(key: str, model_path: str, num_labels: int | None = None) -> list[str]:
    """The model directory ``key`` names holds config.json with values a model can have,
    complete safetensors files whose headers fit it (every tensor, in its shape, none
    extra). num_labels: a reward model's score head."""
    from hybridflow.models.checkpoint_io.hf_checkpoint import safetensors_problem
    from hybridflow.models.checkpoint_io.loadability import config_problems
    from hybridflow.models.checkpoint_io.weight_files import (
        INDEX_FILE,
        SINGLE_FILE,
        checkpoint_files,
    )
    from hybridflow.models.presets import PRESETS

    path = Path(model_path).expanduser()
    if not path.is_dir():
        return [
            f"{key} = {model_path!r} is not a directory, a preset ({', '.join(PRESETS)}) "
            f"or sft:<task>: point it at a Hugging Face model directory"
        ]
    if not (path / "config.json").is_file():
        return [
            f"{key} = {model_path}: no config.json there: point {key} at the Hugging "
            f"Face model directory itself (the one holding config.json and *.safetensors)"
        ]
    problems = [f"{key}: {problem}" for problem in config_problems(path, num_labels)]
    files = []
    try:
        files = checkpoint_files(str(path))  # the files a load reads
    except FileNotFoundError:
        problems.append(
            f"{key} = {model_path}: no {SINGLE_FILE} (or sharded *.safetensors with "
            f"{INDEX_FILE}); convert the weights to safetensors"
        )
    except UserError as error:  # an index that does not parse, or names a missing shard
        problems.append(f"{key}: {error}")
    for file in files:
        problem = safetensors_problem(file)
        if problem:
            problems.append(f"{key}: {problem}: copy the model directory again")
    return problems


def other_checkpoint_problems(cfg: Config, derived: Derived) -> list[str]:
    """:func:`checkpoint_problems` of the reference, critic and reward model directories
    the run loads besides the policy's."""
    from hybridflow.config.model_facts import model_paths
    from hybridflow.config.reward_checks import stored_score_rows
    from hybridflow.models.presets import PRESETS

    problems = []
    for key, path in model_paths(cfg, derived.use_reference, derived.use_critic):
        if key == "model.path" or path in PRESETS or path.startswith("sft:"):
            continue
        rows = stored_score_rows(path) if key == "reward.model.path" else None
        problems += checkpoint_problems(key, path, rows)
    return problems


def _tokenizer_problems(tokenizer_path: str) -> list[str]:
    from hybridflow.models.tokenizer import CHAR_TOKENIZER_NAMES

    if tokenizer_path in CHAR_TOKENIZER_NAMES:
        return []
    path = Path(tokenizer_path).expanduser()
    if not path.is_dir():
        return [f"model.tokenizer_path = {tokenizer_path!r} is not a directory"]
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return [
            f"{path} holds no tokenizer ({', '.join(TOKENIZER_FILES)}): copy the tokenizer "
            f"files there or set model.tokenizer_path"
        ]
    return []
