"""trainer/stop.py: the first SIGTERM asks for a stop, a second one exits; the handler
survives a library (ray.init) that installs its own."""

import os
import signal

import pytest

from hybridflow.trainer.stop import StopRequest


def test_first_sigterm_requests_a_stop_second_exits_and_reclaim_restores_the_handler():
    stop, lines = StopRequest(), []
    before = signal.getsignal(signal.SIGTERM)
    with stop.on_sigterm(lines.append):
        signal.signal(signal.SIGTERM, lambda *a: None)  # what ray.init does
        stop.reclaim()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and "finishing this step" in lines[0]
        with pytest.raises(SystemExit) as exit_info:
            os.kill(os.getpid(), signal.SIGTERM)
        assert exit_info.value.code == 143
    assert signal.getsignal(signal.SIGTERM) is before
