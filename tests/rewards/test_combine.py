"""Reward parts combined per data source with the configured weights."""

from hybridflow.rewards.combine import combine_parts, resolve_weights, used_parts, weights_problems


def test_default_weights_follow_which_parts_are_on():
    assert resolve_weights({}, {}, model=False, judge=False) == {"*": {"rule": 1.0}}
    # a reward model replaces the rule reward unless weights say otherwise (as in verl)
    assert resolve_weights({}, {}, model=True, judge=False) == {"*": {"model": 1.0}}
    table = resolve_weights({"rule": 1.0, "model": 0.5}, {"chat": {"model": 2.0}},
                            model=True, judge=False)  # fmt: skip
    assert table == {"*": {"rule": 1.0, "model": 0.5}, "chat": {"model": 2.0}}
    assert used_parts(table) == {"rule", "model"}


def test_scores_are_weighted_sums_per_data_source():
    table = {"*": {"rule": 1.0, "model": 0.5}, "chat": {"model": 2.0}}
    parts = {"rule": [1.0, 0.0, 1.0], "model": [0.4, -1.0, 3.0]}
    scores, metrics = combine_parts(parts, ["math", "math", "chat"], table)
    # math: 1·1 + 0.5·0.4 = 1.2; math: 0 + 0.5·(−1) = −0.5; chat: 2·3 = 6 (its rule ignored)
    assert scores == [1.2, -0.5, 6.0]
    assert metrics["reward/model/mean"] == (0.4 - 1.0 + 3.0) / 3
    assert metrics["reward/model/min"] == -1.0 and metrics["reward/rule/max"] == 1.0


def test_weights_naming_an_unknown_or_disabled_part_are_refused():
    problems = weights_problems({"modle": 1.0, "judge": 1.0}, {"chat": {"model": "x"}},
                                model=False, judge=False)  # fmt: skip
    assert any("reward.weights.modle is not a reward part" in p for p in problems)
    assert any("judge reward, which is off: set reward.judge.template" in p for p in problems)
    assert any("reward.source_weights.chat.model = 'x' must be a number" in p for p in problems)
    assert weights_problems({"rule": 1, "model": 0.5}, {}, model=True, judge=False) == []
