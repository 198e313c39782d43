import pytest
import torch
from toy_workers import Counter, ReadsPeer, Toy

from hybridflow.controller import Dispatch, fuse, register
from hybridflow.controller.dispatch import dispatch_of, gather, scatter
from hybridflow.controller.worker import resolve_method
from hybridflow.protocol import Batch


def rows(n: int) -> Batch:
    return Batch({"x": torch.arange(n)}, {"uid": [f"u{i}" for i in range(n)]})


def test_dp_split_pads_non_divisible_batch_and_gather_removes_padding():
    batch = rows(5)
    per_rank, pad = scatter(Dispatch.DP_SPLIT, 2, (batch, 0.5), {"extra": "same"})
    assert pad == 1
    assert [a[0]["x"].tolist() for a, _ in per_rank] == [[0, 1, 2], [3, 4, 0]]
    assert all(a[1] == 0.5 and k == {"extra": "same"} for a, k in per_rank)
    echoed = [a[0] for a, _ in per_rank]  # a worker returning one row per input row
    merged = gather(Dispatch.DP_SPLIT, echoed, pad, "echo")
    assert merged["x"].tolist() == [0, 1, 2, 3, 4]
    assert merged["uid"].tolist() == ["u0", "u1", "u2", "u3", "u4"]


def test_dp_split_refuses_results_that_break_the_row_mapping():
    per_rank, pad = scatter(Dispatch.DP_SPLIT, 2, (rows(3),), {})
    with pytest.raises(ValueError, match="one row per input row"):
        gather(Dispatch.DP_SPLIT, [rows(4), rows(1)], pad, "generate")


def test_dp_split_kwargs_and_non_batch_results():
    per_rank, pad = scatter(Dispatch.DP_SPLIT, 3, (), {"batch": rows(6)})
    assert pad == 0 and [len(k["batch"]) for _, k in per_rank] == [2, 2, 2]
    assert gather(Dispatch.DP_SPLIT, [{"loss": 1.0}, {"loss": 2.0}], 0, "m") == [
        {"loss": 1.0},
        {"loss": 2.0},
    ]
    assert gather(Dispatch.DP_SPLIT, [None, None], 0, "m") is None
    with pytest.raises(ValueError, match="at least one Batch"):
        scatter(Dispatch.DP_SPLIT, 2, (1,), {})
    with pytest.raises(ValueError, match="differ in length"):
        scatter(Dispatch.DP_SPLIT, 2, (rows(2), rows(3)), {})


def test_one_to_all_rank_zero_all_to_all():
    per_rank, _ = scatter(Dispatch.ONE_TO_ALL, 3, (7,), {"k": 1})
    assert per_rank == [((7,), {"k": 1})] * 3
    assert gather(Dispatch.ONE_TO_ALL, [1, 2, 3], 0, "m") == [1, 2, 3]
    assert gather(Dispatch.RANK_ZERO, ["r0", "r1"], 0, "m") == "r0"
    per_rank, _ = scatter(Dispatch.ALL_TO_ALL, 2, ([1, 2],), {"k": ["a", "b"]})
    assert per_rank == [((1,), {"k": "a"}), ((2,), {"k": "b"})]
    with pytest.raises(ValueError, match="one entry per rank"):
        scatter(Dispatch.ALL_TO_ALL, 2, ([1, 2, 3],), {})


def test_register_and_resolve():
    @register
    def plain():
        pass

    @register(dispatch=Dispatch.DP_SPLIT)
    def split():
        pass

    assert dispatch_of(plain) is Dispatch.ONE_TO_ALL and dispatch_of(split) is Dispatch.DP_SPLIT
    assert resolve_method(Toy, "transform") == (Dispatch.DP_SPLIT, "")
    with pytest.raises(AttributeError, match="not a remote method.*transform"):
        resolve_method(Toy, "private_helper")
    fused = fuse(counter=Counter, reader=ReadsPeer)
    assert resolve_method(fused, "reader.peer_value") == (Dispatch.RANK_ZERO, "reader")
    with pytest.raises(AttributeError, match="no role 'critic'"):
        resolve_method(fused, "critic.update")
    with pytest.raises(TypeError):
        register(dispatch="dp_split")
