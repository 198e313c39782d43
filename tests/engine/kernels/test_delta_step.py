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
from hybridflow.engine.kernels.delta_step import DeltaStepLaunch, state_tile  # noqa: E402
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


def _step_both_ways(mixer, config, dtype, step, launch=None, rows=4):
    """The step on 5 slots + scratch from random states, by `step` and by the torch op:
    (x, read, write, (got out, conv, ssm), (torch out, conv, ssm), the states before)."""
    slots = 5
    key_total = config.linear_num_key_heads * config.linear_key_head_dim
    conv_dim = 2 * key_total + config.linear_num_value_heads * config.linear_value_head_dim
    shape = (config.linear_num_value_heads, config.linear_key_head_dim,
             config.linear_value_head_dim)  # fmt: skip
    conv = torch.randn(slots + 1, conv_dim, config.linear_conv_kernel_dim - 1, device=DEVICE)
    conv = conv.to(dtype)
    ssm = torch.randn(slots + 1, *shape, device=DEVICE)
    before = (conv.clone(), ssm.clone())
    x = torch.randn(rows, config.hidden_size, device=DEVICE).to(dtype)
    # row 0 reads slot 3 and writes slot 2 (read != write), row 2 is frozen (the scratch slot)
    read = torch.tensor([3, 0, 4, 1][:rows], device=DEVICE)
    write = torch.tensor([2, 0, slots, 1][:rows], device=DEVICE)
    layer = _Layer(mixer)
    expected = [t.clone() for t in (conv, ssm)]
    want = recurrent_decode(layer, x, _States(*expected), 0, read, write, "torch")
    got = recurrent_decode(layer, x, _States(conv, ssm), 0, read, write, step, launch)
    return x, (got, conv, ssm), (want, *expected), before


def _small_config(key_heads=3, value_heads=6, dk=16, dv=8):
    config = preset_config("tiny-hybrid")
    config.linear_num_key_heads, config.linear_num_value_heads = key_heads, value_heads
    config.linear_key_head_dim, config.linear_value_head_dim = dk, dv
    return config


@pytest.mark.parametrize(
    "dtype,tolerance,step,launch",
    [
        (torch.float32, 1e-5, "triton", None),  # Dv = 8 < 64: a whole head, norm fused
        (torch.float32, 1e-5, "triton", DeltaStepLaunch(block_v=4, num_warps=2)),  # 2 tiles
        (torch.bfloat16, 3e-2, "triton", None),
        (torch.float32, 1e-5, "triton-grouped", None),
    ],
    ids=["fp32-fused-norm", "fp32-tiles-norm-kernel", "bf16", "fp32-grouped"],
)
def test_fused_step_equals_the_torch_op_on_slots_in_place(dtype, tolerance, step, launch):
    """The step's output, conv and SSM states equal the torch op's (GatedDeltaNet.decode on
    the gathered states, scattered to the written slots): 3 key heads of 2 value heads each,
    Dk != Dv. A row reading one slot and writing another leaves the slot it read as it was;
    a frozen row writes the scratch slot, its own state untouched."""
    config = _small_config()
    mixer = _mixer(config, dtype)
    x, got, want, before = _step_both_ways(mixer, config, dtype, step, launch)
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(got[1].float(), want[1].float(), atol=tolerance, rtol=0)
    torch.testing.assert_close(got[2], want[2], atol=tolerance, rtol=tolerance)
    conv, ssm = got[1], got[2]
    for slot in (3, 4):  # read only: row 0's source, the frozen row's own slot
        assert torch.equal(conv[slot], before[0][slot]) and torch.equal(ssm[slot], before[1][slot])
    # the frozen row's step went to the scratch slot: the torch op on its state, by hand
    state = RecurrentState(before[0][[4]].clone(), before[1][[4]].clone())
    mixer.decode(x[[2]], state)
    torch.testing.assert_close(ssm[5], state.ssm[0], atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(conv[5].float(), state.conv[0].float(), atol=tolerance, rtol=0)


def test_fused_gates_follow_torchs_softplus_at_both_ends():
    """in_proj_a scaled so a + dt_bias spans beyond +-20 (softplus's linear branch above 20,
    exp overflowing past 88 if it were not clamped; its vanishing tail below): the decayed
    states and outputs still equal the torch op's in fp32; one key head of 4 value heads."""
    config = _small_config(key_heads=1, value_heads=4, dk=8, dv=8)
    mixer = _mixer(config, torch.float32)
    with torch.no_grad():
        mixer.in_proj_a.weight.mul_(40)
        mixer.A_log.copy_(torch.tensor([-3.0, -6.0, -4.0, -5.0]))  # decays that keep the state
    x, got, want, _ = _step_both_ways(mixer, config, torch.float32, "triton")
    gate_in = mixer.in_proj_a(x) + mixer.dt_bias
    assert gate_in.max() > 90 and gate_in.min() < -20  # both ends reached
    for mine, theirs in zip(got, want):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_launch_tiles_fit_the_head_and_pick_warps_by_tile_size():
    assert state_tile(128, 128, DeltaStepLaunch()) == (128, 64, 2)  # Qwen3.5's: 2 tiles a head
    assert state_tile(128, 128, DeltaStepLaunch(block_v=None)) == (128, 128, 4)  # norm fused
    assert state_tile(128, 128, DeltaStepLaunch(block_v=32)) == (128, 32, 2)
    assert state_tile(16, 8, DeltaStepLaunch(num_warps=8)) == (16, 8, 8)  # a head under 64
    assert state_tile(16, 12, DeltaStepLaunch(block_v=5)) == (16, 8, 2)  # powers of two


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
