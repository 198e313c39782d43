"""FP8 training under FSDP2 on two CPU ranks (gloo, torchao's emulation): the update equals
one process's, the weights sync and save as plain fp32 tensors, and with tensorwise scales
FSDP2 all-gathers the weights in float8. One start-up of the two processes serves the tests."""

import importlib.util
import json

import pytest
import torch
from gloo_ranks import run_ranks
from learner_helpers import actor_config, make_batch, tiny_model

from hybridflow.learners import ActorLearner

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="torchao (the fp8 extra) is not installed"
)
RECIPES = ("rowwise", "tensorwise")


def _actor(precision: str, recipe: str = "rowwise") -> ActorLearner:
    cfg = actor_config(precision=precision, fp8_recipe=recipe, ppo_mini_batch_size=8)
    return ActorLearner(tiny_model(), cfg, total_steps=2, device="cpu", fp8_emulate=True)


def _worker(rank: int, world: int, out_dir: str) -> None:
    batch = make_batch(seed=3)
    rows = batch.index(list(range(rank * 4, rank * 4 + 4)))  # rank r: rows 4r..4r+3
    for recipe in RECIPES:
        actor = _actor("fp8", recipe)
        metrics = actor.update(rows)
        full = actor.core.full_state_dict(actor.model)
        gathered = {type(t) for _, t in actor.core.iter_unit_gathered(actor.model)}
        actor.save(f"{out_dir}/{recipe}")
        resumed = _actor("bf16")  # a bf16 run resumes from the fp8 one
        resumed.load(f"{out_dir}/{recipe}")
        reloaded = resumed.core.full_state_dict(resumed.model)  # every rank gathers
        same = all(torch.equal(t, full[n]) for n, t in reloaded.items())
        if rank == 0:
            result = {
                "metrics": metrics,
                "fp8_all_gather": actor.core.fp8_scales_after_step,
                "full_types": sorted({type(t).__name__ for t in full.values()}),
                "full_dtypes": sorted({str(t.dtype) for t in full.values()}),
                "gathered_types": sorted(t.__name__ for t in gathered),
                "resumed_in_bf16": same,
            }
            with open(f"{out_dir}/{recipe}.json", "w") as f:
                json.dump(result, f)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("fp8_fsdp")
    run_ranks(_worker, 2, str(out_dir))
    return {r: json.loads((out_dir / f"{r}.json").read_text()) for r in RECIPES}


@pytest.mark.parametrize("recipe", RECIPES)
def test_fsdp2_fp8_update_equals_one_process(two_ranks, recipe):
    expected = _actor("fp8", recipe).update(make_batch(seed=3))
    got = two_ranks[recipe]["metrics"]
    assert got["pg_loss"] == pytest.approx(expected["pg_loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fsdp2_fp8_weights_sync_and_save_as_plain_fp32(two_ranks, recipe):
    result = two_ranks[recipe]
    # float8 all-gather (torchao's WeightWithDynamicFloat8CastTensor shards): tensorwise only
    assert result["fp8_all_gather"] is (recipe == "tensorwise")
    assert result["full_types"] == ["Tensor"] and result["full_dtypes"] == ["torch.float32"]
    assert result["gathered_types"] == ["Tensor"]
    assert result["resumed_in_bf16"]
