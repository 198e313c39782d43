"""Layout invariance of the rollout (local backend, 2 CPU processes, fp32): one process, two
data-parallel engines and one engine tensor-parallel over both processes draw the same
tokens for the trainer's generate request, whether each prompt row carries its n samples or
the rows repeat the prompts (n=1 per row); and after the same actor update, the reshard
into the tensor-parallel engine samples what the gathered weights of data parallelism do.
A rollout group of its own (split placement), 2 tensor-parallel replicas over 4 processes,
slices the weights it is sent and samples the same tokens again."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.config import load_config
from hybridflow.controller import ResourcePool, WorkerGroup
from hybridflow.protocol import Batch
from hybridflow.trainer.loop.stages import rollout_request
from hybridflow.workers import fused_worker

N = 3


def _config(*overrides: str):
    return load_config(None, [
        "model.path=tiny", "data.max_prompt_length=8", "data.max_response_length=6",
        "data.train_batch_size=4", f"rollout.n={N}", "actor.ppo_mini_batch_size=4",
        "actor.micro_batch_size_per_gpu=8", "actor.lr=1e-2", "trainer.device=cpu", *overrides,
    ])  # fmt: skip


def _prompts(rows: int) -> Batch:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 100, (rows, 8), generator=generator)  # [B, P]
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    ids[1, :3] = 0
    return Batch({"prompts": ids, "attention_mask": mask})


def _generate(rollout, rows: int, engine_n: int) -> Batch:
    """As trainer/stages.generate sends it: engine_n = n, or 1 with the rows repeated."""
    request = rollout_request(_prompts(rows), N, engine_n)
    request.meta.update({"n": engine_n, "temperature": 1.0, "seed": 11, "pad_token_id": 0})
    return rollout.generate(request)


def _update(group) -> None:
    """One actor step on fixed samples and advantages, then the weight sync."""
    out = _generate(group.rollout, 4, N)
    rows = _prompts(4).repeat(N)
    prompt_mask = rows.tensors.pop("attention_mask")
    batch = rows.union(out)
    batch.tensors["attention_mask"] = torch.cat(
        [prompt_mask, batch.tensors["response_mask"].long()], dim=1)  # fmt: skip
    batch.meta = {"temperature": 1.0}
    batch = batch.union(group.actor.compute_logprobs(batch))
    mask = batch.tensors["response_mask"]
    batch.tensors["advantages"] = torch.linspace(-1, 1, mask.numel()).view(mask.shape) * mask
    batch.arrays["uid"] = np.arange(len(batch))
    group.actor.update(batch)
    group.rollout.sync_from_actor()


def _assert_same(got: Batch, expected: Batch) -> None:
    assert torch.equal(got.tensors["responses"], expected.tensors["responses"])
    assert torch.equal(got.tensors["response_mask"], expected.tensors["response_mask"])
    torch.testing.assert_close(got.tensors["rollout_logprobs"],
                               expected.tensors["rollout_logprobs"], rtol=1e-3, atol=1e-5)  # fmt: skip


TWO = ["trainer.backend=local", "trainer.n_gpus_per_node=2"]
CASES = [(4, N), (3, 1)]  # 4 prompts with their n samples; 3 prompts as 9 rows of one


@pytest.mark.slow
def test_split_placement_slices_the_weights_the_controller_sends(tmp_path):
    """A rollout group of its own on 4 processes, 2 replicas of TP = 2: the checkpoint
    directory's tensors (read one at a time) and then the updated actor's whole weights are
    sliced; it samples as the one-process hybrid engine does with the same weights."""
    from hybridflow.models import load_model

    load_model("tiny").save_pretrained(str(tmp_path / "model"))
    path = f"model.path={tmp_path / 'model'}"
    one = WorkerGroup(fused_worker(actor=True, rollout=True), config=_config(path))
    four = ["trainer.backend=local", "trainer.n_gpus_per_node=4", "rollout.tensor_parallel_size=2",
            path]  # fmt: skip
    rollout = WorkerGroup(fused_worker(actor=False, rollout=True), pool=ResourcePool(cpus=4),
                          backend="local", config=_config(*four), name="rollout")  # fmt: skip
    try:
        for rows, engine_n in CASES:
            _assert_same(_generate(rollout.rollout, rows, engine_n),
                         _generate(one.rollout, rows, engine_n))  # fmt: skip
        _update(one)  # its engine reads the actor's weights in place
        rollout.rollout.load_weights(one.actor.full_weights())
        _assert_same(_generate(rollout.rollout, 4, N), _generate(one.rollout, 4, N))
    finally:
        one.shutdown()
        rollout.shutdown()


@pytest.mark.slow
def test_one_process_data_parallel_and_tensor_parallel_draw_the_same_tokens():
    cases = CASES
    one = WorkerGroup(fused_worker(actor=True, rollout=True), config=_config())
    try:
        expected = [_generate(one.rollout, rows, engine_n) for rows, engine_n in cases]
    finally:
        one.shutdown()
    two = TWO
    results = {}
    for name, extra in (("dp", []), ("tp", ["rollout.tensor_parallel_size=2"])):
        group = WorkerGroup(fused_worker(actor=True, rollout=True), pool=ResourcePool(cpus=2),
                            backend="local", config=_config(*two, *extra))  # fmt: skip
        try:
            for (rows, engine_n), want in zip(cases, expected):
                _assert_same(_generate(group.rollout, rows, engine_n), want)
            _update(group)
            results[name] = _generate(group.rollout, 4, N)
        finally:
            group.shutdown()
    # the reshard moved the updated weights: the same samples as the gathered ones, and
    # not the initial weights' samples
    _assert_same(results["tp"], results["dp"])
    assert not torch.equal(results["tp"].tensors["rollout_logprobs"],
                           expected[0].tensors["rollout_logprobs"])  # fmt: skip
