"""FP8 training under FSDP2 on two CPU ranks (gloo, torchao's emulation): the update equals
one process's, the weights sync and save as plain fp32 tensors, and with tensorwise scales
FSDP2 all-gathers the weights in float8; the rollout's e4m3 weights (its quantization of the
bf16 weights the sync gathers) are the bytes and scales of the trainer's forward, before and
after an optimizer step, with bf16 mixed precision as on a GPU. Under Ulysses sequence parallelism (SP = 2) each
rank's slice is padded to a multiple of 16 tokens: the loss and the update are those of the
unpadded slices, and every FP8 matmul runs a multiple of 16 tokens. One start-up of the two
processes serves the tests."""

import importlib.util
import json

import pytest
import torch
from gloo_ranks import run_ranks
from learner_helpers import actor_config, make_batch, record_float8_token_counts, tiny_model

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
    _weight_sync(rank, out_dir)
    _sequence_parallel(rank, world, out_dir)


def _weight_sync(rank: int, out_dir: str) -> None:
    """Per recipe and check (built, then stepped): how many projections the rollout
    quantizes into the trainer's bytes, and into its scales, on rank 0."""
    result = {}
    for recipe in RECIPES:
        core = _mixed_precision_core(recipe)
        for when in ("built", "stepped"):
            if when == "stepped":
                loss = core.module(_packed())[0].float().square().mean()
                loss.backward()
                core.optimizer_step(grad_clip=1.0)
            result[f"{recipe} {when}"] = _rollout_matches(core, recipe)
    if rank == 0:
        with open(f"{out_dir}/weight_sync.json", "w") as f:
            json.dump(result, f)


def _mixed_precision_core(recipe: str):
    """FSDP2 over the two ranks with fp32 masters computing in bf16 (the GPU's layout)."""
    from hybridflow.learners.core import TrainCore
    from hybridflow.learners.fp8_training import Fp8Training
    from hybridflow.learners.modules import PolicyModel

    model = tiny_model(seed=3)
    for param in model.parameters():  # fp32 values that bf16 rounds
        param.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(param.numel()))
    core = TrainCore(PolicyModel(model, token_multiple=16), device="cpu", mixed_precision=True,
                     fp8=Fp8Training(recipe, emulate=True))  # fmt: skip
    core.build_optimizer(lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), schedule="constant",
                         warmup_steps=0, total_steps=2, min_lr_ratio=0.0)  # fmt: skip
    return core


def _packed():
    from hybridflow.learners.packing import pack_rows

    batch = make_batch(seed=3)
    return pack_rows(batch["prompts"], batch["responses"], batch["attention_mask"])


def _rollout_matches(core, recipe: str) -> dict[str, int]:
    from hybridflow.engine.fp8.weight_scales import quantize_weight

    casts = _trainer_weight_casts(core)
    synced = {name: t.clone() for name, t in core.iter_unit_gathered(core.module.lm)}
    counts = {"projections": len(casts), "same bytes": 0, "same scales": 0}
    for name, (values, scale) in casts.items():
        rollout_values, rollout_scale = quantize_weight(synced[f"{name}.weight"], recipe)
        counts["same bytes"] += torch.equal(values.view(torch.uint8),
                                            rollout_values.view(torch.uint8))  # fmt: skip
        counts["same scales"] += torch.equal(scale.expand(len(rollout_scale)),
                                             rollout_scale.view(-1))  # fmt: skip
    return counts


def _trainer_weight_casts(core) -> dict:
    """{linear name: (e4m3 [N, K], scale [N] or [1])} its FP8 forward multiplies by, recorded in
    one forward: a weight FSDP2 all-gathered in float8 (tensorwise) arrives cast; rowwise
    casts the gathered bf16 weight in the forward (torchao's hp_tensor_to_float8_dynamic)."""
    import torchao.float8.float8_linear as float8_linear
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    casts, current, cast = {}, [], float8_linear.hp_tensor_to_float8_dynamic

    def recording(tensor, *args, **kwargs):
        out = cast(tensor, *args, **kwargs)
        if kwargs.get("gemm_input_role") is GemmInputRole.WEIGHT:  # weight.t(): [K, N]
            casts[current[-1]] = (out._data.t(), out._scale.reciprocal().reshape(-1))
        return out

    def before(module, _args, name):
        current.append(name)
        weight = module.weight
        if isinstance(weight, Float8TrainingTensor):  # freed with the unit's gather: copied
            casts[name] = (weight._data.clone(), weight._scale.reciprocal().reshape(-1))

    hooks = [module.register_forward_pre_hook(lambda m, a, name=name: before(m, a, name))
             for name, module in core.module.lm.named_modules()
             if isinstance(module, float8_linear.Float8Linear)]  # fmt: skip
    float8_linear.hp_tensor_to_float8_dynamic = recording
    try:
        with torch.no_grad():
            core.module(_packed())
    finally:
        float8_linear.hp_tensor_to_float8_dynamic = cast
        for hook in hooks:
            hook.remove()
    return casts


def _sequence_parallel(rank: int, world: int, out_dir: str) -> None:
    """SP = 2 (FSDP2 over the two ranks): fp32 actors with the slices unpadded and padded to
    16 tokens (what FP8 training pads to), and an FP8 actor; each rank's own rows."""
    from hybridflow.parallel import build_mesh, train_layout

    mesh = build_mesh(train_layout(world, sp=2), "cpu")
    rows = make_batch(seed=3).index(list(range(rank * 4, rank * 4 + 4)))
    result = {}
    for name, multiple in (("unpadded", 1), ("padded", 16)):
        actor = ActorLearner(tiny_model(), actor_config(ppo_mini_batch_size=8), total_steps=2,
                             device="cpu", mesh=mesh)  # fmt: skip
        actor.policy.token_multiple = multiple  # the padding FP8 training turns on
        slices = _recorded_slice_lengths(actor.model)
        logprobs = actor.compute_logprobs(rows)["old_logprobs"]
        metrics = actor.update(rows)
        weights = {n: t.clone() for n, t in actor.core.iter_full_tensors(actor.model)}
        result[name] = (slices, logprobs, metrics, weights)
    fp8 = ActorLearner(tiny_model(), actor_config(precision="fp8", ppo_mini_batch_size=8),
                       total_steps=2, device="cpu", mesh=mesh, fp8_emulate=True)  # fmt: skip
    counts = record_float8_token_counts(fp8.model)
    fp8.compute_logprobs(rows)
    fp8.update(rows)
    if rank == 0:
        (unpadded_slices, logprobs, metrics, weights), padded = result["unpadded"], result["padded"]
        summary = {
            "unpadded_slices": unpadded_slices,
            "padded_slices": padded[0],
            "logprob_diff": float((padded[1] - logprobs).abs().max()),
            "metrics": (metrics, padded[2]),
            "weight_diff": max(float((padded[3][n] - w).abs().max()) for n, w in weights.items()),
            "fp8_token_counts": counts,
        }
        with open(f"{out_dir}/sequence_parallel.json", "w") as f:
            json.dump(summary, f)


def _recorded_slice_lengths(model) -> list[int]:
    """The token count of each packed forward ``model`` runs (this rank's slice under SP)."""
    lengths, forward = [], model.forward_packed

    def recorded(input_ids, *args, **kwargs):
        lengths.append(input_ids.numel())
        return forward(input_ids, *args, **kwargs)

    model.forward_packed = recorded
    return lengths


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("fp8_fsdp")
    run_ranks(_worker, 2, str(out_dir))
    names = (*RECIPES, "sequence_parallel", "weight_sync")
    return {r: json.loads((out_dir / f"{r}.json").read_text()) for r in names}


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


@pytest.mark.parametrize("when", ["built", "stepped"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_rollout_quantizes_the_synced_weights_into_the_trainers_bytes_and_scales(
    two_ranks, recipe, when
):
    """Rowwise: FSDP2 gathers bf16 weights, which both sides quantize. Tensorwise: FSDP2
    gathers the trainer's float8 bytes, which the sync dequantizes to bf16; the trainer's
    scale is taken from the bf16 amax (fp8_training.precompute_weight_scales), so the
    rollout's quantization of what it receives gives back the trainer's scale and bytes."""
    counts = two_ranks["weight_sync"][f"{recipe} {when}"]
    assert counts == {"projections": 14, "same bytes": 14, "same scales": 14}


def test_sequence_parallel_slices_padded_to_16_tokens_keep_the_loss_and_the_update(two_ranks):
    result = two_ranks["sequence_parallel"]
    assert any(n % 16 for n in result["unpadded_slices"])  # the case that needs padding
    assert result["padded_slices"] and all(n % 16 == 0 for n in result["padded_slices"])
    # the pad is a sequence of its own that no output reads: fp32, the same up to the sums'
    # order (the padded slices split the stream at other tokens)
    assert result["logprob_diff"] < 1e-5
    unpadded, padded = result["metrics"]
    for key in ("pg_loss", "pg_clipfrac", "grad_norm"):
        assert padded[key] == pytest.approx(unpadded[key], rel=1e-5, abs=1e-7), key
    assert result["weight_diff"] < 1e-6


def test_every_float8_matmul_under_sequence_parallelism_runs_a_multiple_of_16_tokens(two_ranks):
    counts = two_ranks["sequence_parallel"]["fp8_token_counts"]
    assert counts and all(n % 16 == 0 for n in counts), sorted(set(counts))
