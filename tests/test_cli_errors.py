"""Bad input through the command line: exit 2, one paragraph naming the file, key or line
and the fix, no traceback; and every case is found before a model is loaded."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hybridflow.cli import main

sys.path.insert(0, str(Path(__file__).parent / "trainer"))
from trainer_helpers import TINY  # noqa: E402

GOOD_ROW = {
    "data_source": "arithmetic",
    "prompt": [{"role": "user", "content": "1+2="}],
    "reward_model": {"ground_truth": "3"},
}


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fails the test if the run gets as far as loading a model or starting workers."""
    import hybridflow.trainer.loop.roles as roles
    import hybridflow.trainer.loop.warm_start as warm_start

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the error was found")

    monkeypatch.setattr(roles, "build_roles", loaded)
    monkeypatch.setattr(warm_start, "resolve_model_path", loaded)


SFT_TINY = ["model.path=tiny", "trainer.device=cpu", "trainer.loggers=[jsonl]", "sft.total_steps=2"]


def run_cli(capsys, tmp_path, *overrides, command=("train",)) -> str:
    """``hybridflow <command> TINY… overrides``; asserts exit 2, a short message and no
    traceback; returns stderr."""
    run = [f"trainer.run_dir={tmp_path / 'run'}"]
    if command[0] == "sft":  # SFT refuses the RL keys it never reads
        status = main([*command, *SFT_TINY, *run, *overrides])
    else:
        status = main(
            [*command, *TINY, *run, f"trainer.cache_dir={tmp_path / 'cache'}", *overrides]
        )
    captured = capsys.readouterr()
    assert status == 2, captured.err
    assert "Traceback" not in captured.err + captured.out
    assert captured.err.startswith("error: "), captured.err
    assert len(captured.err.strip().splitlines()) <= 3, captured.err
    return captured.err


def write(path: Path, data: bytes | str) -> Path:
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def tiny_model_dir(path: Path, preset: str = "tiny") -> Path:
    """A HF directory of a tiny preset (random weights) with a tokenizer file."""
    import torch

    from hybridflow.models import build_model
    from hybridflow.models.checkpoint_io.hf_writer import save_model
    from hybridflow.models.presets import preset_config

    save_model(build_model(preset_config(preset), dtype=torch.float32), str(path))
    (path / "tokenizer.json").write_text("{}")
    return path


def test_a_directory_given_as_data_is_called_a_directory(capsys, tmp_path, no_model_loading):
    (tmp_path / "data").mkdir()
    err = run_cli(capsys, tmp_path, f"data.train_files=[{tmp_path / 'data'}]")
    assert "is a directory" in err and "does not exist" not in err


def test_an_empty_data_file_is_named(capsys, tmp_path, no_model_loading):
    empty = write(tmp_path / "train.jsonl", "")
    err = run_cli(capsys, tmp_path, f"data.train_files=[{empty}]")
    assert str(empty) in err and "no rows" in err


def test_invalid_utf8_names_file_and_line(capsys, tmp_path, no_model_loading):
    good = json.dumps(GOOD_ROW).encode()
    data = write(tmp_path / "train.jsonl", good + b"\n" + b'{"x": "caf\xe9"}\n')
    err = run_cli(capsys, tmp_path, f"data.train_files=[{data}]")
    assert f"{data}: line 2" in err and "UTF-8" in err


def test_a_truncated_safetensors_file_is_named(capsys, tmp_path, no_model_loading):
    model = tiny_model_dir(tmp_path / "model")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    err = run_cli(capsys, tmp_path, f"model.path={model}")
    assert str(weights) in err and "truncated" in err


def test_a_model_directory_without_config_json(capsys, tmp_path, no_model_loading):
    model = tiny_model_dir(tmp_path / "model")
    (model / "config.json").unlink()
    err = run_cli(capsys, tmp_path, f"model.path={model}")
    assert "no config.json" in err and str(model) in err and "tokenizer" not in err


def _char_tokenizer_model(path: Path, preset: str = "tiny") -> Path:
    """A tiny model directory with a tokenizer that loads (the built-in char one)."""
    from hybridflow.models.tokenizer import build_char_tokenizer

    model = tiny_model_dir(path, preset)
    (model / "tokenizer.json").unlink()
    build_char_tokenizer().save_pretrained(str(model))
    return model


def _edit_config(model: Path, **changes) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **changes}))


def _add_tensor(model: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(model / "model.safetensors")
    weights[name] = weights["model.norm.weight"].clone()
    save_file(weights, model / "model.safetensors")


def _retype_tensor(model: Path, name: str) -> None:
    """``name`` stored as int32 (its values truncated): the loader cast it back unnoticed."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(model / "model.safetensors")
    weights[name] = weights[name].to(torch.int32)
    save_file(weights, model / "model.safetensors")


MODELS_THAT_CANNOT_LOAD = {
    "config.json is not JSON": (
        lambda m: (m / "config.json").write_text('{"model_type": "qwen2",'),
        "config.json is not valid JSON (line 1",
    ),
    "config.json is a list": (lambda m: (m / "config.json").write_text("[1, 2]"), "JSON object"),
    "an architecture nothing builds": (
        lambda m: _edit_config(m, model_type="florbnet", architectures=["FlorbForCausalLM"]),
        "names model_type 'florbnet'",
    ),
    "weights of another shape": (lambda m: _edit_config(m, hidden_size=128), "another shape"),
    "weights of fewer layers": (
        lambda m: _edit_config(m, num_hidden_layers=3),
        "hold 2 decoder layers",
    ),
    "a tensor the model has no place for": (
        lambda m: _add_tensor(m, "model.layers.0.mlp.extra.weight"),
        "has no place for (e.g. model.layers.0.mlp.extra.weight)",
    ),
    "a quantization the decoder does not read": (
        lambda m: _edit_config(m, quantization_config={"quant_method": "gptq", "bits": 4}),
        "quantization_config describes gptq weights",
    ),
    "FP8 scales without their weight": (
        lambda m: (
            _edit_config(
                m, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}
            ),
            _add_tensor(m, "model.layers.0.mlp.extra.weight_scale_inv"),
        ),
        "without their pair (e.g. model.layers.0.mlp.extra.weight_scale_inv",
    ),
    "a weight stored as integers": (
        lambda m: _retype_tensor(m, "model.norm.weight"),
        "(e.g. model.norm.weight is I32; weights are floating point",
    ),
    "a tokenizer file that does not load": (
        lambda m: (m / "tokenizer.json").write_text("{}"),
        "the tokenizer in",
    ),
}


@pytest.mark.parametrize("command", [("config", "validate"), ("train",)])
@pytest.mark.parametrize("case", list(MODELS_THAT_CANNOT_LOAD))
def test_a_model_that_cannot_load_is_found_before_it_loads(
    capsys, tmp_path, no_model_loading, command, case
):
    model = _char_tokenizer_model(tmp_path / "model")
    spoil, expected = MODELS_THAT_CANNOT_LOAD[case]
    spoil(model)
    err = run_cli(capsys, tmp_path, f"model.path={model}", command=command)
    assert expected in err and str(model) in err


BAD_CONFIG_VALUES = {
    # every request was a 500 (transformers' router asked for 9 of 8 experts)
    "top-k above the experts": ({"num_experts_per_tok": 9}, "num_experts_per_tok = 9"),
    "top-k 0": ({"num_experts_per_tok": 0}, "num_experts_per_tok = 0"),  # served "====="
    "a negative size": ({"hidden_size": -128}, "hidden_size = -128"),  # a traceback
    "KV heads that do not divide the heads": ({"num_key_value_heads": 3}, "num_key_value_heads = 3"),
    "a NaN epsilon": ({"rms_norm_eps": float("nan")}, "rms_norm_eps = nan"),
    "a size as a string": ({"vocab_size": "128"}, 'vocab_size = "128"'),
    "a quantization_config not an object": ({"quantization_config": "mxfp4"}, "quantization_config"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_CONFIG_VALUES))
def test_a_bad_config_value_is_refused_alike_by_validate_train_sft_and_serve(
    capsys, tmp_path, case
):
    model = _char_tokenizer_model(tmp_path / "model", "tiny-moe")
    changes, key = BAD_CONFIG_VALUES[case]
    _edit_config(model, **changes)
    said = []
    for command in (("config", "validate"), ("train",), ("sft", "sft.total_steps=1")):
        err = run_cli(capsys, tmp_path, f"model.path={model}", command=command)
        said.append(err[err.index(str(model / "config.json")) :].strip())
    serve = ["serve", "--model", str(model), "--device", "cpu", "--port", "0"]
    assert main(serve) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    said.append(err[err.index(str(model / "config.json")) :].strip())
    assert len(set(said)) == 1, said  # the same words everywhere
    assert key in said[0] and "correct the value in config.json" in said[0]


def _drop_tensor(model: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(model / "model.safetensors")
    del weights[name]
    save_file(weights, model / "model.safetensors")


@pytest.mark.parametrize("key", ["ref.path", "critic.path", "reward.model.path"])
def test_the_other_model_directories_are_checked_as_the_policy_is(
    capsys, tmp_path, no_model_loading, key
):
    if key == "reward.model.path":
        sys.path.insert(0, str(Path(__file__).parent))
        from reward_model_helpers import write_reward_model

        model = write_reward_model(tmp_path / "model")
        capsys.readouterr()  # transformers' progress bar
    else:
        model = tiny_model_dir(tmp_path / "model")
    _drop_tensor(model, "model.layers.1.mlp.up_proj.weight")
    uses = {"ref.path": ["actor.use_kl_loss=true"], "critic.path": ["algorithm.adv_estimator=gae"]}
    err = run_cli(capsys, tmp_path, f"{key}={model}", *uses.get(key, []),
                  command=("config", "validate"))  # fmt: skip
    assert err.startswith(f"error: 1 configuration problem(s):\n  - {key}: the weights in {model}")
    assert "lack 1 tensors" in err and "model.layers.1.mlp.up_proj.weight" in err
    _edit_config(model, rms_norm_eps=0)
    err = run_cli(capsys, tmp_path, f"{key}={model}", *uses.get(key, []),
                  command=("config", "validate"))  # fmt: skip
    assert f"{key}: {model / 'config.json'}: rms_norm_eps = 0 must be" in err


def test_a_model_that_can_load_passes_validate(capsys, tmp_path):
    model = _char_tokenizer_model(tmp_path / "model")
    run = [f"trainer.run_dir={tmp_path / 'run'}", f"trainer.cache_dir={tmp_path / 'cache'}"]
    assert main(["config", "validate", *TINY, *run, f"model.path={model}"]) == 0
    assert capsys.readouterr().out.strip().endswith("config OK")


def test_a_missing_model_directory_is_not_called_a_missing_tokenizer(capsys, tmp_path, no_model_loading):  # fmt: skip
    err = run_cli(capsys, tmp_path, f"model.path={tmp_path / 'nothing'}")
    assert "model.path" in err and "not a directory" in err and "tokenizer" not in err


def test_a_run_dir_that_cannot_be_written(capsys, tmp_path, no_model_loading):
    # /proc refuses new files even to root (a chmod would not stop root).
    err = run_cli(capsys, tmp_path, "trainer.run_dir=/proc/hybridflow-run")
    assert "trainer.run_dir" in err and "cannot write in /proc" in err


def test_a_logger_that_is_not_installed(capsys, tmp_path, no_model_loading):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    err = run_cli(capsys, tmp_path, "trainer.loggers=[jsonl,wandb]")
    assert "'wandb' package is not installed" in err and "pip install" in err


def test_a_reward_file_with_a_syntax_error_names_file_and_line(capsys, tmp_path, no_model_loading):  # fmt: skip
    reward = write(tmp_path / "my_reward.py", "def score(**kwargs):\n    return 1 +\n")
    err = run_cli(capsys, tmp_path, f"reward.custom_fn={reward}:score")
    assert str(reward) in err and "SyntaxError" in err and "line 2" in err


def test_a_reward_file_without_the_function(capsys, tmp_path, no_model_loading):
    reward = write(tmp_path / "my_reward.py", "def other(**kwargs):\n    return 1.0\n")
    err = run_cli(capsys, tmp_path, f"reward.custom_fn={reward}:score")
    assert "no function 'score'" in err and "other" in err


LATE_CHECKS = [
    (["actor.lr=-1"], "actor.lr = -1.0"),
    (["rollout.temperature=0"], "rollout.temperature = 0.0"),
    (["trainer.device=cuda"], "no CUDA GPU is visible"),
    (["trainer.run_dir=/proc/hybridflow-run"], "cannot write in /proc"),
    # the uncached warm start would write its model there after minutes of SFT
    (["model.path=sft:arithmetic", "trainer.cache_dir=/proc/hybridflow-cache"],
     "trainer.cache_dir = /proc/hybridflow-cache: cannot write in /proc"),
    (["trainer.loggers=[tensorboard]"], "'tensorboard' package is not installed"),
    # terabytes of samples on the controller: once the kernel killed the run minutes in
    (["rollout.n=100000000"], "rollout.n = 100000000"),
    # 8 built-in prompts; a batch of 16 cannot be drawn
    (["data.builtin_train_size=8", "data.train_batch_size=16", "actor.ppo_mini_batch_size=16"],
     "8 usable prompts, fewer than one batch"),
]  # fmt: skip


@pytest.mark.parametrize("command", [("config", "validate"), ("train",)])
@pytest.mark.parametrize("overrides, expected", LATE_CHECKS)
def test_late_checks_are_found_by_validate_and_before_any_model_loads(
    capsys, tmp_path, no_model_loading, command, overrides, expected
):
    import importlib.util

    if "tensorboard" in expected and importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed here")
    if "CUDA" in expected:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is visible")
        if command == ("config", "validate"):
            pytest.skip("validate leaves the machine's checks to train where no GPU is visible")
    assert expected in run_cli(capsys, tmp_path, *overrides, command=command)


def test_validate_without_a_gpu_checks_the_config_and_names_the_machine_checks_it_left(
    capsys, tmp_path, no_model_loading
):
    """A cluster's config checked on a login node: trainer.device=cuda with no GPU visible.
    The config's own problems are still found; the machine's checks (a GPU, host memory, room
    in the run directory) are named as left to train, which still refuses here."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert "actor.lr = -1.0" in run_cli(capsys, tmp_path, "trainer.device=cuda", "actor.lr=-1",
                                        command=("config", "validate"))  # fmt: skip
    status = main(["config", "validate", *TINY, f"trainer.cache_dir={tmp_path / 'cache'}",
                   "trainer.device=cuda", "trainer.run_dir=/proc/run"])  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0
    assert out.startswith("config OK (not checked here, as no CUDA GPU is visible: a GPU")
    assert "host memory a node" in out and "hybridflow train checks them at start" in out
    assert "no CUDA GPU is visible" in run_cli(capsys, tmp_path, "trainer.device=cuda",
                                               command=("train",))  # fmt: skip


def test_a_read_only_cache_dir_is_fine_when_the_run_writes_nothing_there(capsys, tmp_path):
    # a preset model on the CPU: no warm start, no engine choices, no compiled artifacts
    run = [f"trainer.run_dir={tmp_path / 'run'}", "trainer.cache_dir=/proc/hybridflow-cache"]
    assert main(["config", "validate", *TINY, *run]) == 0, capsys.readouterr().err


def test_debug_shows_the_traceback(capsys, tmp_path):
    status = main(["--debug", "config", "validate", "actor.lr=-1"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" in err and "actor.lr" in err


def test_sft_checks_the_machine_before_it_loads_a_model(capsys, tmp_path):
    err = run_cli(capsys, tmp_path, "trainer.run_dir=/proc/hybridflow-run", command=("sft",))
    assert "cannot write in /proc" in err


def test_optimizer_offload_with_fsdp2_stops_before_any_model_loads(capsys, tmp_path, no_model_loading):  # fmt: skip
    err = run_cli(capsys, tmp_path, "trainer.backend=local", "trainer.n_gpus_per_node=2",
                  "actor.optimizer_offload=true", command=("config", "validate"))  # fmt: skip
    assert "actor.optimizer_offload" in err and "actor.param_offload=true" in err


def test_a_nan_weight_stops_train_at_load_naming_the_tensor(capsys, tmp_path):
    # it trained to exit 0 with null losses: every step skipped on a NaN gradient norm
    from safetensors.torch import load_file, save_file

    model = _char_tokenizer_model(tmp_path / "model")
    weights = load_file(model / "model.safetensors")
    weights["model.layers.0.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    err = run_cli(capsys, tmp_path, f"model.path={model}")
    assert f"{model / 'model.safetensors'}: tensor model.layers.0.mlp.up_proj.weight holds 1" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
