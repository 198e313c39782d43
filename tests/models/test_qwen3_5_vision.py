"""Qwen3.5 with its vision encoder in our decoder: a transformers Qwen3_5ForConditional-
Generation (dense and MoE) gives equal logits on a batch with images (padded and packed), ours
loads back into transformers with equal logits, and the interleaved mRoPE turns each pair by
the row transformers' does."""

import json

import pytest
import torch
from qwen2_5_vl_helpers import END, IMAGE, MERGE, PATCH, START, TEMPORAL, VIDEO, VOCAB, image_batch

from hybridflow.models.checkpoint_io.hf_checkpoint import load_model_from_dir
from hybridflow.models.mrope import mrope_positions

pytest.importorskip("transformers")
TOLERANCE = 1e-4
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=512,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
            # 32-wide heads, a quarter turned: 4 pairs, sections of 2, 1 and 1
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                             "mrope_interleaved": True})  # fmt: skip
# a 6 x 6 learned table resampled to the 4x4, 6x8 and 2x2 patch grids of image_batch
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
              patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL,
              num_position_embeddings=36)  # fmt: skip


def transformers_model(moe: bool):
    import transformers

    torch.manual_seed(0)
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
               vision_end_token_id=END, tie_word_embeddings=False)  # fmt: skip
    if moe:
        text = {**TEXT, "num_experts": 4, "num_experts_per_tok": 2,
                "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24}  # fmt: skip
        config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=VISION, **ids)
        model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    else:
        config = transformers.Qwen3_5Config(text_config=TEXT, vision_config=VISION, **ids)
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every weight random (norms, biases, the table): a misplaced one shows
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            scale = 0.3 if name.endswith(("norm.weight", "A_log", "dt_bias")) else 0.15
            param.copy_(noise * scale + (param if name.endswith("A_log") else 0))
    return model.float().eval()


def transformers_logits(model):
    ids, mask, pixels, grid, types = image_batch()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, pixel_values=pixels,
                     image_grid_thw=grid, mm_token_type_ids=types).logits  # fmt: skip


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def reference_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_vl")
    reference = transformers_model(request.param)
    reference.save_pretrained(path)
    return path, transformers_logits(reference)


def _our_logits(model):
    ids, mask, pixels, grid, _ = image_batch()
    with torch.no_grad():
        return model(ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid)


def test_transformers_checkpoint_gives_equal_logits_with_images(reference_dir, capsys):
    path, expected = reference_dir
    ours = load_model_from_dir(str(path)).eval()
    assert ours.visual is not None and ours.config.vision.kind == "qwen3_5"
    assert "not used" not in capsys.readouterr().err  # the encoder runs: no text-only note
    assert ours.config.num_parameters() == sum(p.numel() for p in ours.parameters())
    real = image_batch()[1].bool()
    assert (_our_logits(ours)[real] - expected[real]).abs().max() <= TOLERANCE


def test_packed_forward_with_images_equals_transformers(reference_dir):
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
    import transformers

    path, expected = reference_dir
    load_model_from_dir(str(path)).save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    name = config["architectures"][0]
    assert name in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
    rope = config["text_config"]["rope_parameters"]
    assert rope["mrope_section"] == [2, 1, 1] and rope["mrope_interleaved"] is True
    back = getattr(transformers, name).from_pretrained(tmp_path).float().eval()
    real = image_batch()[1].bool()
    assert (transformers_logits(back)[real] - expected[real]).abs().max() <= TOLERANCE


def test_interleaved_rows_turn_the_pairs_transformers_does():
    """Pairs 1, 4, 7 ... (height) and 2, 5, 8 ... (width) while their sections last, the
    rest by the temporal row: with rows (0, 100, 10000) each pair's angle names its row."""
    from hybridflow.models.mrope import _interleaved

    rows = torch.tensor([0.0, 100.0, 10000.0]).view(3, 1, 1).expand(3, 1, 8)
    freqs = _interleaved(rows.clone(), (4, 2, 2))
    assert freqs[0].tolist() == [0.0, 100.0, 10000.0, 0.0, 100.0, 10000.0, 0.0, 0.0]
