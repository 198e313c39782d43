"""Asynchronous RL (`trainer.mode=async`): the next steps' rollouts are generated while the
current step trains, with bounded staleness, and the run stays exactly reproducible.

Policy version u is the actor after step u's update (0: the initial weights). The batch of
step j is generated with version

    v(j) = max(0, j - 1 - s, the last checkpoint step before j)

(s = trainer.max_staleness): it lags the version step j trains at (j - 1) by at most s.
Two waits make the schedule exact, whatever the timing:

- the producer (a thread) generates batch j once version v(j) is installed in the rollout;
- the trainer installs version u (the weight sync after step u) only once every batch that
  needs an older one has been generated.

So every batch is generated with exactly v(j): s = 0 is the synchronous algorithm, and a
run stopped at a checkpoint and resumed generates what the uninterrupted run generated
(after a checkpoint step the producer waits for the checkpoint's weights). The engine
samples with its own copy of the weights (the actor's in-place updates must not reach a
generation in flight); the gap between the behaviour policy and the trained one is corrected
with truncated importance weights (actor.rollout_is_cap, 2 by default in async mode).
Waits time out after trainer.call_timeout_s with the role and step that stalled; an error in
the producer (a dead rollout worker, a reward that fails) stops the run as itself.

Partial rollouts (trainer.partial_rollout) drop the second wait: the trainer installs its
weights at once and the requests in flight continue with them (each token records its
version, trainer/loop/staleness.py). The bound holds by the first wait alone: batch j starts
with a version >= v(j), so no token of it lags the version it trains at by more than s.
stale_policy=drop starts batch j one version earlier (v(j) with s + 1: the checkpoint rule
still holds, so no prompt is drawn ahead of a saved loader state), discards the groups whose
oldest token lags by more than s, and replaces them with groups generated once v(j) is
installed (those cannot exceed the bound). Timing decides where a request crosses an
update: partial-rollout runs are not bit-reproducible.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from hybridflow.protocol import Batch
from hybridflow.trainer.loop.staleness import (
    NO_TOKEN,
    concat_rollouts,
    drop_stale_groups,
    first_groups,
    oldest_versions,
)
from hybridflow.trainer.observe.metrics import Timer

if TYPE_CHECKING:
    from hybridflow.trainer.loop.role_handles import RolloutHandle


def generation_version(step: int, max_staleness: int, save_steps: Callable[[int], bool]) -> int:
    """v(step) of the module docstring. save_steps(m): whether step m writes a checkpoint."""
    version = max(0, step - 1 - max_staleness)
    for m in range(step - 1, version, -1):  # a checkpoint in (version, step - 1] wins
        if save_steps(m):
            return m
    return version


class RolloutStalled(RuntimeError):
    """A wait of the async pipeline ran past trainer.call_timeout_s."""


class RolloutProducer:
    """Generates batches for steps first_step .. last_step on a thread (module docstring).

    produce(step, attempt) -> (batch, metrics): the rollout of that step (generation and
    reward), called on the producer's thread in step order; attempt 1 is the one that
    replaces dropped groups (stale_policy=drop), from other prompts.
    partial: the rollout's requests continue across weight updates (trainer.partial_rollout);
    stale_policy: wait or drop (trainer.stale_policy, with partial only); pad_token_id: the
    prompts' padding, to join replacement groups to a batch."""

    def __init__(self, produce: Callable[[int, int], tuple], first_step: int, last_step: int,
                 max_staleness: int, save_steps: Callable[[int], bool], installed: int,
                 timeout_s: float, partial: bool = False, stale_policy: str = "wait",
                 pad_token_id: int = 0):  # fmt: skip
        self.produce, self.first, self.last = produce, first_step, last_step
        self.max_staleness, self.save_steps = max_staleness, save_steps
        self.timeout_s = timeout_s
        self.partial, self.stale_policy, self.pad_token_id = partial, stale_policy, pad_token_id
        self.installed = installed  # the policy version the rollout samples with now
        self.produced: dict[int, tuple] = {}  # step -> (batch, metrics, version), untaken
        self.done_through = first_step - 1  # every batch up to this step is generated
        self.error: BaseException | None = None
        self.closing = False
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="hybridflow-rollout-producer",
                                       daemon=True)  # fmt: skip
        self.thread.start()

    def version_for(self, step: int) -> int:
        return generation_version(step, self.max_staleness, self.save_steps)

    def start_version(self, step: int) -> int:
        """The version the producer waits for before it starts step's rollout: v(step); with
        stale_policy=drop the v of one more staleness (one version earlier), except after a
        checkpoint step (its prompts are drawn after the loader's state is saved)."""
        if self.stale_policy == "drop":
            return generation_version(step, self.max_staleness + 1, self.save_steps)
        return self.version_for(step)

    # -- the producer's thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            for step in range(self.first, self.last + 1):
                version = self.start_version(step)
                if not self._wait_installed(version, step):
                    return
                batch, metrics = self.produce(step, 0)
                if self.partial:
                    batch, metrics = self._within_bound(step, batch, metrics)
                    if batch is None:
                        return
                    oldest = oldest_versions(batch.tensors["token_versions"],
                                             batch.tensors["response_mask"])  # fmt: skip
                    if len(batch) and int(oldest.min()) != NO_TOKEN:
                        version = int(oldest.min())
                batch.meta["policy_version"] = version  # its oldest token's
                with self.changed:
                    self.produced[step] = (batch, metrics, version)
                    self.done_through = step
                    self.changed.notify_all()
        except BaseException as error:  # the trainer re-raises it
            with self.changed:
                self.error = error
                self.changed.notify_all()

    def _wait_installed(self, version: int, step: int) -> bool:
        """Wait until the rollout samples with `version` or newer; False: the run closes."""
        with self.changed:
            self._wait(lambda: self.installed >= version or self.closing,
                       f"the weights of version {version} for step {step}", "trainer")  # fmt: skip
            if self.closing:
                return False
            # without partial rollouts the trainer holds the next version back (before_install)
            assert self.partial or self.installed == version, (self.installed, version)
            return True

    def _within_bound(self, step: int, batch: Batch, metrics: dict) -> tuple:
        """stale_policy=drop: the batch without the groups whose oldest token lags the
        version step trains at (step - 1) by more than s, refilled from a rollout started
        with v(step); (None, None) if the run closes meanwhile."""
        if self.stale_policy != "drop":
            return batch, metrics
        batch, dropped = drop_stale_groups(batch, step - 1 - self.max_staleness)
        metrics["async/dropped_groups"] = float(dropped)
        if dropped:
            if not self._wait_installed(self.version_for(step), step):
                return None, None
            fresh, _ = self.produce(step, 1)
            batch = concat_rollouts([batch, first_groups(fresh, dropped)], self.pad_token_id)
        return batch, metrics

    # -- the trainer's side ---------------------------------------------------------------------

    def take(self, step: int) -> tuple:
        """(batch, metrics, version) of `step`, waiting for it."""
        with self.changed:
            self._wait(lambda: step in self.produced or self.error is not None,
                       f"the rollout of step {step}", "rollout producer")  # fmt: skip
            self._raise()
            return self.produced.pop(step)

    def before_install(self, version: int) -> None:
        """Wait until every batch generated with an older version is done (the sync of
        `version` is about to replace the rollout's weights). Partial rollouts: no wait,
        the requests in flight continue with the new weights."""
        if self.partial:
            return
        needed = [step for step in range(self.first, self.last + 1)
                  if self.version_for(step) < version]  # fmt: skip
        if not needed:
            return
        with self.changed:
            self._wait(lambda: self.done_through >= needed[-1] or self.error is not None,
                       f"the rollout of step {needed[-1]}", "rollout producer")  # fmt: skip
            self._raise()

    def installed_version(self, version: int) -> None:
        with self.changed:
            self.installed = version
            self.changed.notify_all()

    def close(self) -> None:
        with self.changed:
            self.closing = True
            self.changed.notify_all()
        self.thread.join(timeout=self.timeout_s)

    def _wait(self, ready: Callable[[], bool], what: str, who: str) -> None:
        """Wait (holding the condition) until ready(), at most timeout_s."""
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                raise RolloutStalled(
                    f"async rollout: waited {self.timeout_s:g} s for {what} from the {who} "
                    "(trainer.call_timeout_s); the run stops, its last checkpoint is intact"
                )
            self.changed.wait(left)

    def _raise(self) -> None:
        """The producer's error, as itself: a dead rollout worker stays a WorkerDiedError
        naming its role and rank, a user error stays one (the CLI reports them as such)."""
        if self.error is not None:
            note = "raised by the async rollout producer (trainer.mode=async)"
            if note not in getattr(self.error, "__notes__", ()):
                self.error.add_note(note)
            raise self.error


def async_step_metrics(batch_version: int, trained_version: int, timer: Timer) -> dict:
    """How stale the trained batch was, and how long the trainer waited for it."""
    return {
        "async/staleness": float(trained_version - batch_version),
        "timing_s/wait_rollout": timer.seconds.get("wait_rollout", 0.0),
    }


POLL_S = 0.05
"""How long one `generated` call waits on the rollout worker: a call of the trainer to that
worker (its weight sync among them) waits at most this long for its turn."""

_tickets = itertools.count()  # names each started generation on the workers


def generate_across_updates(rollout: RolloutHandle, request: Batch, dp_size: int,
                            timeout_s: float) -> Batch:  # fmt: skip
    """rollout.generate(request) for partial rollouts: started, then collected in short
    waits, so that a weight sync reaches the worker while its requests decode
    (workers/rollout.py). dp_size: the rollout's ranks (DP_SPLIT padded the request)."""
    ticket = next(_tickets)
    rollout.start_generate(Batch(request.tensors, request.arrays,
                                 {**request.meta, "ticket": ticket}))  # fmt: skip
    parts: list[Batch | None] = [None] * dp_size
    deadline = time.monotonic() + timeout_s
    while any(part is None for part in parts):
        if time.monotonic() > deadline:
            raise RolloutStalled(
                f"async rollout: waited {timeout_s:g} s for a generation of {len(request)} "
                "rows from the rollout (trainer.call_timeout_s); the run stops, its last "
                "checkpoint is intact"
            )
        for rank, part in enumerate(rollout.generated(ticket, POLL_S)):
            if part is not None:
                parts[rank] = part
    return Batch.concat(parts).unpad((-len(request)) % dp_size)
