"""verl command lines: detection by name, translation, notices and features that stop."""

import pytest
from verl_command_lines import IMAGES, RUNS, STOPS, command_line

from hybridflow.cli import main
from hybridflow.config import ConfigError, load_config
from hybridflow.config.verl import load_with_verl_keys, translate, translate_command_line

# What a user changes for this machine (`config validate` checks the model directories, the
# data files and the logger packages too): a model and data that exist here, loggers that
# are installed. Ours win.
HERE = ["model.path=qwen2.5-0.5b", "critic.path=qwen2.5-0.5b", "trainer.loggers=[console]",
        "data.train_files=[builtin:arithmetic]",
        "data.val_files=[builtin:arithmetic]", "data.builtin_train_size=8192",
        "rollout.tensor_parallel_size=1",  # the stand-in has 2 KV heads; the examples split 2 or 4
        "rollout.max_num_seqs=64"]  # planned as a CPU run here: its rollout cache on the host  # fmt: skip


@pytest.mark.parametrize("name", RUNS)
def test_verl_example_command_lines_validate(name, capsys):
    assert main(["config", "validate", *command_line(name), *HERE]) == 0
    err = capsys.readouterr().err
    translated = [item.split("=")[0].lstrip("+") for item in command_line(name)]
    for key in translated:  # every verl key is accounted for in the printed translation
        if key.startswith(("actor_rollout_ref.", "critic.")):
            assert key in err, key


@pytest.mark.parametrize(
    "name, feature",
    [
        ("stops_grpo_qwen2_7b_math_megatron", "Megatron-LM"),
    ],
)
def test_unsupported_feature_exits_2_naming_it(name, feature, capsys):
    assert name in STOPS
    assert main(["train", *command_line(name)]) == 2
    err = capsys.readouterr().err
    assert feature in err and "Traceback" not in err


@pytest.mark.parametrize("name", IMAGES)
def test_verl_image_runs_validate_with_a_vision_language_model(name, capsys):
    here = [
        *HERE,
        "model.path=tiny-vl",
        "critic.path=tiny-vl",  # a stand-in that fits here
        "data.max_response_length=1024",
    ]
    assert main(["config", "validate", *command_line(name), *here]) == 0
    assert "config OK" in capsys.readouterr().out
    assert "data.image_key=images" in translate(["data.image_key=images"]).overrides
    for place in ("actor", "model"):  # verl's key, in either section
        key = f"actor_rollout_ref.{place}.freeze_vision_tower=False"
        assert "actor.freeze_vision_tower=false" in translate([key]).overrides


@pytest.mark.parametrize("name", IMAGES)
def test_verl_image_runs_with_a_text_only_model_exit_2_naming_the_key(name, capsys):
    assert main(["config", "validate", *command_line(name), *HERE]) == 2
    err = capsys.readouterr().err
    assert "data.image_key = 'images'" in err and "text-only model" in err
    assert "Traceback" not in err


def test_hydra_forms_and_lists():
    t = translate(
        [
            "+trainer.val_before_train=False",
            "++actor_rollout_ref.rollout.n=3",
            "trainer.logger=['console','wandb']",
        ]
    )
    assert not t.problems
    assert "trainer.val_before_train=False" in t.overrides
    assert "rollout.n=3" in t.overrides
    assert "trainer.loggers=[console, wandb]" in t.overrides


def test_verls_file_logger_is_the_metrics_jsonl():
    t = translate(["trainer.logger=['console','file']"])
    assert not t.problems
    assert "trainer.loggers=[console, jsonl]" in t.overrides


def test_our_keys_win_over_translated_ones():
    cfg = load_with_verl_keys(
        None,
        [
            "actor_rollout_ref.rollout.n=5",
            "rollout.n=2",
            "trainer.total_epochs=15",
            "trainer.total_steps=3",
        ],  # fmt: skip
        log=lambda text: None,
    )
    assert cfg.rollout.n == 2
    assert cfg.trainer.total_steps == 3 and cfg.trainer.total_epochs is None


def test_translation_is_printed_once_with_each_key(capsys):
    assert main(["config", "show", "actor_rollout_ref.actor.optim.lr=3e-6"]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("actor_rollout_ref.actor.optim.lr=3e-6  ->  actor.lr = 3e-6") == 1
    assert "lr: 3.0e-06" in captured.out


def test_ignored_key_gets_one_line_why():
    t = translate(
        ["actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.load_format=dummy"]
    )
    assert not t.problems
    reasons = {n.verl: n.why for n in t.notices}
    assert "own engine" in reasons["actor_rollout_ref.rollout.name"]
    assert reasons["actor_rollout_ref.rollout.load_format"]


def test_harmless_value_of_a_missing_feature_is_accepted():
    ok = translate(["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1"])
    assert not ok.problems and ok.notices
    stop = translate(["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"])
    assert "pipeline parallelism" in stop.problems[0]
    assert "pipeline_model_parallel_size=2" in stop.problems[0]


def test_unknown_verl_key_is_named_with_a_suggestion():
    with pytest.raises(ConfigError) as error:
        translate_command_line(None, ["actor_rollout_ref.actor.ppo_mini_batch_sise=8"])
    assert "actor_rollout_ref.actor.ppo_mini_batch_sise" in str(error.value)
    assert "did you mean 'actor_rollout_ref.actor.ppo_mini_batch_size'" in str(error.value)


def test_our_unknown_keys_still_get_our_message():
    with pytest.raises(ConfigError, match="did you mean 'rollout.n'"):
        load_with_verl_keys(None, ["rollout.nn=3"])


@pytest.mark.parametrize(
    "key",
    ["actor_rollout_ref.actor.xyz", "actor_rollout_ref.rollout.foo", "algorithm.kl_ctrl.bogus"],
)
def test_an_unrelated_unknown_verl_key_gets_no_suggestion(key):
    # the shared prefix alone once made `actor.xyz` suggest `actor.strategy`
    (problem,) = translate([f"{key}=1"]).problems
    assert key in problem and "did you mean" not in problem


def test_a_misspelt_section_of_a_verl_key_is_suggested_in_full():
    (problem,) = translate(["actor_rollout_ref.rolout.n=3"]).problems
    assert "did you mean 'actor_rollout_ref.rollout.n'" in problem


def test_verl_defaults_do_not_override_the_yaml_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  n: 6\n")
    cfg = load_with_verl_keys(path, ["actor_rollout_ref.actor.optim.lr=1e-6"], log=lambda t: None)
    assert cfg.rollout.n == 6  # the file's, not verl's default of 1
    assert cfg.actor.weight_decay == 0.01  # verl's default, the file sets none
    assert load_config(path).rollout.n == 6


def test_overlong_and_reward_function_read_together():
    t = translate(
        [
            "data.filter_overlong_prompts=False",
            "data.truncation=left",
            "custom_reward_function.path=/r/score.py",
        ]
    )
    assert "data.overlong_prompts=truncate" in t.overrides
    assert "reward.custom_fn=/r/score.py:compute_score" in t.overrides
    assert translate(["data.truncation=middle"]).problems


def test_unknown_key_under_a_verl_group_of_a_shared_section_is_named():
    (problem,) = translate(["critic.model.pth=/m"]).problems
    assert "critic.model.pth" in problem and "did you mean 'critic.model.path'" in problem


def test_shared_keys_take_verls_meaning_on_a_verl_command_line():
    verl_line = translate(
        ["actor_rollout_ref.rollout.n=2", "trainer.save_freq=0", "data.val_batch_size=null"]
    )
    assert "trainer.save_freq=-1" in verl_line.overrides  # verl saves only when > 0
    assert not any(o.startswith("data.val_batch_size") for o in verl_line.overrides)
    assert "trainer.save_freq=0" in translate(["trainer.save_freq=0"]).overrides  # ours: at the end
    stop = translate(["actor_rollout_ref.rollout.n=2", "trainer.device=npu"])
    assert "NPU" in stop.problems[0]


def test_background_checkpoints_keep_their_verl_switch():
    t = translate(["actor_rollout_ref.actor.checkpoint.async_save=False",
                   "actor_rollout_ref.actor.checkpoint.save_contents=[model]"])  # fmt: skip
    assert not t.problems
    assert "trainer.async_save=false" in t.overrides
    assert not any("save_contents" in o for o in t.overrides)


def test_torch_compile_becomes_auto_or_off():
    # verl compiles by default and trains on GPUs only: True is our auto (off on the CPU)
    on = load_with_verl_keys(None, ["actor_rollout_ref.actor.use_torch_compile=True"])
    off = load_with_verl_keys(None, ["actor_rollout_ref.actor.use_torch_compile=false"])
    assert (on.model.compile, off.model.compile) == ("auto", False)
    ref = translate(["actor_rollout_ref.ref.use_torch_compile=False"])
    assert not ref.problems and not any("compile" in o for o in ref.overrides)


def test_megatron_fp8_training_keys_become_our_precision():
    # verl's FP8 end-to-end recipe (low_precision/run_dapo_qwen3_moe_30b_megatron_fp8e2e.sh)
    actor = "actor_rollout_ref.actor."
    override = actor + "megatron.override_transformer_config."
    t = translate([override + "fp8=e4m3", override + "fp8_recipe=blockwise",
                   actor + "optim.override_optimizer_config.fp8_recipe=blockwise",
                   "critic.megatron.override_transformer_config.fp8=hybrid",
                   "critic.megatron.override_transformer_config.fp8_recipe=delayed",
                   "actor_rollout_ref.ref.megatron.override_transformer_config.fp8=e4m3"])  # fmt: skip
    assert not t.problems
    for ours in ("actor.precision=fp8", "actor.fp8_recipe=rowwise", "critic.precision=fp8",
                 "critic.fp8_recipe=tensorwise"):  # fmt: skip
        assert ours in t.overrides
    reasons = {n.verl: n.why for n in t.notices}
    assert "fp32" in reasons[actor + "optim.override_optimizer_config.fp8_recipe"]
    assert "bf16" in reasons["actor_rollout_ref.ref.megatron.override_transformer_config.fp8"]


def test_megatron_fp8_off_keeps_bf16_and_an_unknown_recipe_stops():
    override = "actor_rollout_ref.actor.megatron.override_transformer_config."
    off = translate([override + "fp8=null"])
    assert not off.problems and not any("precision" in o for o in off.overrides)
    stop = translate([override + "fp8_recipe=mxfp8"])
    assert "fp8 recipe 'mxfp8'" in stop.problems[0]
