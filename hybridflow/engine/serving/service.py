"""RolloutService: the engine as a request-level server, on its own thread.

    service = RolloutService(engine)
    handle = service.submit(prompt_ids, SamplingParams(max_new_tokens=64), seed=1)
    completion = handle.result()[0]            # or `await handle`, or stream it
    service.pause(); ...train...; service.resume(weights_changed=True)
    service.close()

Requests are submitted from any thread or asyncio task while others decode: the engine's
thread runs the scheduler (scheduler.py) step after step and takes what was submitted at
the next chunk boundary, so a request joins the running batch within one chunk of decode
steps. Each request brings its own sampling settings, seed, stop tokens and budget; a
seeded request samples the same tokens whatever it is batched with. New tokens are read back
once per chunk and handed to the request's handle as they arrive (streaming); `abort` ends a
request at the next boundary with the tokens so far. Kept KV (kept.py): `keep=True` leaves a
finished request's K/V in its slot, and a request naming that handle in `reuse` prefills
only what it adds.

Weights: `pause()` stops decoding at a chunk boundary (the live requests keep their slots
and K/V); the trainer may then change the parameters in place; `resume(weights_changed=True)`
refreshes the engine's fused weight copies and starts a new policy version. Tokens record the
version that sampled them (Completion.version_spans): a request that decodes across an
update has two spans (partial rollouts, for asynchronous RL). `update_weights(named)` is
pause, copy, resume. Kept KV made by old weights is dropped at an update.

Engine.generate() keeps working while a service runs: it submits its prompts here and waits.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from concurrent.futures import Future

import torch

from hybridflow.engine.host import cyclic_gc_paused
from hybridflow.engine.requests import Completion, Submission
from hybridflow.engine.sampling import SamplingParams
from hybridflow.engine.serving.handles import RequestHandle, Wakeups
from hybridflow.engine.serving.service_stream import ServiceStream


class RolloutService:
    """engine: hybridflow.engine.Engine (this service becomes its only driver until
    close()). streams: where its thread launches and how it hands the engine over
    (service_stream.py; default: the engine's options.service_stream). Starts the engine's
    thread at once."""

    def __init__(self, engine, streams: ServiceStream | None = None):
        if engine.service is not None:
            raise RuntimeError("this engine already has a RolloutService; close it first")
        self.engine = engine
        self._inbox: deque = deque()  # (callable, Future) to run on the engine's thread
        self._wake = threading.Condition()
        self._paused = False
        self._closed = False
        # awaiting tasks woken once per event loop per pass of the thread (handles.py)
        self.wakeups = Wakeups()
        self.streams = streams or ServiceStream(engine.device, engine.options.service_stream)
        self._thread = threading.Thread(target=self._run, name="hybridflow-engine", daemon=True)
        engine.service = self
        self._thread.start()
        # The weights may have changed in place since the engine last ran (a colocated
        # trainer's step): the fused copies are refreshed before the first request.
        self._post(self._start)

    # -- requests -------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, seed: int | None = None,
               *, keep: bool = False, reuse: int | None = None,
               stream: bool = False, images=None) -> RequestHandle:  # fmt: skip
        """One request: params.n samples of prompt_ids. seed: its base seed (params.seed
        when None; random when both are). keep/reuse: kept KV (module docstring; n = 1).
        stream: the handle records new tokens as they come (handle.stream()/astream()).
        images: the prompt's engine.images.PromptImages (a vision-language model; with
        keep/reuse, a continuation's new text extends the kept slot, images.py). ValueError, here, for a prompt that cannot be served (empty, too long,
        ids out of the vocabulary, image tokens that its images do not fill)."""
        sub, handle = self._prepare(prompt_ids, params, seed, keep, reuse, stream, images)
        self._post(lambda: self._add(sub, handle.on_error))
        return handle

    def submit_many(self, requests: list[dict]) -> list[RequestHandle | BaseException]:
        """Several requests in one post to the engine's thread (each dict: submit()'s
        arguments): what a client gathers from one tick of its event loop, so hundreds of
        agent turns cost the engine's thread one wake-up and one lock, not one each. A
        request that cannot be served gets its ValueError in its place; the others go in."""
        prepared, out = [], []
        for request in requests:
            try:
                prepared.append(self._prepare(**request))
                out.append(prepared[-1][1])
            except ValueError as error:
                out.append(error)
        if prepared:
            self._post(lambda: [self._add(sub, handle.on_error) for sub, handle in prepared])
        return out

    def _prepare(self, prompt_ids, params: SamplingParams, seed=None, keep=False, reuse=None,
                 stream=False, images=None) -> tuple[Submission, RequestHandle]:  # fmt: skip
        """A request's submission and handle, checked here, on the caller's thread (the
        engine's never raises for a bad prompt)."""
        if images is not None and not self.engine.native:  # the slow path drops them
            raise ValueError(f"prompts with images need hybridflow's own decoder; the engine "
                             f"runs this model on its slow path ({self.engine.slow_reason})")  # fmt: skip
        handle = RequestHandle(params.n, wakeups=self.wakeups)
        seeds = None if seed is None else [seed]
        sub = self.engine.submission(
            [list(prompt_ids)], params, seeds, keep=keep,
            reuse=None if reuse is None else [reuse],
            listener=handle.on_tokens if stream else None, on_finish=handle.on_finish,
            images=None if images is None else [images],
        )  # fmt: skip
        sub.table.check()
        handle._abort = lambda: self._post(lambda: self._abort(sub))
        return sub, handle

    def generate(self, prompts, params: SamplingParams, seeds=None, *, keep=False,
                 reuse=None, sample_index=None, images=None) -> list[Completion]:  # fmt: skip
        """Engine.generate through the service: the prompts decode beside other requests.
        images: Engine.generate's (the submission holds them and their encoder features
        while its requests are in flight, across pauses and weight updates)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("Engine.generate called on the engine's own thread")
        if images is not None and not self.engine.native:  # the slow path drops them
            raise ValueError(f"prompts with images need hybridflow's own decoder; the engine "
                             f"runs this model on its slow path ({self.engine.slow_reason})")  # fmt: skip
        finished = threading.Event()
        sub = self.engine.submission(prompts, params, seeds, keep=keep, reuse=reuse,
                                     on_finish=lambda *_: sub.done and finished.set(),
                                     sample_index=sample_index, images=images)  # fmt: skip
        sub.table.check()
        errors: list[BaseException] = []

        def failed(error):
            errors.append(error)
            finished.set()

        self._submit(sub, failed)
        finished.wait()
        if errors:
            raise errors[0]
        return sub.results

    def _submit(self, sub, failed) -> None:
        """Hand a checked submission to the engine's thread (lockstep.py: to every rank's)."""
        self._post(lambda: self._add(sub, failed))

    def release_kept(self, handles) -> None:
        """Give kept slots back (at the next chunk boundary)."""
        handles = list(handles)
        self._post(lambda: self.engine.release_kept(handles))

    # -- weights --------------------------------------------------------------------------------

    def pause(self) -> None:
        """Stop decoding at the next chunk boundary and wait until it has: the GPU is the
        caller's (the live requests keep their slots; new ones queue) until resume()."""
        self._call(self._pause)

    def resume(self, weights_changed: bool = False, version: int | None = None) -> None:
        """Decode again. weights_changed: the parameters were updated in place meanwhile:
        the fused copies are refreshed and a new policy version begins (`version`, or the
        last + 1)."""
        self._call(lambda: self._resume(weights_changed, version))

    def update_weights(self, named_tensors, version: int | None = None) -> int:
        """Copy (HF name, tensor) pairs into the model between two chunks (Engine.load_weights)
        and start a new policy version; -> that version."""
        return self._call(lambda: self._update(named_tensors, version))

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    # -- life -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Abort what is still running or queued, stop the thread, hand the engine back."""
        if self._closed:
            return
        self._call(self._abort_all)
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._thread.join()
        self.engine.service = None

    def __enter__(self) -> RolloutService:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def on_engine_thread(self) -> bool:
        return threading.current_thread() is self._thread

    # -- the engine's thread --------------------------------------------------------------------

    def _post(self, task) -> Future:
        future: Future = Future()
        with self._wake:
            if self._closed:
                raise RuntimeError("the RolloutService is closed")
            self._inbox.append((task, future))
            self._wake.notify_all()
        return future

    def _call(self, task):
        if self.on_engine_thread():
            return task()
        return self._post(task).result()

    def _has_work(self) -> bool:
        scheduler = self.engine.scheduler
        return not self._paused and scheduler is not None and scheduler.busy

    def _run(self) -> None:
        device = self.engine.device
        context = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with context, self.streams.launching(), torch.no_grad():
            self.streams.take_over()  # the engine's state so far was made on the default stream
            busy = contextlib.ExitStack()  # holds the collector's pause while there is work
            paused_gc = False
            gathered = False  # this burst of requests has had its wait (_gather)
            while True:
                with self._wake:
                    while not self._inbox and not self._closed and not self._has_work():
                        if paused_gc:
                            busy.close()  # idle: the cyclic collector runs again
                            paused_gc = False
                        self._wake.wait()
                    if self._closed and not self._inbox:
                        break
                    tasks, self._inbox = list(self._inbox), deque()
                for task, future in tasks:
                    try:
                        future.set_result(task())
                    except BaseException as error:  # the caller of _call re-raises it
                        future.set_exception(error)
                self.wakeups.post()
                if not gathered and self._should_gather():
                    gathered = True
                    self._gather()
                    continue  # take what arrived meanwhile before the first prefill
                if self._has_work():
                    gathered = False
                    if not paused_gc:
                        busy.enter_context(cyclic_gc_paused())
                        paused_gc = True
                    self._step()
                    self.wakeups.post()  # once a step: the tasks it finished or fed
            busy.close()
            self.streams.hand_back()  # close(): the engine is the caller's again

    def _should_gather(self) -> bool:
        """Nothing decodes and a few requests wait (EngineOptions.admission_gather_ms)."""
        scheduler = self.engine.scheduler
        if (self._paused or scheduler is None or scheduler.rows or scheduler.prefilling
                or scheduler.pending is not None):  # fmt: skip
            return False
        waiting = len(scheduler.waiting) + len(scheduler.extending) + len(scheduler.resuming)
        return 0 < waiting < max(1, scheduler.cache.num_slots // 8)

    def _gather(self) -> None:
        """Wait until no task has arrived for admission_gather_ms (at most ten windows)."""
        quiet = self.engine.options.admission_gather_ms / 1000
        deadline = time.monotonic() + 10 * quiet
        with self._wake:
            while not self._closed:
                arrived, left = len(self._inbox), deadline - time.monotonic()
                if left <= 0:
                    return
                self._wake.wait(min(quiet, left))
                if len(self._inbox) == arrived:
                    return

    def _step(self) -> None:
        try:
            self.engine.scheduler.step()
        except BaseException as error:  # a CUDA error, say: every request hears it
            self._fail_all(error)

    def _start(self) -> None:
        if self.engine.native:
            self.engine.start_generation()

    def _add(self, sub: Submission, on_error) -> None:
        engine = self.engine
        if not engine.native:  # the slow path has no scheduler: serve it whole, now
            from hybridflow.engine.slow import generate_slow

            try:
                seeds = torch.tensor([sub.seed_lo[i] | sub.seed_hi[i] << 32
                                      for i in range(len(sub.max_new))])  # fmt: skip
                for request, completion in enumerate(
                    generate_slow(engine, sub.prompts, sub.params, seeds)
                ):
                    sub.finish(request, completion)
            except Exception as error:
                on_error(error)
            return
        try:  # a cache too large for the memory fails here: the request hears it, never waits
            if engine.scheduler is None:
                engine.start_generation()
            sub.on_error = on_error
            engine.scheduler.add(sub)
        except Exception as error:
            on_error(error)

    def _abort(self, sub: Submission) -> None:
        if self.engine.scheduler is None:
            return
        for request, result in enumerate(sub.results):
            if result is None:
                self.engine.scheduler.abort(sub, request)

    def _abort_all(self) -> None:
        scheduler = self.engine.scheduler
        if scheduler is None:
            return
        subs = scheduler.submissions()
        for sub in subs:
            self._abort(sub)
        scheduler.pending = None

    def _fail_all(self, error: BaseException) -> None:
        scheduler = self.engine.scheduler
        subs = scheduler.submissions()
        self.engine._reset_scheduler()
        for sub in subs:
            sub.error = error
            if sub.on_error is not None:
                sub.on_error(error)

    def _pause(self) -> None:
        if self.engine.scheduler is not None:
            self.engine.scheduler.flush()
        self._paused = True
        self.streams.hand_back()  # the caller may now write the weights the decode reads

    def _resume(self, weights_changed: bool, version: int | None) -> None:
        self.streams.take_over()  # after the caller's in-place writes
        if weights_changed:
            self.engine.new_policy_version(version)
            if self.engine.scheduler is not None:
                self.engine.start_generation()
        self._paused = False

    def _update(self, named_tensors, version: int | None) -> int:
        self._pause()
        self.streams.take_over()  # the tensors handed over were written on the default stream
        try:
            self.engine.load_weights(named_tensors)  # a new version, kept KV dropped
            if version is not None:
                self.engine.new_policy_version(version)
            if self.engine.scheduler is not None:
                self.engine.start_generation()
        finally:
            self._paused = False
            self.streams.hand_back()  # the caller may free or overwrite what it handed over
        return self.engine.policy_version
