"""LoRA adapters decoded unmerged on the fused path (the split layer stack with AdapterMatmul
for prefill and decode, CUDA graphs on a GPU): each sample what the eager engine over the
merged weights samples. fp32 tiny model. Runs on CUDA (marked gpu), or on CPU under
TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device

DEVICE = triton_test_device()
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.engine import Engine, EngineOptions, SamplingParams  # noqa: E402
from hybridflow.learners.lora import apply_lora, lora_scalings, merge_lora_stream  # noqa: E402
from hybridflow.models import build_model  # noqa: E402
from hybridflow.models.presets import preset_config  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_fused_engine_over_adapters_samples_as_the_eager_engine_over_merged_weights():
    model = build_model(preset_config("tiny"), seed=1, device=DEVICE).eval()
    apply_lora(model, rank=4, alpha=8, target_modules=TARGETS)
    generator = torch.Generator(DEVICE).manual_seed(2)
    for name, p in model.named_parameters():
        p.data.normal_(0, 0.3 if "lora_B" not in name else 0.2, generator=generator)
    model.requires_grad_(False)
    merged = build_model(preset_config("tiny"), seed=0, device=DEVICE).eval()
    merged.load_state_dict(dict(merge_lora_stream(model.state_dict().items(),
                                                  lora_scalings(model))))  # fmt: skip
    merged.requires_grad_(False)
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=6, seed=3, ignore_eos=True)
    prompts = [[5, 17, 9, 33, 2, 71, 8], [40, 41]]
    eager = Engine(merged, 8, 32, options=EngineOptions(decode_backend="torch",
                                                         cuda_graphs=False))  # fmt: skip
    fused = Engine(model, 8, 32, options=EngineOptions(decode_backend="triton"))
    assert fused.adapted and fused.decode_backend == "triton" and fused.fuse_projections == "none"
    want, got = eager.generate(prompts, params), fused.generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   atol=2e-3, rtol=0)  # fmt: skip
