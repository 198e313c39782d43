"""Layout invariance of the actor for a model with Gated DeltaNet layers (tiny-hybrid): two
gloo ranks with Ulysses SP = 2 (FSDP2 over them) and two with tensor parallelism TP = 2, each
handed its own rows, compute one process's log-probs, entropy, losses, gradient norm and
every parameter's gradient (fp32)."""

import os

import pytest
import torch
from gloo_ranks import run_ranks
from learner_helpers import actor_config, make_batch, record_full_gradients

from hybridflow.learners import ActorLearner
from hybridflow.models import load_model

CFG = dict(ppo_mini_batch_size=4, max_tokens_per_gpu=14, entropy_coeff=0.01, use_kl_loss=True)
# Rank r receives rows 4r..4r+3; the replica takes mini-batch m as rows 2m, 2m+1, 4+2m, 5+2m
SINGLE_PROCESS_ORDER = [0, 1, 4, 5, 2, 3, 6, 7]
LAYOUTS = {"sp": dict(sp=2), "tp": dict(tp=2)}
METRICS = ("pg_loss", "kl_loss", "entropy", "grad_norm")


def _hybrid(seed: int = 3):
    model = load_model("tiny-hybrid")
    model.init_weights(seed=seed, std=0.1)  # the preset's own init: logits of order 1
    return model


def _ranks(rank: int, world: int, out_dir: str) -> None:
    from hybridflow.parallel import build_mesh, train_layout

    batch = make_batch(seed=21).index(list(range(4 * rank, 4 * rank + 4)))
    for name, sizes in LAYOUTS.items():
        mesh = build_mesh(train_layout(world, **sizes), "cpu")
        actor = ActorLearner(_hybrid(), actor_config(**CFG), total_steps=2, device="cpu",
                             mesh=mesh)  # fmt: skip
        out = {"logprobs": actor.compute_logprobs(batch, with_entropy=True).tensors}
        out["grads"] = record_full_gradients(actor)
        out["metrics"] = actor.update(batch)
        torch.save(out, os.path.join(out_dir, f"{name}_rank{rank}.pt"))


@pytest.mark.slow
def test_two_rank_sequence_and_tensor_parallel_hybrid_actor_equals_one_process(tmp_path):
    run_ranks(_ranks, 2, str(tmp_path))
    batch = make_batch(seed=21)
    single = ActorLearner(_hybrid(), actor_config(**CFG), total_steps=2, device="cpu")
    logprobs = single.compute_logprobs(batch, with_entropy=True).tensors
    grads = record_full_gradients(single)
    metrics = single.update(batch.index(SINGLE_PROCESS_ORDER))
    for name in LAYOUTS:
        ranks = [torch.load(tmp_path / f"{name}_rank{r}.pt", weights_only=True) for r in (0, 1)]
        for key in ("old_logprobs", "entropy"):
            got = torch.cat([r["logprobs"][key] for r in ranks])
            torch.testing.assert_close(got, logprobs[key], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, where=f"{name} {key}": f"{where}: {m}")  # fmt: skip
        for metric in METRICS:
            assert ranks[0]["metrics"][metric] == pytest.approx(
                metrics[metric], rel=1e-4, abs=1e-6), (name, metric)  # fmt: skip
        # two mini-batches; the first step's gradients (the second's follow AdamW's first
        # step, ~lr * sign(g), whose sign may flip where a gradient is ~0)
        assert len(ranks[0]["grads"]) == len(grads) == 2
        for param, grad in grads[0].items():
            torch.testing.assert_close(ranks[0]["grads"][0][param], grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, where=f"{name} {param}": f"{where}: {m}")  # fmt: skip
