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
rename), so a run killed while saving resumes from the previous complete one. With
``trainer.async_save`` the same files are written in the background: the save step only
copies the state to host memory (``start_checkpoint``, trainer/lifecycle/pending_save.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml

from hybridflow.config.yaml_limits import load_yaml
from hybridflow.errors import UserError
from hybridflow.trainer.loop.stages import RunContext

if TYPE_CHECKING:
    from hybridflow.trainer.lifecycle.pending_save import PendingSave

TRAINER_STATE = "trainer_state.pt"
CONFIG_FILE = "config.yaml"
TOKENIZER_DIR = "tokenizer"
MODEL_CONFIG = "hf_config.json"
ENGINE_CHOICES = "engine_choices.json"


def save_checkpoint(run: RunContext) -> Path:
    """Write ``step_<run.step>`` and return it once it is complete (all ranks take part)."""
    _, finish = _begin_save(run, background=False)
    return finish()


def start_checkpoint(run: RunContext) -> PendingSave:
    """Save ``step_<run.step>`` in the background (``trainer.async_save``): returns once the
    workers have copied their state to host memory and the controller has captured its own;
    the files are written and the checkpoint published on threads (trainer/lifecycle/pending_save.py)."""
    from hybridflow.trainer.lifecycle.pending_save import PendingSave

    directory, finish = _begin_save(run, background=True)
    return PendingSave(run.step, directory, finish, run.checkpoints.latest)


def _begin_save(run: RunContext, *, background: bool) -> tuple[Path, Callable[[], Path]]:
    """Start the workers' writes into a fresh ``.tmp-step_N`` and capture the controller's
    state now (the loop changes it); returns that directory and what writes the rest and
    publishes ``step_N``."""
    import copy

    from hybridflow.state_files import to_plain_data
    from hybridflow.trainer.lifecycle.checkpoint import capture_rng_state

    manager, step, roles = run.checkpoints, run.step, run.roles
    directory = manager.prepare(step)
    try:
        roles.actor.save(str(directory), background=background)
        if roles.critic is not None:
            roles.critic.save(str(directory), background=background)
        state = {
            "step": run.step,
            "loader": run.loader.state_dict(),
            "kl_ctrl": run.kl_ctrl.state_dict(),
            "rng": capture_rng_state(),
            "history": run.history,
        }
        state = copy.deepcopy(to_plain_data(state))
        # the rollout's kernel choices, so a resumed run generates with the same kernels
        choices = roles.rollout.engine_choices()
    except BaseException as error:
        manager.abandon(step, directory, error)
        raise

    def write_rest(directory: Path) -> None:
        wait_for_workers(roles)
        torch.save(state, directory / TRAINER_STATE)
        (directory / ENGINE_CHOICES).write_text(json.dumps(choices, indent=1, sort_keys=True))
        write_model_files(directory, run.cfg, run.tokenizer, training_dtype(run.cfg))

    metadata = {"model_path": run.cfg.model.path}
    return directory, functools.partial(manager.complete, step, directory, write_rest, metadata)


SAVE_POLL_S = 0.1


def wait_for_workers(roles) -> None:
    """Until every rank of the actor (and critic) has its background save on disk; raises a
    rank's write error. Polls, since a worker serves one call at a time: a blocking wait
    would hold up the training calls queued behind it."""
    groups = [roles.actor] + ([roles.critic] if roles.critic is not None else [])
    while not all(all(group.save_finished()) for group in groups):
        time.sleep(SAVE_POLL_S)


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


def resume(run: RunContext, log=print) -> Path | None:
    """Load the checkpoint ``trainer.resume`` names (auto: the newest complete one whose files
    are intact, falling back to older ones with a message); None when there is none."""
    from hybridflow.trainer.lifecycle.checkpoint import load_newest_intact

    return load_newest_intact(
        run.checkpoints,
        run.cfg.trainer.resume,
        load=functools.partial(load_checkpoint, run),
        log=log,
        check=lambda path: check_config_changes(path, run.cfg, log),  # a refusal stops here
    )


def refuse_changed_config(cfg) -> None:
    """Before anything long (a warm start, loading the model): refuse to resume the
    checkpoint that :func:`resume` would try first when ``cfg`` changed a key it cannot
    honour. ``cfg`` must hold the model path the run will use (warm_start.planned_model_path)."""
    from hybridflow.trainer.lifecycle.checkpoint import CheckpointManager

    t = cfg.trainer
    candidates = CheckpointManager(f"{t.run_dir}/checkpoints").resume_candidates(t.resume)
    if candidates:
        check_config_changes(candidates[0], cfg, log=lambda line: None)  # listed when resuming


def check_config_changes(path: Path, cfg, log) -> None:
    """Report the keys changed since ``path`` was saved; refuse the ones a resume cannot honour."""
    from hybridflow.trainer.lifecycle.resume_changes import config_changes, refusal_message, refused

    saved_file = path / CONFIG_FILE
    if not saved_file.is_file():
        return
    saved = (
        load_yaml(saved_file.read_text(), source=str(saved_file)) or {}
    )  # bounded: a checkpoint's file
    changes = config_changes(saved, dataclasses.asdict(cfg))
    if refused(changes):
        raise UserError(*refusal_message(str(path), refused(changes)))
    for change in changes:
        log(f"resume: config changed since {path.name}: {change.line()}")


def load_checkpoint(run: RunContext, path: Path) -> None:
    """Workers' state, then the controller's (step, data position, KL, RNG, history)."""
    from hybridflow.state_files import load_state_file
    from hybridflow.trainer.lifecycle.checkpoint import restore_rng_state
    from hybridflow.trainer.loop.roles import sync_weights

    state = load_state_file(path / TRAINER_STATE)  # tensors and plain data only
    run.roles.actor.load(str(path))
    if run.roles.critic is not None:
        run.roles.critic.load(str(path))
    run.step = int(state["step"])
    run.loader.load_state_dict(state["loader"])
    run.kl_ctrl.load_state_dict(state["kl_ctrl"])
    if run.cfg.algorithm.kl_ctrl_type == "fixed":  # the config's coefficient, changed or not
        run.kl_ctrl.value = float(run.cfg.algorithm.kl_coef)
    run.history = state.get("history", {})
    restore_rng_state(state["rng"])
    # a rollout engine with its own copy must see the loaded weights, as version run.step
    sync_weights(run.roles, version=run.step)
    choices = path / ENGINE_CHOICES
    if choices.is_file():  # made on another GPU or with other options: timed afresh instead
        run.roles.rollout.pin_engine_choices(json.loads(choices.read_text()))


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
    problems = apply_mapping(
        cfg, load_yaml(path.read_text(), source=str(path)) or {}, source=str(path)
    )
    if problems:
        raise UserError(f"{path}: " + "; ".join(problems), "was it written by another version?")
    return cfg
