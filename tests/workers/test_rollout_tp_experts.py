"""Split placement's first load of a mixture of experts into a tensor-parallel rollout (2 gloo
ranks, tiny-moe): the checkpoint directory holds one tensor per expert (what save_pretrained
writes, as published checkpoints do); each rank keeps only its own experts' tensors as they
are read and packs them, or every expert when the experts are held whole."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks

from hybridflow.engine.tensor_parallel import local_shard
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config
from hybridflow.workers.rollout_tp import TensorParallelRollout


def _load_on_ranks(rank: int, world: int, path: str) -> None:
    whole = dict(build_model(preset_config("tiny-moe"), seed=5).named_parameters())
    for split in (True, False):
        tensor = TensorParallelRollout.from_checkpoint(path, 2, torch.float32, "cpu", split)
        params = dict(tensor.model.named_parameters())
        for name, param in params.items():
            assert torch.equal(param, local_shard(name, whole[name], rank, 2, split)), name
        experts = params["model.layers.2.mlp.experts.gate_up_proj"].shape[0]
        assert experts == (4 if split else 8)
        dist.barrier()


@pytest.mark.slow
def test_each_rank_reads_its_own_experts_from_a_per_expert_checkpoint(tmp_path):
    model = build_model(preset_config("tiny-moe"), seed=5)
    model.save_pretrained(str(tmp_path))
    from safetensors import safe_open

    names = [n for f in tmp_path.glob("*.safetensors") for n in safe_open(f, "pt").keys()]
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names  # one tensor per expert
    run_ranks(_load_on_ranks, 2, str(tmp_path))
