import pickle

import numpy as np
import pytest
import torch

from hybridflow.protocol import Batch


def make_batch(n: int = 6) -> Batch:
    return Batch(
        tensors={
            "input_ids": torch.arange(n * 3).reshape(n, 3),
            "mask": torch.arange(n) % 2 == 0,
            "logprobs": torch.linspace(-1, 0, n * 2, dtype=torch.bfloat16).reshape(n, 2),
        },
        arrays={
            "uid": [f"u{i}" for i in range(n)],
            "ground_truth": [{"answer": i} for i in range(n)],
        },
        meta={"temperature": 0.7},
    )


def assert_same(a: Batch, b: Batch) -> None:
    assert a.tensors.keys() == b.tensors.keys() and a.arrays.keys() == b.arrays.keys()
    for k in a.tensors:
        assert a.tensors[k].dtype == b.tensors[k].dtype, k
        assert torch.equal(a.tensors[k], b.tensors[k]), k
    for k in a.arrays:
        assert a.arrays[k].tolist() == b.arrays[k].tolist(), k
    assert a.meta == b.meta


def test_construction_checks_leading_dimension():
    with pytest.raises(ValueError, match="leading dimension"):
        Batch({"a": torch.zeros(3, 2)}, {"b": np.zeros(4)})
    with pytest.raises(ValueError, match="scalar"):
        Batch({"a": torch.tensor(1.0)})
    b = make_batch(4)
    assert len(b) == 4
    assert b["ground_truth"].dtype == object and b["ground_truth"][2] == {"answer": 2}
    assert b["uid"].dtype == object
    with pytest.raises(ValueError, match="leading dimension"):
        b["extra"] = torch.zeros(5)
    # A list of equal-length lists stays one object per row, not a 2-D array.
    assert Batch(arrays={"tokens": [[1, 2], [3, 4]]})["tokens"].shape == (2,)


def test_select_and_pop():
    b = make_batch()
    s = b.select("input_ids", "uid")
    assert s.keys() == ["input_ids", "uid"] and s.meta == b.meta
    assert s["input_ids"] is b["input_ids"]  # no copy
    popped = b.pop("mask", "ground_truth")
    assert popped.keys() == ["mask", "ground_truth"]
    assert "mask" not in b and "ground_truth" not in b and "uid" in b
    with pytest.raises(KeyError, match="nope"):
        b.select("nope")


def test_union_accepts_equal_and_refuses_conflicts():
    b = make_batch()
    left, right = b.select("input_ids", "uid"), b.select("mask", "uid")
    merged = left.union(right)
    assert sorted(merged.keys()) == sorted(["input_ids", "mask", "uid"])
    # Same key, equal values (different objects): fine.
    same = Batch({"input_ids": b["input_ids"].clone()})
    assert left.union(same)["input_ids"].equal(b["input_ids"])
    conflicting = Batch({"input_ids": b["input_ids"] + 1})
    with pytest.raises(ValueError, match="input_ids"):
        left.union(conflicting)
    with pytest.raises(ValueError, match="uid"):
        left.union(Batch(arrays={"uid": [f"x{i}" for i in range(6)]}))
    with pytest.raises(ValueError, match="temperature"):
        left.union(Batch(meta={"temperature": 1.0}))


def test_concat_of_chunks_is_identity():
    b = make_batch(6)
    pieces = b.chunk(3)
    assert [len(p) for p in pieces] == [2, 2, 2]
    assert pieces[1]["uid"].tolist() == ["u2", "u3"]
    assert_same(Batch.concat(pieces), b)
    assert [len(p) for p in b.split(4)] == [4, 2]
    assert_same(Batch.concat(b.split(4)), b)
    with pytest.raises(ValueError, match="pad_to_divisor"):
        b.chunk(4)


def test_pad_to_divisor_then_unpad_round_trip():
    b = make_batch(5)
    padded, pad = b.pad_to_divisor(4)
    assert pad == 3 and len(padded) == 8
    # The filler rows are copies of the first rows: valid data, not zeros.
    assert padded["uid"].tolist()[5:] == ["u0", "u1", "u2"]
    assert torch.equal(padded["input_ids"][5:], b["input_ids"][:3])
    assert_same(padded.unpad(pad), b)
    same, zero = b.pad_to_divisor(5)
    assert zero == 0 and same is b
    chunks = padded.chunk(4)
    assert_same(Batch.concat(chunks).unpad(pad), b)


def test_repeat_order():
    b = Batch({"x": torch.tensor([10, 20, 30])}, {"uid": ["a", "b", "c"]})
    inter = b.repeat(2, interleave=True)
    assert inter["x"].tolist() == [10, 10, 20, 20, 30, 30]
    assert inter["uid"].tolist() == ["a", "a", "b", "b", "c", "c"]
    tiled = b.repeat(2, interleave=False)
    assert tiled["x"].tolist() == [10, 20, 30, 10, 20, 30]
    assert tiled["uid"].tolist() == ["a", "b", "c", "a", "b", "c"]


@pytest.mark.parametrize(
    "idx",
    [[4, 0, 2], torch.tensor([4, 0, 2]), np.array([4, 0, 2]), torch.tensor([False, True] * 3)],
)
def test_index_and_reorder(idx):
    b = make_batch(6)
    out = b.index(idx)
    expected_rows = [4, 0, 2] if len(idx) == 3 else [1, 3, 5]
    assert out["uid"].tolist() == [f"u{i}" for i in expected_rows]
    assert out["input_ids"][:, 0].tolist() == [3 * i for i in expected_rows]
    assert b[idx]["uid"].tolist() == out["uid"].tolist()
    b.reorder(idx)
    assert_same(b, out)


def test_getitem_slices_and_ints():
    b = make_batch(6)
    assert b[1:3]["uid"].tolist() == ["u1", "u2"]
    assert len(b[2]) == 1 and b[2]["uid"].tolist() == ["u2"]
    assert b[-1]["uid"].tolist() == ["u5"]
    with pytest.raises(KeyError):
        b["missing"]


def test_to_device_keeps_values():
    b = make_batch()
    moved = b.to("cpu")
    assert_same(moved, b)
    if torch.cuda.is_available():  # pragma: no cover - CPU CI
        assert moved.to("cuda")["input_ids"].is_cuda


def test_pickle_round_trip_keeps_dtypes_and_values():
    b = make_batch()
    b2 = pickle.loads(pickle.dumps(b, protocol=pickle.HIGHEST_PROTOCOL))
    assert_same(b2, b)
    b2["input_ids"][0, 0] = 99  # writable, independent storage
    assert b["input_ids"][0, 0] == 0


def test_an_empty_column_from_a_zero_copy_reader_is_rebuilt():
    # Ray hands out an empty buffer as a read-only numpy array of stride 0
    from numpy.lib.stride_tricks import as_strided

    from hybridflow.protocol import raw_to_tensor

    raw = as_strided(np.empty(0, np.uint8), (0,), (0,))
    raw.flags.writeable = False
    tensor = raw_to_tensor(torch.float32, (4, 0), raw)
    assert tensor.shape == (4, 0) and tensor.dtype == torch.float32


def test_pickled_size_is_close_to_raw_tensor_bytes():
    big = torch.randint(0, 50_000, (256, 1024), dtype=torch.int64)
    raw = big.numel() * big.element_size()
    b = Batch({"input_ids": big, "mask": torch.ones(256, 1024, dtype=torch.bool)})
    raw += 256 * 1024
    size = len(pickle.dumps(b, protocol=pickle.HIGHEST_PROTOCOL))
    assert raw <= size < raw * 1.01 + 4096
    # A slice of a big tensor costs its own bytes, not the whole storage.
    view = Batch({"input_ids": big[:8]})
    assert len(pickle.dumps(view, protocol=5)) < 8 * 1024 * 8 + 4096
    assert len(pickle.dumps({"input_ids": big[:8]}, protocol=5)) > raw // 2  # plain torch does not
