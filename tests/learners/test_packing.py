import torch
from learner_helpers import make_batch, tiny_model

from hybridflow.learners.packing import pack_rows


def test_packed_logprobs_equal_padded_forward():
    batch = make_batch(num_rows=6, seed=3)
    model = tiny_model()
    prompts, responses, mask = (batch[k] for k in ("prompts", "responses", "attention_mask"))
    packed = pack_rows(prompts, responses, mask)
    assert packed.input_ids.numel() == int(mask.sum())  # no padding token is computed
    with torch.no_grad():
        hidden = model.forward_packed(
            packed.input_ids, packed.position_ids, packed.cu_seqlens, packed.max_seqlen
        )
        logits_packed = hidden[packed.hidden_index] @ model.lm_head.weight.T
        lp_packed = packed.scatter(
            torch.log_softmax(logits_packed, -1).gather(-1, packed.targets[:, None])[:, 0]
        )
        # Reference: padded forward, log-prob of response token t read at column P + t - 1.
        logits = model(torch.cat([prompts, responses], 1), mask)
        P = prompts.shape[1]
        lp_ref = torch.log_softmax(logits[:, P - 1 : -1], -1)
        lp_ref = lp_ref.gather(-1, responses[..., None])[..., 0] * batch["response_mask"]
    torch.testing.assert_close(lp_packed, lp_ref, atol=1e-5, rtol=1e-5)


def test_pack_rows_positions_and_targets():
    prompts = torch.tensor([[0, 7, 8], [9, 10, 11]])
    responses = torch.tensor([[12, 13], [14, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    p = pack_rows(prompts, responses, mask)
    assert p.input_ids.tolist() == [7, 8, 12, 13, 9, 10, 11, 14]
    assert p.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert p.cu_seqlens.tolist() == [0, 4, 8]
    # Token 12 is predicted by 8 (packed index 1), 13 by 12 (2), 14 by 11 (6).
    assert p.hidden_index.tolist() == [1, 2, 6]
    assert p.targets.tolist() == [12, 13, 14]
    assert p.scatter(torch.tensor([1.0, 2.0, 3.0])).tolist() == [[1.0, 2.0], [3.0, 0.0]]


def test_tokens_padded_to_a_multiple_give_the_same_logprobs_and_an_fp8_actor_pads():
    """pad_tokens: the pads are a sequence of their own, so the real tokens' hidden states
    (and log-probs) are those of the unpadded stream; the FP8 actor runs every micro-batch
    padded to 16 tokens (torch._scaled_mm's weight gradient has the tokens as inner dim)."""
    import pytest

    from hybridflow.learners.modules import PolicyModel
    from hybridflow.learners.packing import pad_tokens

    batch = make_batch(num_rows=5, seed=3)
    packed = pack_rows(batch["prompts"], batch["responses"], batch["attention_mask"])
    assert packed.input_ids.numel() % 16  # the case that needs padding
    padded = pad_tokens(packed, 16)
    assert padded.input_ids.numel() % 16 == 0 and padded.cu_seqlens[-2] == packed.cu_seqlens[-1]
    assert pad_tokens(padded, 16) is padded
    model = tiny_model()
    with torch.no_grad():
        plain = PolicyModel(model)(packed)[0]
        got = PolicyModel(model, token_multiple=16)(packed)[0]
    torch.testing.assert_close(got, plain, rtol=0, atol=1e-6)

    pytest.importorskip("torchao")
    from learner_helpers import actor_config

    from hybridflow.learners import ActorLearner

    actor = ActorLearner(tiny_model(), actor_config(precision="fp8", ppo_mini_batch_size=8),
                         total_steps=1, device="cpu", fp8_emulate=True)  # fmt: skip
    lengths = []
    forward = actor.model.forward_packed

    def recorded(input_ids, *args, **kwargs):
        lengths.append(input_ids.numel())
        return forward(input_ids, *args, **kwargs)

    actor.model.forward_packed = recorded
    actor.update(make_batch(seed=3))
    assert lengths and all(n % 16 == 0 for n in lengths)
