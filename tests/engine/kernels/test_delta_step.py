"""The fused Gated DeltaNet decode step (kernels/delta_step.py) against the torch op
(GatedDeltaNet.decode on the gathered states), and a hybrid engine stepping with it against
the torch step. Runs on CUDA (marked gpu), or on CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from triton_device import triton_test_device  # noqa: E402

DEVICE = triton_test_device()  # skips this module without CUDA or TRITON_INTERPRET=1
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from hybridflow.engine import Engine, EngineOptions, SamplingParams  # noqa: E402
from hybridflow.engine.layers.mixing import recurrent_decode  # noqa: E402
from hybridflow.models import build_model  # noqa: E402
from hybridflow.models.mixers.gated_deltanet import GatedDeltaNet, RecurrentState  # noqa: E402
from hybridflow.models.presets import preset_config  # noqa: E402


class _Layer(torch.nn.Module):
    mixer_name = "linear_attn"

    def __init__(self, mixer):
        super().__init__()
        self.linear_attn = mixer


class _States:
    def __init__(self, conv, ssm):
        self.conv, self.ssm = conv, ssm

    def layer(self, index):
        return self.conv, self.ssm


def _mixer(config, dtype):
    torch.manual_seed(0)
    mixer = GatedDeltaNet(config).to(DEVICE, dtype)
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0, 0.3)
    return mixer


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_fused_step_equals_the_torch_op_on_slots_in_place(dtype, tolerance):
    """Rows read and write their slots' states in place, a frozen row writes the scratch
    slot (its own state untouched); 3 key heads of 2 value heads each, Dk != Dv."""
    config = preset_config("tiny-hybrid")
    config.linear_num_key_heads, config.linear_num_value_heads = 3, 6
    config.linear_key_head_dim, config.linear_value_head_dim = 16, 8
    mixer = _mixer(config, dtype)
    slots, rows = 5, 4
    conv_dim = 2 * 3 * 16 + 6 * 8
    conv = torch.randn(slots + 1, conv_dim, 3, device=DEVICE).to(dtype)
    ssm = torch.randn(slots + 1, 6, 16, 8, device=DEVICE)
    x = torch.randn(rows, config.hidden_size, device=DEVICE).to(dtype)
    read = torch.tensor([3, 0, 4, 1], device=DEVICE)
    write = torch.tensor([3, 0, slots, 1], device=DEVICE)  # row 2 frozen: the scratch slot
    layer = _Layer(mixer)
    expected = [t.clone() for t in (conv, ssm)]
    want = recurrent_decode(layer, x, _States(*expected), 0, read, write, "torch")
    got = recurrent_decode(layer, x, _States(conv, ssm), 0, read, write, "triton")
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(conv.float(), expected[0].float(), atol=tolerance, rtol=0)
    torch.testing.assert_close(ssm, expected[1], atol=tolerance, rtol=tolerance)
    # the frozen row's own slot kept its state; the torch op's reference: one step by hand
    state = RecurrentState(expected[0][[4]].clone(), expected[1][[4]].clone())
    mixer.decode(x[[2]], state)
    torch.testing.assert_close(ssm[slots], state.ssm[0], atol=tolerance, rtol=tolerance)


def test_hybrid_engine_with_the_fused_step_samples_the_torch_steps_tokens():
    """decode_backend='triton' on a hybrid model: the model's modules, the fused delta step;
    the same greedy tokens and log-probs (fp32) as the torch step, n = 2, two prompts."""
    model = build_model(preset_config("tiny-hybrid"), seed=1).to(DEVICE).eval()
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    params = SamplingParams(n=2, temperature=0, max_new_tokens=5, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        engine = Engine(model, max_batch_size=4, max_seq_len=32,
                        options=EngineOptions(decode_backend=backend, cuda_graphs=False))  # fmt: skip
        assert engine.recurrent_step == backend
        results[backend] = engine.generate(prompts, params)
    for fused, plain in zip(results["triton"], results["torch"]):
        assert fused.token_ids == plain.token_ids
        torch.testing.assert_close(fused.logprobs, plain.logprobs, atol=1e-4, rtol=0)
