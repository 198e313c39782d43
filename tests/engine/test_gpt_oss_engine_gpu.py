"""GPT-OSS's decode steps captured as CUDA graphs (GPU): the tiny model in bf16 samples what
the same engine samples eagerly, for the sink kernel's decode and the torch one, over a slot
cache and a paged one, past the sliding layer's window (its ring wrapping inside the graphs),
with a prompt's samples sharing its blocks and rows ending at different steps."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from tests.engine.gpt_oss_helpers import gpt_oss_model

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

PROMPTS = [[5, 17, 9, 33, 2, 71] * 3, [40, 41], [12], [100, 3, 8, 19, 23, 60, 61]]


@pytest.fixture(scope="module")
def gpt_oss():
    return gpt_oss_model().to("cuda", torch.bfloat16)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("block", [None, 16])
def test_cuda_graph_decode_samples_as_eager(gpt_oss, backend, block):
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=24, seed=4, ignore_eos=True)
    budgets = [24, 5, 17, 9, 24, 3, 12, 20]
    got = {}
    for graphs in (False, True):
        options = EngineOptions(decode_backend=backend, cuda_graphs=graphs, kv_block_size=block)
        engine = Engine(gpt_oss, max_batch_size=8, max_seq_len=64, options=options)
        assert engine.native and engine.cuda_graphs == graphs
        got[graphs] = engine.generate(PROMPTS, params, max_new_tokens=budgets)
    assert [c.token_ids for c in got[True]] == [c.token_ids for c in got[False]]
    for a, b in zip(got[True], got[False]):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-3)
        assert (a.routed_experts == b.routed_experts).all()
