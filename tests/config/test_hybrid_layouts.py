"""validate() and a model with Gated DeltaNet layers (a recurrent state that spans the
sequence): the actor, reference and critic split them by tensor and sequence parallelism
(whole key heads with their value heads), and so does the rollout's tensor parallelism
(engine/tensor_parallel.py); an fp8 rollout validates (engine/fp8/linears.py), on one rank
or tensor-parallel; each refusal naming the key to set, before any model is loaded."""

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


def test_the_rollout_tensor_parallelism_of_the_hybrid_layers_validates():
    validate(load_config(None, [*HYBRID, "rollout.tensor_parallel_size=2"]))


def _moe_hybrid(tmp_path, shared_width: int = 48) -> str:
    """A Qwen3.5-MoE checkpoint directory (its config.json only: validate reads no weights)."""
    import json

    from hybridflow.models.presets import preset_config

    config = preset_config("tiny-hybrid").replace(
        model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=shared_width,
        norm_topk_prob=True,
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf()))
    return str(tmp_path)


@pytest.mark.parametrize(
    "sizes",
    [
        ["rollout.tensor_parallel_size=2"],
        # experts over two tensor-parallel replicas (engine/expert_spread.py)
        ["rollout.tensor_parallel_size=2", "rollout.expert_parallel_size=4"],
        ["rollout.expert_parallel_size=4"],
    ],
)  # fmt: skip
def test_the_rollout_layouts_of_a_hybrid_mixture_of_experts_validate(tmp_path, sizes):
    validate(load_config(None, [*FOUR_CPUS, f"model.path={_moe_hybrid(tmp_path)}", *sizes]))


@pytest.mark.parametrize(
    ("sizes", "shared_width", "says"),
    [
        (["rollout.tensor_parallel_size=4"], 48,
         "rollout: rollout.tensor_parallel_size = 4 must divide the model's Gated DeltaNet key "
         "heads (linear_num_key_heads = 2): pick a divisor of 2"),
        (["rollout.tensor_parallel_size=2"], 49,
         "rollout.tensor_parallel_size = 2 must divide the width of the model's shared expert "
         "(shared_expert_intermediate_size = 49): pick a divisor of 49"),
    ],
)  # fmt: skip
def test_rollout_layouts_of_the_hybrid_layers_not_built_are_refused(tmp_path, sizes,
                                                                     shared_width, says):  # fmt: skip
    problems = _problems([*FOUR_CPUS, f"model.path={_moe_hybrid(tmp_path, shared_width)}",
                          *sizes])  # fmt: skip
    assert any(says in p for p in problems), problems


def test_an_fp8_tensor_parallel_rollout_of_a_hybrid_validates():
    """Its gated attention, Gated DeltaNet and row-parallel projections run fp8 on each rank
    (engine/fp8/linears.py)."""
    validate(load_config(None, [*HYBRID, "rollout.tensor_parallel_size=2", "rollout.dtype=fp8",
                                "trainer.device=cuda"]))  # fmt: skip


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
def test_an_fp8_rollout_of_a_hybrid_validates(model):
    """Gated attention and Gated DeltaNet run fp8 on the eager passes (engine/fp8/linears.py)."""
    path, *rest = model.split()
    validate(load_config(None, [f"model.path={path}", *rest, "rollout.dtype=fp8",
                                "trainer.device=cuda"]))  # fmt: skip


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
