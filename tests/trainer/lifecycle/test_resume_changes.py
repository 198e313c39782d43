"""Resuming with a changed parallel layout: the training and rollout layouts over the same
devices continue (each says how), a change of the devices is refused with the reason; a
change of precision (bf16 <-> FP8) continues and says why it can."""

from hybridflow.trainer.lifecycle.resume_changes import config_changes, refusal_message, refused


def test_a_changed_layout_over_the_same_devices_continues_and_says_how():
    saved = {"actor": {"sequence_parallel_size": 1, "expert_parallel_size": 1},
             "rollout": {"tensor_parallel_size": 1}}  # fmt: skip
    current = {"actor": {"sequence_parallel_size": 2, "expert_parallel_size": 2},
               "rollout": {"tensor_parallel_size": 2}}  # fmt: skip
    changes = config_changes(saved, current)
    assert refused(changes) == []
    assert [change.line() for change in changes] == [
        "actor.expert_parallel_size: 1 -> 2 (each rank reads its part of the checkpoint's "
        "shards in the new layout)",
        "actor.sequence_parallel_size: 1 -> 2 (each rank reads its part of the checkpoint's "
        "shards in the new layout)",
        "rollout.tensor_parallel_size: 1 -> 2 (the rollout keeps no state: its engine is built "
        "in the new layout and takes the loaded actor's weights; the samples are the same)",
    ]


def test_one_process_to_two_is_refused_with_the_reason():
    changes = config_changes(
        {"trainer": {"n_gpus_per_node": 1}}, {"trainer": {"n_gpus_per_node": 2}}
    )
    message, fix = refusal_message("run/checkpoints/step_1", refused(changes))
    assert message == (
        "cannot resume run/checkpoints/step_1 with a changed config: trainer.n_gpus_per_node: "
        "1 -> 2 (the optimizer state is sharded over the old number of ranks)"
    )
    assert fix.startswith("put the old values back to continue that run, or start a new run")


def test_a_precision_change_continues_and_says_why_it_can():
    saved = {"actor": {"precision": "bf16", "fp8_recipe": "rowwise"},
             "critic": {"precision": "fp8"}, "rollout": {"dtype": "model"}}  # fmt: skip
    current = {"actor": {"precision": "fp8", "fp8_recipe": "tensorwise"},
               "critic": {"precision": "bf16"}, "rollout": {"dtype": "fp8"}}  # fmt: skip
    changes = config_changes(saved, current)
    assert refused(changes) == []
    lines = {change.key: change.line() for change in changes}
    assert lines["actor.precision"] == (
        "actor.precision: 'bf16' -> 'fp8' (the checkpoint holds the same fp32/bf16 weights and "
        "AdamW state in either precision (FP8 casts them at each matmul): the linears compute "
        "in the new one from the next step)"
    )
    assert "from the next step" in lines["critic.precision"]
    assert "none is saved" in lines["actor.fp8_recipe"]
    assert "takes the loaded actor's weights in the new format" in lines["rollout.dtype"]
