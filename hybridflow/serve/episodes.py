"""Episodes of an agent program that talks to the server in text, kept token in, token out.

An agent program sends each turn of a conversation as a new chat request, the whole
conversation re-sent as messages. Rendering it again from text can encode the model's
earlier turns differently from the tokens it sampled (merges across turn boundaries, a
template that rewrites the assistant's text), and a trainer would then train on tokens the
model never produced. A request that names its episode (the `X-Hybridflow-Episode` header)
is instead continued from the episode's tokens: when its messages extend the episode's
(same roles, the same non-assistant messages), the prompt is the earlier prompt, every
sampled token, and the template's delta for the new messages only (agents' ChatRenderer),
as the built-in tool loop does. The episode keeps the token ids, the sampled log-probs and a
loss mask (1 on the model's tokens, 0 on what the template and the program added), ready to
train on. A request whose messages do not extend the episode restarts it (counted).

An episode opened by a trainer (`open`) also fixes how its turns sample: the trainer's
sampling settings and per-turn seeds, and a budget of response tokens for the episode.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field

EPISODE_HEADER = "X-Hybridflow-Episode"


@dataclass
class EpisodeState:
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    """Everything after the prompt: the sampled turns and the deltas between them."""
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    """The conversation so far, the assistant turns with the text their tokens decode to."""
    stop_text: str = ""
    """The text of the stop token that ended the last turn ("" if it ran out of tokens)."""
    turns: list[tuple[int, str]] = field(default_factory=list)
    """(tokens generated, finish reason) per turn."""
    restarts: int = 0
    """Requests whose messages did not extend the episode (it started again from them)."""
    sampling: object | None = None
    """The trainer's SamplingParams for every turn (None: each request's own)."""
    seed: int | None = None
    max_tokens: int | None = None
    """Response tokens the whole episode may hold (None: no limit)."""

    def remaining(self, delta: int) -> int | None:
        """Tokens the next turn may generate after a delta of `delta` tokens."""
        if self.max_tokens is None:
            return None
        return self.max_tokens - len(self.response_ids) - delta


@dataclass
class Plan:
    """How one request continues its episode: the prompt to generate from and what to
    append to the episode once the completion is back."""

    prompt_ids: list[int]
    delta: list[int]
    messages: list[dict]
    restart: bool


def extends(history: list[dict], messages: list[dict]) -> bool:
    """Whether `messages` continue `history`: longer, the same roles, and the same
    non-assistant messages (an assistant turn is the episode's own: its tokens stand,
    whatever text the program sends back for it)."""
    if len(messages) <= len(history):
        return False
    for old, new in zip(history, messages):
        if old.get("role") != new.get("role"):
            return False
        if old["role"] != "assistant" and (old.get("content"), old.get("name")) != (
            new.get("content"),
            new.get("name"),
        ):
            return False
    return True


class EpisodeTracker:
    """The episodes the server is serving, by id (module docstring)."""

    def __init__(self, tokenizer, max_episodes: int = 100_000):
        self.tokenizer = tokenizer
        self.max_episodes = max_episodes
        self._episodes: dict[str, EpisodeState] = {}
        self._lock = threading.Lock()

    def open(self, episode: str, sampling=None, seed: int | None = None,
             max_tokens: int | None = None) -> None:  # fmt: skip
        """A trainer's episode: its turns sample with `sampling` (seed + turn index) and
        may generate `max_tokens` response tokens in all."""
        with self._lock:
            self._episodes[episode] = EpisodeState(sampling=sampling, seed=seed,
                                                   max_tokens=max_tokens)  # fmt: skip

    def pop(self, episode: str) -> EpisodeState | None:
        with self._lock:
            return self._episodes.pop(episode, None)

    def get(self, episode: str) -> EpisodeState:
        with self._lock:
            state = self._episodes.get(episode)
            if state is None:
                if len(self._episodes) >= self.max_episodes:  # oldest first
                    self._episodes.pop(next(iter(self._episodes)))
                state = self._episodes[episode] = EpisodeState()
            return state

    def plan(self, episode: str, messages: list[dict], tools: list[dict] | None) -> Plan:
        """The prompt of the episode's next turn (module docstring)."""
        from hybridflow.agents.loop import ChatRenderer, TemplateError

        state = self.get(episode)
        renderer = ChatRenderer(self.tokenizer, tools)
        if state.messages and extends(state.messages, messages):
            new = messages[len(state.messages) :]
            try:
                delta = renderer.delta_ids(state.messages, state.stop_text, new)
            except TemplateError:
                delta = None
            if delta is not None:
                prompt = state.prompt_ids + state.response_ids + delta
                return Plan(prompt, delta, messages, restart=False)
        return Plan(renderer.prompt_ids(messages), [], messages, restart=bool(state.messages))

    def turn_sampling(self, episode: str, params):
        """The SamplingParams of the episode's next turn: the trainer's (with its seed for
        this turn) when it opened the episode, else the request's."""
        state = self.get(episode)
        if state.sampling is None:
            return params
        seed = None if state.seed is None else state.seed + len(state.turns)
        cap = min(params.max_new_tokens, state.sampling.max_new_tokens)  # the trainer's per turn
        return dataclasses.replace(state.sampling, n=1, seed=seed, max_new_tokens=cap)

    def record(self, episode: str, plan: Plan, token_ids: list[int], logprobs: list[float],
               finish_reason: str, stop_ids: set[int]) -> None:  # fmt: skip
        """Append a finished turn: the delta (mask 0), then the sampled tokens (mask 1)."""
        state = self.get(episode)
        if plan.restart or not state.messages:
            state.restarts += plan.restart
            state.prompt_ids, state.response_ids = list(plan.prompt_ids), []
            state.logprobs, state.loss_mask, state.turns = [], [], []
        state.response_ids += plan.delta + list(token_ids)
        state.logprobs += [0.0] * len(plan.delta) + list(logprobs)
        state.loss_mask += [0] * len(plan.delta) + [1] * len(token_ids)
        stopped = bool(token_ids) and token_ids[-1] in stop_ids
        decode = self.tokenizer.decode
        text = decode(token_ids[:-1] if stopped else token_ids, skip_special_tokens=False)
        state.stop_text = decode(token_ids[-1:], skip_special_tokens=False) if stopped else ""
        state.messages = [*plan.messages, {"role": "assistant", "content": text}]
        state.turns.append((len(token_ids), finish_reason))
