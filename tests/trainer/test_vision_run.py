"""examples/vision.yaml end to end, shortened: the warm start SFTs tiny-vl on the shapes
pictures and caches it with its image processor, then GRPO runs natively on images (the
engine prefills them, the trainer's log-probs equal the engine's)."""

from pathlib import Path

from trainer_helpers import read_metrics, tiny_config

from hybridflow.trainer.lifecycle.run import train


def test_vision_example_warm_starts_and_trains_on_images(tmp_path, quiet):
    cfg = tiny_config(
        tmp_path,
        "model.path=sft:shapes",  # the example's (TINY shrinks it to the tiny preset)
        "data.max_response_length=8",
        "sft.builtin_size=64",
        "sft.batch_size=16",
        "sft.total_steps=4",
        "sft.eval_every=2",
        "sft.eval_size=8",
        "actor.ppo_mini_batch_size=2",  # two mini-batches: the old-log-prob pass runs
        "reward.custom_fn=null",  # the task's own exact-answer scorer
        example="vision",
    )
    train(cfg, log=quiet)
    cached = next(Path(cfg.trainer.cache_dir).glob("sft-shapes-*"))
    assert (cached / "preprocessor_config.json").is_file() and (cached / "COMPLETE").is_file()
    rows = read_metrics(cfg.trainer.run_dir)
    assert sorted(rows) == [0, 1, 2] and "val/shapes/mean@1" in rows[2]
    # fp32 on the CPU: the engine's log-probs with the images are the trainer's
    assert rows[2]["rollout_gap/abs_logprob_diff_max"] < 1e-4
