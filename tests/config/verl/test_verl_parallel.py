"""verl's parallel keys: Ulysses, the rollout's tensor and expert parallel sizes and the
Megatron-style sizes become our layout keys; the global micro sizes divide by the
data-parallel ranks as verl divides them."""

import pytest

from hybridflow.config import ConfigError, parallel_checks
from hybridflow.config.verl import load_with_verl_keys, translate

A, R = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."


def _rows(items: list[str]) -> dict[str, str]:
    t = translate(items)
    assert not t.problems, t.problems
    return dict(item.split("=", 1) for item in t.overrides)


def test_ulysses_and_megatron_sizes_become_each_roles_layout():
    rows = _rows([
        A + "ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1",
        "critic.ulysses_sequence_parallel_size=4",
        A + "strategy=megatron",
        A + "megatron.tensor_model_parallel_size=2",
        A + "megatron.expert_model_parallel_size=4",
        "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1",
        R + "expert_parallel_size=8",
    ])  # fmt: skip
    assert rows["actor.sequence_parallel_size"] == "2"
    assert rows["ref.sequence_parallel_size"] == "1"
    assert rows["critic.sequence_parallel_size"] == "4"
    assert rows["actor.tensor_parallel_size"] == "2"
    assert rows["actor.expert_parallel_size"] == "4"
    assert rows["ref.tensor_parallel_size"] == "1"
    assert rows["rollout.expert_parallel_size"] == "8"


def test_what_does_not_map_stops_naming_it():
    (problem,) = translate([A + "megatron.context_parallel_size=2"]).problems
    assert "ring context parallelism" in problem
    (problem,) = translate([A + "megatron.expert_tensor_parallel_size=2"]).problems
    assert "a tensor-parallel size of its own for the experts" in problem
    assert not translate([A + "megatron.expert_tensor_parallel_size=null"]).problems


def test_a_translated_ulysses_size_trains_in_that_layout():
    derived = load_and_validate([A + "ulysses_sequence_parallel_size=2",
                                 "trainer.n_gpus_per_node=2", "trainer.device=cpu"])  # fmt: skip
    assert (derived.layouts.actor.sp, derived.layouts.actor.dp) == (2, 1)


def test_a_translated_layout_without_its_code_path_is_refused_by_validate(monkeypatch):
    monkeypatch.setattr(parallel_checks, "SUPPORTED_LAYOUTS", frozenset())
    with pytest.raises(ConfigError) as error:
        load_and_validate([R + "expert_parallel_size=2", "actor_rollout_ref.model.path=tiny-moe",
                           "trainer.n_gpus_per_node=2", "trainer.device=cpu"])  # fmt: skip
    assert any(p.startswith("rollout.expert_parallel_size = 2: expert parallelism is not yet "
                            "supported for the rollout") for p in error.value.problems)  # fmt: skip


def test_verls_rollout_tensor_and_expert_keys_split_a_mixture_of_experts():
    """rollout TP 2 with EP 2 (the experts split over the replica's ranks) is accepted for an
    MoE model, and EP over several replicas."""
    keys = [R + "tensor_model_parallel_size=2", "actor_rollout_ref.model.path=tiny-moe",
            "trainer.n_gpus_per_node=4", "trainer.device=cpu"]  # fmt: skip
    derived = load_and_validate([*keys, R + "expert_parallel_size=2"])
    assert (derived.layouts.rollout.tp, derived.layouts.rollout.ep) == (2, 2)
    # verl's default 1 (vLLM splits each expert's width): ours stays unset, the experts split
    cfg = load_with_verl_keys(None, [*keys, R + "expert_parallel_size=1"], log=lambda text: None)
    assert cfg.rollout.expert_parallel_size is None
    # EP over both replicas (engine/expert_spread.py)
    derived = load_and_validate([*keys, R + "expert_parallel_size=4"])
    assert (derived.layouts.rollout.tp, derived.layouts.rollout.ep) == (2, 4)


def load_and_validate(items):
    from hybridflow.config import validate

    return validate(load_with_verl_keys(None, items, log=lambda text: None))


def test_rollout_tensor_parallel_is_the_engine_replicas_ranks():
    assert (
        "rollout.tensor_parallel_size=2"
        in translate([R + "tensor_model_parallel_size=2"]).overrides
    )
    derived = load_and_validate([R + "tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2",
                                 "trainer.device=cpu"])  # fmt: skip
    assert (derived.layouts.rollout.tp, derived.rollout_dp_size) == (2, 1)


def test_global_micro_sizes_divide_by_devices_over_sequence_and_tensor_parallel():
    # verl: ppo_micro_batch_size //= world // ulysses = 8 // (8 / 2) = 2 per GPU; the reference
    # follows the actor's Ulysses size (4 // 4 = 1); the critic's own size 4: 8 // (8 / 4) = 4.
    rows = _rows([
        "trainer.n_gpus_per_node=8",
        A + "ulysses_sequence_parallel_size=2",
        A + "ppo_micro_batch_size=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size=4",
        "critic.ulysses_sequence_parallel_size=4",
        "critic.ppo_micro_batch_size=8",
    ])  # fmt: skip
    assert rows["actor.micro_batch_size_per_gpu"] == "2"
    assert rows["ref.micro_batch_size_per_gpu"] == "1"
    assert rows["critic.micro_batch_size_per_gpu"] == "4"
    (problem,) = translate(["trainer.n_gpus_per_node=8", A + "ulysses_sequence_parallel_size=2",
                            A + "ppo_micro_batch_size=6"]).problems  # fmt: skip
    assert problem == (
        f"{A}ppo_micro_batch_size = 6 counts samples over all 4 data-parallel ranks (8 devices "
        f"/ (sequence × tensor parallel = 2)) and must be a multiple of 4: set "
        f"{A}ppo_micro_batch_size_per_gpu instead"
    )
