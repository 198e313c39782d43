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
from hybridflow.trainer.lifecycle.checkpoint_files import copy_regular_files


def export_checkpoint(checkpoint: str | Path, out: str | Path, log=print) -> Path:
    """Write the actor of ``checkpoint`` (a checkpoint, or a run directory: its latest
    complete one, said through ``log``) as an HF model directory at ``out``."""
    from hybridflow.learners import lora
    from hybridflow.learners.actor_learner import export_causal_lm
    from hybridflow.learners.core import TrainCore
    from hybridflow.learners.modules import PolicyModel
    from hybridflow.models import build_model, load_model
    from hybridflow.models.architecture import ModelArchitecture
    from hybridflow.trainer.lifecycle.run_state import MODEL_CONFIG, TOKENIZER_DIR, read_run_config

    checkpoint, out = checkpoint_to_export(Path(checkpoint), log), Path(out)
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
    quantized = dequantised_note(hf_config, out)
    if quantized:  # the source checkpoint's precision, not the training masters' fp32
        log(quantized)
        stream = ((n, t.to(torch.bfloat16) if t.is_floating_point() else t) for n, t in stream)
    tied = model.config.tie_word_embeddings
    state = {name: t for name, t in stream if not (tied and name == "lm_head.weight")}
    export_causal_lm(model.config, state, out)
    tokenizer_dir = checkpoint / TOKENIZER_DIR
    if tokenizer_dir.is_dir():
        copy_regular_files(tokenizer_dir, out)
    return out


def dequantised_note(hf_config: dict, out: Path) -> str | None:
    """The line saying the export is written in bf16 without quantization_config, when
    model.path's checkpoint stored its weights quantized (read dequantised:
    models/checkpoint_io/quantized_checkpoint.py); None otherwise."""
    quantization = hf_config.get("quantization_config")
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if not method:
        return None
    return (
        f"{out}: model.path stored its weights as {method} (quantization_config); they were "
        "trained dequantised and are written in bfloat16, without quantization_config"
    )


def check_export_target(out: Path, overwrite: bool) -> None:
    """``out`` is a directory to create (made here, before any work: the file system may
    refuse it), an empty one, or (``overwrite``) any directory: an export never replaces a
    model someone may still need without being told to."""
    if out.exists() and not out.is_dir():
        raise UserError(
            f"{out} is a file, not a directory", "give a directory to write the model to"
        )
    if not out.exists():
        try:
            out.mkdir(parents=True)
        except OSError as error:  # a file above it, procfs, a read-only file system
            raise UserError(f"{out}: the directory cannot be made ({error.strerror or error})",
                            "give a directory you can write to") from None  # fmt: skip
        return
    if overwrite or not any(out.iterdir()):
        return
    raise UserError(
        f"{out} already exists and is not empty; export does not write over it",
        "give a new or empty directory, or add --overwrite to replace the model files in it",
    )


GIVE_A_CHECKPOINT = (
    "give a checkpoint directory <run_dir>/checkpoints/step_N, or a run directory "
    "(<trainer.run_dir>) to export its latest complete checkpoint"
)


def checkpoint_to_export(path: Path, log) -> Path:
    """``path`` itself when it is a checkpoint whose files are intact; for a run directory
    (or its ``checkpoints/``), the newest complete checkpoint whose files are intact, said
    through ``log`` with any newer damaged one it skipped."""
    from hybridflow.trainer.lifecycle.checkpoint import (
        COMPLETE_MARKER,
        CheckpointManager,
        is_complete,
    )

    if not path.exists():
        raise UserError(f"{path} does not exist", GIVE_A_CHECKPOINT)
    if not path.is_dir():
        raise UserError(f"{path} is a file, not a checkpoint directory", GIVE_A_CHECKPOINT)
    if is_complete(path):
        if not (path / "actor").is_dir():
            raise UserError(f"{path} holds no actor/ (the model's weights)", GIVE_A_CHECKPOINT)
        problems = file_problems(path, log)
        if problems:
            raise UserError(
                f"{path} is damaged: {'; '.join(problems)}",
                "export an older checkpoint of the run (its checkpoints/step_N)",
            )
        return path
    root = path if path.name == "checkpoints" else path / "checkpoints"
    if not root.is_dir():
        raise UserError(
            f"{path} is not a complete hybridflow checkpoint (no {COMPLETE_MARKER} marker: "
            "unfinished, or not a checkpoint) and holds no checkpoints/",
            GIVE_A_CHECKPOINT,
        )
    complete = [p for _, p in reversed(CheckpointManager(root).complete_checkpoints())]
    if not complete:
        raise UserError(f"{root} holds no complete checkpoint yet", GIVE_A_CHECKPOINT)
    for candidate in complete:
        problems = file_problems(candidate, log)
        if not problems:
            which = "complete" if candidate == complete[0] else "intact"
            log(f"exporting {candidate}, the latest {which} checkpoint in {root}")
            return candidate
        log(f"skipping {candidate}: damaged ({'; '.join(problems)})")
    raise UserError(
        f"every complete checkpoint in {root} is damaged ({', '.join(p.name for p in complete)})",
        "export a checkpoint from elsewhere, or train again",
    )


def file_problems(checkpoint: Path, log) -> list[str]:
    """What :func:`damage` finds (links, sizes, checksums); a link raises at once, naming
    every link. Says once when the checkpoint has no checksums (an earlier version's)."""
    from hybridflow.trainer.lifecycle.checkpoint_files import (
        LINKS_FIX,
        damage,
        has_checksums,
        links_problem,
    )

    links = links_problem(checkpoint)
    if links is not None:
        raise UserError(links, LINKS_FIX)
    if not has_checksums(checkpoint):
        log(f"{checkpoint} was saved by an earlier version, without content checksums: only "
            "its file sizes are checked")  # fmt: skip
    return damage(checkpoint)
