"""Saving and resuming a run: the workers' training state plus the controller's own.

A checkpoint directory ``<run_dir>/checkpoints/step_N`` holds

    actor/            model (or LoRA adapters), optimizer, scheduler, RNG: written by the workers
    critic/           the same for the critic (GAE runs)
    trainer_state.pt  step, sampler position, KL controller, controller RNG states
    config.yaml       the resolved run config
    hf_config.json    the model's architecture and training dtype (``hybridflow export``)
    tokenizer/        the tokenizer, so an export is a complete HF model directory
    engine_choices.json  the rollout engine's timing choices (kernels, decode layers), pinned
                      again on resume so the resumed run generates with the same kernels

and is published atomically by the CheckpointManager (temporary directory, COMPLETE marker,
rename), so a run killed while saving resumes from the previous complete one.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import yaml

from hybridflow.errors import UserError
from hybridflow.trainer.stages import RunContext

TRAINER_STATE = "trainer_state.pt"
CONFIG_FILE = "config.yaml"
TOKENIZER_DIR = "tokenizer"
MODEL_CONFIG = "hf_config.json"
ENGINE_CHOICES = "engine_choices.json"


def save_checkpoint(run: RunContext) -> Path:
    """Write ``step_<run.step>`` (all ranks of every group take part)."""
    from hybridflow.state_files import to_plain_data
    from hybridflow.trainer.checkpoint import capture_rng_state

    def write(directory: Path) -> None:
        run.roles.actor.save(str(directory))
        if run.roles.critic is not None:
            run.roles.critic.save(str(directory))
        state = {
            "step": run.step,
            "loader": run.loader.state_dict(),
            "kl_ctrl": run.kl_ctrl.state_dict(),
            "rng": capture_rng_state(),
            "history": run.history,
        }
        torch.save(to_plain_data(state), directory / TRAINER_STATE)
        # the rollout's kernel choices, so a resumed run generates with the same kernels
        choices = run.roles.rollout.engine_choices()
        (directory / ENGINE_CHOICES).write_text(json.dumps(choices, indent=1, sort_keys=True))
        write_model_files(directory, run.cfg, run.tokenizer, training_dtype(run.cfg))

    return run.checkpoints.save(run.step, write, metadata={"model_path": run.cfg.model.path})


def training_dtype(cfg) -> torch.dtype:
    """The dtype the actor holds its weights in (see workers.model_loading.training_dtype)."""
    from hybridflow.workers.model_loading import training_dtype as actor_dtype

    return actor_dtype(cfg.model)


def write_model_files(directory: Path, cfg, tokenizer, dtype: torch.dtype) -> None:
    """The resolved config, the architecture (HF config.json content with the training dtype)
    and the tokenizer: what ``hybridflow export`` needs besides the weights."""
    import json

    (directory / CONFIG_FILE).write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    hf_config = model_hf_config(cfg.model.path)
    hf_config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (directory / MODEL_CONFIG).write_text(json.dumps(hf_config, indent=2))
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(directory / TOKENIZER_DIR))


def model_hf_config(path: str) -> dict:
    """HF config.json content of a local model directory or a preset."""
    import json

    from hybridflow.models.presets import PRESETS

    if path in PRESETS:
        return PRESETS[path].to_hf()
    return json.loads((Path(path) / "config.json").read_text())


def resume(run: RunContext) -> Path | None:
    """Load the checkpoint ``trainer.resume`` names (auto: the latest complete one)."""
    from hybridflow.state_files import load_state_file
    from hybridflow.trainer.checkpoint import restore_rng_state
    from hybridflow.trainer.roles import sync_weights

    path = run.checkpoints.resolve_resume(run.cfg.trainer.resume)
    if path is None:
        return None
    run.roles.actor.load(str(path))
    if run.roles.critic is not None:
        run.roles.critic.load(str(path))
    state = load_state_file(path / TRAINER_STATE)  # tensors and plain data only
    run.step = int(state["step"])
    run.loader.load_state_dict(state["loader"])
    run.kl_ctrl.load_state_dict(state["kl_ctrl"])
    run.history = state.get("history", {})
    restore_rng_state(state["rng"])
    sync_weights(run.roles)  # a rollout engine with its own copy must see the loaded weights
    choices = path / ENGINE_CHOICES
    if choices.is_file():  # made on another GPU or with other options: timed afresh instead
        run.roles.rollout.pin_engine_choices(json.loads(choices.read_text()))
    return path


def read_run_config(checkpoint: str | Path):
    """The Config a checkpoint was written with."""
    from hybridflow.config import Config, apply_mapping

    path = Path(checkpoint) / CONFIG_FILE
    if not path.is_file():
        raise UserError(
            f"{checkpoint}: no {CONFIG_FILE}",
            "give a hybridflow checkpoint directory (<run_dir>/checkpoints/step_N)",
        )
    cfg = Config()
    problems = apply_mapping(cfg, yaml.safe_load(path.read_text()) or {}, source=str(path))
    if problems:
        raise UserError(f"{path}: " + "; ".join(problems), "was it written by another version?")
    return cfg
