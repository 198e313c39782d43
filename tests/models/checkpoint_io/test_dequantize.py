"""The dequantisers give what transformers' own give, bit for bit in fp32: MXFP4 blocks
(GPT-OSS's experts, its nibble order and e8m0 scales) and block-scaled FP8 (DeepSeek-V3's
weight_scale_inv), tails of partial blocks included."""

import pytest
import torch

from hybridflow.models.checkpoint_io.dequantize import (
    fp8_blocks_to_float,
    mxfp4_experts_to_float,
    mxfp4_to_float,
)


def _bits(tensor):
    return tensor.view(torch.int32) if tensor.dtype == torch.float32 else tensor.view(torch.int16)


def _random_mxfp4(experts, rows, groups, seed=0):
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.uint8,
                           generator=generator)  # fmt: skip
    scales = torch.randint(0, 255, (experts, rows, groups), dtype=torch.uint8, generator=generator)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 10, 2), (1, 7, 5)])
def test_mxfp4_experts_equal_transformers_bit_for_bit(shape, dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4(*shape)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    ours = mxfp4_experts_to_float(blocks, scales, dtype)
    assert ours.shape == expected.shape == (shape[0], shape[2] * 32, shape[1])
    assert torch.equal(_bits(ours), _bits(expected))


def test_mxfp4_reads_the_low_nibble_first_and_the_scale_per_32_values():
    blocks = torch.zeros(1, 2, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x9 << 4 | 0x7  # low nibble 7 (+6.0) first, then 9 (-0.5)
    blocks[0, 1, 0] = 0x2  # 1.0 in the second block of 32
    scales = torch.tensor([[127 + 1, 127 - 2]], dtype=torch.uint8)  # x2, then x1/4
    row = mxfp4_to_float(blocks, scales, torch.float32)[0]
    assert row.shape == (64,)
    assert row[:2].tolist() == [12.0, -1.0] and row[32].item() == 0.25
    assert row.abs().sum().item() == 12.0 + 1.0 + 0.25


def test_mxfp4_chunks_give_the_whole_tensor(monkeypatch):
    from hybridflow.models.checkpoint_io import dequantize

    blocks, scales = _random_mxfp4(2, 9, 3)
    whole = mxfp4_to_float(blocks, scales, torch.float32)
    monkeypatch.setattr(dequantize, "CHUNK_ELEMENTS", 64)  # two rows of 32 at a time
    assert torch.equal(_bits(mxfp4_to_float(blocks, scales, torch.float32)), _bits(whole))


def _random_fp8(shape, block, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(shape, generator=generator) * 100).to(torch.float8_e4m3fn)
    grid = [-(-shape[-2] // block[0]), -(-shape[-1] // block[1])]
    scale_inv = torch.rand([*shape[:-2], *grid], generator=generator) * 1e-2 + 1e-4
    return weight, scale_inv


@pytest.mark.parametrize(
    "shape, block",
    [((256, 384), (128, 128)), ((300, 200), (128, 128)), ((129, 257), (128, 128)),
     ((4, 70, 45), (16, 32)), ((5, 3), (128, 128))],
)  # fmt: skip
def test_fp8_blocks_equal_transformers_bit_for_bit_with_partial_tails(shape, block):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    weight, scale_inv = _random_fp8(shape, block)
    expected = _dequantize_fp8_weight(weight, scale_inv, list(block), torch.float32)
    ours = fp8_blocks_to_float(weight, scale_inv, block, torch.float32)
    assert ours.shape == weight.shape
    assert torch.equal(_bits(ours), _bits(expected))
    rounded = fp8_blocks_to_float(weight, scale_inv, block, torch.bfloat16)
    assert torch.equal(_bits(rounded), _bits(expected.to(torch.bfloat16)))  # one rounding


@pytest.mark.parametrize("chunk_elements", [1, 2 * 16 * 45])  # one, then two rows of blocks
def test_fp8_chunks_of_block_rows_give_the_whole_tensor(monkeypatch, chunk_elements):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    from hybridflow.models.checkpoint_io import dequantize

    monkeypatch.setattr(dequantize, "CHUNK_ELEMENTS", chunk_elements)
    weight, scale_inv = _random_fp8((3, 70, 45), (16, 32), seed=2)  # 5 rows of blocks
    expected = _dequantize_fp8_weight(weight, scale_inv, [16, 32], torch.float32)
    ours = fp8_blocks_to_float(weight, scale_inv, (16, 32), torch.float32)
    assert torch.equal(_bits(ours), _bits(expected))


def test_fp8_blocks_equal_transformers_load_dequantiser_where_blocks_divide():
    """The dequantiser transformers runs on load (scales as a grid, blocks derived)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    weight, scale_inv = _random_fp8((256, 384), (128, 128), seed=1)
    expected = Fp8Dequantize(None)._dequantize_one(weight, scale_inv, torch.float32)
    ours = fp8_blocks_to_float(weight, scale_inv, (128, 128), torch.float32)
    assert torch.equal(_bits(ours), _bits(expected))


def test_fp8_e8m0_scales_are_powers_of_two():
    weight = torch.ones(2, 3).to(torch.float8_e4m3fn)
    scale_inv = torch.tensor([[127 - 3]], dtype=torch.uint8)
    assert fp8_blocks_to_float(weight, scale_inv, (128, 128), torch.float32).eq(0.125).all()


def test_fp8_scales_of_another_grid_are_named():
    weight, _ = _random_fp8((300, 200), (128, 128))
    with pytest.raises(ValueError, match=r"needs scale_inv \[3, 2\], not \[2, 2\]"):
        fp8_blocks_to_float(weight, torch.ones(2, 2), (128, 128))


def test_mxfp4_blocks_of_another_dtype_or_shape_are_named():
    blocks, scales = _random_mxfp4(1, 4, 2)
    with pytest.raises(ValueError, match="bytes, not torch.float32"):
        mxfp4_to_float(blocks[0].float(), scales[0])
    with pytest.raises(ValueError, match=r"scales \[4, 1\] differ"):
        mxfp4_to_float(blocks[0], scales[0, :, :1])
