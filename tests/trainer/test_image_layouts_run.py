"""`hybridflow train` on prompts with images (the built-in shapes pictures, tiny-vl) in the
sharded layouts on two CPU processes logs the metrics of one process and samples the same
tokens, step after step (step 2 samples with the resharded weights): the rollout
tensor-parallel (each rank holds the vision encoder whole, the rows' images gathered with
them, the frozen encoder copied once and the language model resharded from the actor's FSDP2
shards after each update), and with it the actor in Ulysses SP = 2 (each rank encodes the
whole images and takes its slice's features and mRoPE rows)."""

from __future__ import annotations

import pytest
from rollout_layout_helpers import LAYOUT, ONE_PROCESS, VERL, assert_same, read_samples, train_run

IMAGES = ("model.path=tiny-vl", "data.train_files=[builtin:shapes]", "data.val_files=[]",
          "data.image_key=images", "data.max_prompt_length=40")  # fmt: skip
LAYOUTS = {"rollout-tp": (VERL + "rollout.tensor_model_parallel_size=2",),
           "actor-sp-and-rollout-tp": LAYOUT}  # fmt: skip


@pytest.mark.slow
def test_sharded_layouts_on_images_log_the_metrics_of_one_process(tmp_path):
    one = train_run(tmp_path / "one", *ONE_PROCESS, *IMAGES)
    assert one.keys() == {1, 2}
    for name, layout in LAYOUTS.items():
        got = train_run(tmp_path / name, *IMAGES, *layout)
        assert got.keys() == {1, 2}, name
        for step, want in one.items():
            assert_same(want, got[step], step)
            assert read_samples(tmp_path / "one", step) == read_samples(tmp_path / name, step)
