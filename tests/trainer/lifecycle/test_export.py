"""`hybridflow export`: a checkpoint becomes an HF directory transformers loads with the
same logits as the trained policy; a run directory exports its latest complete checkpoint;
a missing path, an unfinished checkpoint and links inside a checkpoint are refused by name."""

from __future__ import annotations

import shutil

import pytest
import torch
from trainer_helpers import tiny_config

from hybridflow.cli import main
from hybridflow.data.chat import encode_chat_prompt
from hybridflow.trainer.lifecycle.run import train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory holding the complete checkpoints of steps 1 and 2 (lr 1e-2)."""
    root = tmp_path_factory.mktemp("export")
    cfg = tiny_config(root, "trainer.total_steps=2", "trainer.save_freq=1", "actor.lr=1e-2")
    train(cfg, log=lambda *a, **k: None)
    return root / "run"


def test_export_round_trip_matches_transformers(run_dir, tmp_path, capsys, recwarn):
    transformers = __import__("transformers")
    checkpoint = run_dir / "checkpoints" / "step_2"
    out = tmp_path / "hf"
    assert main(["export", str(checkpoint), str(out)]) == 0
    assert capsys.readouterr().out == f"wrote Hugging Face model directory {out}\n"
    assert not [w for w in recwarn if "torch.distributed" in str(w.message)]

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


def test_an_out_the_file_system_refuses_is_named_before_any_work(tmp_path, capsys):
    """It was a FileNotFoundError traceback once the model had been loaded and converted."""
    (tmp_path / "step_3" / "actor").mkdir(parents=True)
    out = "/proc/hybridflow-export"  # procfs makes no directories, even for root
    assert main(["export", str(tmp_path / "step_3"), out]) == 2
    err = capsys.readouterr().err
    assert f"{out}: the directory cannot be made" in err and "not a complete" not in err


def test_export_of_a_missing_path_says_it_does_not_exist(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'nowhere'} does not exist" in err and "not a complete" not in err


def test_export_of_a_run_directory_takes_its_latest_complete_checkpoint(run_dir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / "checkpoints" / "step_2" / "COMPLETE").unlink()  # as if killed while saving
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert f"exporting {run / 'checkpoints' / 'step_1'}, the latest complete checkpoint" in said
    from safetensors.torch import load_file

    assert main(["export", str(run / "checkpoints" / "step_1"), str(tmp_path / "direct")]) == 0
    exported, direct = (load_file(tmp_path / d / "model.safetensors") for d in ("out", "direct"))
    assert exported.keys() == direct.keys()
    assert all(torch.equal(exported[k], direct[k]) for k in exported)


def test_export_refuses_links_inside_a_checkpoint_and_names_them(run_dir, tmp_path, capsys):
    checkpoint = tmp_path / "step_2"
    shutil.copytree(run_dir / "checkpoints" / "step_2", checkpoint)
    secret = tmp_path / "secret.txt"
    secret.write_text("not for export")
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "data.bin").write_bytes(b"x" * 1000)
    (checkpoint / "tokenizer" / "special_tokens_map.json").symlink_to(secret)
    (checkpoint / "tokenizer" / "extra").symlink_to(tmp_path / "big", target_is_directory=True)
    assert main(["export", str(checkpoint), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"tokenizer/special_tokens_map.json (a link to {secret})" in err
    assert f"tokenizer/extra (a link to {tmp_path / 'big'})" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_export_verifies_checksums_and_a_run_directory_skips_a_damaged_checkpoint(
    run_dir, tmp_path, capsys
):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    shard = run / "checkpoints" / "step_2" / "actor" / "__0_0.distcp"
    with open(shard, "r+b") as handle:  # same size, zeroed bytes
        handle.seek(1000)
        handle.write(bytes(512))
    assert main(["export", str(shard.parent.parent), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "step_2 is damaged: actor/__0_0.distcp has other content than when saved" in err
    assert not (tmp_path / "out").exists()
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert f"skipping {run / 'checkpoints' / 'step_2'}: damaged (actor/__0_0.distcp" in said
    assert f"exporting {run / 'checkpoints' / 'step_1'}, the latest intact checkpoint" in said


def test_export_refuses_a_non_empty_directory_unless_told_to_overwrite(run_dir, tmp_path, capsys):
    checkpoint = str(run_dir / "checkpoints" / "step_2")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["export", checkpoint, str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out} already exists and is not empty" in err and "--overwrite" in err
    assert "Traceback" not in err and sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert main(["export", checkpoint, str(out), "--overwrite"]) == 0
    assert (out / "model.safetensors").is_file() and (out / "notes.txt").read_text() == "mine"


def test_exported_weights_get_the_mode_the_umask_gives_as_the_config_does(run_dir, tmp_path):
    import os
    import stat

    previous = os.umask(0o022)
    try:
        assert main(["export", str(run_dir / "checkpoints" / "step_2"), str(tmp_path / "hf")]) == 0
    finally:
        os.umask(previous)
    for name in ("model.safetensors", "config.json"):
        assert stat.S_IMODE((tmp_path / "hf" / name).stat().st_mode) == 0o644, name


def test_a_run_from_a_quantized_checkpoint_exports_bf16_without_its_quantization(
    run_dir, tmp_path, capsys
):
    """model.path stored its weights quantized (its config.json, copied into the checkpoint's
    hf_config.json, says so): the export is plain bf16 and says so."""
    import json

    from safetensors import safe_open

    from hybridflow.trainer.lifecycle.checkpoint_files import METADATA_FILE, checksum

    checkpoint = tmp_path / "step_2"
    shutil.copytree(run_dir / "checkpoints" / "step_2", checkpoint)
    hf_config_file = checkpoint / "hf_config.json"
    hf_config = json.loads(hf_config_file.read_text())
    hf_config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    hf_config_file.write_text(json.dumps(hf_config))
    metadata = json.loads((checkpoint / METADATA_FILE).read_text())  # as if saved so
    metadata["files"]["hf_config.json"] = hf_config_file.stat().st_size
    metadata["checksums"]["hf_config.json"] = checksum(hf_config_file)
    (checkpoint / METADATA_FILE).write_text(json.dumps(metadata))

    out = tmp_path / "hf"
    assert main(["export", str(checkpoint), str(out)]) == 0
    said = capsys.readouterr().out
    assert "stored its weights as fp8" in said and "written in bfloat16" in said
    written = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in written and written["torch_dtype"] == "bfloat16"
    with safe_open(out / "model.safetensors", framework="pt") as weights:
        assert {weights.get_tensor(n).dtype for n in weights.keys()} == {torch.bfloat16}
