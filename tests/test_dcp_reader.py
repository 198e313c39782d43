"""torch.distributed.checkpoint shards load as tensors and plain values only: a BYTES item
declared where a tensor belongs, a planted pickle in a plain value, and a storage entry that
names a file outside the checkpoint (or a link) are refused, naming the file, and nothing a
crafted checkpoint asks for runs."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hybridflow.dcp_reader import SINGLE_PROCESS_WARNING, load_state
from hybridflow.errors import UserError

sys.path.insert(0, str(Path(__file__).parent / "trainer"))
from crafted_checkpoints import (  # noqa: E402
    declare_bytes_item,
    planted_torch_file,
    point_entry_at,
)

WEIGHT = "model.weight"
LEARNING_RATE = "optimizer.param_groups.0.lr"  # DCP stores the optimizer's plain values as bytes


def trained(lr: float, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def state_of(model, optimizer) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


@pytest.fixture
def saved(tmp_path):
    """A DCP checkpoint of a Linear and its AdamW (lr 1e-3) at ``tmp_path / 'actor'``."""
    model, optimizer = trained(lr=1e-3, seed=0)
    directory = tmp_path / "actor"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        dcp.save(state_of(model, optimizer), checkpoint_id=str(directory), no_dist=True)
    return directory, model


def load_into_fresh(directory: Path):
    model, optimizer = trained(lr=5e-2, seed=1)
    state = state_of(model, optimizer)
    load_state(state, directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])  # fmt: skip
    return model, optimizer


def test_tensors_and_the_optimizers_plain_values_load(saved, recwarn):
    directory, model = saved
    loaded, optimizer = load_into_fresh(directory)
    torch.testing.assert_close(loaded.weight, model.weight, rtol=0, atol=0)
    assert optimizer.param_groups[0]["lr"] == 1e-3  # the checkpoint's, read as a plain value
    assert not [w for w in recwarn if "torch.distributed is" in str(w.message)]  # not printed


def test_torchs_own_loader_runs_a_planted_bytes_item(saved, tmp_path):
    """The attack is real: DCP's default planner unpickles a BYTES item unrestricted."""
    directory, _ = saved
    declare_bytes_item(directory, WEIGHT, planted_torch_file(tmp_path / "ran"), "planted.distcp")
    model, optimizer = trained(lr=1e-3, seed=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        dcp.load(state_of(model, optimizer), checkpoint_id=str(directory), no_dist=True)
    assert (tmp_path / "ran").exists()


def test_a_bytes_item_where_a_tensor_belongs_is_refused_before_reading(saved, tmp_path):
    directory, _ = saved
    declare_bytes_item(directory, WEIGHT, planted_torch_file(tmp_path / "ran"), "planted.distcp")
    with pytest.raises(UserError) as refused:
        load_into_fresh(directory)
    assert f"{directory / '.metadata'} was not loaded" in str(refused.value)
    assert f"declares the tensor {WEIGHT} as a pickled bytes item" in str(refused.value)
    assert not (tmp_path / "ran").exists()


def test_a_planted_pickle_in_a_plain_value_is_refused(saved, tmp_path):
    directory, _ = saved
    payload = planted_torch_file(tmp_path / "ran")
    declare_bytes_item(directory, LEARNING_RATE, payload, "planted.distcp")
    with pytest.raises(UserError) as refused:
        load_into_fresh(directory)
    message = str(refused.value)
    assert f"{directory / 'planted.distcp'} was not loaded" in message
    assert LEARNING_RATE in message and "could run code" in message
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("name", ["../outside.distcp", "/tmp/outside.distcp", "sub/x.distcp"])
def test_an_entry_naming_a_file_outside_the_directory_is_refused(saved, name):
    directory, _ = saved
    point_entry_at(directory, WEIGHT, name)
    with pytest.raises(UserError) as refused:
        load_into_fresh(directory)
    message = str(refused.value)
    assert f"{directory / '.metadata'} was not loaded" in message
    assert f"names {name!r}, not a file directly inside the checkpoint directory" in message


def test_an_entry_naming_a_link_is_refused(saved, tmp_path):
    directory, _ = saved
    shard = next(directory.glob("*.distcp"))
    (directory / "link.distcp").symlink_to(shard)
    point_entry_at(directory, WEIGHT, "link.distcp")
    with pytest.raises(UserError, match="names link.distcp, a link"):
        load_into_fresh(directory)


def test_a_damaged_shard_is_named(saved):
    directory, _ = saved
    for shard in directory.glob("*.distcp"):
        shard.write_bytes(b"\0" * shard.stat().st_size)  # same size, zeroed
    with pytest.raises(UserError, match=r"__0_0\.distcp is damaged"):
        load_into_fresh(directory)


def rewrite_metadata(directory: Path, change) -> None:
    from crafted_checkpoints import read_metadata, write_metadata

    metadata = read_metadata(directory)
    change(metadata)
    write_metadata(directory, metadata)


def test_a_weight_stored_without_chunks_is_refused_not_left_as_initialised(saved):
    directory, _ = saved
    rewrite_metadata(directory, lambda m: setattr(m.state_dict_metadata[WEIGHT], "chunks", []))
    with pytest.raises(UserError, match=f"its chunks of {WEIGHT} hold 0 of its 12 elements"):
        load_into_fresh(directory)


def test_malformed_metadata_is_a_user_error_naming_it(saved):
    directory, _ = saved
    rewrite_metadata(directory, lambda m: setattr(m, "state_dict_metadata", None))
    with pytest.raises(UserError, match=r"\.metadata does not describe this model's state"):
        load_into_fresh(directory)
