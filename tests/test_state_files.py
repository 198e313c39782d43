"""A checkpoint someone sends you cannot run code: planted pickles in trainer_state.pt,
extra_rank0.pt, rng_state.pt and the DCP .metadata (also through a module's attributes), a
BYTES item declared for a weight and a shard entry naming a file outside the checkpoint are
refused, on resume and on export, and nothing they ask for runs."""

from __future__ import annotations

import pickle
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridflow.cli import main
from hybridflow.errors import UserError
from hybridflow.state_files import check_dcp_metadata, load_state_file
from hybridflow.trainer.lifecycle.checkpoint import (
    load_rng_state,
    restore_rng_state,
    save_rng_state,
)

sys.path.insert(0, str(Path(__file__).parent / "trainer"))
from crafted_checkpoints import (  # noqa: E402
    Planted,
    declare_bytes_item,
    planted_torch_file,
    point_entry_at,
    reseal,
)
from trainer_helpers import tiny_config  # noqa: E402


def plant(path: Path, marker: Path, *, raw_pickle: bool = False) -> None:
    if raw_pickle:  # what torch.distributed.checkpoint reads with plain pickle.load
        path.write_bytes(pickle.dumps({"evil": Planted(marker)}))
    else:
        torch.save({"step": 1, "rng_cpu": torch.get_rng_state(), "evil": Planted(marker)}, path)


def test_the_planted_pickle_would_run_with_an_unrestricted_load(tmp_path):
    """The payload is real: a plain torch.load runs it (so the refusals below mean something)."""
    plant(tmp_path / "state.pt", tmp_path / "ran")
    torch.load(tmp_path / "state.pt", weights_only=False)
    assert (tmp_path / "ran").exists()


@pytest.mark.parametrize("name", ["trainer_state.pt", "extra_rank0.pt", "rng_state.pt"])
def test_planted_state_files_are_refused_and_do_not_run(tmp_path, name):
    plant(tmp_path / name, tmp_path / "ran")
    with pytest.raises(UserError, match="could run code"):
        if name == "rng_state.pt":
            load_rng_state(tmp_path, name)
        else:
            load_state_file(tmp_path / name)
    assert not (tmp_path / "ran").exists()


def test_a_planted_dcp_metadata_is_refused(tmp_path):
    plant(tmp_path / ".metadata", tmp_path / "ran", raw_pickle=True)
    with pytest.raises(UserError, match="posix.system is not checkpoint metadata"):
        check_dcp_metadata(tmp_path)
    assert not (tmp_path / "ran").exists()


def through_a_module_attribute(module: str, name: str, command: str) -> bytes:
    """A protocol-4 pickle calling ``module``'s attribute ``name`` (dotted: pickle resolves
    "os.system" through the module's own imports) with ``command``."""

    def text(value: str) -> bytes:
        return pickle.SHORT_BINUNICODE + bytes([len(value)]) + value.encode()

    return (b"\x80\x04" + text(module) + text(name) + pickle.STACK_GLOBAL + text(command)
            + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)  # fmt: skip


@pytest.mark.parametrize(
    "module, name",
    [
        ("torch.distributed.checkpoint.metadata", "os.system"),  # the module imports os
        ("pathlib", "PosixPath.touch"),  # a method of an allowed class
        ("torch.distributed.checkpoint.planner", "io.open"),  # a module allowed before
    ],
)
def test_metadata_globals_are_allowed_by_exact_name_only(tmp_path, module, name):
    marker = tmp_path / "ran"
    payload = through_a_module_attribute(module, name, f"touch {marker}")
    (tmp_path / ".metadata").write_bytes(payload)
    with pytest.raises(UserError, match="is not checkpoint metadata"):
        check_dcp_metadata(tmp_path)
    assert not marker.exists()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from hybridflow.trainer.lifecycle.run import train

    root = tmp_path_factory.mktemp("ckpt")
    train(tiny_config(root, "trainer.total_steps=1"), log=lambda *a: None)
    return root / "run" / "checkpoints" / "step_1"


def test_our_own_checkpoint_passes_the_checks(checkpoint):
    check_dcp_metadata(checkpoint / "actor")
    assert load_state_file(checkpoint / "trainer_state.pt")["step"] == 1
    assert "rng_cpu" in load_state_file(checkpoint / "actor" / "extra_rank0.pt")


WEIGHT = "model.lm.model.norm.weight"


def plant_bytes_item(step: Path, marker: Path) -> None:
    declare_bytes_item(step / "actor", WEIGHT, planted_torch_file(marker), "__0_9.distcp")


def plant_outside_entry(step: Path, marker: Path) -> None:
    (step / "outside.distcp").write_bytes(planted_torch_file(marker))
    point_entry_at(step / "actor", WEIGHT, "../outside.distcp")


@pytest.mark.parametrize(
    "planted, attack, said",
    [
        ("extra_rank0.pt", lambda step, marker: plant(step / "actor/extra_rank0.pt", marker),
         "could run code"),
        (".metadata", lambda step, marker: plant(step / "actor/.metadata", marker, raw_pickle=True),
         "could run code"),
        (".metadata", plant_bytes_item, f"declares the tensor {WEIGHT} as a pickled bytes item"),
        (".metadata", plant_outside_entry,
         "names '../outside.distcp', not a file directly inside the checkpoint directory"),
    ],
    ids=["extra_rank0", "metadata_pickle", "bytes_item", "path_outside"],
)  # fmt: skip
def test_export_of_a_planted_checkpoint_exits_2_without_running_it(
    checkpoint, tmp_path, capsys, planted, attack, said
):
    import shutil

    copy = tmp_path / "step_1"
    shutil.copytree(checkpoint, copy)
    attack(copy, tmp_path / "ran")
    reseal(copy)  # metadata.json lists the crafted files: only the loader can tell
    assert main(["export", str(copy), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{copy / 'actor' / planted}" in err and said in err and "Traceback" not in err
    assert not (tmp_path / "ran").exists()
    assert not (tmp_path / "out").exists()


def test_resume_from_a_planted_trainer_state_does_not_run_it(checkpoint, tmp_path):
    import shutil

    from hybridflow.trainer.lifecycle.run import train

    run_dir = tmp_path / "run" / "checkpoints"
    shutil.copytree(checkpoint, run_dir / "step_1")
    plant(run_dir / "step_1" / "trainer_state.pt", tmp_path / "ran")
    cfg = tiny_config(tmp_path, "trainer.total_steps=2", f"trainer.resume={run_dir}/step_1")
    with pytest.raises(UserError):  # damaged (its size changed) or refused: never loaded
        train(cfg, log=lambda *a: None)
    assert not (tmp_path / "ran").exists()


def test_rng_state_of_earlier_versions_still_loads(tmp_path):
    """Earlier checkpoints pickled numpy's state tuple: plain array data, allowed."""
    random.seed(3)
    np.random.seed(3)
    legacy = {"python": random.getstate(), "numpy": np.random.get_state(),
              "torch": torch.get_rng_state()}  # fmt: skip
    torch.save(legacy, tmp_path / "rng_state.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    load_rng_state(tmp_path)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_rng_state_round_trip_in_the_new_format(tmp_path):
    np.random.seed(5)
    save_rng_state(tmp_path)
    expected = (random.random(), np.random.randn(), torch.rand(1).item())  # randn: gauss cache
    restore_rng_state(load_state_file(tmp_path / "rng_state.pt"))
    assert (random.random(), np.random.randn(), torch.rand(1).item()) == expected
