"""Values through ray_transport's encode/decode, with the buffers read-only as Ray hands them
out of its object store (Ray itself: tests/controller/test_ray.py)."""

import sys
from fractions import Fraction

import numpy as np
import pytest
import torch
from numpy.lib.stride_tricks import as_strided
from toy_workers import assert_same_batch, trainer_batch

from hybridflow.controller import ray_transport


def as_ray_reads(encoded: ray_transport.Encoded) -> ray_transport.Encoded:
    """The encoded value as a reader gets it from Ray: the same bytes as read-only views,
    an empty one with stride 0."""
    buffers = []
    for buffer in encoded.buffers:
        view = buffer.view() if buffer.size else as_strided(buffer, (0,), (0,))
        view.flags.writeable = False
        buffers.append(view)
    return ray_transport.Encoded(encoded.payload, tuple(buffers))


def test_a_batch_of_every_trainer_dtype_round_trips_exactly():
    batch = trainer_batch()
    got = ray_transport.decode(as_ray_reads(ray_transport.encode(batch)))
    assert_same_batch(got, batch)


def test_tensors_leave_the_pickle_stream_each_once():
    big = torch.randn(256, 256)  # 256 KiB
    encoded = ray_transport.encode({"twice": [big, big], "row": big[0]})
    assert len(encoded.payload) < 1000  # the bytes travel out of band
    assert [b.nbytes for b in encoded.buffers] == [big.numel() * 4, 256 * 4]
    got = ray_transport.decode(as_ray_reads(encoded))
    assert got["twice"][0] is got["twice"][1] and torch.equal(got["twice"][0], big)
    assert torch.equal(got["row"], big[0])


def test_a_plain_tensor_travels_as_its_bytes_not_through_torch_pickling():
    weights = {"w": torch.randn(64, 64).bfloat16(), "bias": torch.zeros(64)}
    encoded = ray_transport.encode(weights)
    assert b"_rebuild_tensor" not in encoded.payload
    got = ray_transport.decode(as_ray_reads(encoded))
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], weights["w"])


def test_read_only_buffers_become_private_writable_memory():
    sent = torch.arange(1 << 19)  # 4 MiB
    encoded = as_ray_reads(ray_transport.encode(sent))
    first = ray_transport.decode(encoded)
    second = ray_transport.decode(encoded)  # another rank reading the same object
    first[0] = -5
    assert second[0] == 0 and sent[0] == 0 and encoded.buffers[0][0] == 0


def test_writable_buffers_are_used_as_they_are():
    buffer = np.arange(8, dtype=np.uint8)
    assert ray_transport.private_copy(buffer) is buffer


def test_functions_of_a_script_travel_by_value():
    pytest.importorskip("ray")  # Ray's cloudpickle, as Ray pickles call arguments
    local = lambda x: x + 1  # noqa: E731 - not importable by reference
    encoded = ray_transport.encode(local)
    assert ray_transport.decode(encoded)(1) == 2


def test_without_ray_the_standard_pickler_carries_the_rest(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails
    monkeypatch.setitem(sys.modules, "ray.cloudpickle", None)
    ray_transport._pickler_class.cache_clear()
    try:
        value = {"tensor": torch.arange(3), "third": Fraction(1, 3), "batch": trainer_batch()}
        got = ray_transport.decode(as_ray_reads(ray_transport.encode(value)))
    finally:
        ray_transport._pickler_class.cache_clear()
    assert got["third"] == Fraction(1, 3) and got["tensor"].tolist() == [0, 1, 2]
    assert_same_batch(got["batch"], value["batch"])
