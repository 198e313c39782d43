"""benchmarks/grpo_vs_trl.py on CPU: one hybridflow GRPO run prints its step table, and
--scaling runs the 2-rank local-backend GRPO step (gloo, FSDP2 actor, one rollout engine per
rank) end to end through the real train_step, at equal per-rank work, with the scaling
numbers computed from what was measured."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from benchmark_run import run_benchmark

from hybridflow.bench.grpo_steps import bench_config
from hybridflow.config import validate

REPO = Path(__file__).resolve().parents[2]


def test_bench_config_splits_the_batch_over_gpus():
    cfg = bench_config(
        "tiny", prompts=8, samples=4, prompt_len=8, new_tokens=8, micro_batch_tokens=256, gpus=2
    )
    assert (cfg.trainer.backend, cfg.trainer.n_gpus_per_node) == ("local", 2)
    assert cfg.rollout.max_num_seqs == 4 * 4  # per engine: its 4 prompts x 4 samples
    assert cfg.actor.ppo_mini_batch_size == 8  # one optimizer step over the global batch
    assert validate(cfg).train_dp_size == 2
    one = bench_config(
        "tiny", prompts=4, samples=4, prompt_len=8, new_tokens=8, micro_batch_tokens=256
    )
    assert one.trainer.backend == "inprocess" and one.rollout.max_num_seqs == 16
    cpu = bench_config("tiny", prompts=4, samples=4, prompt_len=8, new_tokens=8,
                       micro_batch_tokens=256, overrides=("trainer.device=cpu",))  # fmt: skip
    assert cpu.model.compile is False  # model.compile=auto resolved as a run resolves it
    with pytest.raises(ValueError, match="split evenly"):
        bench_config(
            "tiny", prompts=3, samples=2, prompt_len=8, new_tokens=8, micro_batch_tokens=64, gpus=2
        )


@pytest.mark.slow
@pytest.mark.parametrize("preset, tokens, recompute", [
    ("qwen2.5-0.5b", 65536, False),  # the default workload fits an H200 without recomputing
    ("qwen2.5-1.5b", 65536, True),  # its update would need ~188 GiB without
    ("qwen2.5-1.5b", 32768, False),  # half the micro-batch: ~109 of the 118 GiB allowed
    ("qwen2.5-1.5b", "auto", False),  # the default: the plan picks ~36k tokens to stay off
])  # fmt: skip
def test_hybridflow_checkpoints_as_its_memory_plan_decides_for_the_gpu(preset, tokens, recompute):
    from benchmark_run import load_script

    bench = load_script("grpo_vs_trl.py")
    args = argparse.Namespace(prompts=128, samples=8, prompt_len=128, new_tokens=256, gpus=1,
                              hf_micro_tokens=tokens, override=["trainer.gpu_memory_gib=139"])  # fmt: skip
    assert bench.hybridflow_overrides(args)[0] == "model.gradient_checkpointing=auto"
    assert bench.resolved_checkpointing(preset, args) is recompute
    if tokens == "auto":
        assert (
            bench.resolved_config(preset, args).actor.max_tokens_per_gpu == 30720
        )  # trainer.device resolves to this host's CPU: layers not compiled
    args.override.append("model.gradient_checkpointing=true")  # a user's override wins
    assert bench.resolved_checkpointing(preset, args) is True


def test_scaling_one_and_two_cpu_ranks(tmp_path):
    out = tmp_path / "scaling.json"
    command = [
        sys.executable, str(REPO / "benchmarks" / "grpo_vs_trl.py"), "--which", "hybridflow",
        "--scaling", "1", "2", "--device", "cpu", "--preset", "tiny", "--prompts", "2",
        "--samples", "2", "--prompt-len", "6", "--new-tokens", "5", "--steps", "2",
        "--model-dir", str(tmp_path / "model"), "--run-timeout", "120", "--json", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = json.loads(out.read_text())
    assert "error" not in one and "error" not in two, (one, two)
    assert (one["gpus"], one["prompts"], two["gpus"], two["prompts"]) == (1, 2, 2, 4)
    assert len(one["all_steps_s"]) == len(two["all_steps_s"]) == 2
    # 2 ranks: twice the tokens per step (4 prompts x 2 samples x (6 + 5)), half per rank.
    assert two["tokens_per_s"] * two["step_s"] == pytest.approx(4 * 2 * 11)
    assert two["tokens_per_s_per_gpu"] == pytest.approx(two["tokens_per_s"] / 2)
    ratio = two["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"]
    assert two["scaling_efficiency"] == pytest.approx(ratio)
    # The stage breakdown is measured, and on 2 ranks the FSDP2-sharded actor's weights reach
    # each rank's rollout engine by an all-gather: a sync that takes time.
    for result in (one, two):
        stages = result["breakdown"]
        assert stages["timing_s/update_actor"] > 0 and stages["timing_s/gen"] > 0
        assert stages["timing_s/step"] >= stages["timing_s/update_actor"] + stages["timing_s/gen"]
    assert two["breakdown"]["timing_s/sync_weights"] > 0
    assert "scaling" in done.stdout and "2 GPU" in done.stdout


def test_one_hybridflow_run_prints_its_step_table(tmp_path):
    out_json = tmp_path / "grpo.json"
    out = run_benchmark(
        "grpo_vs_trl.py", "--which", "hybridflow", "--device", "cpu", "--preset", "tiny",
        "--prompts", "2", "--samples", "2", "--prompt-len", "6", "--new-tokens", "5",
        "--steps", "3", "--model-dir", str(tmp_path / "model"), "--json", str(out_json),
    )  # fmt: skip
    (result,) = json.loads(out_json.read_text())
    assert len(result["all_steps_s"]) == 3
    assert result["step_s"] == pytest.approx(sum(result["all_steps_s"][1:]) / 2)  # warm-up out
    assert result["tokens_per_s"] * result["step_s"] == pytest.approx(2 * 2 * (6 + 5))
    row = next(line for line in out.splitlines() if line.startswith(result["name"]))
    step_s, tokens_per_s, _peak, *steps = row[len(result["name"]) :].split()
    assert float(step_s) == pytest.approx(result["step_s"], abs=0.006)
    assert float(tokens_per_s) == pytest.approx(result["tokens_per_s"], abs=0.6)
    assert [float(s) for s in steps] == pytest.approx(result["all_steps_s"], abs=0.006)
    stages = {line.split()[0]: float(line.split()[1]) for line in out.splitlines()
              if line.startswith("  timing_s/")}  # fmt: skip
    assert stages["timing_s/gen"] > 0 and stages["timing_s/update_actor"] > 0
    assert stages["timing_s/step"] >= stages["timing_s/gen"] + stages["timing_s/update_actor"]
    assert "controller (step - stages)" in out


# 16-pixel merged patches: 32x32 -> 4 image tokens, 48x64 -> 12; each prompt also holds the
# vision start and end tokens and 6 text tokens: 12 and 20 tokens, 16 on average
VL_ARGS = ("--preset", "tiny-vl", "--prompts", "2", "--samples", "2", "--prompt-len", "6",
           "--new-tokens", "5", "--steps", "2", "--image-size", "32x32,48x64")  # fmt: skip


def test_a_vision_language_run_trains_on_prompts_with_images(tmp_path):
    out_json = tmp_path / "grpo.json"
    out = run_benchmark(
        "grpo_vs_trl.py", "--which", "hybridflow", "--device", "cpu", *VL_ARGS,
        "--model-dir", str(tmp_path / "model"), "--json", str(out_json),
    )  # fmt: skip
    (result,) = json.loads(out_json.read_text())
    assert result["tokens_per_s"] * result["step_s"] == pytest.approx(2 * 2 * (16 + 5))
    assert "prompts: 1 image(s) a prompt (32x32,48x64 px), 4-12 image tokens (mean 8)" in out
    assert (tmp_path / "model" / "preprocessor_config.json").is_file()


def test_trls_processor_makes_the_ids_and_pixels_hybridflow_trains_on(tmp_path):
    """What TRL's GRPOTrainer does with a conversational prompt and its images (its
    prepare_multimodal_messages puts the images first), through the directory's processor:
    the same ids as hybridflow's prompts, the same pixels and grids, and its padded call's
    mm_token_type_ids on the image tokens of the left-padded prompts, as TRL pads them."""
    from benchmark_run import load_script

    bench = load_script("grpo_vs_trl.py")
    vl = bench.grpo_vl
    model_dir = bench.build_hf_model_dir("tiny-vl", str(tmp_path / "model"))
    texts = bench.random_prompts(2, 6, 100)
    made = vl.image_prompts(model_dir, texts, 1, ((32, 32), (48, 64)))
    processor = vl.trl_processor(model_dir)
    words = [" ".join(f"w{i}" for i in text) for text in texts]
    conversations = [[{"role": "user", "content": [{"type": "image", "image": pictures[0]},
                                                   {"type": "text", "text": text}]}]
                     for pictures, text in zip(made.pictures, words)]  # fmt: skip
    out = processor.apply_chat_template(conversation=conversations, add_generation_prompt=True,
                                        tokenize=True, return_dict=True)  # fmt: skip
    assert [list(ids) for ids in out["input_ids"]] == made.prompts
    grids, pixels = (torch.as_tensor(out[key]) for key in ("image_grid_thw", "pixel_values"))
    assert torch.equal(grids, torch.cat([e.image_grid_thw for e in made.images]))
    assert torch.equal(pixels.float(), torch.cat([e.pixel_values for e in made.images]))
    rendered = [processor.apply_chat_template(c, tokenize=False) for c in conversations]
    padded = processor(images=made.pictures, text=rendered, padding=True, return_tensors="pt")
    image_pad = made.images[0].image_grid_thw.new_tensor(124)  # tiny-vl's image-pad id
    assert padded["input_ids"][0, 0] != image_pad and padded["attention_mask"][0, 0] == 0
    assert torch.equal(padded["mm_token_type_ids"].bool(), padded["input_ids"] == image_pad)


def test_images_asked_of_a_text_model_are_refused_and_a_vision_model_gets_one():
    from benchmark_run import load_script

    bench = load_script("grpo_vs_trl.py")
    args = argparse.Namespace(prompts=2, gpus=1, prompt_len=4, images_per_prompt=1,
                              image_size=((32, 32),))  # fmt: skip
    with pytest.raises(ValueError, match="--images-per-prompt 1: tiny holds a text model"):
        bench.workload("tiny", args)
    args.images_per_prompt = None  # a text model: none; a vision-language one: one a prompt
    assert bench.workload("tiny", args)[1] is None
    texts, made = bench.workload("tiny-vl", args)
    assert made.summary()["images_per_prompt"] == 1 and made.prompts[0][-4:] == texts[0]


@pytest.mark.slow
def test_trl_runs_a_vision_language_grpo_step_on_the_same_tokens(tmp_path):
    pytest.importorskip("trl")
    out_json = tmp_path / "grpo.json"
    run_benchmark("grpo_vs_trl.py", "--which", "trl", *VL_ARGS, "--model-dir",
                  str(tmp_path / "model"), "--json", str(out_json))  # fmt: skip
    (result,) = json.loads(out_json.read_text())
    assert result["name"].startswith("TRL") and len(result["all_steps_s"]) == 2
    assert result["tokens_per_s"] * result["step_s"] == pytest.approx(2 * 2 * (16 + 5))
