"""Verify passes on the GPU (triton backend, decode steps replayed as CUDA graphs, a paged
cache): in fp32 the tokens and log-probs equal the engine's without speculation, greedy and
sampled, while drafts are accepted; in bf16 a second epoch's drafts are mostly accepted."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

PROMPTS = [[5, 17, 9, 33, 2, 71] * 3, [40, 41, 42, 40, 41], list(range(60, 80)) * 2, [12, 13]]
SPECULATIVE = dict(speculative="ngram", speculative_max_rows=64, speculative_min_ngram=1)


def _model(dtype):
    generator = torch.Generator().manual_seed(1)
    model = build_model(preset_config("tiny"), seed=1).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if not name.endswith("bias"):
            p.normal_(0, 0.3, generator=generator)
    return model.to(device="cuda", dtype=dtype)


def _engine(model, speculative: bool) -> Engine:
    options = EngineOptions(decode_backend="triton", kv_block_size=16,
                            **(SPECULATIVE if speculative else {}))  # fmt: skip
    return Engine(model, 8, 128, options=options)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(n=2, temperature=0, max_new_tokens=40, ignore_eos=True),
     SamplingParams(n=2, temperature=0.8, top_p=0.9, max_new_tokens=40, seed=2,
                    ignore_eos=True)],
    ids=["greedy", "sampled"],
)  # fmt: skip
def test_fp32_tokens_equal_the_engine_without_speculation(params):
    model = _model(torch.float32)
    expected = _engine(model, False).generate(PROMPTS, params)
    engine = _engine(model, True)
    for _ in range(2):  # the second call drafts from the first's responses
        got = engine.generate(PROMPTS, params)
        assert [c.token_ids for c in got] == [c.token_ids for c in expected]
        for a, b in zip(got, expected):
            torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-4)
    assert engine.speculation.stats.accepted > 0


def test_bf16_second_epoch_accepts_its_drafts():
    model = _model(torch.bfloat16)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=40, ignore_eos=True)
    engine = _engine(model, True)
    engine.generate(PROMPTS, params)
    stats = engine.speculation.stats
    before = (stats.rows, stats.emitted)
    engine.generate(PROMPTS, params)
    assert (stats.emitted - before[1]) / (stats.rows - before[0]) > 2.5
