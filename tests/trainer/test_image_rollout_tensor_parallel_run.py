"""`hybridflow train` on prompts with images (the built-in shapes pictures, tiny-vl) with the
rollout tensor-parallel over two CPU processes (each rank holds the vision encoder whole,
the rows' images gathered with them, the frozen encoder copied once and the language model
resharded from the actor's FSDP2 shards after each update) logs the metrics of one process
and samples the same tokens, step after step (step 2 samples with the resharded weights)."""

from __future__ import annotations

import pytest
from rollout_layout_helpers import ONE_PROCESS, VERL, assert_same, read_samples, train_run

IMAGES = ("model.path=tiny-vl", "data.train_files=[builtin:shapes]", "data.val_files=[]",
          "data.image_key=images", "data.max_prompt_length=40")  # fmt: skip


@pytest.mark.slow
def test_a_tensor_parallel_rollout_on_images_logs_the_metrics_of_one_process(tmp_path):
    one = train_run(tmp_path / "one", *ONE_PROCESS, *IMAGES)
    layout = train_run(tmp_path / "tp", *IMAGES, VERL + "rollout.tensor_model_parallel_size=2")
    assert one.keys() == layout.keys() == {1, 2}
    for step, want in one.items():
        assert_same(want, layout[step], step)
        assert read_samples(tmp_path / "one", step) == read_samples(tmp_path / "tp", step)
