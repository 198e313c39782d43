"""examples/*.yaml: each loads and validates as shipped (a user's first command must not stop
at a config error) and writes its own run directory, and the GSM8K example's settings left to the memory plan resolve on an
H200 to a run that fits, with no gradient checkpointing at the 0.5b shape."""

from __future__ import annotations

from pathlib import Path

import pytest
from example_helpers import command_overrides

from hybridflow.config import load_config, validate
from hybridflow.trainer.plan import memory_check as mc
from hybridflow.trainer.plan import memory_fixes as mf
from hybridflow.trainer.plan import memory_from_config as mfc

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def test_there_are_examples():
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_each_example_starts_with_the_command_that_runs_it(path):
    assert path.read_text().startswith("# hybridflow "), path.name
    command_overrides(path)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_each_example_is_a_valid_config(path, tmp_path):
    """As its first line runs it (a reward model's path there is a tiny one written here)."""
    from reward_model_helpers import write_reward_model

    from hybridflow.models import load_tokenizer

    local = {}
    if "reward.model.path=" in path.read_text().splitlines()[0]:
        rm = write_reward_model(tmp_path / "rm", tokenizer=load_tokenizer("char"))
        local["reward.model.path"] = str(rm)
    validate(load_config(str(path), command_overrides(path, local)))


def test_there_is_a_reward_model_example():
    names = [p.name for p in EXAMPLES]
    first = EXAMPLES[names.index("reward_model.yaml")].read_text().splitlines()[0]
    assert "reward.model.path=" in first


def test_each_example_has_its_own_run_dir():
    """runs/<example name>: one example's checkpoints never make another say "nothing to do"
    or refuse a changed config; the demo (no --config) keeps runs/demo."""
    for path in EXAMPLES:
        assert load_config(str(path), []).trainer.run_dir == f"runs/{path.stem}", path.name


def test_the_gsm8k_example_on_an_h200_fits_and_trains_without_recomputing():
    example = str(EXAMPLES[[p.name for p in EXAMPLES].index("gsm8k.yaml")])
    cfg = load_config(example, ["model.path=qwen2.5-0.5b", "trainer.gpu_memory_gib=141"])
    lines = []
    resolved = mc.memory_defaults(cfg, lines.append)
    assert resolved.model.gradient_checkpointing is False
    # 32 prompts x 8 samples of up to 1,024 tokens a mini-batch: the budget's cap, 65,536
    assert resolved.actor.max_tokens_per_gpu == 65536
    assert resolved.actor.log_prob_max_tokens_per_gpu == resolved.ref.max_tokens_per_gpu >= 65536
    assert lines[0].startswith("actor.max_tokens_per_gpu=auto: 65,536 tokens")
    assert mf.fits(mfc.plan_for_config(cfg, validate(cfg), 141 * 2**30))
    validate(resolved)
