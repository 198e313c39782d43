"""Synthetic tasks: deterministic by seed, schema-valid, solvable, test split held out."""

import random

from hybridflow.data.arithmetic import arithmetic_splits, write_arithmetic_dataset
from hybridflow.data.builtin import load_records
from hybridflow.data.countdown import countdown_problem, write_countdown_dataset
from hybridflow.data.schema import iter_rows, load_prompt_records
from hybridflow.data.sft_examples import load_sft_rows
from hybridflow.rewards import default_registry
from hybridflow.rewards.scorers import arithmetic as arithmetic_scorer
from hybridflow.rewards.scorers import countdown as countdown_scorer


def test_arithmetic_files_valid_deterministic_and_held_out(tmp_path):
    paths = write_arithmetic_dataset(
        tmp_path / "a", train_size=300, test_size=50, sft_size=100, seed=4
    )
    again = write_arithmetic_dataset(
        tmp_path / "b", train_size=300, test_size=50, sft_size=100, seed=4
    )
    known = default_registry().names()
    train = load_prompt_records(paths["train"], known_data_sources=known)
    test = load_prompt_records(paths["test"], known_data_sources=known)
    assert train == load_prompt_records(again["train"]) and len(train) == 300
    test_questions = {r.prompt[0]["content"] for r in test}
    assert len(test_questions) == 50  # unique
    assert not test_questions & {r.prompt[0]["content"] for r in train}
    sft = load_sft_rows(paths["sft"])
    assert not test_questions & {prompt[0]["content"] for prompt, _ in sft}
    for r in train:
        question = r.prompt[0]["content"]
        a, b = question[:-1].split("+")
        assert r.ground_truth == str(int(a) + int(b)) and len(question) <= 6
        assert arithmetic_scorer.compute_score(r.ground_truth, r.ground_truth) == 1.0
    for prompt, response in sft:
        a, b = prompt[0]["content"][:-1].split("+")
        assert response == str(int(a) + int(b))


def test_arithmetic_other_operations():
    splits = arithmetic_splits(200, 10, seed=1, operations=("-", "*"), max_operand=9)
    ops = {q[1] if q[1] in "-*" else q[2] for q, _ in splits["train"]}
    assert ops == {"-", "*"}
    for question, answer in splits["train"]:
        assert eval(question[:-1]) == int(answer)  # noqa: S307 - our own generated text


def test_countdown_problems_are_solvable_by_their_solution():
    rng = random.Random(0)
    for _ in range(200):
        numbers, target, solution = countdown_problem(rng, num_numbers=4)
        truth = {"target": target, "numbers": numbers}
        assert 1 <= target <= 100
        assert countdown_scorer.compute_score(f"<answer>{solution}</answer>", truth) == 1.0


def test_countdown_files(tmp_path):
    paths = write_countdown_dataset(
        tmp_path, train_size=20, test_size=5, seed=2, file_format="jsonl"
    )
    records = load_prompt_records(paths["train"], known_data_sources=default_registry().names())
    assert len(records) == 20 and records[0].ground_truth.keys() == {"target", "numbers"}
    sft = [row for _, row in iter_rows(paths["sft"])]
    for record, row in zip(records, sft):
        assert countdown_scorer.compute_score(row["response"], record.ground_truth) == 1.0


def test_builtin_entries_give_disjoint_deterministic_splits():
    train = load_records(
        ["builtin:arithmetic"], "train", builtin_train_size=100, builtin_val_size=20, seed=3
    )
    val = load_records(
        "builtin:arithmetic", "test", builtin_train_size=100, builtin_val_size=20, seed=3
    )
    assert len(train) == 100 and len(val) == 20
    assert train == load_records(
        ["builtin:arithmetic"], "train", builtin_train_size=100, builtin_val_size=20, seed=3
    )
    assert not {r.prompt[0]["content"] for r in val} & {r.prompt[0]["content"] for r in train}
    assert len(load_records(["builtin:countdown"], "test", builtin_val_size=7)) == 7
