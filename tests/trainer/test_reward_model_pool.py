"""The reward model on devices of its own (reward.model.n_gpus_per_node) and in the async mode:
the scores, and so every metric, are those of the reward model sharing the training devices in
a synchronous run."""

from __future__ import annotations

import pytest
from reward_model_helpers import write_reward_model
from trainer_helpers import CLOCKED, read_metrics, tiny_config

from hybridflow.config import ConfigError, validate
from hybridflow.models import load_tokenizer
from hybridflow.trainer.lifecycle.run import train
from hybridflow.trainer.loop import roles as roles_module

NOT_COMPARED = ("timing_s/", "perf/", "async/", "memory/", *CLOCKED)


def _comparable(rows: dict) -> dict:
    return {step: {k: v for k, v in row.items() if not k.startswith(NOT_COMPARED)}
            for step, row in rows.items()}  # fmt: skip


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return write_reward_model(tmp_path_factory.mktemp("rm") / "rm", "llama",
                              tokenizer=load_tokenizer("char"))  # fmt: skip


def _run(tmp_path, name: str, directory, *overrides: str) -> dict:
    # the reference pass gives the reward a forward pass to run beside (rl_loop.score_beside)
    cfg = tiny_config(tmp_path / name, f"reward.model.path={directory}",
                      "reward.weights={rule: 1.0, model: 0.5}", "reward.model.max_tokens_per_gpu=64",
                      "actor.use_kl_loss=true", "trainer.val_before_train=false",
                      "trainer.total_steps=3", "trainer.save_freq=-1", *overrides)  # fmt: skip
    train(cfg, log=lambda *a, **k: None)
    return read_metrics(cfg.trainer.run_dir)


def test_async_with_a_reward_model_at_staleness_zero_is_the_synchronous_run(tmp_path, reward_model):
    sync = _run(tmp_path, "sync", reward_model)
    asynchronous = _run(tmp_path, "async", reward_model, "trainer.mode=async",
                        "trainer.max_staleness=0")  # fmt: skip
    assert all(row["reward/model/min"] < row["reward/model/max"] for row in sync.values())
    assert _comparable(asynchronous) == _comparable(sync)


@pytest.mark.slow  # two runs, one of them two worker processes
def test_a_reward_model_on_devices_of_its_own_scores_as_a_colocated_one(tmp_path, reward_model,
                                                                        monkeypatch):  # fmt: skip
    """Async (staleness 1) on the local backend, the reward model in a process of its own,
    against the in-process run with the reward model beside the actor: metric for metric."""
    built = []

    def build_and_keep(cfg, derived, _build=roles_module.build_roles):
        built.append(_build(cfg, derived))
        return built[-1]

    args = ("trainer.mode=async", "trainer.max_staleness=1")
    colocated = _run(tmp_path, "colocated", reward_model, *args)
    monkeypatch.setattr(roles_module, "build_roles", build_and_keep)
    apart = _run(tmp_path, "apart", reward_model, *args, "trainer.backend=local",
                 "reward.model.n_gpus_per_node=1")  # fmt: skip
    (roles,) = built
    assert roles.reward_model_apart and len(roles.groups) == 2
    assert roles.reward_model.compute_rm_scores.group is roles.groups[1]  # not the actor's
    assert [apart[step]["async/staleness"] for step in (1, 2, 3)] == [0, 1, 1]
    assert _comparable(apart) == _comparable(colocated)


@pytest.mark.slow  # two runs, one of them two worker processes
def test_a_sync_step_scores_beside_the_reference_pass_when_the_reward_model_is_apart(
    tmp_path, reward_model, monkeypatch
):
    from hybridflow.trainer.loop import rl_loop

    beside = []

    def counted(*args, _score_beside=rl_loop.score_beside):
        beside.append(args[2])  # the stage the reward runs beside
        return _score_beside(*args)

    monkeypatch.setattr(rl_loop, "score_beside", counted)
    colocated = _run(tmp_path, "colocated", reward_model, "trainer.total_steps=1")
    assert beside == []  # the reward model needs the training group: scored before the pass
    apart = _run(tmp_path, "apart", reward_model, "trainer.backend=local",
                 "reward.model.n_gpus_per_node=1", "trainer.total_steps=1")  # fmt: skip
    assert beside == ["ref"]
    assert _comparable(apart) == _comparable(colocated)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reward.model.n_gpus_per_node=1"], "reward.model.path is not set"),
        (["reward.model.n_gpus_per_node=-1"], "must be an integer >= 0"),
        (["reward.model.path={rm}", "reward.model.n_gpus_per_node=1"],
         "trainer.backend = inprocess runs on one device"),
        (["reward.model.path={rm}", "reward.model.max_tokens_per_gpu=30"],
         r"below the longest conversation, .* = 38 tokens"),
    ],
)  # fmt: skip
def test_reward_model_settings_are_checked(tmp_path, reward_model, overrides, message):
    cfg = tiny_config(tmp_path, *(item.format(rm=reward_model) for item in overrides))
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_the_reward_models_devices_count_against_the_node(tmp_path, reward_model):
    cfg = tiny_config(tmp_path, f"reward.model.path={reward_model}", "trainer.device=cuda",
                      "trainer.backend=local", "trainer.n_gpus_per_node=2",
                      "reward.model.n_gpus_per_node=1", "data.train_batch_size=4")  # fmt: skip
    with pytest.raises(ConfigError, match=r"2 \+ 1 GPUs, but this node has 2"):
        validate(cfg, gpus_available=2)
    validate(cfg, gpus_available=3)
