"""`python benchmarks/controller_overhead.py`: per-call overhead and the transfer of a GRPO batch,
per backend, and the ways Ray can carry that batch.

    python benchmarks/controller_overhead.py [--backends inprocess local local-pickle ray]
        [--world-size 2] [--rows 1024] [--prompt-len 1024] [--response-len 3072]

The batch is what the actor update of a GRPO step with a reference model receives
(trainer/loop/rl_loop.py ``train_step``): ``rows`` sequences of prompt + response tokens
with their masks, token versions, rollout / old / reference log-probs, entropy, scores,
rewards, advantages and returns, plus the uid, data source, ground truth, extra info,
response text and score arrays (1024 x 4096 tokens: 204 MiB of tensors).

For each backend, with one group of ``--world-size`` CPU workers:
- ``noop``: a ONE_TO_ALL call without arguments (dispatch + round trip);
- ``update``: DP_SPLIT of the batch (each rank gets its rows, as the actor update does);
- ``one_to_all``: the whole batch to every rank;
- ``logprobs``: DP_SPLIT of the row indices, each rank returns ``old_logprobs`` and
  ``entropy`` [rows, response] float32 of its rows (the old-log-prob pass's reply).
Each worker reads every page of what it receives (so lazily mapped bytes are paid for),
and the controller every page of what comes back. MiB moved counts tensor bytes (the
arrays ride along uncounted); ``inprocess`` moves nothing: its rows are the floor.
``local-pickle`` is the local backend with shared memory off (bytes inline in the pipe).

``--encodings`` (with ray) then sends the same batch to one Ray actor and back in each way
Ray can carry it, in the same run (hybridflow/controller/ray_transport.py says which one
the ray backend uses and why).
"""

from __future__ import annotations

import argparse
import io
import mmap
import os
import pickle
import statistics
import time
import warnings

import numpy as np
import torch

from hybridflow.controller import Dispatch, ResourcePool, Worker, WorkerGroup, register
from hybridflow.protocol import Batch

MiB = 1 << 20
PAGE = 4096


def grpo_update_batch(rows: int, prompt_len: int, response_len: int) -> Batch:
    """The columns of a GRPO actor update, with their trainer dtypes (values random)."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(response_len // 4, response_len + 1, (rows,), generator=generator)
    response_mask = (torch.arange(response_len)[None, :] < lengths[:, None]).float()  # [B, R]

    def floats() -> torch.Tensor:
        return torch.randn(rows, response_len, generator=generator) * response_mask  # [B, R]

    tensors = {
        "prompts": torch.randint(0, 150_000, (rows, prompt_len), generator=generator),
        "prompt_mask": torch.ones(rows, prompt_len, dtype=torch.long),
        "responses": torch.randint(0, 150_000, (rows, response_len), generator=generator),
        "response_mask": response_mask,
        "token_versions": torch.where(response_mask.bool(), 0, -1),  # int64
        "attention_mask": torch.cat([torch.ones(rows, prompt_len), response_mask], 1).long(),
    }
    for name in ("rollout_logprobs", "old_logprobs", "entropy", "ref_logprobs"):
        tensors[name] = floats()
    scores = torch.randint(0, 2, (rows,), generator=generator).float()
    tensors["token_level_scores"] = torch.zeros(rows, response_len)
    tensors["token_level_scores"][torch.arange(rows), lengths - 1] = scores
    tensors["token_level_rewards"] = tensors["token_level_scores"].clone()
    tensors["advantages"] = floats()
    tensors["returns"] = tensors["advantages"].clone()
    arrays = {
        "uid": [f"0.0.{i // 8}" for i in range(rows)],
        "data_source": ["gsm8k"] * rows,
        "ground_truth": [str(i) for i in range(rows)],
        "extra_info": [{"index": i, "split": "train"} for i in range(rows)],
        "response_text": ["word " * int(n * 0.8) for n in lengths],  # ~4 characters a token
        "scores": scores.double().numpy(),
    }
    return Batch(tensors, arrays)


def tensor_bytes(batch: Batch) -> int:
    return sum(t.numel() * t.element_size() for t in batch.tensors.values())


def touch(batch: Batch) -> int:
    """Read one byte of every page of every tensor (what a worker moving it to a GPU reads,
    page by page)."""
    return sum(int(t.reshape(-1).view(torch.uint8)[::PAGE].sum()) for t in batch.tensors.values())


class BenchWorker(Worker):
    def __init__(self, response_len: int) -> None:
        self.response_len = response_len
        self.replies: dict[int, Batch] = {}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @register(dispatch=Dispatch.DP_SPLIT)
    def update(self, batch: Batch) -> int:
        return touch(batch)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def one_to_all(self, batch: Batch) -> int:
        return touch(batch)

    @register(dispatch=Dispatch.DP_SPLIT)
    def logprobs(self, rows: Batch) -> Batch:
        # made once: the calls time the transfer, not the random numbers
        if len(rows) not in self.replies:
            self.replies[len(rows)] = logprobs_reply(len(rows), self.response_len)
        return self.replies[len(rows)]


def logprobs_reply(rows: int, response_len: int) -> Batch:
    shape = (rows, response_len)
    return Batch({"old_logprobs": torch.randn(shape), "entropy": torch.rand(shape)})


def median_seconds(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_backend(backend: str, world_size: int, batch: Batch, repeats: int) -> list[dict]:
    label = backend
    if backend == "local-pickle":
        os.environ["HYBRIDFLOW_SHM_MIN_BYTES"] = str(1 << 62)  # read by controller and workers
        backend = "local"
    response_len = batch["responses"].shape[1]
    pool = ResourcePool(cpus=world_size, cpus_per_worker=0.5)
    group = WorkerGroup(BenchWorker, pool, backend, response_len=response_len)
    rows = Batch({"row": torch.arange(len(batch))})
    sent = tensor_bytes(batch)
    returned = 2 * len(batch) * response_len * 4
    try:
        noop = median_seconds(group.noop, repeats * 10)
        calls = [
            ("update", lambda: group.update(batch), sent),
            ("one_to_all", lambda: group.one_to_all(batch), sent * world_size),
            ("logprobs", lambda: touch(group.logprobs(rows)), returned),
        ]
        results = [{"backend": label, "call": "noop", "MiB": 0, "ms": noop * 1e3}]
        for name, fn, nbytes in calls:
            ms = median_seconds(fn, repeats) * 1e3
            results.append({"backend": label, "call": name, "MiB": nbytes / MiB, "ms": ms})
    finally:
        group.shutdown()
        os.environ.pop("HYBRIDFLOW_SHM_MIN_BYTES", None)
    return results


def print_rows(rows: list[dict], first: str) -> None:
    header = f"{first:<24} {'call':<11} {'MiB moved':>9} {'ms median':>10} {'GB/s':>6}"
    print(header)
    print("-" * len(header))
    for r in rows:
        rate = f"{r['MiB'] * MiB / 1e9 / (r['ms'] / 1e3):6.2f}" if r["MiB"] else f"{'':>6}"
        print(f"{r[first]:<24} {r['call']:<11} {r['MiB']:>9.1f} {r['ms']:>10.1f} {rate}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--backends", nargs="*", default=["inprocess", "local", "local-pickle", "ray"]
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--response-len", type=int, default=3072)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--encodings", nargs="*", metavar="NAME", choices=list(ENCODINGS),
        help="also compare Ray's encodings: all, or those named",
    )  # fmt: skip
    args = parser.parse_args()
    batch = grpo_update_batch(args.rows, args.prompt_len, args.response_len)
    tokens = args.prompt_len + args.response_len
    print(
        f"GRPO update batch: {args.rows} x {tokens} tokens, {tensor_bytes(batch) / MiB:.0f} MiB "
        f"of tensors in {len(batch.tensors)} columns + {len(batch.arrays)} arrays; world size "
        f"{args.world_size}; torch {torch.__version__}; {os.cpu_count()} CPUs"
    )
    use_ray = "ray" in args.backends or args.encodings is not None
    if use_ray:
        import ray

        ray.init(num_cpus=max(2, args.world_size), include_dashboard=False, log_to_driver=False)
        print(f"Ray {ray.__version__}")
    rows = []
    for backend in args.backends:
        rows += measure_backend(backend, args.world_size, batch, args.repeats)
    if rows:
        print_rows(rows, "backend")
    if args.encodings is not None:
        print()
        names = args.encodings or list(ENCODINGS)
        print_rows(measure_encodings(batch, names, args.repeats), "ray encoding")


# ---------------------------------------------------------------- Ray's encodings
# Each: (sender: batch -> what ray.put stores, reader: stored value -> Batch). "copy" rows
# give the reader writable tensors of its own; "read-only" rows hand out views of the
# object store, which a write would change for every reader on the node (reference only).


def _torch_pickle():
    return (lambda b: (dict(b.tensors), b.arrays)), (lambda v: Batch(*v))


def _batch_pickle():
    return (lambda b: b), (lambda v: v)  # Batch.__reduce__: uint8 numpy views, copied per tensor


def _numpy_views(copy: str):
    """copy: "private" (ray_transport.decode: a copy per buffer), "arena" (one copy of all
    into fresh huge pages), "none" (the read-only views of the object store)."""
    from hybridflow.controller import ray_transport

    def read(encoded):
        if copy == "arena":
            return pickle.loads(encoded.payload, buffers=_huge_page_copies(encoded.buffers))
        return _ReadOnlyUnpickler(io.BytesIO(encoded.payload), buffers=encoded.buffers).load()

    return ray_transport.encode, ray_transport.decode if copy == "private" else read


class _ReadOnlyUnpickler(pickle.Unpickler):
    """Tensors as views of read-only buffers (a Batch would copy them)."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("hybridflow.protocol", "raw_to_tensor"):
            return _view
        if (module, name) == ("hybridflow.protocol", "_rebuild_batch"):
            return lambda packed, *rest: Batch({k: _view(*v) for k, v in packed.items()}, *rest)
        return super().find_class(module, name)


def _view(dtype: torch.dtype, shape: tuple[int, ...], raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def _huge_page_copies(buffers) -> list[np.ndarray]:
    """All buffers copied into one anonymous private mapping, transparent huge pages advised
    (fewer page faults than fresh 4 KiB pages, but fresh memory at every call)."""
    sizes = [(b.nbytes + 63) // 64 * 64 for b in buffers]  # 64-byte aligned
    mapping = mmap.mmap(-1, max(sum(sizes), 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    arena = np.frombuffer(mapping, np.uint8)
    copies, offset = [], 0
    for buffer, size in zip(buffers, sizes):
        copies.append(arena[offset : offset + buffer.nbytes])
        np.copyto(copies[-1], buffer)
        offset += size
    return copies


def _arrow(copy: bool):
    import pyarrow as pa

    from hybridflow.controller import ray_transport
    from hybridflow.protocol import tensor_to_raw

    def send(batch):
        sink = pa.BufferOutputStream()  # one IPC stream: the tensors one after another
        for t in batch.tensors.values():
            pa.ipc.write_tensor(pa.Tensor.from_numpy(tensor_to_raw(t)[2]), sink)
        header = {k: (t.dtype, tuple(t.shape)) for k, t in batch.tensors.items()}
        return header, batch.arrays, sink.getvalue()

    def read(value):
        header, arrays, buffer = value
        reader = pa.BufferReader(buffer)
        buffers = [pa.ipc.read_tensor(reader).to_numpy() for _ in header]  # read-only views
        if copy:
            buffers = [ray_transport.private_copy(b) for b in buffers]
        raw = [torch.from_numpy(b) for b in buffers]
        tensors = {k: r.view(d).reshape(s) for (k, (d, s)), r in zip(header.items(), raw)}
        return Batch(tensors, arrays)

    return send, read


ENCODINGS = {
    "torch pickle (copy)": _torch_pickle,
    "Batch pickle (copy)": _batch_pickle,
    "numpy views (copy)": lambda: _numpy_views("private"),
    "numpy views (huge pages)": lambda: _numpy_views("arena"),
    "numpy views (read-only)": lambda: _numpy_views("none"),
    "Arrow IPC (copy)": lambda: _arrow(copy=True),
    "Arrow IPC (read-only)": lambda: _arrow(copy=False),
}


class EncodingActor:
    def __init__(self, rows: int, response_len: int) -> None:
        self.logprobs = logprobs_reply(rows, response_len)

    def take(self, name: str, stored) -> int:
        return touch(ENCODINGS[name]()[1](stored))

    def give(self, name: str):
        return ENCODINGS[name]()[0](self.logprobs)


def measure_encodings(batch: Batch, names: list[str], repeats: int, warmup: int = 2) -> list[dict]:
    """One actor; the controller puts the batch (encode + ray.put), the actor decodes it and
    reads every page; then the actor returns the log-probs of all rows the same way. The
    encodings take turns in each round, so that a busy moment of the host hits them all."""
    import ray

    response_len = batch["responses"].shape[1]
    actor = ray.remote(num_cpus=0.5)(EncodingActor).remote(len(batch), response_len)
    codecs = {name: ENCODINGS[name]() for name in names}
    times: dict[str, tuple[list, list]] = {name: ([], []) for name in codecs}
    for round_index in range(warmup + repeats):
        for name, (send, read) in codecs.items():
            start = time.perf_counter()
            ray.get(actor.take.remote(name, ray.put(send(batch))))
            middle = time.perf_counter()
            touch(read(ray.get(actor.give.remote(name))))
            if round_index >= warmup:
                times[name][0].append(middle - start)
                times[name][1].append(time.perf_counter() - middle)
    ray.kill(actor)
    returned = 2 * len(batch) * response_len * 4
    results = []
    for name, (to_worker, back) in times.items():
        results.append(_row(name, "to worker", tensor_bytes(batch), statistics.median(to_worker)))
        results.append(_row(name, "logprobs", returned, statistics.median(back)))
    return results


def _row(name: str, call: str, nbytes: int, seconds: float) -> dict:
    return {"ray encoding": name, "call": call, "MiB": nbytes / MiB, "ms": seconds * 1e3}


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    main()
