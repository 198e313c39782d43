"""`bench rollout` of a vision-language model (tiny-vl, CPU): prompts carry images, the engine
and transformers' Qwen2.5-VL generate the same token count from the same pixels, the
result says how many image tokens a prompt has, greedy tokens agree with transformers'
in fp32, and images asked of a text model are refused."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from hybridflow.bench.cli import main
from hybridflow.bench.rollout import (
    _hf_twin,
    add_rollout_arguments,
    bench_prompts,
    hf_inputs,
)
from hybridflow.progress import quiet_reporter

# 16-pixel merged patches: 32x32 -> 4 image tokens, 48x64 -> 12, 64x32 -> 8
SIZES = "32x32,48x64,64x32"


def _args(argv):
    parser = argparse.ArgumentParser()
    add_rollout_arguments(parser)
    return parser.parse_args(argv)


def test_bench_rollout_with_images_counts_image_and_generated_tokens(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["rollout", "--preset", "tiny-vl", "--prompts", "3", "--prompt-len", "5",
            "--new-tokens", "6", "--n", "2", "--device", "cpu", "--dtype", "float32",
            "--image-size", SIZES, "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["engine"]["tokens"] == 3 * 2 * 6 == result["hf"]["tokens"]
    assert result["images_per_prompt"] == 1 and result["image_sizes"] == SIZES
    assert result["image_tokens_per_prompt"] == {"min": 4, "mean": 8.0, "max": 12}
    # each prompt: vision start, its image tokens, vision end, 5 text tokens
    assert result["prompt_tokens"] == {"min": 11, "mean": 15.0, "max": 19}
    printed = capsys.readouterr().out
    assert "image tokens a prompt 4-12 (mean 8)" in printed


def test_text_prompts_of_a_vision_model_hold_no_vision_token():
    from hybridflow.models.presets import preset_config

    config = preset_config("tiny-vl")
    args = _args(["--preset", "tiny-vl", "--prompts", "64", "--prompt-len", "16",
                  "--images-per-prompt", "0"])  # fmt: skip
    prompts, images, info = bench_prompts(config, args, quiet_reporter())
    assert images is None and info == {}
    assert max(max(p) for p in prompts) < config.vision.vision_start_token_id


def test_greedy_tokens_equal_transformers_with_images_in_fp32():
    """The engine and transformers' Qwen2_5_VLForConditionalGeneration (the bench's twin,
    the same tensors) on left-padded prompts with images of three sizes: the same first
    greedy tokens. std-0.3 weights: peaked logits, greedy far from ties."""
    from hybridflow.engine import Engine, SamplingParams
    from hybridflow.models import build_model
    from hybridflow.models.presets import preset_config

    model = build_model(preset_config("tiny-vl"), seed=1).eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if not name.endswith("bias"):
            p.normal_(0, 0.1 if name.startswith("visual.") else 0.3, generator=generator)
    args = _args(["--preset", "tiny-vl", "--prompts", "3", "--prompt-len", "4",
                  "--image-size", SIZES])  # fmt: skip
    prompts, images, _ = bench_prompts(model.config, args, quiet_reporter())
    params = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)
    engine = Engine(model, max_batch_size=3, max_seq_len=64)
    ours = [c.token_ids for c in engine.generate(prompts, params, images=images)]
    hf = _hf_twin(model, torch.device("cpu"))
    given = hf_inputs(model.config, prompts, images, 0, torch.device("cpu"))
    with torch.no_grad():
        out = hf.generate(**given, do_sample=False, max_new_tokens=5, min_new_tokens=5,
                          pad_token_id=0)  # fmt: skip
    theirs = out[:, given["input_ids"].shape[1] :].tolist()
    assert ours == theirs
    # the pixels matter: other images, other tokens
    flipped = [type(e)(e.pixel_values.flip(0), e.image_grid_thw, e.positions) for e in images]
    moved = [c.token_ids for c in engine.generate(prompts, params, images=flipped)]
    assert moved != ours


def test_images_asked_of_a_text_model_are_refused_naming_the_option(capsys):
    from hybridflow.cli import main as hybridflow_main

    status = hybridflow_main(["bench", "rollout", "--preset", "tiny", "--prompts", "2",
                              "--prompt-len", "4", "--new-tokens", "2", "--device", "cpu",
                              "--images-per-prompt", "1", "--no-hf"])  # fmt: skip
    assert status == 2
    err = capsys.readouterr().err
    assert "--images-per-prompt 1: tiny is a text model" in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["--image-size", "448by448"], ["--images-per-prompt", "-1"]])
def test_a_bad_image_size_or_count_is_an_argument_error(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        _args(argv)
    assert stop.value.code == 2 and argv[0] in capsys.readouterr().err
