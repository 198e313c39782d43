"""verl's defaults never replace what the ``--config`` file sets, even where the file's
value equals our own default (``algorithm.adv_estimator: grpo`` stays GRPO)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hybridflow.config import load_config
from hybridflow.config.verl import load_with_verl_keys
from hybridflow.config.verl.table import VERL_DEFAULTS

EXAMPLES = sorted((Path(__file__).parents[3] / "examples").glob("*.yaml"))
DEFAULTED = {ours for _, ours, _ in VERL_DEFAULTS}
HARMLESS = "actor_rollout_ref.model.use_remove_padding=True"  # a verl key with no effect here


def keys_set_in(path: Path) -> set[str]:
    """``section.key`` and ``section.group.key`` for each key the YAML file writes."""
    out = set()
    for section, values in yaml.safe_load(path.read_text()).items():
        for key, value in values.items():
            out.add(f"{section}.{key}")
            if isinstance(value, dict):
                out.update(f"{section}.{key}.{inner}" for inner in value)
    return out


def _value(cfg, dotted: str):
    value = cfg
    for part in dotted.split("."):  # a section's field, or a key of a mapping (reward.weights)
        value = value[part] if isinstance(value, dict) else getattr(value, part)
    return value


def _defaulted_keys_set_by_examples() -> list[tuple[Path, str]]:
    return [(path, key) for path in EXAMPLES for key in sorted(keys_set_in(path) & DEFAULTED)]


def test_the_examples_set_keys_verl_has_defaults_for():
    assert len(_defaulted_keys_set_by_examples()) >= len(EXAMPLES)  # the test below is not empty


@pytest.mark.parametrize(
    "path,key", _defaulted_keys_set_by_examples(), ids=lambda p: getattr(p, "name", p)
)
@pytest.mark.parametrize("verl_item", ["actor_rollout_ref.rollout.n=5", HARMLESS])
def test_a_verl_key_keeps_the_value_the_example_sets(path, key, verl_item):
    from_file = load_config(path)
    with_verl_key = load_with_verl_keys(path, [verl_item], log=lambda text: None)
    if key == "rollout.n" and verl_item.startswith("actor_rollout_ref.rollout.n="):
        assert with_verl_key.rollout.n == 5  # the verl key given on the command line wins
    else:
        assert _value(with_verl_key, key) == _value(from_file, key)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_key_an_example_sets_survives_a_verl_key(path):
    from_file = load_config(path)
    with_verl_key = load_with_verl_keys(path, [HARMLESS], log=lambda t: None)
    for key in keys_set_in(path):
        assert _value(with_verl_key, key) == _value(from_file, key), key


def test_grpo_stays_grpo_beside_a_verl_key():
    path = next(p for p in EXAMPLES if p.name == "grpo.yaml")
    cfg = load_with_verl_keys(path, ["actor_rollout_ref.rollout.n=5"], log=lambda t: None)
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.rollout.n == 5


def test_a_key_the_file_sets_to_our_default_is_kept(tmp_path):
    default = load_config().algorithm.adv_estimator  # our default
    path = tmp_path / "run.yaml"
    path.write_text(f"algorithm:\n  adv_estimator: {default}\n")
    cfg = load_with_verl_keys(path, [HARMLESS], log=lambda t: None)
    assert cfg.algorithm.adv_estimator == default
    bare = load_with_verl_keys(None, [HARMLESS], log=lambda t: None)
    assert bare.algorithm.adv_estimator == "gae"  # without the file: verl's default
