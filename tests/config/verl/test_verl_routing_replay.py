"""verl's routing-replay keys become actor.router_replay (R3: replay the rollout's experts)."""

import pytest

from hybridflow.cli import main
from hybridflow.config.verl import translate

MODE = "actor_rollout_ref.actor.router_replay.mode"
ENABLE = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
HERE = ["trainer.loggers=[console]", "data.train_files=[builtin:arithmetic]",
        "data.val_files=[builtin:arithmetic]"]  # fmt: skip


@pytest.mark.parametrize(
    "items",
    [[f"{MODE}=R3", f"{ENABLE}=True"], [f"{MODE}=R3"], [f"{ENABLE}=True"]],
)
def test_rollout_routing_replay_translates(items):
    t = translate(items)
    assert not t.problems
    assert "actor.router_replay=rollout" in t.overrides


def test_disabled_translates_to_off_and_r2_stops_naming_it():
    off = translate([f"{MODE}=disabled"])
    assert not off.problems and "actor.router_replay=rollout" not in off.overrides
    problems = translate([f"{MODE}=R2"]).problems
    assert len(problems) == 1 and "R2" in problems[0]


def test_verl_r3_keys_validate_with_a_mixture_of_experts(capsys):
    line = [f"{MODE}=R3", f"{ENABLE}=True", "model.path=tiny-moe", *HERE]
    assert main(["config", "validate", *line]) == 0
    assert "actor.router_replay = rollout" in capsys.readouterr().err


def test_verl_r3_keys_validate_with_the_default_model(capsys):
    # as in verl, replay on a model without experts has nothing to patch: the run says so
    line = [f"{MODE}=R3", f"{ENABLE}=True", *HERE]
    assert main(["config", "validate", *line]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_unknown_router_replay_value_is_named(capsys):
    assert main(["config", "validate", "actor.router_replay=R3", *HERE]) == 2
    assert "use off or rollout" in capsys.readouterr().err
