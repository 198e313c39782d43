"""The loop's role-handle Protocols match the worker methods the calls run."""

from __future__ import annotations

import inspect

import pytest

from hybridflow.controller.dispatch import dispatch_of
from hybridflow.trainer.loop import role_handles
from hybridflow.workers import ActorWorker, CriticWorker, RefWorker, RolloutWorker


@pytest.mark.parametrize(
    "handle, worker",
    [
        (role_handles.ActorHandle, ActorWorker),
        (role_handles.RolloutHandle, RolloutWorker),
        (role_handles.RefHandle, RefWorker),
        (role_handles.CriticHandle, CriticWorker),
    ],
)
def test_every_handle_method_is_a_remote_method_with_the_same_parameters(handle, worker):
    methods = [name for name in vars(handle) if not name.startswith("_")]
    assert methods
    for name in methods:
        target = getattr(worker, name, None)
        assert dispatch_of(target) is not None, f"{worker.__name__}.{name} is not @register'ed"
        expected = list(inspect.signature(getattr(handle, name)).parameters)
        assert list(inspect.signature(target).parameters) == expected, name
        assert worker.__name__ in getattr(handle, name).__doc__, name
