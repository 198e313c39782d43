"""Layout arithmetic by hand, and the DeviceMesh that build_mesh makes agrees with it."""

import pytest

from hybridflow.parallel.layout import (
    coordinates,
    group_ranks,
    layout_problems,
    ranks_with,
    rollout_layout,
    train_layout,
)


def test_tp_is_innermost_then_sp_then_dp():
    # 8 ranks, tp=2, sp=2: rank = dp·4 + sp·2 + tp, so dp = 2
    layout = train_layout(8, tp=2, sp=2)
    assert layout.dp == 2
    assert group_ranks(layout, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert group_ranks(layout, "sp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_ranks(layout, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # FSDP shards over dp × sp: every rank with the same tp index
    assert group_ranks(layout, "fsdp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # rank 7 = dp 1, sp 1, tp 1; within fsdp it is dp·sp_size + sp = 3
    assert coordinates(layout, 7) == {"dp": 1, "sp": 1, "tp": 1, "fsdp": 3}


def test_expert_group_spans_the_sp_ranks_and_some_data_ranks():
    # 8 ranks, sp=2, ep=4: dp = 4; an EP group = 2 data ranks × 2 SP ranks; experts'
    # own FSDP over fsdp / ep = 8 / 4 = 2 ranks.
    layout = train_layout(8, sp=2, ep=4)
    assert dict(layout.base_dims) == {"dp_mod_ep": 2, "dp_in_ep": 2, "sp": 2, "tp": 1}
    assert group_ranks(layout, "ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert group_ranks(layout, "expert_fsdp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert group_ranks(layout, "dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.size("ep") == 4 and layout.size("expert_fsdp") == 2


def test_rollout_replicas_are_tp_groups_and_ep_spans_whole_replicas():
    layout = rollout_layout(8, tp=2, ep=4)
    assert group_ranks(layout, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert group_ranks(layout, "ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.dp == 4 and layout.size("sp") == 1 and layout.size("fsdp") == 1


def test_every_group_partitions_the_world():
    for layout in (train_layout(16, tp=2, sp=2, ep=4), rollout_layout(16, tp=4, ep=8)):
        for name in layout.named_groups:
            groups = group_ranks(layout, name)
            assert sorted(r for g in groups for r in g) == list(range(16))
            assert {len(g) for g in groups} == {layout.size(name)}
            for rank in range(16):
                assert ranks_with(layout, name, rank)[coordinates(layout, rank)[name]] == rank


@pytest.mark.parametrize(
    ("kind", "sizes", "says"),
    [
        ("train", (6, 4, 1, 1), "world = 6 is not a multiple of tp × sp = 4 × 1"),
        ("train", (8, 1, 2, 3), "ep = 3 must be a multiple of sp = 2 and divide world / tp = 8"),
        ("train", (8, 1, 4, 2), "ep = 2 must be a multiple of sp = 4"),
        ("rollout", (8, 4, 1, 2), "ep = 2 must be a multiple of tp = 4 and divide world = 8"),
        ("rollout", (8, 1, 2, 1), "the rollout has no sequence parallelism"),
        ("train", (8, 0, 1, 1), "tp = 0 must be >= 1"),
    ],
)
def test_sizes_that_do_not_tile_are_explained(kind, sizes, says):
    assert any(says in problem for problem in layout_problems(kind, *sizes))


def test_problems_name_the_given_labels():
    labels = {"world": "trainer.n_gpus_per_node", "tp": "actor.tensor_parallel_size"}
    assert layout_problems("train", 6, 4, 1, 1, labels) == [
        "trainer.n_gpus_per_node = 6 is not a multiple of actor.tensor_parallel_size × sp = 4 × 1"
    ]


def test_the_builders_refuse_what_does_not_tile():
    with pytest.raises(ValueError, match="not a multiple of tp × sp = 4 × 1"):
        train_layout(6, tp=4)
    with pytest.raises(ValueError, match="ep = 2 must be a multiple of tp = 4"):
        rollout_layout(8, tp=4, ep=2)


def test_a_runs_layout_line_names_each_role_in_use_with_its_sizes():
    from hybridflow.parallel.layout import rollout_layout, train_layout
    from hybridflow.parallel.roles import RoleLayouts, layout_line

    layouts = RoleLayouts(actor=train_layout(4, tp=2), ref=train_layout(4, sp=2),
                          critic=train_layout(4), rollout=rollout_layout(4, tp=4))  # fmt: skip
    assert layout_line(layouts, {"actor", "ref", "rollout"}, "cuda", 4) == (
        "layout on 4 GPUs (NCCL): actor TP=2 SP=1 EP=1 DP=2 | ref TP=1 SP=2 EP=1 DP=2 | "
        "rollout TP=4 EP=1 DP=1"
    )
    one = RoleLayouts(*(train_layout(1),) * 3, rollout=rollout_layout(1))
    assert layout_line(one, {"actor", "rollout"}, "cpu", 1) == (
        "layout on 1 CPU process: actor TP=1 SP=1 EP=1 DP=1 | rollout TP=1 EP=1 DP=1"
    )
