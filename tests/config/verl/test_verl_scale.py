"""verl's seed-scale Megatron GRPO examples (DeepSeek-671B and Qwen3-235B on GPUs of 96 GB):
their offload, recompute and checkpoint-format keys translate, and `config validate
--gpu-memory 96GB` names what hybridflow lacks for them, nothing else."""

from __future__ import annotations

import pytest
from verl_command_lines import SCALE, command_line

from hybridflow.cli import main
from hybridflow.config.verl.translate import translate

PRESET = {"scale_grpo_deepseek671b_math_megatron_96gb": "deepseek-v3",
          "scale_grpo_qwen3_235b_megatron_96gb": "qwen3-235b-a22b"}  # fmt: skip
MISSING = ("Megatron-LM pipeline parallelism", "a tensor-parallel size of its own for the experts")


@pytest.mark.parametrize("name", SCALE)
def test_the_seed_scale_examples_translate_but_for_what_is_missing(name):
    result = translate(command_line(name))
    lacking = " ".join(result.problems)
    assert all(feature in lacking for feature in MISSING), lacking
    assert len(result.problems) == len(MISSING), result.problems
    ours = {row.ours: row.value for row in result.rows}
    assert ours["actor.param_offload"] is True and ours["ref.param_offload"] is True
    assert ours["model.gradient_checkpointing"] is True  # recompute_granularity=full


@pytest.mark.parametrize("name", SCALE)
def test_validate_at_96_gb_names_what_is_missing(name, capsys):
    status = main(["config", "validate", "--gpu-memory", "96GB", *command_line(name),
                   f"model.path={PRESET[name]}"])  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err and "unknown key" not in err, err
    assert "error: 2 configuration problem(s)" in err
    assert all(feature in err for feature in MISSING), err
