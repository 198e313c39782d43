"""Prompts with images through the data path into a Batch: each row's images checked as it
is read, its image tokens counted in its length, the pixels made once when its batch is;
the Batch's images and mRoPE rows give the trainer's log-prob pass the model's own forward."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from hybridflow.data.dataset import PromptDataset, make_prompt_batch
from hybridflow.data.image_batch import (
    IMAGE_GRID_THW,
    MROPE_POSITIONS,
    PIXEL_VALUES,
    extend_positions,
)
from hybridflow.data.images import IMAGE_PAD, VISION_END, VISION_START, ImageProcessor
from hybridflow.data.schema import DataSchemaError, write_rows

pytest.importorskip("PIL")


def _png(width: int, height: int, colour=(20, 120, 220)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _row(images, content):
    return {"data_source": "geo", "prompt": [{"role": "user", "content": content}],
            "images": images, "reward_model": {"ground_truth": "1"}}  # fmt: skip


def _tokenizer():
    from hybridflow.models import load_tokenizer

    tokenizer = load_tokenizer("char")
    tokenizer.add_special_tokens({"additional_special_tokens": [VISION_START, IMAGE_PAD,
                                                                VISION_END]})  # fmt: skip
    return tokenizer


@pytest.fixture
def setup(tmp_path):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    # tiny-vl's encoder: 8-pixel patches merged 2x2
    Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2,
                             min_pixels=16 * 16, max_pixels=48 * 48).save_pretrained(tmp_path)  # fmt: skip
    (tmp_path / "b.png").write_bytes(_png(48, 32))
    rows = [_row([{"bytes": _png(32, 32), "path": None}], "<image>A?"),
            _row(None, "text only"),
            _row([{"bytes": None, "path": "b.png"}, {"bytes": _png(16, 16), "path": None}],
                 "<image>and<image>B?")]  # fmt: skip
    path = write_rows(rows, tmp_path / "train.parquet")
    return path, ImageProcessor.from_model_dir(tmp_path), _tokenizer()


def test_a_prompt_batch_carries_each_rows_images_and_position_rows(setup):
    path, processor, tokenizer = setup
    dataset = PromptDataset.from_files(path, tokenizer, 128, image_key="images",
                                       images=processor)  # fmt: skip
    grids = [None if item.image_grid_thw is None else item.image_grid_thw.tolist()
             for item in dataset.items]  # fmt: skip
    assert grids == [[[1, 4, 4]], None, [[1, 4, 6], [1, 2, 2]]]
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert [item.prompt_ids.count(pad) for item in dataset.items] == [4, 0, 6 + 1]
    batch = make_prompt_batch(dataset.items, 0, images=processor)
    assert [tuple(p.shape) for p in batch[PIXEL_VALUES]] == [(16, 384), (0, 384), (28, 384)]
    assert [g.tolist() for g in batch[IMAGE_GRID_THW]] == [[[1, 4, 4]], [], [[1, 4, 6], [1, 2, 2]]]
    positions, mask = batch[MROPE_POSITIONS], batch["attention_mask"].bool()
    for row, item in enumerate(dataset.items):
        assert torch.equal(positions[row][:, mask[row]], item.mrope_positions
                           if item.mrope_positions is not None
                           else torch.arange(len(item.prompt_ids)).expand(3, -1))  # fmt: skip
    repeated = batch.repeat(2)  # n samples of a prompt share its pixels
    assert repeated[PIXEL_VALUES][1] is repeated[PIXEL_VALUES][0]
    extended = extend_positions(positions, torch.ones(3, 2))
    last = positions.amax(dim=(1, 2))
    assert extended[:, :, -2:].tolist() == [[[v + 1, v + 2]] * 3 for v in last.tolist()]


def test_images_count_towards_the_prompt_length_and_are_not_truncated(setup):
    path, processor, tokenizer = setup
    filtered = PromptDataset.from_files(path, tokenizer, 16, image_key="images",
                                        images=processor)  # fmt: skip
    # the two-image row: 21 tokens with its 7 image-pad tokens; the text row: 14
    assert filtered.num_filtered == 1 and len(filtered) == 2
    with pytest.raises(DataSchemaError, match="row 2: .* a prompt with images is not truncated"):
        PromptDataset.from_files(path, tokenizer, 16, "truncate", image_key="images",
                                 images=processor)  # fmt: skip


def test_rows_with_images_need_the_models_image_processor_and_tokens(setup):
    path, processor, tokenizer = setup
    with pytest.raises(DataSchemaError, match="row 0: the row has 1 images, and the model has no"):
        PromptDataset.from_files(path, tokenizer, 128, image_key="images")
    from hybridflow.models import load_tokenizer

    with pytest.raises(DataSchemaError, match=f"row 0: the tokenizer has no {IMAGE_PAD}"):
        PromptDataset.from_files(path, load_tokenizer("char"), 128, image_key="images",
                                 images=processor)  # fmt: skip


def test_the_batch_gives_the_trainer_the_models_log_probs(setup):
    """Data path -> Batch -> the actor's log-prob pass, against the model's own forward."""
    from hybridflow.config import ActorConfig
    from hybridflow.learners import ActorLearner
    from hybridflow.models import build_model
    from hybridflow.models.presets import PRESETS
    from hybridflow.protocol import Batch

    path, processor, tokenizer = setup
    ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(token) for name, token in
           (("image", IMAGE_PAD), ("vision_start", VISION_START), ("vision_end", VISION_END))}  # fmt: skip
    config = PRESETS["tiny-vl"]
    model = build_model(config.replace(vision=dataclasses.replace(config.vision, **ids)))
    dataset = PromptDataset.from_files(path, tokenizer, 128, image_key="images",
                                       images=processor)  # fmt: skip
    prompts = make_prompt_batch(dataset.items, 0, images=processor)
    responses = torch.tensor([[30, 31], [32, 0], [33, 34]])
    response_mask = (responses > 0).float()
    tensors = {**prompts.tensors, "responses": responses, "response_mask": response_mask,
               "attention_mask": torch.cat([prompts["attention_mask"], response_mask.long()], 1),
               MROPE_POSITIONS: extend_positions(prompts[MROPE_POSITIONS], response_mask)}  # fmt: skip
    batch = Batch(tensors, prompts.arrays)
    actor = ActorLearner(model, ActorConfig(ppo_mini_batch_size=3, micro_batch_size_per_gpu=3),
                         total_steps=1, device="cpu")  # fmt: skip
    got = actor.compute_logprobs(batch)["old_logprobs"]
    with torch.no_grad():
        for row, item in enumerate(dataset.items):
            response = responses[row][response_mask[row].bool()].tolist()
            logits = model(torch.tensor([item.prompt_ids + response]),
                           pixel_values=batch[PIXEL_VALUES][row] if item.record.images else None,
                           image_grid_thw=item.image_grid_thw)[0]  # fmt: skip
            logprobs = logits.log_softmax(-1)[len(item.prompt_ids) - 1 : -1]
            expected = logprobs.gather(-1, torch.tensor(response)[:, None])[:, 0]
            assert (got[row, : len(response)] - expected).abs().max() <= 1e-5
