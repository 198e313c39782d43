"""Values through ray_transport's encode/decode, with the buffers read-only as Ray hands them
out of its object store (Ray itself: tests/controller/test_ray.py)."""

import numpy as np
import pytest
import torch
from toy_workers import assert_same_batch, trainer_batch

from hybridflow.controller import ray_transport
from hybridflow.protocol import Batch


def as_ray_reads(encoded: ray_transport.Encoded) -> ray_transport.Encoded:
    """The encoded value as a reader gets it from Ray: the same bytes, read-only views."""
    buffers = []
    for buffer in encoded.buffers:
        view = buffer.view()
        view.flags.writeable = False
        buffers.append(view)
    return ray_transport.Encoded(encoded.payload, tuple(buffers))


def test_a_batch_of_every_trainer_dtype_round_trips_exactly():
    batch = trainer_batch()
    got = ray_transport.decode(as_ray_reads(ray_transport.encode(batch)))
    assert_same_batch(got, batch)


def test_tensors_leave_the_pickle_stream_each_once():
    big = torch.randn(256, 256)  # 256 KiB
    encoded = ray_transport.encode({"twice": [big, big], "batch": Batch({"x": big})})
    assert len(encoded.payload) < 1000  # the bytes travel out of band
    assert [b.nbytes for b in encoded.buffers] == [big.numel() * 4]
    got = ray_transport.decode(as_ray_reads(encoded))
    one, other = got["twice"]
    assert one.data_ptr() == other.data_ptr() and torch.equal(got["batch"]["x"], big)


def test_read_only_buffers_become_private_writable_memory():
    sent = torch.arange(1 << 19)  # 4 MiB
    encoded = as_ray_reads(ray_transport.encode(sent))
    first = ray_transport.decode(encoded)
    second = ray_transport.decode(encoded)  # another rank reading the same object
    first[0] = -5
    assert second[0] == 0 and sent[0] == 0 and encoded.buffers[0][0] == 0


def test_writable_buffers_are_used_as_they_are():
    buffers = [np.arange(8, dtype=np.uint8)]
    (tensor,) = ray_transport.private_tensors(buffers)
    assert tensor.data_ptr() == buffers[0].ctypes.data


def test_functions_of_a_script_travel_by_value():
    pytest.importorskip("ray")  # Ray's cloudpickle, as Ray pickles call arguments
    local = lambda x: x + 1  # noqa: E731 - not importable by reference
    encoded = ray_transport.encode(local)
    assert ray_transport.decode(encoded)(1) == 2


def test_an_empty_buffer_with_stride_zero_becomes_an_empty_column():
    # what Ray hands back for a column of no bytes: numpy strides (0,)
    empty = np.lib.stride_tricks.as_strided(np.empty(0, np.uint8), (0,), (0,))
    empty.flags.writeable = False
    (raw,) = ray_transport.private_tensors([empty])
    assert raw.view(torch.float32).reshape(6, 0).shape == (6, 0)
