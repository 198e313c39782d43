"""Images in prompt rows: decoded from bytes, paths or {'bytes', 'path'} dicts, preprocessed
by the model directory's image processor without torchvision, expanded into image-pad
tokens with mRoPE rows; bad images refused naming the file, the row and the image."""

from __future__ import annotations

import io
import struct
import zlib

import pytest
import torch

from hybridflow.data.images import (
    IMAGE_PAD,
    MAX_IMAGE_BYTES,
    VISION_END,
    VISION_START,
    ImageProcessor,
    check_placeholders,
    image_prompt,
    row_images,
)
from hybridflow.data.schema import DataSchemaError

pytest.importorskip("PIL")
WHERE = "train.parquet: row 3"


def _png(width: int, height: int, colour=(200, 30, 30)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _with_header_size(png: bytes, width: int, height: int) -> bytes:
    """A PNG whose header claims another size (its IHDR chunk rewritten, CRC fixed)."""
    ihdr = bytearray(png[12:29])  # chunk type + 13 data bytes
    ihdr[4:12] = struct.pack(">II", width, height)
    return png[:12] + bytes(ihdr) + struct.pack(">I", zlib.crc32(bytes(ihdr))) + png[33:]


def test_bytes_paths_and_dicts_decode_to_rgb(tmp_path):
    (tmp_path / "a.png").write_bytes(_png(12, 8))
    row = {"images": [_png(8, 8), {"bytes": None, "path": "a.png"}, str(tmp_path / "a.png")]}
    images = row_images(row, "images", WHERE, base_dir=tmp_path)
    assert [image.size for image in images] == [(8, 8), (12, 8), (12, 8)]
    assert {image.mode for image in images} == {"RGB"}
    assert row_images({"prompt": "x"}, "images", WHERE) == []


@pytest.mark.parametrize(
    "entry, words",
    [
        (b"not an image", "key 'images[0]' cannot be decoded as an image (not a format PIL"),
        (_with_header_size(_png(4, 4), 0, 0), "cannot be decoded"),  # PIL refuses a 0x0 PNG
        (_with_header_size(_png(4, 4), 10_000, 10_000), "10000x10000 image, more than"),
        (_png(1, 250), "1x250 image: its long side is over 200 times its short side"),
        ({"path": "missing.png"}, "key 'images[0]' no image file"),
        (7, "holds a int"),
        ("x" * 5000, "names no image file: 'xxx"),  # the OS refuses so long a name
        ("a\0b.png", "no image file"),
        ({"bytes": "iVBORw0KGgo=", "path": None}, "holds {'bytes': <a string>}"),  # JSON text
    ],
    ids=[
        "undecodable",
        "zero-size",
        "100-megapixels",
        "too-thin",
        "missing-file",
        "not-an-image",
        "name-too-long",
        "nul-in-name",
        "text-as-bytes",
    ],  # fmt: skip
)
def test_a_bad_image_is_refused_naming_file_row_and_key(tmp_path, entry, words):
    with pytest.raises(DataSchemaError) as error:
        row_images({"images": [entry]}, "images", WHERE, base_dir=tmp_path)
    assert str(error.value).startswith(WHERE) and words in str(error.value)


def test_an_image_path_is_named_when_it_is_bad(tmp_path):
    (tmp_path / "broken.png").write_bytes(_png(4, 4)[:40])  # cut short
    with pytest.raises(DataSchemaError, match="broken.png"):
        row_images({"images": "broken.png"}, "images", WHERE, base_dir=tmp_path)


def test_an_image_over_the_byte_cap_is_refused_before_it_is_read(tmp_path, monkeypatch):
    from PIL import Image

    huge = tmp_path / "huge.png"  # a valid picture, then trailing bytes (sparse: no disk)
    with huge.open("wb") as file:
        file.write(_png(4, 4))
        file.truncate(MAX_IMAGE_BYTES + 1)
    monkeypatch.setattr(Image, "open", lambda *a, **k: pytest.fail("opened"))
    with pytest.raises(DataSchemaError) as error:
        row_images({"images": [{"path": "huge.png"}]}, "images", WHERE, base_dir=tmp_path)
    assert str(error.value).startswith(f"{WHERE}: key 'images[0]' names the image file {huge}")
    assert f"of {MAX_IMAGE_BYTES + 1:,} bytes, more than the {MAX_IMAGE_BYTES:,}" in str(
        error.value
    )
    import hybridflow.data.images as images

    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 10)  # embedded bytes: the same cap
    with pytest.raises(DataSchemaError, match=r"'images\[0\]' holds an image of \d+ bytes"):
        row_images({"images": [_png(4, 4)]}, "images", WHERE)


def test_a_zero_width_image_is_refused(tmp_path, monkeypatch):
    """PIL opens some formats with no pixels (a 0-wide header it accepts): refused by size."""
    from PIL import Image

    class Empty:
        size = (0, 5)

    monkeypatch.setattr(Image, "open", lambda source: Empty())
    with pytest.raises(DataSchemaError, match="0x5 image, which has no pixels"):
        row_images({"images": [_png(4, 4)]}, "images", WHERE)


def test_placeholders_must_match_the_images():
    messages = [{"role": "user", "content": "<image> and <image>: which is larger?"}]
    check_placeholders(messages, 2, WHERE, "images")
    with pytest.raises(DataSchemaError, match="2 <image> placeholders, key 'images' holds 1"):
        check_placeholders(messages, 1, WHERE, "images")


@pytest.fixture
def model_dir(tmp_path):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    processor = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                         min_pixels=8 * 8, max_pixels=32 * 32)  # fmt: skip
    processor.save_pretrained(tmp_path)
    return tmp_path


def _tokenizer():
    from hybridflow.models import load_tokenizer

    tokenizer = load_tokenizer("char")
    tokenizer.add_special_tokens({"additional_special_tokens": [VISION_START, IMAGE_PAD,
                                                                VISION_END]})  # fmt: skip
    return tokenizer


def test_a_prompt_with_two_images_gets_its_pad_tokens_pixels_and_rows(model_dir):
    processor = ImageProcessor.from_model_dir(model_dir)  # torchvision is not installed here
    images = row_images({"images": [_png(16, 16), _png(24, 16)]}, "images", WHERE)
    messages = [{"role": "user", "content": "<image>a<image>b"}]
    tokenizer = _tokenizer()
    prompt = image_prompt(messages, images, tokenizer, processor)
    assert prompt.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 6]]
    assert prompt.pixel_values.shape == (16 + 24, 3 * 2 * 4 * 4)
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert prompt.prompt_ids.count(pad) == 4 + 6  # one a merged 2x2 block of patches
    first = prompt.prompt_ids.index(pad)
    assert prompt.position_ids.shape == (3, len(prompt.prompt_ids))
    assert prompt.position_ids[:, first : first + 4].tolist() == [
        [first] * 4, [first, first, first + 1, first + 1], [first, first + 1] * 2]  # fmt: skip
    # the <|vision_end|> after the first image: its largest position plus one
    assert prompt.position_ids[:, first + 4].tolist() == [first + 2] * 3


def test_a_model_directory_without_an_image_processor_is_named(tmp_path):
    from hybridflow.errors import UserError

    with pytest.raises(UserError, match="no preprocessor_config.json"):
        ImageProcessor.from_model_dir(tmp_path)


def test_pixel_values_match_transformers_processor(model_dir):
    """The same numbers the model's own processor gives (our preprocessing adds nothing)."""
    from transformers import AutoImageProcessor

    images = row_images({"images": [_png(20, 12)]}, "images", WHERE)
    ours, grid = ImageProcessor.from_model_dir(model_dir)(images)
    theirs = AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")(
        images=images, return_tensors="pt"
    )
    assert torch.equal(ours, theirs["pixel_values"].float())
    assert torch.equal(grid, theirs["image_grid_thw"])


def _geo3k_row(images, content="<image>Find x."):
    return {"data_source": "hiyouga/geometry3k", "prompt": [{"role": "user", "content": content}],
            "images": images, "reward_model": {"style": "rule", "ground_truth": "3"},
            "ability": "math"}  # fmt: skip


def test_data_check_decodes_the_images_of_a_geo3k_shaped_parquet(tmp_path, capsys):
    from hybridflow.data.cli import main
    from hybridflow.data.schema import write_rows

    good = [{"bytes": _png(8, 8), "path": None}]
    path = write_rows([_geo3k_row(good), _geo3k_row(good * 2, "<image><image>Same?")],
                      tmp_path / "train.parquet")  # fmt: skip
    assert main(["check", str(path), "--image-key", "images"]) == 0
    assert "2 rows OK, 3 images decoded" in capsys.readouterr().out
    bad = write_rows([_geo3k_row(good), _geo3k_row([{"bytes": b"GIF89a?", "path": None}])],
                     tmp_path / "bad.parquet")  # fmt: skip
    assert main(["check", str(bad), "--image-key", "images"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: row 1: key 'images[0]' cannot be decoded" in err and "Traceback" not in err


def _edit_json(path, **changes):
    import json

    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"patch_size": 14}, "patch_size = 14, but config.json's vision_config.patch_size = 4"),
        ({"merge_size": 3}, "merge_size = 3, but config.json's vision_config.spatial_merge_size = 2"),
        ({"temporal_patch_size": 1}, "temporal_patch_size = 1, but config.json's vision_config."
         "temporal_patch_size = 2"),
        ({"size": {"shortest_edge": 64, "longest_edge": 0}}, "size shortest_edge = 64, "
         "longest_edge = 0 (min_pixels, max_pixels"),
    ],
    ids=["patch", "merge", "temporal", "max-pixels-0"],
)  # fmt: skip
def test_a_processor_that_does_not_fit_the_encoder_is_named(model_dir, changes, words):
    """Each reached the worker: a shape error in the encoder's first matmul, an image-token
    count that does not add up, or a division by zero while sizing an image."""
    from hybridflow.errors import UserError

    vision = {"patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2}
    (model_dir / "config.json").write_text(__import__("json").dumps({"vision_config": vision}))
    ImageProcessor.from_model_dir(model_dir)  # as written, it fits
    _edit_json(model_dir / "preprocessor_config.json", **changes)
    with pytest.raises(UserError) as error:
        ImageProcessor.from_model_dir(model_dir)
    assert str(error.value).startswith(f"{model_dir / 'preprocessor_config.json'}: {words}")


def test_a_processor_file_that_is_not_json_is_named_by_line(model_dir):
    from hybridflow.errors import UserError

    (model_dir / "preprocessor_config.json").write_text('{\n  "patch_size": 4,\n  oops\n}')
    with pytest.raises(UserError, match=r"preprocessor_config.json is not valid JSON \(line 3"):
        ImageProcessor.from_model_dir(model_dir)
