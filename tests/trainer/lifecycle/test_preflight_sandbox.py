"""The code sandbox in the preflight checks: the isolation in force is said when the run
executes the model's programs, and isolation=strict is refused, with the key, the reason and
the fix, on a machine that cannot build the jail (simulated by what `jail_unavailable` says)."""

import pytest

import hybridflow.agents.sandbox as sandbox
from hybridflow.config import ConfigError, load_config, validate
from hybridflow.trainer.lifecycle.preflight import sandbox_problems

TOOL = ["rollout.agent.loop=tools", "rollout.agent.tools=[python]"]


def problems(overrides: list[str], why_no_jail: str, monkeypatch) -> tuple[list[str], list[str]]:
    monkeypatch.setattr(sandbox, "jail_unavailable", lambda: why_no_jail)
    said: list[str] = []
    return sandbox_problems(load_config(None, overrides), said.append), said


def test_the_python_tool_says_which_isolation_is_in_force(monkeypatch):
    found, said = problems(TOOL, "", monkeypatch)
    assert found == [] and said == ["code sandbox: strict isolation (a jail per program)"]
    found, said = problems(TOOL, "unshare: Operation not permitted", monkeypatch)
    assert found == []
    assert said == ["code sandbox: basic isolation only (unshare: Operation not permitted)"]


def test_strict_isolation_is_refused_where_no_jail_can_be_built(monkeypatch):
    why = "unshare: Operation not permitted"
    asked = [*TOOL, "rollout.agent.sandbox_isolation=strict", "reward.sandbox_isolation=strict"]
    found, _ = problems(asked, why, monkeypatch)
    assert [problem.split(" = ")[0] for problem in found] == [
        "reward.sandbox_isolation", "rollout.agent.sandbox_isolation"]  # fmt: skip
    assert f"cannot build the code sandbox's jail ({why})" in found[1]
    assert "set rollout.agent.sandbox_isolation=auto" in found[1]
    assert problems(asked, "", monkeypatch)[0] == []


def test_runs_without_programs_do_not_probe_the_sandbox(monkeypatch):
    def probe():
        raise AssertionError("probed")

    monkeypatch.setattr(sandbox, "jail_unavailable", probe)
    assert sandbox_problems(load_config(None, []), print) == []


def test_unknown_isolation_levels_are_config_errors():
    with pytest.raises(ConfigError) as error:
        validate(load_config(None, [*TOOL, "rollout.agent.sandbox_isolation=jail",
                                    "reward.sandbox_isolation=none"]))  # fmt: skip
    assert "sandbox_isolation='jail'" in str(error.value)
    assert "reward.sandbox_isolation = 'none' is unknown" in str(error.value)
