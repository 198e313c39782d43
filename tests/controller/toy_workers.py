"""Worker classes for the controller tests (importable by spawned and Ray workers)."""

import os
import subprocess
import time

import torch

from hybridflow.controller import Dispatch, Worker, current_context, register
from hybridflow.protocol import Batch


class Toy(Worker):
    def __init__(self, scale: int = 1, fail_on_rank: int | None = None) -> None:
        if fail_on_rank == self.rank:
            raise RuntimeError(f"cannot build on rank {self.rank}")
        if fail_on_rank is not None and torch.distributed.is_initialized():
            torch.distributed.barrier()  # waits for the failed rank: never returns
        self.scale = scale

    @register(dispatch=Dispatch.DP_SPLIT)
    def transform(self, batch: Batch) -> Batch:
        # One output row per input row, tagged with the rank that computed it.
        y = batch["x"] * self.scale + batch["x"].sum(dim=1, keepdim=True)  # [b, T]
        rank = torch.full((len(batch),), self.rank)
        return Batch({"y": y, "rank": rank}, {"uid": batch["uid"]}, {"seen_rows": len(batch)})

    @register(dispatch=Dispatch.DP_SPLIT)
    def count_rows(self, batch: Batch) -> int:
        return len(batch)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def whoami(self) -> tuple:
        ctx = current_context()
        return ctx.rank, ctx.world_size, ctx.device, self.scale

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def rendezvous_listeners(self) -> list[str]:
        """Addresses this process listens on at the torch.distributed store's port."""
        import psutil

        port = int(os.environ["MASTER_PORT"])
        return sorted(
            c.laddr.ip
            for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        )

    @register(dispatch=Dispatch.RANK_ZERO)
    def sum_of_ranks(self) -> int:
        # A real collective: every rank must take part.
        value = torch.tensor([self.rank])
        torch.distributed.all_reduce(value)
        return int(value.item())

    @register(dispatch=Dispatch.ALL_TO_ALL)
    def add_rank(self, value: int) -> int:
        return value + self.rank

    @register
    def fail(self, message: str, only_rank: int | None = None) -> int:
        if only_rank is None or only_rank == self.rank:
            raise ValueError(message)
        return self.rank

    @register
    def barrier_on(self, ranks: list[int]) -> int:
        """A barrier that only ``ranks`` join: they hit the collective timeout."""
        if self.rank in ranks:
            torch.distributed.barrier()
        return self.rank

    @register
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register
    def pid(self) -> int:
        return os.getpid()

    @register
    def getenv(self, name: str) -> str | None:
        return os.environ.get(name)

    @register
    def start_child(self) -> int:
        """A grandchild of the controller, which must not outlive the group."""
        return subprocess.Popen(["sleep", "300"]).pid

    @register
    def echo(self, value):
        return value

    @register
    def write_then_read(self, tensor: torch.Tensor) -> int:
        """Rank 1 writes into the tensor it received, in place; rank 0 then reads its own."""
        if self.rank == 1:
            tensor[0] = -1
        torch.distributed.barrier()
        return int(tensor[0])

    @register
    def keep(self, batch: Batch) -> None:
        self.kept = batch  # views of the message, kept past this call

    @register
    def kept_sum(self) -> int:
        return int(self.kept["x"].sum())

    def private_helper(self) -> None:
        """Not registered: not callable from the controller."""


class Counter(Worker):
    def __init__(self, start: int = 0) -> None:
        self.value = start

    @register(dispatch=Dispatch.RANK_ZERO)
    def add(self, amount: int) -> int:
        self.value += amount
        return self.value


class ReadsPeer(Worker):
    """A role that uses another role of the same fused worker in place."""

    def __init__(self, start: int = 0) -> None:
        self.peer = self.context.colocated["counter"]

    @register(dispatch=Dispatch.RANK_ZERO)
    def peer_value(self) -> int:
        return self.peer.value


class RecordsClose(Worker):
    """Appends "<tag> <rank> <pid>" to ``path`` when its group shuts down (the close hook)."""

    def __init__(self, path: str, tag: str = "closed") -> None:
        self.path, self.tag = path, tag

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        with open(self.path, "a") as out:
            out.write(f"{self.tag} {self.rank} {os.getpid()}\n")


def closed_lines(path) -> list[str]:
    return sorted(open(path).read().splitlines()) if os.path.exists(path) else []


def trainer_batch(rows: int = 6) -> Batch:
    """Every dtype a training step's Batch carries, plus a non-contiguous column."""
    grid = torch.arange(rows * 10).reshape(rows, 10)
    return Batch(
        {
            "responses": torch.randint(0, 1000, (rows, 5)),  # int64
            "response_mask": torch.ones(rows, 5),  # float32
            "old_logprobs": torch.randn(rows, 5).bfloat16(),
            "token_versions": torch.arange(rows, dtype=torch.int32),
            "image_mask": torch.rand(rows, 3) > 0.5,  # bool
            "pixels": torch.randint(0, 255, (rows, 2), dtype=torch.uint8),
            "scores": torch.randn(rows, dtype=torch.float64),
            "every_third": grid[:, ::3],  # not contiguous
            "empty": torch.zeros(rows, 0),
        },
        {"uid": [f"u{i}" for i in range(rows)], "ground_truth": [{"a": i} for i in range(rows)]},
        {"temperature": 0.7, "step_tensor": torch.tensor(3.5)},  # a 0-d tensor in meta
    )


def assert_same_batch(got: Batch, want: Batch) -> None:
    assert list(got.tensors) == list(want.tensors)
    for key, tensor in want.tensors.items():
        assert got[key].dtype == tensor.dtype and got[key].shape == tensor.shape, key
        assert torch.equal(got[key], tensor), key
    assert got["uid"].tolist() == want["uid"].tolist()
    assert got["ground_truth"].tolist() == want["ground_truth"].tolist()
    assert got.meta["temperature"] == 0.7
    assert torch.equal(got.meta["step_tensor"], want.meta["step_tensor"])
    assert got.meta["step_tensor"].shape == ()


def toy_input(rows: int = 7, cols: int = 4) -> Batch:
    x = torch.arange(rows * cols).reshape(rows, cols)
    return Batch({"x": x}, {"uid": [f"p{i}" for i in range(rows)]}, {"temperature": 1.0})


def exercise(group) -> dict:
    """Every dispatch mode on a 2-rank Toy group, as plain Python values to compare."""
    batch = toy_input(7)  # not divisible by 2 ranks
    out = group.transform(batch)
    return {
        "y": out["y"].tolist(),
        "rank": out["rank"].tolist(),
        "uid": out["uid"].tolist(),
        "meta": out.meta,
        "count_rows": group.count_rows(batch),
        "whoami": group.whoami(),
        "add_rank": group.add_rank([10, 20]),
    }


EXPECTED_EXERCISE = {
    # row i of x is [4i, 4i+1, 4i+2, 4i+3], sum 16i+6; y = 3x + sum
    "y": [[3 * (4 * i + j) + 16 * i + 6 for j in range(4)] for i in range(7)],
    # 7 rows padded to 8: rank 0 gets rows 0-3, rank 1 rows 4-6 (+ one padding row)
    "rank": [0, 0, 0, 0, 1, 1, 1],
    "uid": [f"p{i}" for i in range(7)],
    "meta": {"seen_rows": 4},
    "count_rows": [4, 4],
    "whoami": [(0, 2, "cpu", 3), (1, 2, "cpu", 3)],
    "add_rank": [10, 21],
}
