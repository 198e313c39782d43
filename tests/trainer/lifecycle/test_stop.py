"""trainer/lifecycle/stop.py: in a phase with work to save, the first SIGTERM/SIGINT asks for a stop
and says what the phase will do, a second one stops at once; where there is nothing to
save, the first one stops at once. The handler survives a library (ray.init) that installs
its own, and the previous handlers come back after the block."""

import os
import signal

import pytest

from hybridflow.trainer.lifecycle.stop import StopRequest


def test_first_sigterm_requests_a_stop_second_exits_and_reclaim_restores_the_handler():
    stop, lines = StopRequest(), []
    before = signal.getsignal(signal.SIGTERM)
    with stop.on_signals(lines.append), stop.graceful("finishing this step, then saving"):
        signal.signal(signal.SIGTERM, lambda *a: None)  # what ray.init does
        stop.reclaim()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and lines[0].startswith("SIGTERM: finishing this step")
        with pytest.raises(SystemExit) as exit_info:
            os.kill(os.getpid(), signal.SIGTERM)
        assert exit_info.value.code == 143
    assert signal.getsignal(signal.SIGTERM) is before
    error = stop.stopped("after step 2 of 4: saved")
    assert str(error) == "stopped by SIGTERM after step 2 of 4: saved" and error.exit_code == 143


def test_ctrl_c_is_a_stop_request_too_with_its_own_exit_status():
    stop, lines = StopRequest(), []
    before = signal.getsignal(signal.SIGINT)
    with stop.on_signals(lines.append), stop.graceful("saving the progress"):
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and lines == ["SIGINT: saving the progress (a second SIGINT "
                                            "stops at once)"]  # fmt: skip
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
    assert stop.stopped("during x").exit_code == 130


def test_where_there_is_nothing_to_save_the_first_signal_stops_at_once():
    stop, lines = StopRequest(), []
    with stop.on_signals(lines.append):
        with stop.graceful("saving"):
            pass  # the phase with work to save is over
        with pytest.raises(SystemExit) as exit_info:
            os.kill(os.getpid(), signal.SIGTERM)
    assert exit_info.value.code == 143 and not stop.requested
    assert lines == ["SIGTERM: stopping now (nothing to save at this point)"]


def test_nested_phases_say_the_innermost_plan():
    stop, lines = StopRequest(), []
    with stop.on_signals(lines.append), stop.graceful("outer"):
        with stop.graceful("inner"):
            os.kill(os.getpid(), signal.SIGTERM)
    assert lines[0].startswith("SIGTERM: inner")
