"""Streaming text as the engine decodes: token ids arriving in chunks -> the pieces of text
that are safe to send.

A piece is held back while it could still be the start of a stop string (the longest stop
string minus one character), and the stop token the engine ends on is never shown; once a
stop string completes, the text is cut where it starts and the request can be aborted. The
pieces sent concatenate to exactly what text.finish_output makes of the same tokens at the
end (the record and the unstreamed response), token for token.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from hybridflow.serve.http import generation_failed, stream_events
from hybridflow.serve.openai_protocol import usage
from hybridflow.serve.text import PieceDecoder, _spelling, finish_output

log = logging.getLogger("hybridflow.serve")


@dataclass
class Emit:
    """One token's part of the streamed text: its piece (possibly ""), its log-prob and its
    spelling for the logprobs fields; index counts the request's tokens from 0."""

    index: int
    text: str
    logprob: float | None
    token: str
    offset: int  # where the piece starts in the text


class TextStream:
    """One choice's tokens in, safe pieces out (module docstring). stop_ids: the token ids
    the engine stops on (their piece is never shown)."""

    def __init__(self, tokenizer, stops: list[str], stop_ids: set[int],
                 skip_special_tokens: bool = True):  # fmt: skip
        self.tokenizer = tokenizer
        self.decoder = PieceDecoder(tokenizer, skip_special_tokens)
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.stop_ids = stop_ids
        self.special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        self.pieces: list[str] = []
        self.raw: list[str] = []  # each token's own piece (a stop token's too): its spelling
        self.logprobs: list[float] = []
        self.offsets: list[int] = []
        self.full = ""  # the visible text so far
        self.sent = 0  # tokens emitted
        self.cut: int | None = None  # where a completed stop string starts in the text
        self.keep: int | None = None  # tokens kept once a stop string completed

    @property
    def stopped(self) -> bool:
        """A stop string completed: nothing more will be shown (abort the request)."""
        return self.cut is not None

    def push(self, token_ids: list[int], logprobs: list[float]) -> list[Emit]:
        if self.stopped:
            return []
        for token_id, logprob in zip(token_ids, logprobs):
            piece = self.decoder.push(token_id)
            self.offsets.append(len(self.full))
            self.raw.append(piece)
            self.pieces.append("" if token_id in self.stop_ids else piece)
            self.logprobs.append(logprob)
            self.full += self.pieces[-1]
        self._find_stop()
        if self.stopped:
            return self._emit(len(self.full), upto=self.keep)
        return self._emit(len(self.full) - self.hold)

    def finish(self) -> list[Emit]:
        """The rest, once the engine is done (or the stream was cut at a stop string)."""
        if not self.stopped and self.pieces:
            tail = self.decoder.trailing()
            if tail and self.decoder.ids[-1] not in self.stop_ids:
                self.pieces[-1] += tail  # as text.token_pieces does
                self.full += tail
            self._find_stop()
        end = len(self.full) if not self.stopped else self.cut
        return self._emit(end, upto=self.keep if self.stopped else len(self.pieces))

    def _find_stop(self) -> None:
        best = None  # (end, start) of the stop string that completes first
        for stop in self.stops:
            start = self.full.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best):
                best = (start + len(stop), start)
        if best is None:
            return
        end, self.cut = best
        self.keep = next(k for k in range(len(self.pieces))
                         if self.offsets[k] + len(self.pieces[k]) >= end) + 1  # fmt: skip

    def _emit(self, safe_end: int, upto: int | None = None) -> list[Emit]:
        """Tokens whose pieces end by safe_end (all up to `upto` when given), in order."""
        limit = len(self.pieces) if upto is None else upto
        text_end = self.cut if self.stopped else len(self.full)
        out = []
        while self.sent < limit:
            k = self.sent
            end = self.offsets[k] + len(self.pieces[k])
            # (a token past the decoder's last finished character may still gain the
            # replacement text of an unfinished one at the end: it waits)
            if upto is None and (end > safe_end or k >= self.decoder.read):
                break
            shown = self.full[min(self.offsets[k], text_end) : min(end, text_end)]
            out.append(Emit(k, shown, self.logprobs[k], self._token(k), min(self.offsets[k],
                                                                             text_end)))  # fmt: skip
            self.sent += 1
        return out

    def _token(self, k: int) -> str:
        token_id = self.decoder.ids[k]
        if self.raw[k] and token_id not in self.special:
            return self.raw[k]
        return _spelling(self.tokenizer, token_id)


async def stream_choices(client, tokenizer, request, prompts: list[list[int]], sampling,
                         params: list, stop_ids: set[int], event, finish_event, usage_event,
                         start_event, images: list | None = None) -> tuple:  # fmt: skip
    """Stream every choice's text as it decodes: `event(index, emits)` makes the chunk of
    new pieces (None: nothing to send), `finish_event(index, reason)` the last one of a
    choice, `usage_event(counts)` the usage chunk, `start_event(index)` an opening one.
    images: per prompt its PromptImages or None (None: no prompt has images).
    -> (response, [(index, prompt, Output, finish)] for the record)."""
    n = sampling.n
    choices = [(i * n + j, prompt, p) for i, prompt in enumerate(prompts)
               for j, p in enumerate(params)]  # fmt: skip
    handles = []
    try:
        for index, prompt, p in choices:
            image = None if images is None else images[index // n]
            extra = {} if image is None else {"images": image}
            handles.append(client.stream(prompt, p, **extra))
    except Exception as error:
        for handle in handles:
            handle.abort()
        raise generation_failed(error) from None
    queue: asyncio.Queue = asyncio.Queue()
    outputs: dict[int, tuple] = {}

    async def follow(index, prompt, handle):
        text = TextStream(tokenizer, sampling.stop, stop_ids, sampling.skip_special_tokens)
        ids, lps, reason = [], [], "length"
        async for delta in handle.astream():
            ids += delta.token_ids
            lps += delta.logprobs
            emits = text.push(delta.token_ids, delta.logprobs)
            if emits and (chunk := event(index, emits)) is not None:
                await queue.put(chunk)
            if delta.completion is not None:
                reason = delta.completion.finish_reason
            if text.stopped:
                handle.abort()  # a stop string completed: nothing more is shown
                break
        emits = text.finish()
        if emits and (chunk := event(index, emits)) is not None:
            await queue.put(chunk)
        out = finish_output(tokenizer, ids, lps, reason, sampling.stop,
                                sampling.skip_special_tokens)  # fmt: skip
        outputs[index] = (index, prompt, out, out.finish_reason)
        await queue.put(finish_event(index, out.finish_reason))

    tasks = [asyncio.create_task(follow(i, prompt, h))
             for (i, prompt, _), h in zip(choices, handles)]  # fmt: skip
    done = asyncio.gather(*tasks)
    done.add_done_callback(lambda _: queue.put_nowait(None))

    async def events():
        for index, _, _ in choices:
            if (first := start_event(index)) is not None:
                yield first
        while (item := await queue.get()) is not None:
            yield item
        if done.exception() is not None:  # the headers are out: an error event, then the end
            log.error("generation failed mid-stream", exc_info=done.exception())
            yield generation_failed(done.exception()).body()
            return
        if sampling.include_usage:
            counts = usage(sum(len(p) for p in prompts) * n,
                               sum(len(o[2].token_ids) for o in outputs.values()))  # fmt: skip
            yield usage_event(counts)

    try:
        response = await stream_events(request, events())
    finally:
        for task, handle in zip(tasks, handles):
            if not task.done():
                task.cancel()
                handle.abort()  # the client went away: its rows go back
    return response, [outputs[i] for i, _, _ in choices if i in outputs]
