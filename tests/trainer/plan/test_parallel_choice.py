"""The layouts `config plan` recommends (trainer/plan/parallel_choice.py) pass `validate` and
its memory check, which `train` runs too: one memory model, and nothing recommended that
validate refuses (actor tp on a mixture of experts, experts across rollout replicas)."""

from __future__ import annotations

import pytest

from hybridflow.config import load_config, validate
from hybridflow.trainer.plan.memory_check import check_memory
from hybridflow.trainer.plan.memory_from_config import with_changes
from hybridflow.trainer.plan.memory_plan import GIB
from hybridflow.trainer.plan.parallel_choice import recommend

GRPO = ["trainer.backend=local", "trainer.device=cuda", "trainer.gpu_memory_gib=80",
        "data.max_prompt_length=1024", "data.max_response_length=4096", "rollout.n=8",
        "actor.max_tokens_per_gpu=16384", "rollout.max_num_seqs=256", "actor.use_kl_loss=true"]  # fmt: skip


def recommended(model: str, gpus: int, batch: int):
    cfg = load_config(None, [f"model.path={model}", f"trainer.n_gpus_per_node={gpus}",
                             f"data.train_batch_size={batch}",
                             f"actor.ppo_mini_batch_size={batch // 4}", *GRPO])  # fmt: skip
    return cfg, recommend(cfg, 80 * GIB)


@pytest.mark.parametrize(
    "model, gpus, batch, expected",
    [("llama3.1-70b", 8, 128, {"actor.tensor_parallel_size": 2, "rollout.tensor_parallel_size": 8,
                               "model.gradient_checkpointing": True, "actor.param_offload": True}),
     ("qwen3-30b-a3b", 8, 128, {"actor.expert_parallel_size": 8,
                                "rollout.tensor_parallel_size": 4,
                                "model.gradient_checkpointing": True, "actor.param_offload": True}),
     ("qwen2.5-7b", 8, 128, {"rollout.tensor_parallel_size": 2,
                             "model.gradient_checkpointing": True}),
     ("qwen2.5-7b", 1, 16, {"model.gradient_checkpointing": True, "actor.optimizer_offload": True}),
     ("qwen3-30b-a3b", 1, 16, None),
     ("llama3.1-70b", 1, 16, None)],
)  # fmt: skip
def test_every_recommended_layout_passes_validate(model, gpus, batch, expected):
    """On 8 × 80 GiB and 1 × 80 GiB; where nothing fits (a 30B or 70B model on one GPU) the
    plan recommends nothing rather than a layout validate refuses."""
    cfg, advice = recommended(model, gpus, batch)
    if expected is None:
        assert advice.plan is None and advice.closest is not None
        return
    assert advice.changes == expected
    changed = with_changes(cfg, advice.changes)
    derived = validate(changed)  # the code paths exist: not refused as "not built"
    plan = check_memory(changed, derived)  # validate's and train's memory check: it fits
    assert plan.checked_peak() == advice.plan.checked_peak()


def test_a_vision_language_model_on_images_gets_a_tensor_parallel_rollout():
    """Qwen2.5-VL-72B on 2 nodes of 8 × 80 GiB with prompts with images: a replica a GPU
    does not fit, so the plan splits the rollout (built for images: each rank holds the
    vision encoder whole), and the layout it recommends passes validate."""
    cfg = load_config(None, ["model.path=qwen2.5-vl-72b", "data.image_key=images",
                             "trainer.nnodes=2", "trainer.n_gpus_per_node=8",
                             "trainer.device=cuda", "trainer.backend=ray",
                             "data.train_batch_size=128", "actor.ppo_mini_batch_size=64"])  # fmt: skip
    advice = recommend(cfg, 80 * GIB)
    assert advice.plan is not None and advice.changes["rollout.tensor_parallel_size"] > 1
    changed = with_changes(cfg, advice.changes)
    assert changed.data.image_key == "images"
    check_memory(changed, validate(changed))  # not refused, and it fits


def test_moe_actors_offload_their_expert_shards_and_get_no_tensor_parallelism():
    """Qwen3-30B-A3B on 8 GPUs: the plan may not pick actor tp (not built for experts); it
    offloads the expert-parallel shards (built: learners/sharding/expert_shard.py), at the
    largest ep (the fewest experts gathered a GPU)."""
    cfg, advice = recommended("qwen3-30b-a3b", 8, 128)
    changed = with_changes(cfg, advice.changes)
    assert changed.actor.tensor_parallel_size == 1
    assert changed.actor.param_offload and changed.actor.expert_parallel_size == 8


def test_validate_checks_the_memory_of_the_layout(capsys, monkeypatch):
    """`config validate` prices tensor parallelism and offload as plan does: Llama-3.1-70B's
    recommended layout on 8 × 80 GiB passes the memory check (the next check, the host's
    memory for the offloaded state, is this machine's)."""
    from hybridflow.cli import main
    from hybridflow.trainer.plan import host_memory

    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: (2**50, "test"))
    keys = ["model.path=llama3.1-70b", "trainer.n_gpus_per_node=8", "data.train_batch_size=128",
            "actor.ppo_mini_batch_size=32", *GRPO[:1], *GRPO[3:], "actor.tensor_parallel_size=2",
            "rollout.tensor_parallel_size=8", "model.gradient_checkpointing=true",
            "actor.param_offload=true"]  # fmt: skip
    main(["config", "validate", "--gpu-memory", "80GiB", "trainer.device=cpu", *keys])
    err = capsys.readouterr().err
    assert "does not fit" not in err and "per GPU" not in err, err
    main(["config", "validate", "--gpu-memory", "80GiB", "trainer.device=cpu", *keys[:-3]])
    assert "model.path = llama3.1-70b does not fit on a 80.0 GiB GPU" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["llama3.1-70b", "qwen3-30b-a3b"])
def test_the_printed_recommendation_passes_config_validate_on_a_machine_without_the_gpus(
    model, capsys
):
    """What a user does on a login node: `config plan` for 8 × 80 GiB, then `config validate`
    with the keys it printed. The config passes; the checks of the run's own machine (a GPU,
    the host memory a node needs for the offloaded state) are named, not failed, and the
    plan's recommendation says that host memory too. `train` still runs them at start."""
    import re

    import torch

    from hybridflow.cli import main

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: this machine is the run's")
    keys = [f"model.path={model}", "trainer.n_gpus_per_node=8", "trainer.backend=local",
            "trainer.device=cuda"]  # fmt: skip
    assert main(["config", "plan", "--gpu-memory", "80GiB", *keys]) == 2  # the base does not fit
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "recommended layout:" in x)
    recommended = re.search(r"recommended layout: (.*?) \(", line).group(1).split()
    host = re.search(r"; ([\d,.]+ GiB) of host memory a node", line).group(1)
    assert main(["config", "validate", "--gpu-memory", "80GiB", *keys, *recommended]) == 0
    out = capsys.readouterr().out
    assert out.startswith("config OK (not checked here, as no CUDA GPU is visible")
    needed = re.search(r"([\d,.]+) GiB of host memory a node", out).group(1)
    # the offloaded state the plan printed, and a step's data (MiB) beside it
    assert float(needed.replace(",", "")) == pytest.approx(float(host.split()[0]), abs=0.1)


def test_the_rollouts_copy_is_freed_only_where_nothing_fits_without_it():
    """Qwen2.5-7B on 2 × 26 GiB with a reference: no layout fits with the rollout's copy
    held through the update, even with the training state on the host; freed (the sync
    rewrites it anyway) one does, so the plan turns rollout.release_weights on, before the
    reference's shard goes to the host. In async mode, which cannot free it, the reference
    goes instead."""
    from hybridflow.trainer.plan.memory_fixes import fits
    from hybridflow.trainer.plan.memory_from_config import plan_for_config

    keys = ["model.path=qwen2.5-7b", "trainer.n_gpus_per_node=2", "trainer.backend=local",
            "trainer.device=cuda", "actor.use_kl_loss=true"]  # fmt: skip
    cfg = load_config(None, keys)
    advice = recommend(cfg, 26 * GIB)
    assert advice.changes["rollout.release_weights"] is True
    assert (
        advice.changes["actor.param_offload"] is True and "ref.param_offload" not in advice.changes
    )
    kept = with_changes(cfg, {**advice.changes, "rollout.release_weights": False})
    assert not fits(plan_for_config(kept, validate(kept), 26 * GIB))
    asynchronous = recommend(load_config(None, [*keys, "trainer.mode=async"]), 26 * GIB)
    assert asynchronous.changes["ref.param_offload"] is True
    assert "rollout.release_weights" not in asynchronous.changes


def test_a_candidate_is_the_config_with_its_keys_set():
    """The search builds each candidate by replacing the sections its keys name
    (parallel_choice.with_keys): the config with_changes gives through the loader, and the
    base config untouched by the search."""
    from hybridflow.trainer.plan.parallel_choice import with_keys

    cfg = recommended("qwen3-30b-a3b", 8, 128)[0]
    before = repr(cfg)
    recommend(cfg, 80 * GIB)  # its candidates share the sections they do not set with cfg
    keys = {"actor.tensor_parallel_size": 1, "actor.sequence_parallel_size": 2,
            "actor.expert_parallel_size": 4, "rollout.tensor_parallel_size": 2,
            "model.gradient_checkpointing": True, "rollout.expert_parallel_size": 8,
            "actor.param_offload": True, "ref.param_offload": True}  # fmt: skip
    assert with_keys(cfg, keys) == with_changes(cfg, keys)
    assert repr(cfg) == before


def test_a_training_layout_validate_refuses_is_not_judged_rollout_by_rollout(monkeypatch):
    """Qwen3-30B-A3B on 8 GPUs: actor tp > 1 (tensor parallelism of experts, not built) is
    refused whatever the rollout's layout, so none of its candidates goes through validate;
    every candidate validate judges, it accepts. The recommendation is the same."""
    from hybridflow.config import ConfigError
    from hybridflow.trainer.plan import parallel_choice

    judged, refused = [], []

    def counting(cfg, **kwargs):
        judged.append(cfg)
        try:
            return validate(cfg, **kwargs)
        except ConfigError:
            refused.append(cfg)
            raise

    monkeypatch.setattr(parallel_choice, "validate", counting)
    cfg, advice = recommended("qwen3-30b-a3b", 8, 128)
    assert judged and not refused, f"{len(refused)} of {len(judged)} candidates refused"
    assert advice.changes["actor.expert_parallel_size"] == 8


def test_the_search_is_reported_on_the_progress_reporter():
    """`config plan` shows the search going on (a bar on a terminal, a status line in a log
    after a silence): how many training layouts it tried, of at most how many."""
    from progress_helpers import recording_reporter

    reporter, buffer, opened = recording_reporter()
    cfg = load_config(None, ["model.path=qwen2.5-7b", "trainer.n_gpus_per_node=8", *GRPO,
                             "data.train_batch_size=128", "actor.ppo_mini_batch_size=32"])  # fmt: skip
    recommend(cfg, 80 * GIB, reporter)
    reporter.close()
    assert opened == ["config plan: the layout to recommend"]
    text = buffer.getvalue()
    assert "config plan: the layout to recommend: 1 of at most " in text, text
    assert "config plan: the layout to recommend: done, " in text, text
