"""The algorithm names validate() knows without importing hybridflow.algos (and torch)."""

import subprocess
import sys

import pytest

from hybridflow.config import Config, ConfigError, validate
from hybridflow.config.validation import BUILTIN_NAMES


def test_builtin_names_are_the_registries_of_a_fresh_interpreter():
    # a new process: this one's registries may hold names other tests registered
    code = (
        "from hybridflow import algos\n"
        "for registry in (algos.ADVANTAGE_ESTIMATORS, algos.POLICY_LOSSES, "
        "algos.LOSS_AGG_MODES, algos.KL_KINDS):\n"
        "    names = registry.names() if hasattr(registry, 'names') else registry\n"
        "    print(' '.join(sorted(names)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    registered = [set(line.split()) for line in out.stdout.splitlines()]
    assert registered == [set(names) for names in BUILTIN_NAMES]


def test_a_registered_estimator_is_accepted_and_an_unknown_one_refused():
    from hybridflow.algos import ADVANTAGE_ESTIMATORS, register_advantage

    cfg = Config()
    cfg.algorithm.adv_estimator = "validation_names_estimator"
    with pytest.raises(ConfigError, match="algorithm.adv_estimator"):
        validate(cfg)
    register_advantage("validation_names_estimator")(lambda **_: None)
    try:
        validate(cfg)
    finally:
        ADVANTAGE_ESTIMATORS.unregister("validation_names_estimator")
