"""What the server keeps of every request it served: the exact token ids and log-probs.

An agent program outside hybridflow talks to the server through the OpenAI API, in text; a
trainer needs the tokens. Each served request leaves a RequestRecord (under the response's
`id`): per choice, the prompt's token ids, the completion's token ids (those the returned
text covers, the stop token included) and the sampled log-prob of each, and the sampling
settings (temperature, top_p, ... : what the log-probs were computed under). Nothing has to
be re-tokenized to train on it. Each record is exact for its request; an agent program's next
request re-renders the conversation from text, so its prompt may encode the earlier turns'
text differently from the tokens sampled for them (compare the ids to see).

The last `max_records` records are kept (oldest dropped first). Token ids are stored as
int32 arrays and log-probs as float64 arrays, a few bytes per token rather than a Python int
object each.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class ChoiceRecord:
    index: int
    prompt_token_ids: array
    token_ids: array
    logprobs: array
    finish_reason: str

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "prompt_token_ids": self.prompt_token_ids.tolist(),
            "token_ids": self.token_ids.tolist(),
            "logprobs": self.logprobs.tolist(),
            "finish_reason": self.finish_reason,
        }


@dataclass
class RequestRecord:
    id: str
    """The response's id."""
    endpoint: str
    """"completions" or "chat.completions"."""
    model: str
    created: int
    choices: list[ChoiceRecord]
    sampling: dict = field(default_factory=dict)
    user: str | None = None
    metadata: dict | None = None
    """The request's `user` and `metadata` fields (a caller can tag its episodes)."""

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "object": "hybridflow.request",
            "endpoint": self.endpoint,
            "model": self.model,
            "created": self.created,
            "sampling": dict(self.sampling),
            "user": self.user,
            "metadata": self.metadata,
            "choices": [choice.to_dict() for choice in self.choices],
        }


def choice_record(index: int, prompt_ids, token_ids, logprobs, finish_reason: str) -> ChoiceRecord:
    prompt = prompt_ids if isinstance(prompt_ids, array) else array("i", prompt_ids)
    return ChoiceRecord(index, prompt, array("i", token_ids), array("d", logprobs), finish_reason)


class RequestRecords:
    """The last `max_records` RequestRecords by id, safe to read from another thread (a
    trainer next to the server's event loop)."""

    def __init__(self, max_records: int = 10_000):
        if max_records < 1:
            raise ValueError(f"max_records={max_records} must be >= 1")
        self.max_records = max_records
        self._records: OrderedDict[str, RequestRecord] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, record: RequestRecord) -> None:
        with self._lock:
            self._records[record.id] = record
            self._records.move_to_end(record.id)
            while len(self._records) > self.max_records:
                self._records.popitem(last=False)

    def get(self, id: str) -> RequestRecord | None:
        with self._lock:
            return self._records.get(id)

    def pop(self, id: str) -> RequestRecord | None:
        """Take a record out (a trainer that consumed it frees the memory)."""
        with self._lock:
            return self._records.pop(id, None)

    def ids(self) -> list[str]:
        """Oldest first."""
        with self._lock:
            return list(self._records)

    def records(self) -> list[RequestRecord]:
        """Oldest first (a snapshot)."""
        with self._lock:
            return list(self._records.values())

    def clear(self) -> None:
        with self._lock:
            self._records.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def __contains__(self, id: object) -> bool:
        with self._lock:
            return id in self._records
