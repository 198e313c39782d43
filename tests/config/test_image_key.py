"""data.image_key: a vision-language model reads its rows' images (verl's `images` column
unless named), a text-only model refuses the key naming it."""

import pytest

from hybridflow.config import ConfigError, load_config, validate
from hybridflow.config.model_facts import image_key


def _config(*overrides):
    return load_config(None, ["data.train_files=[builtin:shapes]",
                              "data.val_files=[builtin:shapes]", *overrides])  # fmt: skip


def test_a_vision_language_model_reads_verls_images_column_by_default():
    assert image_key(_config("model.path=tiny-vl")) == "images"
    assert image_key(_config("model.path=tiny-vl", "data.image_key=pictures")) == "pictures"
    assert image_key(_config("model.path=sft:shapes", "sft.preset=tiny-vl")) == "images"
    assert image_key(_config("model.path=tiny")) is None
    validate(_config("model.path=tiny-vl", "data.image_key=images"))


def test_a_text_only_model_refuses_the_key_naming_it():
    with pytest.raises(ConfigError, match=r"data.image_key = 'images' .* text-only model"):
        validate(_config("model.path=tiny", "data.image_key=images"))


def test_what_prompts_with_images_do_not_run_through_is_refused_up_front():
    for settings in (["rollout.expert_parallel_size=2"],):
        key = settings[-1].split("=")[0]
        with pytest.raises(ConfigError, match=rf"{key} = .* prompts with images"):
            validate(_config("model.path=tiny-vl", *settings))


def test_a_tensor_parallel_rollout_runs_prompts_with_images():
    """Every rank holds the vision encoder whole and the rows' images travel with them
    (tests/engine/test_image_tensor_parallel.py, tests/workers/test_rollout_tp_images.py)."""
    validate(_config("model.path=tiny-vl", "trainer.n_gpus_per_node=2", "trainer.backend=local",
                     "rollout.tensor_parallel_size=2"))  # fmt: skip
    validate(_config("model.path=tiny-vl", "trainer.n_gpus_per_node=2", "trainer.backend=local",
                     "rollout.tensor_parallel_size=2", "trainer.mode=async",
                     "trainer.partial_rollout=true"))  # fmt: skip


def test_a_sequence_parallel_actor_trains_on_prompts_with_images():
    """Every rank of the group encodes the whole images and takes its slice's features and
    mRoPE rows (tests/learners/test_image_sequence_parallel.py)."""
    validate(_config("model.path=tiny-vl", "trainer.n_gpus_per_node=2", "trainer.backend=local",
                     "actor.sequence_parallel_size=2"))  # fmt: skip


def test_mixed_steps_partial_rollouts_and_fp8_run_prompts_with_images():
    """The engine chunks prompts with images in mixed steps, keeps them across a partial
    rollout's weight updates (tests/engine/test_image_engine.py) and runs their passes on
    its fp8 copies (tests/engine/test_image_engine_fused.py)."""
    validate(_config("model.path=tiny-vl", "rollout.engine.max_prefill_tokens_per_step=256"))
    validate(_config("model.path=tiny-vl", "rollout.dtype=fp8"))
    validate(_config("model.path=tiny-vl", "trainer.mode=async", "trainer.partial_rollout=true",
                     "trainer.stale_policy=drop"))  # fmt: skip


def test_the_tool_loop_runs_prompts_with_images_and_an_agent_program_is_refused():
    validate(_config("model.path=tiny-vl", "rollout.agent.loop=tools",
                     "rollout.agent.tools=[calculator]"))  # fmt: skip
    with pytest.raises(ConfigError, match=r"rollout.agent.loop = 'openai' .* prompts with images"):
        validate(_config("model.path=tiny-vl", "rollout.agent.loop=openai",
                         "rollout.agent.program=agent.py:run"))  # fmt: skip


def test_a_picture_task_for_a_text_only_model_is_refused_naming_the_files_key():
    with pytest.raises(ConfigError) as error:
        validate(_config("model.path=tiny"))
    text = str(error.value)
    assert "data.train_files has builtin:shapes, whose prompts are pictures" in text
    assert "data.val_files has builtin:shapes" in text and "model.path=sft:shapes" in text
    validate(load_config(None, ["model.path=tiny"]))  # the text tasks stay as they were
