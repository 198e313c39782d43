"""LockstepService: the rollout service of a tensor-parallel engine (engine/tensor_parallel.py).

A tensor-parallel engine's ranks must run the same scheduler steps in the same order (every
layer all-reduces), but a RolloutService admits requests at whatever moment they reach its
thread, and that moment differs by rank. Here the service threads of a group move in
rounds. At each round every rank hands over what its callers posted since the last round
(all_gather_object over a gloo group of the engine's ranks that only these threads use),
and every rank applies the union in the same order, then runs one scheduler step if there
is work. The engines start from the same state and apply the same operations, so their
scheduler states, and the tokens they draw (the logits are gathered, the seeds travel with
each request), are the same on every rank.

Two kinds of operations:

- requests (a submission, an abort, a release of kept KV): a rank's own. The submitting rank
  builds the request (its seeds resolved there) and keeps its handle; the other ranks run a
  copy without callers. Its tokens reach only the rank that submitted it.
- group operations (pause, resume, a weight update, close, any other call on the engine's
  thread): every rank posts the same ones in the same order, each with its own data (its
  weight shard), and one runs when every rank has posted it, so a weight update lands
  between the same two steps on every rank.

Each rank's operations run in the order it posted them. A caller that waits for a group
operation waits for the other ranks to post theirs.

Kept KV (keep/reuse, engine/scheduling/kept.py: an agent episode's turns continue its
conversation's slot): every rank keeps the slot of a kept request, its own or a copy, and
holds its share of the K/V (its heads). The engine numbers kept slots in the order requests
finish, and the ranks finish the same requests at the same step in the same order, so a
handle means the same slot on every rank: the owner's `reuse` and its release travel as they
are. A release (the episode is over, which only its rank knows) is a request of its rank: it
runs on every rank at the same place in the round's order, between the same two steps.
Streaming to other ranks is not served here. A request's images (engine/images.py) travel
with it: the copies on the other ranks hold the same pixels, grids and mRoPE rows, so every
rank encodes the same features (the vision encoder is whole on every rank) and prefills
alike.

Experts spread over several replicas (engine/expert_spread.py): ``rounds``
(spread_rounds.py) makes the replicas' services move together as well. Each replica's ranks
keep the lockstep above over their own group (None: a replica of one rank), and after the
ops of a round every rank of the expert-parallel group beats: the ranks with work run a step,
every rank serves the others' rounds of the experts, and a group operation runs once every
rank of the expert-parallel group has posted it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import deque
from concurrent.futures import Future

import torch
import torch.distributed as dist

from hybridflow.engine.requests import Completion, Submission
from hybridflow.engine.sampling import SamplingParams
from hybridflow.engine.serving.handles import RequestHandle
from hybridflow.engine.serving.service import RolloutService
from hybridflow.engine.serving.service_stream import ServiceStream
from hybridflow.engine.serving.spread_rounds import SpreadRounds

ADD, ABORT, RELEASE, GROUP = "add", "abort", "release", "group"


class LockstepService(RolloutService):
    """engine: this rank's tensor-parallel Engine. group: a gloo group of the engine's
    ranks, for this service's thread alone (its rounds must not interleave with other
    collectives); None: an engine of one rank (with ``rounds``). poll_s: how long an idle
    round waits for a caller before it asks the others (every rank keeps asking while the
    group is idle: a round is one small all-gather). rounds: the engine's experts are
    spread over several replicas (module docstring)."""

    def __init__(self, engine, group, poll_s: float = 0.002,
                 streams: ServiceStream | None = None,
                 rounds: SpreadRounds | None = None):  # fmt: skip
        self.group, self.poll_s, self.rounds = group, poll_s, rounds
        self.rank, self.size = (0, 1) if group is None else (dist.get_rank(group),
                                                             dist.get_world_size(group))  # fmt: skip
        self._group_ops = [0] * self.size  # group operations each rank has posted so far
        self._group_runs = 0  # group operations run here
        self._group_limit = 0  # those every rank of the expert group has posted (last beat)
        self._peers_busy = False  # the last beat found work on some rank
        self._outbox: list[tuple] = []  # (op id, kind, payload) since the last round
        self._local: dict[int, tuple] = {}  # op id -> (what runs here, its Future)
        self._queues = [deque() for _ in range(self.size)]  # each rank's ops not run yet
        self._requests: dict[tuple[int, int], Submission] = {}  # (rank, key) -> submission
        self._ids = itertools.count()
        self._keys = itertools.count()
        self._stopping = False
        super().__init__(engine, streams)  # starts the thread; its first group op: _start

    # -- callers --------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, seed: int | None = None,
               *, keep: bool = False, reuse: int | None = None,
               stream: bool = False, images=None) -> RequestHandle:  # fmt: skip
        sub, handle = self._prepare(prompt_ids, params, seed, keep, reuse, stream=stream,
                                    images=images)  # fmt: skip
        self._send(sub, handle.on_error)
        return handle

    def generate(self, prompts, params: SamplingParams, seeds=None, *, keep=False,
                 reuse=None, sample_index=None, images=None) -> list[Completion]:  # fmt: skip
        return super().generate(prompts, params, seeds, keep=keep, reuse=reuse,
                                sample_index=sample_index, images=images)  # fmt: skip

    def submit_many(self, requests: list[dict]) -> list[RequestHandle | BaseException]:
        out: list[RequestHandle | BaseException] = []
        for request in requests:
            try:
                out.append(self.submit(**request))
            except ValueError as error:
                out.append(error)
        return out

    def _prepare(self, prompt_ids, params, seed=None, keep=False, reuse=None, stream=False,
                 images=None) -> tuple[Submission, RequestHandle]:  # fmt: skip
        sub, handle = super()._prepare(prompt_ids, params, seed, keep, reuse, stream, images)
        key = (self.rank, next(self._keys))
        handle._abort = lambda: self._enqueue(ABORT, key, None)  # this rank's request only
        sub.lockstep_key = key
        return sub, handle

    def _submit(self, sub, failed) -> None:
        """A generate()'s submission goes to every rank, under this rank's key."""
        sub.lockstep_key = (self.rank, next(self._keys))
        self._send(sub, failed)

    def release_kept(self, handles) -> None:
        """Give kept slots back on every rank: a request of this rank's (module docstring),
        so it needs nothing from the others."""
        self._enqueue(RELEASE, list(handles), None)

    def close(self) -> None:
        """Abort what runs, then stop: a group operation, so every rank's thread leaves after
        the same round (each rank's close waits for the others')."""
        if self.engine.service is not self:
            return
        if not self._closed:  # else the group failed and the thread has left
            self._call(self._abort_and_stop)
        self._thread.join()
        self.engine.service = None

    # -- posting --------------------------------------------------------------------------------

    def _post(self, task) -> Future:
        """Every call the base service runs on the engine's thread (pause, resume, weights,
        close, the engine's own calls) is a group operation."""
        return self._enqueue(GROUP, None, task)

    def _send(self, sub: Submission, on_error) -> Future:
        seeds = [lo | hi << 32 for lo, hi in zip(sub.seed_lo, sub.seed_hi)]
        reuse = None if sub.reuse is None else list(sub.reuse)
        payload = (sub.lockstep_key, [list(p) for p in sub.prompts], sub.params, seeds,
                   list(sub.max_new), sub.keep, reuse, _travelling_images(sub))  # fmt: skip
        return self._enqueue(ADD, payload, (sub, on_error))

    def _enqueue(self, kind: str, payload, local) -> Future:
        future: Future = Future()
        with self._wake:
            if self._closed:
                raise RuntimeError("the RolloutService is closed")
            op_id = next(self._ids)
            self._local[op_id] = (local, future)
            self._outbox.append((op_id, kind, payload))
            self._wake.notify_all()
        return future

    # -- the engine's thread --------------------------------------------------------------------

    def _run(self) -> None:
        device = self.engine.device
        context = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with context, self.streams.launching(), torch.no_grad():
            self.streams.take_over()
            while not self._stopping:
                with self._wake:
                    if not self._outbox and not self._has_work() and not self._peers_busy:
                        self._wake.wait(self.poll_s)
                    mine, self._outbox = self._outbox, []
                try:
                    everyone = self._gathered(mine)
                except BaseException as error:  # a rank is gone: nothing can run in step
                    self._fail_everything(error)
                    break
                for rank, ops in enumerate(everyone):
                    self._queues[rank].extend(ops)
                    self._group_ops[rank] += sum(op[1] == GROUP for op in ops)
                self._run_ready()
                self.wakeups.post()
                working = self._has_work() and not self._stopping
                if self.rounds is not None:
                    try:
                        working = self._spread_step(working)
                    except BaseException as error:  # a rank of the expert group is gone
                        self._fail_everything(error)
                        break
                if working:
                    self._step()
                    self._forget_finished()
                    self.wakeups.post()
                if self.rounds is not None and self._peers_busy:
                    self.rounds.serve()  # the rounds of this iteration, closed on every rank
            self.streams.hand_back()

    def _gathered(self, mine: list) -> list:
        """Every rank's ops since the last round, in rank order."""
        if self.group is None:
            return [mine]
        everyone: list = [None] * self.size
        dist.all_gather_object(everyone, mine, group=self.group)
        return everyone

    def _spread_step(self, working: bool) -> bool:
        """The expert group's beat (spread_rounds.py) -> whether this rank steps now."""
        beat = self.rounds.beat(working, min(self._group_ops))
        self._group_limit, self._peers_busy = beat.posted, beat.busy
        return working and beat.busy

    def _run_ready(self) -> None:
        """Each rank's requests up to its next group operation; then that group operation
        if every rank has posted it; again until nothing more can run."""
        while True:
            for rank, queue in enumerate(self._queues):
                while queue and queue[0][1] != GROUP:
                    self._run_request(rank, *queue.popleft())
            if not all(self._queues):
                return
            if self.rounds is not None and self._group_runs >= self._group_limit:
                return  # a rank of the expert group has not posted it yet
            self._group_runs += 1
            heads = [queue.popleft() for queue in self._queues]
            task, future = self._local.pop(heads[self.rank][0])
            try:
                future.set_result(task())
            except BaseException as error:  # the caller of _call re-raises it
                future.set_exception(error)

    def _run_request(self, rank: int, op_id: int, kind: str, payload) -> None:
        mine = rank == self.rank
        if kind == ABORT:
            sub = self._requests.get(payload)
            if sub is not None:
                self._abort(sub)
        elif kind == RELEASE:
            self.engine.release_kept(payload)  # on the engine's thread: now, not posted
        else:
            key = payload[0]
            sub, on_error = self._local[op_id][0] if mine else (self._copy(payload), _ignore)
            self._requests[key] = sub
            self._add(sub, on_error)
        if mine:
            self._local.pop(op_id)[1].set_result(None)

    def _copy(self, payload) -> Submission:
        """Another rank's request, run here without a caller: the same prompts, settings,
        budgets and seeds."""
        key, prompts, params, seeds, max_new, keep, reuse, images = payload
        sub = self.engine.submission(prompts, params, seeds=[0] * len(prompts), keep=keep,
                                     reuse=reuse, max_new_tokens=max_new,
                                     images=images)  # fmt: skip
        sub.seed_lo = [seed & 0xFFFFFFFF for seed in seeds]
        sub.seed_hi = [(seed >> 32) & 0xFFFFFFFF for seed in seeds]
        sub.lockstep_key = key
        return sub

    def _forget_finished(self) -> None:
        done = [key for key, sub in self._requests.items() if sub.done]
        for key in done:
            del self._requests[key]

    def _abort_and_stop(self) -> None:
        self._abort_all()
        with self._wake:
            self._closed = True
        self._stopping = True

    def _fail_everything(self, error: BaseException) -> None:
        """The group cannot go on (a rank left): every waiting caller hears why."""
        with self._wake:
            self._closed = True
            waiting, self._local = list(self._local.values()), {}
        for local, future in waiting:
            if isinstance(local, tuple):  # a request: its handle fails too
                local[1](error)
            future.set_exception(error)
        if self.engine.scheduler is not None:
            self._fail_all(error)


def _ignore(error: BaseException) -> None:
    """Another rank's request failed here: its own rank tells its caller."""


def _travelling_images(sub: Submission) -> list | None:
    """A submission's checked images as the other ranks' copies take them (PromptImages on
    the host: pickled to the group over gloo), None for a text submission."""
    from hybridflow.engine.images import PromptImages

    if sub.images is None:
        return None
    return [None if entry is None else
            PromptImages(entry.pixel_values.cpu(), entry.image_grid_thw.cpu(),
                         entry.positions.cpu(), entry.span)
            for entry in sub.images.prepared]  # fmt: skip
