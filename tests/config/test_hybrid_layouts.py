"""validate() and a model with Gated DeltaNet layers (a recurrent state that spans the
sequence): the actor, reference and critic split them by tensor and sequence parallelism
(whole key heads with their value heads), the rollout's tensor parallelism does not yet, and
an fp8 rollout is refused (its engine refuses the layers it runs on its eager passes), each
naming the key to set, before any model is loaded."""

import pytest

from hybridflow.config import ConfigError, load_config, validate

FOUR_CPUS = ["trainer.backend=local", "trainer.n_gpus_per_node=4", "trainer.device=cpu"]
HYBRID = [*FOUR_CPUS, "model.path=tiny-hybrid"]


def _problems(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as error:
        validate(load_config(None, overrides))
    return error.value.problems


@pytest.mark.parametrize(
    "layout",
    [
        ["actor.sequence_parallel_size=2"],
        ["actor.tensor_parallel_size=2"],
        ["actor.sequence_parallel_size=2", "actor.use_kl_loss=true",
         "ref.sequence_parallel_size=2"],
        ["algorithm.adv_estimator=gae", "critic.tensor_parallel_size=2"],
    ],
)  # fmt: skip
def test_training_layouts_that_split_recurrent_layers_validate(layout):
    validate(load_config(None, [*HYBRID, *layout]))


def test_the_rollout_tensor_parallelism_of_recurrent_layers_is_still_refused():
    key = "rollout.tensor_parallel_size"
    problems = _problems([*HYBRID, f"{key}=2"])
    assert any(
        f"{key} = 2: this model's 3 Gated DeltaNet layers" in p
        and "not split by the rollout's tensor parallelism" in p
        and f"set {key}=1" in p
        for p in problems
    ), problems


@pytest.mark.parametrize(
    ("sizes", "says"),
    [
        (["actor.sequence_parallel_size=4"],
         "actor.sequence_parallel_size = 4 must divide the Gated DeltaNet key heads per "
         "tensor-parallel rank = linear_num_key_heads / 1 = 2"),
        (["actor.tensor_parallel_size=4"],
         "actor.tensor_parallel_size = 4 must divide the model's Gated DeltaNet key heads "
         "(linear_num_key_heads = 2)"),
        (["actor.sequence_parallel_size=2", "actor.tensor_parallel_size=2"],
         "actor.sequence_parallel_size = 2 must divide the Gated DeltaNet key heads per "
         "tensor-parallel rank = linear_num_key_heads / 2 = 1"),
    ],
)  # fmt: skip
def test_layouts_that_split_key_heads_are_refused(sizes, says):
    problems = _problems([*HYBRID, *sizes])
    assert any(says in p for p in problems), problems


@pytest.mark.parametrize("model", ["tiny-hybrid", "sft:arithmetic sft.preset=tiny-hybrid"])
def test_an_fp8_rollout_of_a_hybrid_is_refused_before_loading(model):
    path, *rest = model.split()
    overrides = [f"model.path={path}", *rest, "rollout.dtype=fp8", "trainer.device=cuda"]
    with pytest.raises(ConfigError) as error:
        validate(load_config(None, overrides))
    assert any(
        p.startswith("rollout.dtype = fp8: the fp8 rollout does not cover this model's "
                     "gated_attention and gated_deltanet layers") and p.endswith("rollout.dtype=model")
        for p in error.value.problems
    ), error.value.problems  # fmt: skip


def test_an_fp8_rollout_of_a_dense_model_validates():
    validate(load_config(None, ["model.path=tiny", "rollout.dtype=fp8", "trainer.device=cuda"]))


def test_an_fp8_kv_cache_of_a_hybrid_or_a_slot_cache_is_refused_before_loading():
    with pytest.raises(ConfigError) as error:
        validate(load_config(None, ["model.path=tiny-hybrid", "rollout.engine.kv_cache_dtype=fp8"]))
    assert any(
        p.startswith("rollout.engine.kv_cache_dtype='fp8' covers full-attention K/V only, and "
                     "this model has gated_attention (kv cache), gated_deltanet (recurrent "
                     "cache) layers") and p.endswith("set rollout.engine.kv_cache_dtype=model")
        for p in error.value.problems
    ), error.value.problems  # fmt: skip
    with pytest.raises(ConfigError) as error:
        validate(load_config(None, ["model.path=tiny", "rollout.engine.kv_cache_dtype=fp8",
                                    "rollout.engine.kv_block_size=null"]))  # fmt: skip
    assert any("kv_cache_dtype='fp8' covers the paged cache only" in p
               for p in error.value.problems), error.value.problems  # fmt: skip
    validate(load_config(None, ["model.path=tiny", "rollout.engine.kv_cache_dtype=fp8"]))
