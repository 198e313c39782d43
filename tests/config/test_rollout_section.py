"""rollout.gpu_memory_utilization: auto gives the KV cache most of the memory free in
generation when nothing else needs it then, a number is kept, anything else is refused."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError, load_config, validate
from hybridflow.config.rollout_section import kv_memory_share


def share(*overrides: str) -> float:
    cfg = load_config(None, list(overrides))
    return kv_memory_share(cfg.rollout, cfg.trainer)


def test_auto_takes_most_of_the_free_memory_when_generation_has_the_gpu_to_itself():
    assert load_config(None, []).rollout.gpu_memory_utilization == "auto"
    assert share() == 0.9
    # asynchronous without staleness: generation and update still take turns
    assert share("trainer.mode=async", "trainer.max_staleness=0") == 0.9


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.release_cache=false"],  # the cache stays through the update
        ["trainer.mode=async", "trainer.max_staleness=1"],  # the update runs beside it
        ["trainer.mode=async", "trainer.max_staleness=0", "trainer.partial_rollout=true"],
    ],
)
def test_auto_leaves_most_of_it_to_an_update_that_shares_the_gpu(overrides):
    assert share(*overrides) == 0.4


def test_a_number_is_kept():
    assert share("rollout.gpu_memory_utilization=0.6") == 0.6
    assert share("rollout.gpu_memory_utilization=0.6", "rollout.release_cache=false") == 0.6


@pytest.mark.parametrize("value", ["half", "0.99", "0"])
def test_anything_else_is_refused_naming_the_key(value):
    cfg = load_config(None, [f"rollout.gpu_memory_utilization={value}"])
    with pytest.raises(ConfigError, match="rollout.gpu_memory_utilization = .* must be auto or"):
        validate(cfg)


def test_speculative_decoding_is_off_by_default_and_its_options_are_checked():
    assert load_config(None, []).rollout.engine.speculative == "off"
    cfg = load_config(None, ["rollout.engine.speculative=ngram",
                             "rollout.engine.speculative_draft_tokens=0"])  # fmt: skip
    with pytest.raises(ConfigError, match="rollout.engine.speculative_draft_tokens=0: must be"):
        validate(cfg)


def test_released_weights_are_off_by_default_and_pass_in_a_colocated_sync_run():
    assert load_config(None, []).rollout.release_weights is False
    validate(load_config(None, ["rollout.release_weights=true", "trainer.backend=local",
                                "trainer.n_gpus_per_node=2"]))  # fmt: skip


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["trainer.mode=async", "trainer.max_staleness=0"], "needs trainer.mode = sync"),
        (["trainer.placement=split", "trainer.rollout_gpus=1"], "trainer.placement = split"),
    ],
)
def test_released_weights_where_something_else_needs_them_exit_2_naming_why(
    overrides, named, capsys
):
    """Async mode generates over the update; a split rollout shares no GPU with it."""
    from hybridflow.cli import main

    keys = ["rollout.release_weights=true", "trainer.backend=local", "trainer.n_gpus_per_node=2",
            *overrides]  # fmt: skip
    assert main(["config", "validate", *keys]) == 2
    err = capsys.readouterr().err
    assert "rollout.release_weights = true" in err and named in err, err
    assert "set rollout.release_weights=false" in err and "Traceback" not in err
