"""The reward model: one score per conversation from a sequence classifier, in packed
forwards under a token budget.

The conversation is the policy's own tokens (prompt + response) when the reward model reads
the policy's tokenizer and chat template; otherwise it is rendered again from text with the
reward model's: the prompt's messages plus the response as the assistant's turn.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hybridflow.learners.micro_batch import pack_by_token_budget, split_fixed
from hybridflow.learners.packing import to_device
from hybridflow.models.heads.sequence_scores import pad_token_of
from hybridflow.protocol import Batch


def policy_token_rows(batch: Batch) -> list[list[int]]:
    """Each row's real tokens, prompt then response (``attention_mask`` [B, P+R])."""
    ids = torch.cat([batch.tensors["prompts"], batch.tensors["responses"]], dim=1)  # [B, P+R]
    mask = batch.tensors["attention_mask"].bool()
    return [row[keep].tolist() for row, keep in zip(ids, mask)]


def conversation(prompt, response: str) -> list[dict[str, str]]:
    """The prompt's chat messages (a plain string is one user turn) + the assistant's reply."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return [*(dict(m) for m in messages), {"role": "assistant", "content": response}]


def rendered_token_rows(tokenizer, prompts: Sequence, responses: Sequence[str]) -> list[list[int]]:
    """Each conversation through the reward model's chat template, then its tokenizer."""
    rows = []
    for prompt, response in zip(prompts, responses):
        text = tokenizer.apply_chat_template(conversation(prompt, str(response)), tokenize=False)
        rows.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return rows


def same_tokenization(policy_tokenizer, reward_tokenizer) -> bool:
    """Whether the policy's token ids mean to the reward model what they mean to the policy:
    the same vocabulary and the same chat template."""
    if policy_tokenizer is reward_tokenizer:
        return True
    same_template = getattr(policy_tokenizer, "chat_template", None) == getattr(
        reward_tokenizer, "chat_template", None
    )
    return same_template and policy_tokenizer.get_vocab() == reward_tokenizer.get_vocab()


def budget_plan(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Packed forwards of at most ``max_tokens`` tokens; a conversation longer than that (one
    rendered again with a longer template than the policy's) is scored alone."""
    long = [i for i, n in enumerate(lengths) if n > max_tokens]
    short = [i for i, n in enumerate(lengths) if n <= max_tokens]
    packed = pack_by_token_budget([lengths[i] for i in short], max_tokens) if short else []
    return [[short[j] for j in group] for group in packed] + [[i] for i in long]


class RewardModelScorer:
    """``compute_rm_scores(batch) -> Batch(rm_scores [B])``.

    Args:
        model: a sequence classifier with ``forward_scores`` (models/heads/sequence_scores.py).
        device: where it computes.
        tokenizer: the reward model's; None: the batch's token ids are scored as they are.
        micro_batch_size, max_tokens: conversations per forward, or a token budget per
            forward (packed, as the learners' passes).
        offload: weights in host memory between calls.
    """

    def __init__(self, model: nn.Module, *, device: torch.device | str, tokenizer=None,
                 micro_batch_size: int = 16, max_tokens: int | None = None,
                 offload: bool = False):  # fmt: skip
        model.requires_grad_(False)
        self.model = model.eval()
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        self.micro_batch_size, self.max_tokens = micro_batch_size, max_tokens
        self.offload = offload and self.device.type == "cuda"
        self.pad_token_id = pad_token_of(model)
        self.model.to("cpu" if self.offload else self.device)

    def token_rows(self, batch: Batch) -> list[list[int]]:
        if self.tokenizer is None:
            return policy_token_rows(batch)
        return rendered_token_rows(
            self.tokenizer, batch.arrays["raw_prompt"], batch.arrays["response_text"]
        )

    @torch.no_grad()
    def compute_rm_scores(self, batch: Batch) -> Batch:
        rows = self.token_rows(batch)
        lengths = [len(row) for row in rows]
        if self.max_tokens is None:
            plan = split_fixed(len(rows), self.micro_batch_size)
        else:
            plan = budget_plan(lengths, self.max_tokens)
        scores = torch.zeros(len(rows), dtype=torch.float32)  # [B]
        if self.offload:
            self.model.to(self.device)
        try:
            for micro_batch in plan:
                if micro_batch:
                    scores[micro_batch] = self._forward([rows[i] for i in micro_batch]).cpu()
        finally:
            if self.offload:
                self.model.to("cpu")
                torch.cuda.empty_cache()
        return Batch({"rm_scores": scores})

    def _forward(self, rows: list[list[int]]) -> torch.Tensor:
        """Packed rows -> the first label's score of each [S]."""
        input_ids = torch.tensor([token for row in rows for token in row], dtype=torch.long)
        positions = torch.cat([torch.arange(len(row)) for row in rows])
        lengths = torch.tensor([0] + [len(row) for row in rows])
        cu_seqlens = lengths.cumsum(0).to(torch.int32)
        logits = self.model.forward_scores(
            to_device(input_ids, self.device), to_device(positions, self.device),
            to_device(cu_seqlens, self.device), max(len(row) for row in rows),
            pad_token_id=self.pad_token_id,
        )  # fmt: skip
        return logits[:, 0]  # [S]: a reward model has one label; of more, the first
