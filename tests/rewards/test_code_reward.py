"""The code reward: programs run on stdin/stdout tests in the sandbox; bad programs score
0 without raising, malformed ground truth raises ValueError naming the problem."""

import json
import sys
import time

import pytest

if not sys.platform.startswith("linux"):
    pytest.skip("the sandbox is Linux-only", allow_module_level=True)

from hybridflow.rewards import RewardManager, default_registry
from hybridflow.rewards.scorers import code

# a + b, one pair per test
TESTS = {"inputs": ["1 2\n", "10 20\n"], "outputs": ["3\n", "30\n"]}
SUM = "a, b = map(int, input().split())\nprint(a + b)\n"


def test_correct_program_scores_one():
    assert code.compute_score(SUM, json.dumps(TESTS)) == 1.0
    assert code.compute_score(SUM, TESTS) == 1.0  # a dict works too


def test_half_correct_program_scores_half():
    half = "a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)\n"
    assert code.compute_score(half, TESTS) == 0.5


def test_trailing_whitespace_is_ignored_but_content_is_not():
    spaced = "a, b = map(int, input().split())\nprint(a + b, '  ')\nprint()\n"
    assert code.compute_score(spaced, TESTS) == 1.0
    assert code.compute_score("print(3)", TESTS) == 0.5


def test_infinite_loop_scores_zero_within_the_timeout():
    started = time.monotonic()
    score = code.compute_score("while True:\n    pass\n", TESTS, extra_info={"timeout_s": 0.5})
    assert score == 0.0
    assert time.monotonic() - started < 3  # one timeout at most per test, then stop


def test_crashing_program_scores_zero():
    assert code.compute_score("raise SystemExit(3)", TESTS) == 0.0
    assert code.compute_score("import os\nos.abort()", TESTS) == 0.0
    assert code.compute_score("def broken(:\n", TESTS) == 0.0
    assert code.compute_score("", TESTS) == 0.0


def test_correct_output_with_a_nonzero_exit_fails():
    assert code.compute_score(SUM + "raise SystemExit(1)\n", TESTS) == 0.0


def test_program_in_a_fenced_block_amid_text():
    response = (
        "Read the two numbers and add them:\n\n"
        "```python\nprint('first draft')\n```\n\n"
        "Better:\n\n"
        f"```python\n{SUM}```\n\n"
        "This runs in O(1)."
    )
    assert code.extract_program(response) == SUM
    assert code.compute_score(response, TESTS) == 1.0


def test_extract_program_fallbacks():
    assert code.extract_program(SUM) == SUM  # no fence: the whole text
    assert code.extract_program(f"```\n{SUM}```") == SUM  # untagged fence
    assert code.extract_program(f"```bash\nls\n```\n```py\n{SUM}```") == SUM
    assert code.extract_program(f"```python\n{SUM}") == SUM  # cut off before the fence


@pytest.mark.parametrize(
    "ground_truth, message",
    [
        ("not json", "not valid JSON"),
        ("[1, 2]", "must be"),
        ({"inputs": ["1"]}, "no outputs"),
        ({"inputs": ["1", "2"], "outputs": ["1"]}, "2 inputs but 1 outputs"),
        ({"inputs": [], "outputs": []}, "no test cases"),
        ({"inputs": "1", "outputs": "1"}, "must be a list"),
        ({"inputs": [1], "outputs": ["1"]}, r"\['inputs'\]\[0\] must be a string"),
        ({"fn_name": "solve", "inputs": [], "outputs": []}, "only stdin/stdout"),
    ],
)
def test_malformed_ground_truth_raises(ground_truth, message):
    with pytest.raises(ValueError, match=message):
        code.compute_score(SUM, ground_truth)


def test_registered_as_data_sources():
    for name in ("code", "codecontests", "codeforces"):
        assert default_registry().get(name).target.endswith("scorers.code:compute_score")


def test_scored_through_the_reward_manager():
    manager = RewardManager("naive")
    scores, metrics = manager.score([SUM, "print(0)"], [json.dumps(TESTS)] * 2, ["code"] * 2)
    assert scores == [1.0, 0.0]
    assert metrics["reward/num_errors"] == 0.0


def test_a_scorer_timeout_mid_run_leaves_nothing_behind():
    """The scoring pool's alarm (a BaseException raised inside the sandbox's event loop)
    must still kill the program and remove its directory."""
    import os
    import tempfile

    from hybridflow.rewards.parallel import guarded_call
    from hybridflow.rewards.scorer_registry import ScorerSpec

    before = set(os.listdir(tempfile.gettempdir()))
    sleeper = "import time\ntime.sleep(30)\n"
    arguments = {"solution_str": sleeper, "ground_truth": TESTS, "extra_info": {"timeout_s": 20}}
    started = time.monotonic()
    outcome = guarded_call(ScorerSpec(f"{code.__name__}:compute_score"), arguments, 0.5)
    assert outcome.status == "timeout"
    assert time.monotonic() - started < 2
    left = set(os.listdir(tempfile.gettempdir())) - before
    assert not [name for name in left if name.startswith("hybridflow-sandbox-")]


def test_programs_run_under_the_configured_isolation():
    """reward.sandbox_isolation reaches the sandbox through the registry; a row's extra_info
    cannot lower it. Strict: a program that prints a file of the repository fails."""
    from pathlib import Path

    from hybridflow.agents.sandbox import jail_unavailable
    from hybridflow.config import load_config
    from hybridflow.rewards import build_reward_manager

    cfg = load_config(None, ["reward.sandbox_isolation=strict"])
    manager = build_reward_manager(cfg.reward, cfg.data.max_response_length)
    assert manager.registry.get("code").options == {"isolation": "strict"}
    if jail_unavailable():
        pytest.skip(f"this machine cannot build the sandbox's jail: {jail_unavailable()}")
    readme = Path(__file__).resolve().parents[2] / "README.md"
    cat = f"print(open({str(readme)!r}).readline(), end='')"
    tests = {"inputs": [""], "outputs": [readme.read_text().splitlines()[0]]}
    assert code.compute_score(cat, tests, isolation="basic") == 1.0  # the hole strict closes
    scores, _ = manager.score([cat], [tests], ["code"], [{"isolation": "basic"}])
    assert scores == [0.0]
