"""Gated DeltaNet's two paths agree (fp32): the engine's prefill of a prompt, then decode steps
one token at a time on the state it hands over, give the training op's outputs for the whole
sequences; the padded forward equals the packed one."""

import torch

from hybridflow.models.mixers.gated_deltanet import GatedDeltaNet, TokenLayout
from hybridflow.models.presets import PRESETS


def _mixer(seed: int = 0) -> GatedDeltaNet:
    torch.manual_seed(seed)
    mixer = GatedDeltaNet(PRESETS["tiny-hybrid"])
    with torch.no_grad():
        for name, param in mixer.named_parameters():
            param.copy_(torch.randn(param.shape) * (0.3 if name != "A_log" else 1.0))
    return mixer.eval()


def test_prefill_then_decode_steps_equal_the_training_op():
    mixer = _mixer()
    lengths, prompts, steps = [9, 6], [5, 3], 3
    x = torch.randn(sum(lengths), 64)
    cu = torch.tensor([0, 9, 15], dtype=torch.int32)
    with torch.no_grad():
        full = mixer(x, TokenLayout.packed(cu, 9))
        rows = list(x.split(lengths))
        prompt_x = torch.cat([row[:p] for row, p in zip(rows, prompts)])
        prompt_cu = torch.tensor([0, 5, 8], dtype=torch.int32)
        out, state = mixer.prefill(prompt_x, TokenLayout.packed(prompt_cu, 5))
        assert torch.allclose(out, torch.cat([full[:5], full[9:12]]), atol=1e-5)
        for step in range(steps):
            token = torch.stack([row[p + step] for row, p in zip(rows, prompts)])
            decoded = mixer.decode(token, state)
            expected = torch.stack([full[5 + step], full[9 + 3 + step]])
            assert torch.allclose(decoded, expected, atol=1e-5), step


def test_a_prompt_shorter_than_the_conv_window_starts_from_zeros():
    mixer = _mixer(1)
    x = torch.randn(4, 64)
    with torch.no_grad():
        full = mixer(x, TokenLayout.packed(torch.tensor([0, 4], dtype=torch.int32), 4))
        _, state = mixer.prefill(x[:1], TokenLayout.packed(torch.tensor([0, 1]), 1))
        assert torch.equal(state.conv[0, :, :2], torch.zeros(state.conv.shape[1], 2))
        for t in range(1, 4):
            assert torch.allclose(mixer.decode(x[t : t + 1], state)[0], full[t], atol=1e-5)


def test_padded_rows_equal_packed_sequences():
    mixer = _mixer(2)
    x = torch.randn(2, 7, 64)
    mask = torch.tensor([[1] * 7, [0, 0, 0, 1, 1, 1, 1]])  # the second row left-padded
    with torch.no_grad():
        padded = mixer(x, TokenLayout(attention_mask=mask))
        packed = mixer(torch.cat([x[0], x[1, 3:]]), TokenLayout.packed(torch.tensor([0, 7, 11]), 7))
    assert torch.allclose(padded[0], packed[:7], atol=1e-5)
    assert torch.allclose(padded[1, 3:], packed[7:], atol=1e-5)


def test_extend_continues_a_prefilled_state_as_the_training_op():
    """The engine's extend op (a kept turn, a prompt's later chunk): new tokens of sequences
    whose earlier tokens were prefilled, one of them a single token and one shorter than the
    conv window, give the training op's outputs; decode goes on from the state it leaves."""
    mixer = _mixer(3)
    lengths, prompts = [9, 5, 7], [5, 3, 1]
    x = torch.randn(sum(lengths), 64)
    with torch.no_grad():
        rows = list(x.split(lengths))
        full = [mixer(row, TokenLayout.packed(torch.tensor([0, len(row)]), len(row)))
                for row in rows]  # fmt: skip
        heads = torch.cat([row[:p] for row, p in zip(rows, prompts)])
        _, state = mixer.prefill(heads, TokenLayout.packed(torch.tensor([0, 5, 8, 9]), 5))
        tails = torch.cat([row[p:-1] for row, p in zip(rows, prompts)])  # all but the last
        out = mixer.extend(tails, TokenLayout.packed(torch.tensor([0, 3, 4, 9]), 5), state)
        news = [n - p - 1 for n, p in zip(lengths, prompts)]
        for got, row_full, p, n in zip(out.split(news), full, prompts, news):
            assert torch.allclose(got, row_full[p : p + n], atol=1e-5)
        last = mixer.decode(torch.stack([row[-1] for row in rows]), state)
        assert torch.allclose(last, torch.stack([row_full[-1] for row_full in full]), atol=1e-5)
