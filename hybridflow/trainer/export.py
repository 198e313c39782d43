"""``hybridflow export CKPT OUT``: a checkpoint directory -> a Hugging Face model directory.

Works on RL and SFT checkpoints (``<run_dir>/checkpoints/step_N``): the architecture comes
from the checkpoint's ``hf_config.json``, the weights from ``actor/`` (LoRA adapters are
folded into the base weights of ``model.path``), the tokenizer from ``tokenizer/``. The
result loads with ``transformers.AutoModelForCausalLM.from_pretrained(OUT)``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from hybridflow.errors import UserError


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    """Write the actor of ``checkpoint`` as an HF model directory at ``out``."""
    from hybridflow.learners import lora
    from hybridflow.learners.actor_learner import export_causal_lm
    from hybridflow.learners.core import TrainCore
    from hybridflow.learners.modules import PolicyModel
    from hybridflow.models import build_model, load_model
    from hybridflow.models.architecture import ModelArchitecture
    from hybridflow.trainer.checkpoint import is_complete
    from hybridflow.trainer.run_state import MODEL_CONFIG, TOKENIZER_DIR, read_run_config

    checkpoint, out = Path(checkpoint), Path(out)
    if not (checkpoint / "actor").is_dir() or not is_complete(checkpoint):
        raise UserError(
            f"{checkpoint} is not a complete hybridflow checkpoint (expected actor/ and a "
            "COMPLETE marker)",
            "give a directory <run_dir>/checkpoints/step_N that holds both",
        )
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
        shutil.copytree(tokenizer_dir, out, dirs_exist_ok=True)
    return out
