"""The reward model's scores are the checkpoint's: each equals a direct transformers forward
of the same conversation, through the policy's tokens or rendered again from text."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reward_model_helpers import byte_bpe_tokenizer, transformers_score, write_reward_model

from hybridflow.learners.reward_model import RewardModelScorer, same_tokenization
from hybridflow.models import load_tokenizer
from hybridflow.models.checkpoint_io.sequence_classifier import load_sequence_classifier
from hybridflow.protocol import Batch

PROMPTS = [[{"role": "user", "content": "12+30="}], [{"role": "user", "content": "7+5="}],
           "9+9="]  # fmt: skip
RESPONSES = ["42", "13", "18 is it"]


def policy_batch(tokenizer) -> Batch:
    """Left-padded prompts, right-padded responses, as the rollout returns them."""
    prompt_ids = [tokenizer.apply_chat_template(
        p if not isinstance(p, str) else [{"role": "user", "content": p}],
        add_generation_prompt=True, tokenize=True, return_dict=False) for p in PROMPTS]  # fmt: skip
    response_ids = [tokenizer(r + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
                    for r in RESPONSES]  # fmt: skip
    P, R = max(map(len, prompt_ids)), max(map(len, response_ids))
    prompts = torch.zeros(len(PROMPTS), P, dtype=torch.long)
    responses = torch.zeros(len(PROMPTS), R, dtype=torch.long)
    mask = torch.zeros(len(PROMPTS), P + R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        prompts[i, P - len(p) :], responses[i, : len(r)] = torch.tensor(p), torch.tensor(r)
        mask[i, P - len(p) : P + len(r)] = 1
    arrays = {"raw_prompt": np.asarray(PROMPTS + [None], dtype=object)[:-1],
              "response_text": np.asarray(RESPONSES, dtype=object)}  # fmt: skip
    return Batch({"prompts": prompts, "responses": responses, "attention_mask": mask}, arrays)


@pytest.mark.parametrize("max_tokens", [None, 40, 8])  # 8: shorter than any: one at a time
def test_scores_of_the_policy_tokens_equal_transformers(tmp_path, max_tokens):
    tokenizer = load_tokenizer("char")
    directory = write_reward_model(tmp_path / "rm", "llama", tokenizer=tokenizer)
    assert same_tokenization(tokenizer, load_tokenizer(str(directory)))
    scorer = RewardModelScorer(load_sequence_classifier(str(directory)), device="cpu",
                               micro_batch_size=2, max_tokens=max_tokens)  # fmt: skip
    batch = policy_batch(tokenizer)
    scores = scorer.compute_rm_scores(batch).tensors["rm_scores"]  # [B]
    ids = torch.cat([batch.tensors["prompts"], batch.tensors["responses"]], 1)
    expected = [transformers_score(directory, row[keep.bool()].tolist())
                for row, keep in zip(ids, batch.tensors["attention_mask"])]  # fmt: skip
    torch.testing.assert_close(scores, torch.tensor(expected), atol=1e-4, rtol=1e-4)
    assert len({round(float(s), 3) for s in scores}) == 3  # continuous, one per conversation


def test_another_tokenizer_scores_the_conversation_rendered_again(tmp_path):
    policy = load_tokenizer("char")
    reward = byte_bpe_tokenizer(["12+30= 42 13 7+5= 9+9= 18 is it user assistant"] * 4)
    directory = write_reward_model(tmp_path / "rm", "qwen2", vocab_size=len(reward),
                                   pad_token_id=reward.pad_token_id, tokenizer=reward)  # fmt: skip
    reward = load_tokenizer(str(directory))
    assert not same_tokenization(policy, reward)
    scorer = RewardModelScorer(load_sequence_classifier(str(directory)), device="cpu",
                               tokenizer=reward)  # fmt: skip
    scores = scorer.compute_rm_scores(policy_batch(policy)).tensors["rm_scores"]
    # what a user of transformers would do with the same text
    text = ("<|im_start|>user\n12+30=<|im_end|>\n"
            "<|im_start|>assistant\n42<|im_end|>\n")  # fmt: skip
    first = transformers_score(directory, reward(text, add_special_tokens=False)["input_ids"])
    assert abs(float(scores[0]) - first) < 1e-4
    assert len({round(float(s), 3) for s in scores}) == 3


def test_the_token_budget_packs_and_scores_longer_conversations_alone():
    from hybridflow.learners.reward_model import budget_plan

    plan = budget_plan([5, 30, 6, 12, 4], max_tokens=12)
    assert sorted(i for group in plan for i in group) == [0, 1, 2, 3, 4]
    assert [1] in plan  # 30 tokens > 12: alone
    assert all(sum([5, 30, 6, 12, 4][i] for i in group) <= 12 for group in plan if group != [1])
