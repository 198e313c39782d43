"""`hybridflow export`: a checkpoint becomes an HF directory transformers loads with the
same logits as the trained policy."""

from __future__ import annotations

import torch
from trainer_helpers import tiny_config

from hybridflow.cli import main
from hybridflow.data.chat import encode_chat_prompt
from hybridflow.trainer.run import train


def test_export_round_trip_matches_transformers(tmp_path, quiet):
    transformers = __import__("transformers")
    cfg = tiny_config(tmp_path, "trainer.total_steps=1", "actor.lr=1e-2")
    train(cfg, log=quiet)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_1"
    out = tmp_path / "hf"
    assert main(["export", str(checkpoint), str(out)]) == 0

    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    prompt = encode_chat_prompt(tokenizer, [{"role": "user", "content": "12+34="}])
    ids = torch.tensor([prompt + tokenizer.encode("46")])

    # The trained weights, read straight from the checkpoint through the actor learner.
    from hybridflow.learners.core import TrainCore
    from hybridflow.learners.modules import PolicyModel
    from hybridflow.models import load_model

    trained = load_model("tiny")
    initial_logits = trained(ids).detach()
    TrainCore(PolicyModel(trained), device="cpu", fsdp=False).load(
        checkpoint / "actor", trainable_only=False
    )
    with torch.no_grad():
        ours, theirs = trained(ids), hf(ids).logits
    assert not torch.allclose(ours, initial_logits)  # training moved the weights
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def test_export_rejects_incomplete_checkpoint(tmp_path, capsys):
    (tmp_path / "step_3" / "actor").mkdir(parents=True)
    assert main(["export", str(tmp_path / "step_3"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "not a complete hybridflow checkpoint" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
