"""validate() refuses tensor and sequence parallelism for a model with Gated DeltaNet layers
(a recurrent state that spans the sequence), naming the key to set."""

import pytest

from hybridflow.config import ConfigError, load_config, validate

FOUR_CPUS = ["trainer.backend=local", "trainer.n_gpus_per_node=4", "trainer.device=cpu"]


@pytest.mark.parametrize("key", ["actor.sequence_parallel_size", "actor.tensor_parallel_size"])
def test_parallel_layouts_that_split_recurrent_layers_are_refused(key):
    with pytest.raises(ConfigError) as error:
        validate(load_config(None, [*FOUR_CPUS, "model.path=tiny-hybrid", f"{key}=2"]))
    assert any(
        f"{key} = 2: this model's 3 Gated DeltaNet layers" in p and p.endswith(f"set {key}=1")
        for p in error.value.problems
    ), error.value.problems
