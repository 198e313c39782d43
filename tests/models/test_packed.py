"""Packed forward (sequences concatenated, cu_seqlens) equals the padded forward."""

import pytest
import torch
from model_helpers import randomized_model, small_config

from hybridflow.models.attention import make_packed_attention, sdpa_loop_attention
from hybridflow.models.heads.logprobs import logprobs_from_hidden


def pack(sequences):
    input_ids = torch.cat(sequences)
    position_ids = torch.cat([torch.arange(len(s)) for s in sequences])
    lengths = torch.tensor([len(s) for s in sequences])
    cu_seqlens = torch.zeros(len(sequences) + 1, dtype=torch.int32)
    cu_seqlens[1:] = lengths.cumsum(0)
    return input_ids, position_ids, cu_seqlens, int(lengths.max())


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama"])
def test_packed_equals_padded(model_type):
    model = randomized_model(small_config(model_type))
    lengths = [5, 17, 1, 11]
    sequences = [torch.randint(3, model.config.vocab_size, (n,)) for n in lengths]
    packed = pack(sequences)
    # Right-padded batch and left-padded batch of the same sequences.
    width = max(lengths)
    right = torch.zeros(len(lengths), width, dtype=torch.long)
    left = torch.zeros_like(right)
    right_mask, left_mask = torch.zeros_like(right), torch.zeros_like(right)
    for i, seq in enumerate(sequences):
        right[i, : len(seq)], right_mask[i, : len(seq)] = seq, 1
        left[i, width - len(seq) :], left_mask[i, width - len(seq) :] = seq, 1
    with torch.no_grad():
        hidden = model.forward_packed(*packed)  # [N, H]
        packed_logits = model.lm_head(hidden)
        right_logits = model(right, right_mask)[right_mask.bool()]
        left_logits = model(left, left_mask)[left_mask.bool()]
        one_by_one = torch.cat([model(s[None])[0] for s in sequences])
    assert hidden.shape == (sum(lengths), model.config.hidden_size)
    torch.testing.assert_close(packed_logits, one_by_one, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_logits, right_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_logits, left_logits, atol=1e-5, rtol=1e-5)


def test_packed_attention_never_crosses_sequences():
    """Changing sequence 0 must not change any output of sequence 1."""
    model = randomized_model(small_config("qwen2"))
    a, b = torch.randint(3, 97, (9,)), torch.randint(3, 97, (6,))
    other_a = torch.randint(3, 97, (9,))
    with torch.no_grad():
        first = model.forward_packed(*pack([a, b]))[9:]
        second = model.forward_packed(*pack([other_a, b]))[9:]
    torch.testing.assert_close(first, second)


def test_gradient_checkpointing_same_gradients():
    model = randomized_model(small_config("qwen3")).train()
    packed = pack([torch.randint(3, 97, (n,)) for n in (7, 12)])
    targets = torch.randint(0, 97, (19,))

    def grads(checkpointing):
        model.zero_grad()
        model.gradient_checkpointing = checkpointing
        hidden = model.forward_packed(*packed)
        logprobs, _ = logprobs_from_hidden(hidden, model.lm_head.weight, targets)
        logprobs.sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, recomputed = grads(False), grads(True)
    for name in plain:
        torch.testing.assert_close(plain[name], recomputed[name], msg=name)


def test_attention_backend_factory_rejects_unknown():
    with pytest.raises(ValueError, match="unknown packed attention backend"):
        make_packed_attention("nope", torch.tensor([0, 3], dtype=torch.int32), 3, 3)


def test_sdpa_loop_gqa_matches_repeated_heads():
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    grouped = sdpa_loop_attention(q, k, v, [4, 6])
    repeated = sdpa_loop_attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), [4, 6]
    )
    torch.testing.assert_close(grouped, repeated)


def test_sequences_longer_than_the_sliding_window_are_refused():
    model = randomized_model(small_config("mistral", sliding_window=8))
    with pytest.raises(ValueError, match="sliding_window=8"):
        model(torch.randint(3, 97, (1, 9)))
    with pytest.raises(ValueError, match="sliding_window=8"):
        model.forward_packed(*pack([torch.randint(3, 97, (n,)) for n in (3, 9)]))
    assert model(torch.randint(3, 97, (1, 8))).shape == (1, 8, 97)
