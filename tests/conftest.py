"""Suite-wide set-up."""

from __future__ import annotations

import signal

from collection_order import slow_files_first


def pytest_configure(config) -> None:
    # A suite started in the background of a shell without job control (`make test &` in a
    # script, nohup) inherits SIGINT ignored, and every process it starts would too: the
    # tests of Ctrl-C handling (serve, the controller, reward scorers) need Python's own
    # handler, as in a terminal. A handler (unlike SIG_IGN) is reset to the default at exec.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items) -> None:
    slow_files_first(items)  # why: collection_order.py
