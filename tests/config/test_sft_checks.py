import pytest

from hybridflow.config import ConfigError, load_config, validate
from hybridflow.config.sft_checks import SFT_READS, sft_problems, task_problems, unread_key_problems


def test_the_defaults_and_the_vision_example_have_no_problem():
    assert sft_problems(load_config(None, []).sft) == []
    assert sft_problems(load_config("examples/vision.yaml", []).sft) == []


@pytest.mark.parametrize(
    "override, expected",
    [
        ("sft.total_steps=-1", "sft.total_steps = -1 must be a whole number >= 1"),
        ("sft.total_steps=0", "sft.total_steps = 0 must be a whole number >= 1"),
        ("sft.batch_size=0", "sft.batch_size = 0 must be a whole number >= 1"),
        ("sft.builtin_size=-5", "sft.builtin_size = -5 must be a whole number >= 1"),
        ("sft.max_length=0", "sft.max_length = 0 must be a whole number >= 1"),
        ("sft.eval_every=0", "sft.eval_every = 0 must be a whole number >= 1"),
        ("sft.warmup_steps=-1", "sft.warmup_steps = -1 must be a whole number >= 0"),
        ("sft.lr_decay_steps=0", "sft.lr_decay_steps = 0 must be a whole number >= 1, or null"),
        ("sft.lr=inf", "sft.lr = inf must be a finite number > 0"),
        ("sft.lr=0", "sft.lr = 0.0 must be a finite number > 0"),
        ("sft.weight_decay=-0.1", "sft.weight_decay = -0.1 must be a finite number >= 0"),
        ("sft.min_lr_ratio=2", "sft.min_lr_ratio = 2.0 must be a fraction between 0 and 1"),
        ("sft.miscopy_rate=inf", "sft.miscopy_rate = inf must be a fraction between 0 and 1"),
        ("sft.stop_at_accuracy=2", "sft.stop_at_accuracy = 2.0 must be a fraction in (0, 1]"),
        ("sft.stop_at_accuracy=0", "sft.stop_at_accuracy = 0.0 must be a fraction in (0, 1]"),
    ],
)
def test_a_bad_value_is_named_with_its_key(override, expected):
    (problem,) = sft_problems(load_config(None, [override]).sft)
    assert problem.startswith(expected)


def test_validate_checks_the_section_for_the_warm_start_only():
    with pytest.raises(ConfigError, match=r"sft\.builtin_size = 0"):
        validate(load_config(None, ["model.path=sft:arithmetic", "sft.builtin_size=0"]))
    validate(load_config(None, ["model.path=tiny", "sft.builtin_size=0"]))  # sft unused


def test_a_nan_from_yaml_is_refused_too():
    with pytest.raises(ConfigError, match=r"sft\.lr \(command line\) = nan: give a number"):
        load_config(None, ["sft.lr=.nan"])


def test_keys_sft_never_reads_are_named_with_the_sft_key_to_set_instead():
    problems = unread_key_problems(
        ["trainer.total_steps", "data.train_files", "rollout.n", "trainer.total_steps",
         "rollout.engine.speculative", "sft.lr", "trainer.run_dir", "data.builtin_val_size"]
    )  # fmt: skip
    assert problems == [
        "trainer.total_steps: hybridflow sft does not read it; set sft.total_steps instead",
        "data.train_files: hybridflow sft does not read it; set sft.train_files instead",
        problems[2],
    ]
    assert problems[2].startswith(
        "rollout.n, rollout.engine.speculative: hybridflow sft does not read them; remove them"
    )
    assert unread_key_problems(sorted(SFT_READS)) == []


def test_hybridflow_sft_refuses_an_rl_key_before_any_work(capsys, tmp_path):
    from hybridflow.cli import main

    status = main(["sft", "trainer.total_steps=3", "data.train_batch_size=4",
                   f"trainer.run_dir={tmp_path / 'run'}"])  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert "trainer.total_steps: hybridflow sft does not read it; set sft.total_steps" in err
    assert "data.train_batch_size: hybridflow sft does not read it; set sft.batch_size" in err
    assert not (tmp_path / "run").exists()


def test_an_sft_task_beside_other_builtin_files_is_named():
    (problem,) = task_problems("sft:calc", load_config(None, []).sft)  # builtin:arithmetic
    assert problem.startswith("model.path = sft:calc names the task calc, but sft.train_files")
    assert problem.endswith("set sft.train_files=[builtin:calc]")
    calc = load_config(None, ["sft.train_files=[builtin:calc]"]).sft
    own = load_config(None, ["sft.train_files=[data/sft.jsonl]"]).sft
    assert task_problems("sft:calc", calc) == task_problems("sft:calc", own) == []
    assert task_problems("/models/qwen", calc) == task_problems("sft:arithmetic", own) == []
