"""The CUDA stream a RolloutService's thread launches on (EngineOptions.service_stream), and
the hand-overs between it and the device's default stream, where the caller's thread works.

On the default stream (the default), the service's kernels and another thread's (a trainer
in asynchronous RL on one GPU) run one after the other in launch order: nothing to order by
hand, and no overlap. On a stream of its own at high priority, decode kernels run beside
the trainer's and are scheduled first; the two streams then share nothing unordered:

- the service's thread takes the engine over at its start and at every resume and weight
  update: its stream waits for the default stream's work so far (the weights a trainer just
  wrote in place, the tensors handed to update_weights);
- it hands back at every pause, update, release and at its end: the default stream waits
  for the service's work so far, so the caller may write the weights the decode reads and
  reuse memory the engine freed (a caller's thread is blocked in the service's call until
  then, so its next kernels come after the wait).

Everything the engine allocates while the service runs comes from the service's thread, so
from its stream's pool; what it frees is reused by that stream only. Completions reach the
callers as host lists.
"""

from __future__ import annotations

import contextlib

import torch

HIGH_PRIORITY = -1  # CUDA stream priorities: lower is higher; torch clamps to the device's range


class ServiceStream:
    """choice: "default" or "priority" (EngineOptions.service_stream); off CUDA both are the
    plain sequential order, with nothing to hand over."""

    def __init__(self, device: torch.device, choice: str):
        own = device.type == "cuda" and choice == "priority"
        self.stream = torch.cuda.Stream(device, priority=HIGH_PRIORITY) if own else None
        self.default = torch.cuda.default_stream(device) if own else None

    @property
    def separate(self) -> bool:
        return self.stream is not None

    def launching(self):
        """The context the service's thread runs in: its kernels go to its stream."""
        return (
            torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        )

    def take_over(self) -> None:
        """The service's next work waits for everything launched on the default stream so far."""
        if self.stream is not None:
            self.stream.wait_stream(self.default)

    def hand_back(self) -> None:
        """The default stream's next work waits for everything the service launched so far."""
        if self.stream is not None:
            self.default.wait_stream(self.stream)
