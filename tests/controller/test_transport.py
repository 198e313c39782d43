import glob
import os

import numpy as np
import torch

from hybridflow.controller import transport
from hybridflow.protocol import Batch


def test_round_trip_through_shared_memory_is_exact_and_leaves_no_file():
    big = torch.randint(0, 1000, (512, 1024))  # 4 MiB: above SHM_MIN_BYTES
    batch = Batch(
        {"ids": big, "logp": torch.randn(512, 3).bfloat16(), "empty": torch.zeros(512, 0)},
        {"uid": [f"u{i}" for i in range(512)], "gt": [{"a": i} for i in range(512)]},
        {"step": 3},
    )
    message = {"args": (batch, big[:2, :5]), "n": 4}
    data = transport.encode(message, "test-owner")
    assert len(data) < 100_000  # the tensor bytes are not in the message itself
    assert len(glob.glob("/dev/shm/" + transport.segment_prefix("test-owner") + "*")) == 1
    out = transport.decode(data)
    assert glob.glob("/dev/shm/" + transport.segment_prefix("test-owner") + "*") == []
    got = out["args"][0]
    assert torch.equal(got["ids"], big) and torch.equal(got["logp"], batch["logp"])
    assert got["logp"].dtype == torch.bfloat16 and got["empty"].shape == (512, 0)
    assert got["gt"][7] == {"a": 7} and got.meta == {"step": 3}
    assert torch.equal(out["args"][1], big[:2, :5]) and out["n"] == 4
    got["ids"][0, 0] = -1  # writable, and not aliasing the sender's tensor
    assert big[0, 0] != -1


def test_small_messages_are_inline():
    data = transport.encode([torch.arange(4), np.arange(3)], "test-small")
    assert glob.glob("/dev/shm/" + transport.segment_prefix("test-small") + "*") == []
    tensor, array = transport.decode(data)
    assert tensor.tolist() == [0, 1, 2, 3] and array.tolist() == [0, 1, 2]


def test_remove_segments_cleans_up_unreceived_messages():
    transport.encode(torch.zeros(1 << 18), "test-orphan")  # 2 MiB, never decoded
    prefix = "/dev/shm/" + transport.segment_prefix("test-orphan")
    assert len(glob.glob(prefix + "*")) == 1
    transport.remove_segments("test-orphan")
    assert glob.glob(prefix + "*") == [] and not os.path.exists(prefix)


def test_one_segment_for_all_ranks_with_private_copies_on_write():
    shared = torch.arange(1 << 19)  # 4 MiB, sent to two ranks
    messages, segment = transport.encode_many([(shared, 0), (shared, 1)], "test-many")
    assert os.path.getsize(segment) == shared.numel() * 8  # written once, not per rank
    (first, rank0), (second, rank1) = (transport.decode(m) for m in messages)
    first[0] = -5  # one rank editing its batch in place ...
    assert second[0] == 0 and shared[0] == 0  # ... changes nothing the others see
    assert (rank0, rank1) == (0, 1) and torch.equal(second, shared)
    os.unlink(segment)  # the sender's job once every rank has decoded
    assert torch.equal(second, shared)  # mappings outlive the file
