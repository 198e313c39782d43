"""A checkpoint holding a NaN or an inf weight is refused at load, naming the file and the
tensor, on every path a checkpoint takes into a model: our decoder, transformers' fallback,
a reward model, `train` and `serve`."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from hybridflow.cli import main
from hybridflow.errors import UserError
from hybridflow.models import build_model, load_model
from hybridflow.models.checkpoint_io.finite_weights import non_finite_count
from hybridflow.models.checkpoint_io.hf_writer import save_model
from hybridflow.models.presets import preset_config

TENSOR = "model.layers.1.mlp.down_proj.weight"


def _poison(directory: Path, part: str, value: float) -> tuple[Path, str]:
    """Sets one entry of the first tensor whose name holds ``part`` to ``value``; returns
    its file and name."""
    for file in sorted(directory.glob("*.safetensors")):
        weights = load_file(file)
        name = next((n for n in sorted(weights) if part in n), None)
        if name is not None:
            weights[name].view(-1)[0] = value
            save_file(weights, file, metadata={"format": "pt"})
            return file, name
    raise AssertionError(f"no tensor named *{part}* in {directory}")


def _tiny_dir(path: Path) -> Path:
    from hybridflow.models.tokenizer import build_char_tokenizer

    save_model(build_model(preset_config("tiny"), dtype=torch.float32), str(path))
    build_char_tokenizer().save_pretrained(str(path))
    return path


def test_non_finite_count():
    assert non_finite_count(torch.zeros(5)) == 0
    assert non_finite_count(torch.tensor([1.0, math.nan, -math.inf, math.inf])) == 3
    assert non_finite_count(torch.tensor([1.0, math.nan], dtype=torch.bfloat16)) == 1
    assert non_finite_count(torch.arange(4)) == 0  # integer tensors hold no NaN
    fp8 = torch.tensor([1.0, math.nan, 2.0]).to(torch.float8_e4m3fn)  # fp8 checkpoints
    assert non_finite_count(fp8) == 1


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_our_decoder_refuses_a_non_finite_weight(tmp_path, value):
    model = _tiny_dir(tmp_path / "model")
    file, name = _poison(model, TENSOR, value)
    with pytest.raises(UserError, match=f"{file}: tensor {name} holds 1 non-finite"):
        load_model(str(model))


def test_transformers_fallback_refuses_a_non_finite_weight(tmp_path):
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=97, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    transformers.GPT2LMHeadModel(config).save_pretrained(str(tmp_path))
    _, name = _poison(tmp_path, "mlp.c_fc.weight", math.nan)
    with pytest.raises(UserError, match=f"{tmp_path}: tensor .*{name} holds 1 non-finite"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_reward_model_refuses_a_non_finite_weight(tmp_path, family):
    from hybridflow.models.checkpoint_io.sequence_classifier import load_sequence_classifier

    if family == "llama":  # our decoder with a score head
        sys.path.insert(0, str(Path(__file__).parents[2]))
        from reward_model_helpers import write_reward_model

        write_reward_model(tmp_path)
    else:  # transformers' classifier
        config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=97,
                                         n_positions=64, num_labels=1, pad_token_id=0,
                                         bos_token_id=0, eos_token_id=0)  # fmt: skip
        transformers.GPT2ForSequenceClassification(config).save_pretrained(str(tmp_path))
    _poison(tmp_path, "score.weight", math.nan)
    with pytest.raises(UserError, match="tensor score.weight holds 1 non-finite"):
        load_sequence_classifier(str(tmp_path))


def test_serve_refuses_a_non_finite_weight_at_startup(tmp_path, capsys):
    pytest.importorskip("aiohttp")
    model = _tiny_dir(tmp_path / "model")
    _, name = _poison(model, TENSOR, math.nan)
    assert main(["serve", "--model", str(model), "--device", "cpu", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"tensor {name} holds 1 non-finite" in err
