"""Segments a sender reuses: a message's views keep their bytes for as long as they live."""

import glob
import os

import pytest
import torch

from hybridflow.controller import transport
from hybridflow.controller.segment_pool import MAX_RECEIVERS

MiB = 1 << 20


@pytest.fixture
def pool():
    pool = transport.segment_pool("test-pool")
    yield pool
    pool.close()
    transport.remove_segments("test-pool")
    assert glob.glob("/dev/shm/" + transport.segment_prefix("test-pool") + "*") == []


def send(pool, tensor, reader):
    [message], _ = transport.encode_many([tensor], "test-pool", receiver_unlinks=True, pool=pool)
    return transport.decode(message, reader)


def test_a_released_segment_is_written_again_in_place(pool):
    reader = transport.segment_reader()
    first = send(pool, torch.arange(MiB // 4), reader)  # 2 MiB of int64
    assert glob.glob("/dev/shm/" + transport.segment_prefix("test-pool") + "*") == []
    del first  # the last view: the receiver releases the segment
    second = send(pool, torch.arange(MiB // 4) * 3, reader)
    assert len(pool.segments) == 1 and pool.segments[0].generation == 2
    assert torch.equal(second, torch.arange(MiB // 4) * 3)


def test_a_view_kept_after_later_calls_still_reads_its_own_bytes(pool):
    reader = transport.segment_reader()
    kept = send(pool, {"x": torch.arange(MiB // 4)}, reader)["x"][10:]  # a view of a view
    for scale in (2, 3):
        assert torch.equal(
            send(pool, torch.arange(MiB // 4) * scale, reader), torch.arange(MiB // 4) * scale
        )
    assert len(pool.segments) == 2  # the kept one is busy: later calls took another
    assert torch.equal(kept, torch.arange(10, MiB // 4))
    del kept
    send(pool, torch.zeros(MiB // 4), reader)
    assert len(pool.segments) == 2  # freed again, nothing new made


def test_a_receiver_that_wrote_in_place_reads_the_next_message(pool):
    # Its private copies of the pages it wrote are dropped at release: else it would keep
    # reading its own edits instead of what the sender wrote next.
    reader = transport.segment_reader()
    first = send(pool, torch.zeros(MiB // 4, dtype=torch.long), reader)
    first[::512] = -1  # one write in every page
    del first
    second = send(pool, torch.arange(MiB // 4), reader)
    assert len(pool.segments) == 1 and torch.equal(second, torch.arange(MiB // 4))


def test_receivers_get_private_copies_on_write(pool):
    shared = torch.arange(MiB // 4)
    messages, path = transport.encode_many([shared, shared], "test-pool", pool=pool)
    rank0, rank1 = transport.segment_reader(), transport.segment_reader()  # two processes
    first, second = transport.decode(messages[0], rank0), transport.decode(messages[1], rank1)
    os.unlink(path)  # a new segment: the sender unlinks it once every receiver has mapped it
    first[0] = -5
    assert second[0] == 0 and shared[0] == 0
    assert pool.segments[0].capacity < 2 * shared.numel() * 8  # stored once for both


def test_a_segment_is_busy_until_every_receiver_released_it(pool):
    messages, path = transport.encode_many([torch.ones(MiB)] * 2, "test-pool", pool=pool)
    held = transport.decode(messages[1], transport.segment_reader())
    del held  # rank 1 is done, rank 0 never received its message
    transport.encode_many([torch.ones(MiB)] * 2, "test-pool", pool=pool)
    assert len(pool.segments) == 2
    transport.release_unsent(messages[0], pool)  # e.g. rank 0 had died: not sent
    assert pool.segments[0].free()
    os.unlink(path)


def test_a_free_segment_too_small_is_retired_and_its_file_removed(pool):
    reader = transport.segment_reader()
    send(pool, torch.ones(MiB // 4), reader)
    small = pool.segments[0].name
    big = send(pool, torch.ones(4 * MiB), reader)
    assert [s.name for s in pool.segments] != [small] and len(pool.segments) == 1
    assert torch.equal(big, torch.ones(4 * MiB))
    del big
    send(pool, torch.ones(4 * MiB), reader)
    assert small not in reader.mapped  # the receiver unmapped the retired one


def test_too_many_receivers_fall_back_to_a_fresh_segment(pool):
    tensors = [torch.ones(MiB // 4)] * (MAX_RECEIVERS + 1)
    messages, path = transport.encode_many(tensors, "test-pool", pool=pool)
    assert pool.segments == [] and os.path.exists(path)
    assert torch.equal(transport.decode(messages[-1]), tensors[0])
    os.unlink(path)
