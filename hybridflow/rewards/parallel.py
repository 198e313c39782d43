"""Running scorers with a per-call timeout (in this process; rewards/scoring_pool.py runs
these chunks in reward worker processes, where user code always runs).

A scorer is user code: it may raise, loop forever or crash its process. None of that may
stop training, so every call ends as a `ScoreOutcome` with status "ok", "error" or "timeout",
and the caller scores the failures 0 and counts them.

Two layers of timeout:
  1. Inside the process that runs the scorers. The calls of a chunk run concurrently, one
     thread each (up to `MAX_CONCURRENT_CALLS`), so calls that hang or sleep time out
     together: 8 samples at a 1 s timeout take about 1 s, not 8. A call's time is its wall
     time minus the time the other scorer threads (and the thread timing them) ran or waited
     for a CPU meanwhile: under the GIL a busy scorer delays the others, so CPU-bound scorers
     are timed as if run one after another, and on a loaded machine (Linux: each thread's
     wait for a CPU is in /proc) a call is charged only its own wait, not the others'.
     A call past its timeout gets `ScoringTimeout` raised inside its thread (this stops
     Python loops; a call blocked in C is abandoned, its thread is a daemon) and scores as
     a timeout. A single call runs in the main thread, where `SIGALRM` interrupts it (also
     `time.sleep`, regexes). `ScoringTimeout` derives from BaseException so a scorer's own
     `except Exception` cannot swallow it. Scorers therefore must be thread-safe and must
     not install signal handlers.
  2. The trainer waits for a worker's chunk at most a bound derived from the per-call
     timeout; a worker still busy after that (stuck in C code that ignores signals), or
     one that dies (segfault, `os._exit`), fails its calls and is replaced
     (rewards/scoring_pool.py).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridflow.rewards.custom import load_function
from hybridflow.rewards.scorer_registry import ScorerSpec


class ScoringTimeout(BaseException):
    """Raised inside a scorer by the alarm; BaseException so `except Exception` misses it."""


@dataclass(frozen=True)
class ScoreOutcome:
    status: str  # "ok" | "error" | "timeout"
    value: Any = None
    message: str = ""


Call = tuple[ScorerSpec, dict[str, Any]]


def call_scorer(spec: ScorerSpec, arguments: dict[str, Any]) -> Any:
    """Resolve the spec's function and call it in the spec's style."""
    function = load_function(spec.target)
    if spec.style == "builtin":
        return function(
            arguments["solution_str"],
            arguments["ground_truth"],
            extra_info=arguments.get("extra_info"),
            **spec.options,
        )
    return function(**arguments, **spec.options)


def _on_alarm(signum, frame):
    raise ScoringTimeout()


def _alarm_available() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


def failure_message(target: str, error: BaseException) -> str:
    """What a scorer's exception is reported as; ``sys.exit`` and other BaseExceptions are
    the scorer's errors like any other (they must not end the trainer)."""
    if isinstance(error, SystemExit):
        return (f"scorer {target} called sys.exit({error.code!r}); a reward function must "
                "return a score (or raise an exception), not exit")  # fmt: skip
    return f"scorer {target}: {type(error).__name__}: {error}"


def guarded_call(
    spec: ScorerSpec, arguments: dict[str, Any], timeout_s: float | None
) -> ScoreOutcome:
    """Run one scorer call; never raises, except for a signal (Ctrl-C, a stop) that arrived
    during the call: a KeyboardInterrupt or SystemExit the scorer raised itself is its error."""
    timeout = ScoreOutcome("timeout", message=f"scorer {spec.target} took more than {timeout_s}s")
    in_main_thread = _alarm_available()  # only the main thread receives signals
    use_alarm = bool(timeout_s) and in_main_thread
    previous = signal.signal(signal.SIGALRM, _on_alarm) if use_alarm else None
    signals: list[int] = []
    watch = _watching_signals(signals) if in_main_thread else contextlib.nullcontext()
    try:
        with watch:
            try:
                if use_alarm:
                    signal.setitimer(signal.ITIMER_REAL, timeout_s)
                try:
                    value = call_scorer(spec, arguments)
                finally:
                    if use_alarm:
                        signal.setitimer(signal.ITIMER_REAL, 0)
                return ScoreOutcome("ok", value)
            except ScoringTimeout:
                return timeout
            except BaseException as error:
                if signals:  # raised by a signal handler (Ctrl-C), not by the scorer
                    raise
                return ScoreOutcome("error", message=failure_message(spec.target, error))
    except ScoringTimeout:  # the alarm landed while an exception was being handled
        return timeout
    finally:
        if use_alarm:
            signal.signal(signal.SIGALRM, previous)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _watching_signals(received: list[int]):
    """Within the block, SIGINT and SIGTERM are appended to ``received`` before their
    handlers run as before: an exception they raise is then known to be theirs."""

    def recording(handler):
        def handle(signum, frame):
            received.append(signum)
            if callable(handler):
                return handler(signum, frame)
            if handler == signal.SIG_DFL:  # the default action: terminate the process
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)
            return None

        return handle

    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum, handler in previous.items():
        if handler is not None:  # None: installed outside Python; leave it alone
            signal.signal(signum, recording(handler))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if handler is not None:
                signal.signal(signum, handler)


MAX_CONCURRENT_CALLS = 64
"""Scorer threads alive at once in one process."""
_POLL_S = 0.01


def run_chunk(calls: Sequence[Call], timeout_s: float | None) -> list[ScoreOutcome]:
    """Run calls, each with its own timeout (the worker-side entry): concurrently when there
    is a timeout to share, else one after another."""
    if not timeout_s or len(calls) <= 1:
        return [guarded_call(spec, arguments, timeout_s) for spec, arguments in calls]
    outcomes: list[ScoreOutcome] = []
    for start in range(0, len(calls), MAX_CONCURRENT_CALLS):
        outcomes += _run_concurrently(calls[start : start + MAX_CONCURRENT_CALLS], timeout_s)
    return outcomes


def _busy_s(thread_id: int | None) -> float | None:
    """Seconds the thread ``thread_id`` of this process ran or waited runnable for a CPU
    (Linux's /proc/self/task/<id>/schedstat); None elsewhere or once the thread ended."""
    try:
        with open(f"/proc/self/task/{thread_id}/schedstat", "rb") as stats:
            running_ns, runnable_ns = stats.read().split()[:2]
    except (OSError, ValueError):
        return None
    return (int(running_ns) + int(runnable_ns)) / 1e9


def _thread_cpu_s(thread: threading.Thread) -> float:
    """A live thread's CPU seconds (0.0 where there are no per-thread clocks)."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AttributeError, OSError, TypeError):  # no per-thread clocks, or it just ended
        return 0.0


def _own_busy_s() -> float:
    busy = _busy_s(threading.get_native_id())
    return time.thread_time() if busy is None else busy


def _raise_in_thread(thread: threading.Thread, exception: type[BaseException]) -> None:
    import ctypes

    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread.ident), ctypes.py_object(exception)
    )


def _run_concurrently(calls: Sequence[Call], timeout_s: float) -> list[ScoreOutcome]:
    results: dict[int, ScoreOutcome] = {}
    finished: dict[int, tuple[float, float]] = {}  # index -> (CPU s, busy s) at its end

    def run(index: int, spec: ScorerSpec, arguments: dict[str, Any]) -> None:
        outcome = guarded_call(spec, arguments, timeout_s)  # no alarm off the main thread
        finished[index] = (time.thread_time(), _own_busy_s())
        results.setdefault(index, outcome)

    def cpu_and_busy(index: int) -> tuple[float, float]:
        if index in finished:
            return finished[index]
        cpu = _thread_cpu_s(threads[index])
        busy = _busy_s(threads[index].native_id)
        return finished.get(index, (cpu, cpu if busy is None else busy))

    threads = [
        threading.Thread(target=run, args=(i, *call), name="hybridflow-scorer", daemon=True)
        for i, call in enumerate(calls)
    ]
    started, timer_busy_at_start = time.monotonic(), _own_busy_s()
    for thread in threads:
        thread.start()
    pending = set(range(len(threads)))
    while pending:
        time.sleep(_POLL_S)
        cpu, busy = zip(*(cpu_and_busy(i) for i in range(len(threads))))
        wall = time.monotonic() - started
        # the time a call could not have run: the others (and this timer) ran or were ready to
        all_busy = sum(busy) + _own_busy_s() - timer_busy_at_start
        for index in list(pending):
            if not threads[index].is_alive():
                pending.discard(index)
            elif cpu[index] > timeout_s or wall - (all_busy - busy[index]) > timeout_s:
                pending.discard(index)
                message = f"scorer {calls[index][0].target} took more than {timeout_s}s"
                results.setdefault(index, ScoreOutcome("timeout", message=message))
                _raise_in_thread(threads[index], ScoringTimeout)
    return [results[i] for i in range(len(calls))]
