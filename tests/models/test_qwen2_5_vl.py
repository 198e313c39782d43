"""Qwen2.5-VL in our decoder: a transformers checkpoint gives equal logits on a batch with
images (padded and packed), ours loads back into transformers with equal logits, the
published (transformers 4) config and weight names load too, mRoPE's rows match
transformers' and refuse ids that do not fit the grids."""

import json

import pytest
import torch
from qwen2_5_vl_helpers import IMAGE, MERGE, image_batch, transformers_model
from safetensors.torch import load_file, save_file

from hybridflow.models.checkpoint_io.hf_checkpoint import load_model_from_dir
from hybridflow.models.checkpoint_io.loadability import config_problems
from hybridflow.models.mrope import batch_mrope_positions, mrope_positions

pytest.importorskip("transformers")
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    reference = transformers_model()
    reference.save_pretrained(path)
    ids, mask, pixels, grid, types = image_batch()
    with torch.no_grad():
        logits = reference(input_ids=ids, attention_mask=mask, pixel_values=pixels,
                           image_grid_thw=grid, mm_token_type_ids=types).logits  # fmt: skip
    return path, logits


def _our_logits(model):
    ids, mask, pixels, grid, _ = image_batch()
    with torch.no_grad():
        return model(ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid)


def test_transformers_checkpoint_gives_equal_logits_with_images(reference_dir):
    path, expected = reference_dir
    ours = load_model_from_dir(str(path)).eval()
    assert ours.visual is not None
    assert ours.config.num_parameters() == sum(p.numel() for p in ours.parameters())
    real = image_batch()[1].bool()
    assert (_our_logits(ours)[real] - expected[real]).abs().max() <= TOLERANCE


def test_packed_forward_with_images_equals_transformers(reference_dir):
    """The rows concatenated without padding, mRoPE's rows [3, N] computed per sequence."""
    path, expected = reference_dir
    ours = load_model_from_dir(str(path)).eval()
    ids, mask, pixels, grid, _ = image_batch()
    real = mask.bool()
    sequences = [row[keep] for row, keep in zip(ids, real)]
    grids_of = [grid[:1], grid[1:], grid[:0]]  # row 0 one image, row 1 two, row 2 none
    positions = torch.cat([mrope_positions(seq, g, IMAGE, MERGE)
                           for seq, g in zip(sequences, grids_of)], dim=1)  # fmt: skip
    lengths = torch.tensor([len(seq) for seq in sequences])
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    ours.attention_backend = "sdpa_loop"
    with torch.no_grad():
        hidden = ours.forward_packed(torch.cat(sequences), positions, cu_seqlens,
                                     int(lengths.max()), pixel_values=pixels,
                                     image_grid_thw=grid)  # fmt: skip
    assert (ours.lm_head(hidden) - expected[real]).abs().max() <= TOLERANCE


def test_our_checkpoint_loads_in_transformers_with_equal_logits(reference_dir, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    path, expected = reference_dir
    load_model_from_dir(str(path)).save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]
    back = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path).eval()
    ids, mask, pixels, grid, types = image_batch()
    with torch.no_grad():
        logits = back(input_ids=ids, attention_mask=mask, pixel_values=pixels,
                      image_grid_thw=grid, mm_token_type_ids=types).logits  # fmt: skip
    real = mask.bool()
    assert (logits[real] - expected[real]).abs().max() <= TOLERANCE


def test_published_flat_config_and_transformers_5_names_load(reference_dir, tmp_path):
    """Qwen's own config.json keeps the language model's keys at the top level with
    rope_scaling {"type": "mrope"}; some writers name weights model.language_model.* and
    model.visual.*. Both read as the same model."""
    path, expected = reference_dir
    config = json.loads((path / "config.json").read_text())
    text = config.pop("text_config")
    section = text.pop("rope_parameters")["mrope_section"]
    flat = {**text, **config, "model_type": "qwen2_5_vl", "rope_theta": 10000.0,
            "rope_scaling": {"type": "mrope", "mrope_section": section}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(flat))
    renamed = {}
    for name, tensor in load_file(path / "model.safetensors").items():
        if name.startswith("visual."):
            name = "model." + name
        elif name.startswith("model."):
            name = "model.language_model." + name.removeprefix("model.")
        renamed[name] = tensor
    save_file(renamed, tmp_path / "model.safetensors")
    assert config_problems(tmp_path) == []
    ours = load_model_from_dir(str(tmp_path)).eval()
    real = image_batch()[1].bool()
    assert (_our_logits(ours)[real] - expected[real]).abs().max() <= TOLERANCE


def test_mrope_rows_equal_transformers_and_text_continues_after_the_image():
    ids, mask, _, grid, types = image_batch()
    reference = transformers_model()
    expected, _ = reference.model.get_rope_index(ids, types, image_grid_thw=grid,
                                                 attention_mask=mask)  # fmt: skip
    rows = batch_mrope_positions(ids, mask, grid, IMAGE, MERGE)
    real = mask.bool()
    assert torch.equal(rows[:, real], expected[:, real])
    # row 0: 2 text tokens, <vision_start> at 2, a 2x2 token image from 3, then 3 + 2
    row = mrope_positions(ids[0][real[0]], grid[:1], IMAGE, MERGE)
    assert row[:, 3:7].tolist() == [[3, 3, 3, 3], [3, 3, 4, 4], [3, 4, 3, 4]]
    assert row[:, 7].tolist() == [5, 5, 5]  # <vision_end>: the image's largest + 1


def test_mrope_refuses_ids_that_do_not_fit_the_grids():
    ids = torch.tensor([5, IMAGE, IMAGE, IMAGE, 6])  # 3 image tokens, a 4-token grid
    with pytest.raises(ValueError, match="needs 4 consecutive image tokens"):
        mrope_positions(ids, torch.tensor([[1, 4, 4]]), IMAGE, MERGE)
    with pytest.raises(ValueError, match="beyond the 0 images"):
        mrope_positions(ids, None, IMAGE, MERGE)


def test_image_features_must_match_the_image_tokens(reference_dir):
    path, _ = reference_dir
    ours = load_model_from_dir(str(path)).eval()
    ids, mask, pixels, grid, _ = image_batch()
    ids[0, ids[0] == IMAGE] = 5  # row 0's image tokens gone, its pixels still given
    with pytest.raises(ValueError, match="image tokens, the images give"):
        ours.embed(ids, pixels, grid)


def test_given_positions_must_be_mropes_three_rows(reference_dir):
    path, expected = reference_dir
    ours = load_model_from_dir(str(path)).eval()
    ids, mask, pixels, grid, _ = image_batch()
    rows = batch_mrope_positions(ids, mask, grid, IMAGE, MERGE)
    with torch.no_grad():
        given = ours(ids, mask, pixel_values=pixels, image_grid_thw=grid, position_ids=rows)
    real = mask.bool()
    assert (given[real] - expected[real]).abs().max() <= TOLERANCE
    with pytest.raises(ValueError, match=r"must be mRoPE's rows \[3, B, T\]"):
        ours(ids, mask, position_ids=rows[0])
