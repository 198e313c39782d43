"""The engine on prompts with images on CUDA: a vision-language model decodes on the fused
layers (the triton backend, chosen by "auto"), each slot turned at its mRoPE shift read from
a fixed buffer, so greedy tokens (fp32) equal the model's own decoding with its images and
log-probs the torch backend's, whether the decode steps replay captured graphs or run
eagerly."""

import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]  # fmt: skip


@pytest.mark.parametrize("graphs", [True, False])
def test_greedy_tokens_with_images_on_cuda_equal_the_models_own(graphs):
    from test_image_engine import GRIDS, PROMPTS, _greedy_reference, _images, _pixels

    from hybridflow.models import build_model
    from hybridflow.models.presets import preset_config

    generator = torch.Generator().manual_seed(1)
    model = build_model(preset_config("tiny-vl"), seed=1).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if not name.endswith("bias"):
            p.normal_(0, 0.1 if name.startswith("visual.") else 0.3, generator=generator)
    # the image token's output row zeroed (tied: its input row, replaced by the features):
    # std-0.3 weights would otherwise emit it, and the model's own forward (the reference)
    # refuses image tokens past its images' grids
    model.model.embed_tokens.weight[model.config.vision.image_token_id].zero_()  # tied head
    model = model.cuda()
    pixels = [None if p is None else p.cuda() for p in _pixels()]
    engine = Engine(model, max_batch_size=4, max_seq_len=64,
                    options=EngineOptions(cuda_graphs=graphs))  # fmt: skip
    assert engine.decode_backend == "triton" and engine.cuda_graphs == graphs
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    got = engine.generate(PROMPTS, params, images=_images(pixels))
    assert not graphs or engine.runner.captures > 0
    for prompt, p, grid, completion in zip(PROMPTS, pixels, GRIDS, got):
        grid = None if grid is None else grid.cuda()
        assert completion.token_ids == _greedy_reference(model, prompt, p, grid, 12)
    torch_engine = Engine(model, max_batch_size=4, max_seq_len=64,
                          options=EngineOptions(decode_backend="torch", cuda_graphs=False))  # fmt: skip
    expected = torch_engine.generate(PROMPTS, params, images=_images(pixels))
    for a, b in zip(got, expected):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-4)
