"""The sm_90 compile tests' fixtures (test_*_compile.py, tests/sm90_compile.py): one pool of
compile workers for the session, and every compile a test asked for checked at its end."""

from __future__ import annotations

import pytest
from sm90_compile import PENDING, POOL


@pytest.fixture(autouse=True, scope="session")
def _compile_workers():
    yield
    if POOL:
        POOL.pop().shutdown(cancel_futures=True)


@pytest.fixture(autouse=True)
def _every_compile_checked():
    """A compile no assertion read (e.g. the row kernels') must still have succeeded."""
    yield
    pending = PENDING[:]
    PENDING.clear()
    for compiled in pending:
        assert compiled.asm["ptx"]
