"""The vision encoder's attention on the CPU: the segments of each length in one batched SDPA
call equal SDPA segment by segment (outputs and gradients), and an encoder call over several
prompts' images gives each image the features of a call of its own."""

import torch
import torch.nn.functional as F

from hybridflow.models import build_model
from hybridflow.models.presets import preset_config
from hybridflow.models.vision.qwen2_5_vl import Segments, equal_length_groups, segment_attention


def _segment_by_segment(q, k, v, lengths):
    out = [F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in part)).transpose(0, 1)
           for part in zip(q.split(lengths), k.split(lengths), v.split(lengths))]  # fmt: skip
    return torch.cat(out)


def test_segments_of_equal_length_batched_equal_sdpa_segment_by_segment():
    generator = torch.Generator().manual_seed(0)
    lengths = [64, 17, 64, 100, 3, 17, 64]
    q, k, v = (torch.randn(sum(lengths), 4, 16, generator=generator).requires_grad_()
               for _ in range(3))  # fmt: skip
    got = segment_attention(q, k, v, Segments.of(lengths, q.device))
    expected = _segment_by_segment(q, k, v, lengths)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    reference = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for ours, ref in zip(grads, reference):
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_equal_length_groups_run_one_call_a_length():
    groups = equal_length_groups([64, 17, 64, 100, 3, 17, 64], torch.device("cpu"))
    assert groups.lengths == [3, 17, 64, 100]
    assert [tuple(i.shape) for i in groups.index] == [(1, 3), (2, 17), (3, 64), (1, 100)]
    assert groups.index[1][1, 0] == 64 + 17 + 64 + 100 + 3  # the second 17's first token


def test_one_call_over_several_images_gives_each_its_own_features():
    model = build_model(preset_config("tiny-vl"), seed=0).eval()
    spec = model.config.vision
    grids = [torch.tensor([[1, 4, 6]]), torch.tensor([[1, 8, 8], [1, 2, 8]])]
    generator = torch.Generator().manual_seed(0)
    pixels = [torch.randn(int(g.prod(-1).sum()), spec.patch_elements, generator=generator)
              for g in grids]  # fmt: skip
    with torch.no_grad():
        alone = torch.cat([model.visual(p, g) for p, g in zip(pixels, grids)])
        together = model.visual(torch.cat(pixels), torch.cat(grids))
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-6)


def test_to_device_moves_index_tensors_in_one_copy_keeping_their_shapes():
    from hybridflow.models.vision.grid import to_device

    a, b = torch.arange(6).view(2, 3), torch.tensor([7, 8], dtype=torch.int32)
    moved = to_device(torch.device("cpu"), a, b)
    assert [tuple(t.shape) for t in moved] == [(2, 3), (2,)]
    assert torch.equal(moved[0], a) and moved[1].tolist() == [7, 8]
