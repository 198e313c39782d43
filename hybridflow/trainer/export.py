"""``hybridflow export CKPT OUT``: a checkpoint directory -> a Hugging Face model directory.

Works on RL and SFT checkpoints (``<run_dir>/checkpoints/step_N``, or a run directory: its
latest complete checkpoint): the architecture comes from the checkpoint's
``hf_config.json``, the weights from ``actor/`` (LoRA adapters are folded into the base
weights of ``model.path``), the tokenizer from ``tokenizer/``. The result loads with
``transformers.AutoModelForCausalLM.from_pretrained(OUT)``.

A checkpoint is data from wherever it came: links inside it are refused (never followed),
its files must be as listed when saved, and the weights load as tensors only
(hybridflow/dcp_reader.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hybridflow.errors import UserError
from hybridflow.trainer.checkpoint_files import copy_regular_files


def export_checkpoint(checkpoint: str | Path, out: str | Path, log=print) -> Path:
    """Write the actor of ``checkpoint`` (a checkpoint, or a run directory: its latest
    complete one, said through ``log``) as an HF model directory at ``out``."""
    from hybridflow.learners import lora
    from hybridflow.learners.actor_learner import export_causal_lm
    from hybridflow.learners.core import TrainCore
    from hybridflow.learners.modules import PolicyModel
    from hybridflow.models import build_model, load_model
    from hybridflow.models.architecture import ModelArchitecture
    from hybridflow.trainer.run_state import MODEL_CONFIG, TOKENIZER_DIR, read_run_config

    checkpoint, out = checkpoint_to_export(Path(checkpoint), log), Path(out)
    check_files(checkpoint)
    cfg = read_run_config(checkpoint)
    hf_config = json.loads((checkpoint / MODEL_CONFIG).read_text())
    dtype = getattr(torch, hf_config.get("torch_dtype") or "float32")
    use_lora = cfg.model.lora_rank > 0
    if use_lora:  # adapters only in the checkpoint: the base weights come from model.path
        model = load_model(cfg.model.path, dtype=dtype, device="cpu")
        lora.apply_lora(
            model,
            rank=cfg.model.lora_rank,
            alpha=cfg.model.lora_alpha,
            target_modules=cfg.model.lora_target_modules,
            dropout=cfg.model.lora_dropout,
        )
    else:
        model = build_model(ModelArchitecture.from_hf(hf_config), dtype=dtype, device="cpu")
    core = TrainCore(PolicyModel(model), device="cpu", fsdp=False)
    rng = torch.get_rng_state()
    core.load(checkpoint / "actor", trainable_only=use_lora)
    torch.set_rng_state(rng)  # loading restores the training RNG; the caller's is kept
    stream = core.iter_full_tensors(model)
    if use_lora:
        stream = lora.merge_lora_stream(stream, lora.lora_scalings(model))
    tied = model.config.tie_word_embeddings
    state = {name: t for name, t in stream if not (tied and name == "lm_head.weight")}
    export_causal_lm(model.config, state, out)
    tokenizer_dir = checkpoint / TOKENIZER_DIR
    if tokenizer_dir.is_dir():
        copy_regular_files(tokenizer_dir, out)
    return out


GIVE_A_CHECKPOINT = (
    "give a checkpoint directory <run_dir>/checkpoints/step_N, or a run directory "
    "(<trainer.run_dir>) to export its latest complete checkpoint"
)


def checkpoint_to_export(path: Path, log) -> Path:
    """``path`` itself when it is a checkpoint; the latest complete checkpoint of a run
    directory (or of its ``checkpoints/``), said through ``log``."""
    from hybridflow.trainer.checkpoint import COMPLETE_MARKER, CheckpointManager, is_complete

    if not path.exists():
        raise UserError(f"{path} does not exist", GIVE_A_CHECKPOINT)
    if not path.is_dir():
        raise UserError(f"{path} is a file, not a checkpoint directory", GIVE_A_CHECKPOINT)
    if is_complete(path):
        if not (path / "actor").is_dir():
            raise UserError(f"{path} holds no actor/ (the model's weights)", GIVE_A_CHECKPOINT)
        return path
    root = path if path.name == "checkpoints" else path / "checkpoints"
    if root.is_dir():
        latest = CheckpointManager(root).latest()
        if latest is None:
            raise UserError(f"{root} holds no complete checkpoint yet", GIVE_A_CHECKPOINT)
        log(f"exporting {latest}, the latest complete checkpoint in {root}")
        return latest
    raise UserError(
        f"{path} is not a complete hybridflow checkpoint (no {COMPLETE_MARKER} marker: "
        "unfinished, or not a checkpoint) and holds no checkpoints/",
        GIVE_A_CHECKPOINT,
    )


def check_files(checkpoint: Path) -> None:
    """Refuse a checkpoint holding links or files that differ from what was saved."""
    from hybridflow.trainer.checkpoint_files import LINKS_FIX, damage, links_problem

    links = links_problem(checkpoint)
    if links is not None:
        raise UserError(links, LINKS_FIX)
    problems = damage(checkpoint)
    if problems:
        raise UserError(
            f"{checkpoint} is damaged: {'; '.join(problems)}",
            "export an older checkpoint of the run (its checkpoints/step_N)",
        )
