"""A model directory's shape read once per version of its config.json
(models/architecture_file.py)."""

from __future__ import annotations

import json
import os

import pytest

from hybridflow.models.architecture_file import directory_architecture
from hybridflow.models.presets import PRESETS


def test_a_directory_is_read_once_until_its_config_changes(tmp_path):
    """The thousands of candidate layouts of `config plan` ask for the same shape: one parsed
    object; an edited config.json (another size or time) is read again."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(PRESETS["qwen2.5-0.5b"].to_hf()))
    first = directory_architecture(tmp_path)
    assert directory_architecture(str(tmp_path)) is first
    assert first.num_parameters() == PRESETS["qwen2.5-0.5b"].num_parameters()
    config.write_text(json.dumps({**PRESETS["qwen2.5-0.5b"].to_hf(), "num_hidden_layers": 4}))
    os.utime(config, ns=(0, 12345))  # whatever the file system's clock granularity
    assert directory_architecture(tmp_path).num_hidden_layers == 4


def test_an_unreadable_directory_raises_each_time(tmp_path):
    with pytest.raises(OSError):
        directory_architecture(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError):
        directory_architecture(tmp_path)
