import torch

from hybridflow.models.tokenizer import build_char_tokenizer
from hybridflow.rewards.placement import decode_responses, place_scores


def test_score_lands_on_last_valid_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 0, 1, 0]])
    out = place_scores([0.5, -1.0, 7.0, 2.0], mask)
    expected = torch.tensor(
        [[0, 0, 0.5, 0], [-1.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 2.0, 0]], dtype=torch.float32
    )
    assert torch.equal(out, expected)
    # the sum over tokens recovers each score (except the empty response)
    assert out.sum(dim=1).tolist() == [0.5, -1.0, 0.0, 2.0]


def test_place_scores_rejects_wrong_batch_size():
    import pytest

    with pytest.raises(ValueError, match="do not match"):
        place_scores([1.0], torch.ones(2, 3))


def test_decode_responses_skips_padding_and_special_tokens():
    tokenizer = build_char_tokenizer()
    ids = tokenizer.encode("68", add_special_tokens=False)
    ids += [tokenizer.eos_token_id, tokenizer.pad_token_id]
    responses = torch.tensor([ids])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert decode_responses(tokenizer, responses, mask) == ["68"]
