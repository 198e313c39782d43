"""The OpenAI-compatible HTTP server: an aiohttp Application over one engine.

    app = build_app(engine, tokenizer, "my-model")
    with BackgroundServer(app) as server:           # a thread, a free port, 127.0.0.1
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        ...
        records = app[RECORDS]                       # the token ids of every request

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET
/v1/models/{model}, GET /health, GET /v1/hybridflow/requests (the kept records' ids) and GET
/v1/hybridflow/requests/{id} (one record: prompt and completion token ids, log-probs; see
records.py). Field by field, what the two POST routes take and reject: openai_protocol.py.

Every request's samples go through one GenerationClient (by default agents' EngineClient:
the requests that arrive together become one batched Engine.generate call, run in a worker
thread, each sample with its own seed, so a seeded request samples the same whatever it was
batched with). n > 1 is n samples of the prompt; choice j's seed is derived from the
request's seed (choice 0 uses it as is).

Streaming (`stream: true`): Server-Sent Events in OpenAI's chunk format, ending with
`data: [DONE]`. Text is sent as the engine decodes it (a chunk per chunk of decode steps:
EngineClient.stream; streaming.py holds back what could still start a stop string), then
each choice's finish chunk, then the usage chunk with `stream_options: {"include_usage":
true}`. The chunks reassemble to exactly the text of the same request unstreamed. A client
that disconnects has its requests aborted, streamed or not (their rows go back to the
engine: running.start_site cancels the handler of a lost connection). Chat with `tools`
streams once the whole text is there (the calls are parsed from it); so does a generation
client without `stream` (the scripted one in tests).

Chat: the messages are rendered by the tokenizer's chat template with the request's `tools`
(agents' ChatRenderer); an assistant message's `tool_calls` are written into its content as
Hermes `<tool_call>` blocks, so templates without native tool support show them too. With
`tools`, the generated text is parsed by a ToolCallParser (Hermes by default): calls come back
as `message.tool_calls` with finish_reason "tool_calls", the text outside them as `content`.
`tools` with a chat template that does not render them is a 400 (prompts.py).

Images: a server over a vision-language model (build_app's image_processor) takes chat
messages' image_url parts (data URLs); each becomes its image-pad tokens in the prompt and
its pixels go to the engine with it (images.py). A text-only model refuses them (400).

Errors are OpenAI's JSON error body: 400 for a request that cannot be served as written
(invalid JSON, a missing or out-of-range field, an unknown role, a prompt with no room left
under max_seq_len), 404 for an unknown route or model, 408 for a body that arrives too
slowly, 413 for a body larger than the context could use (limits.py), 500 when generation
itself fails. Never a traceback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from array import array

from aiohttp import web

from hybridflow.serve.connections import request_deadlines
from hybridflow.serve.episodes import EPISODE_HEADER, EpisodeTracker
from hybridflow.serve.http import (
    generation_failed,
    json_errors,
    json_response,
    read_json,
    stream_events,
)
from hybridflow.serve.images import ChatImages, chat_images, refuse_images
from hybridflow.serve.limits import ServerLimits
from hybridflow.serve.openai_protocol import (
    RequestError,
    Sampling,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_chunk,
    completion_logprobs,
    completion_response,
    parse_chat_request,
    parse_completion_request,
    usage,
)
from hybridflow.serve.prompts import PromptBuilder
from hybridflow.serve.records import RequestRecord, RequestRecords, choice_record
from hybridflow.serve.streaming import stream_choices
from hybridflow.serve.text import Output, finish_output

log = logging.getLogger("hybridflow.serve")

RECORDS = web.AppKey("hybridflow.records", RequestRecords)
"""app[RECORDS]: the RequestRecords of the requests served."""
EPISODES = web.AppKey("hybridflow.episodes", EpisodeTracker)
"""app[EPISODES]: the episodes of agent programs, token in and token out (episodes.py)."""
LIMITS = web.AppKey("hybridflow.limits", ServerLimits)
"""app[LIMITS]: the ServerLimits it serves with (running.start_site reads the timeouts)."""


class OpenAIServer:
    """The request handlers (build_app wires them into an Application)."""

    def __init__(self, tokenizer, model_name: str, client, max_seq_len: int, vocab_size: int,
                 records: RequestRecords, limits: ServerLimits, parser=None,
                 images: ChatImages | None = None):  # fmt: skip
        from hybridflow.agents.parsers import HermesParser

        self.tokenizer = tokenizer
        self.model_name = model_name
        self.client = client
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.records = records
        self.limits = limits
        self.images = images  # None: a text-only model, image parts refused
        self.max_request_bytes = limits.request_bytes(max_seq_len, images is not None)
        self.prompts = PromptBuilder(tokenizer, max_seq_len, vocab_size, limits)
        self.parser = parser or HermesParser()
        self.created = int(time.time())
        self.episodes = EpisodeTracker(tokenizer)
        self.eos_id = getattr(tokenizer, "eos_token_id", None)

    # -- routes --------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return json_response({"status": "ok"})

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "hybridflow", "max_model_len": self.max_seq_len}  # fmt: skip

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        self._check_model(request.match_info["model"])
        return json_response(self._model_card())

    async def list_records(self, request: web.Request) -> web.Response:
        data = [{"id": r.id, "object": "hybridflow.request", "endpoint": r.endpoint,
                 "created": r.created} for r in self.records.records()]  # fmt: skip
        return json_response({"object": "list", "data": data})

    async def get_record(self, request: web.Request) -> web.Response:
        record = self.records.get(request.match_info["id"])
        if record is None:
            raise RequestError(f"no record of request {request.match_info['id']!r} (kept: the "
                               f"last {self.records.max_records})", "id", "record_not_found",
                               status=404)  # fmt: skip
        return json_response(record.to_dict())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_completion_request(await self._body(request), self.limits)
        self._check_model(req.model)
        sampling = req.sampling
        prompts = self.prompts.completion_prompts(req.prompts)
        if self.images is not None:  # image tokens come with images, which only chat takes
            for i, ids in enumerate(prompts):
                self.images.check_pads(ids, 0, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
        rid, created, n = f"cmpl-{uuid.uuid4().hex}", int(time.time()), sampling.n
        want_logprobs = req.logprobs is not None
        if sampling.stream and self._streams():
            return await self._stream_completions(request, req, prompts, rid, created)
        outputs = await self._generate(prompts, sampling)
        choices, chosen = [], []
        for i, prompt_outputs in enumerate(outputs):
            for j, out in enumerate(prompt_outputs):
                lp = (completion_logprobs(out.tokens, out.logprobs, out.offsets)
                      if want_logprobs else None)  # fmt: skip
                choices.append({"index": i * n + j, "text": out.text, "logprobs": lp,
                                "finish_reason": out.finish_reason})  # fmt: skip
                chosen.append((i * n + j, prompts[i], out, out.finish_reason))
        counts = usage(
            sum(len(p) for p in prompts) * n, sum(len(o.token_ids) for _, _, o, _ in chosen)
        )
        self._record(rid, "completions", created, chosen, sampling, req.user, req.metadata)
        if not sampling.stream:
            return json_response(completion_response(rid, created, self.model_name, choices,
                                                         counts))  # fmt: skip

        def events():
            for index, _, out, finish in chosen:
                for k, piece in enumerate(out.pieces):
                    lp = (completion_logprobs([out.tokens[k]], [out.logprobs[k]],
                                              [out.offsets[k]]) if want_logprobs else None)  # fmt: skip
                    if piece or lp:
                        yield completion_chunk(rid, created, self.model_name, [
                            {"index": index, "text": piece, "logprobs": lp, "finish_reason": None}
                        ])  # fmt: skip
                yield completion_chunk(rid, created, self.model_name, [
                    {"index": index, "text": "", "logprobs": None, "finish_reason": finish}
                ])  # fmt: skip
            if sampling.include_usage:
                yield completion_chunk(rid, created, self.model_name, [], counts)

        return await stream_events(request, events())

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_chat_request(await self._body(request), self.limits)
        self._check_model(req.model)
        sampling = req.sampling
        episode = request.headers.get(EPISODE_HEADER)
        if self.images is None:
            refuse_images(req.images, self.model_name)
        images = plan = None
        if episode is None and self.images is not None:
            prompt, images = await self.images.chat_prompt(self.prompts, req)
        elif episode is None:
            prompt = self.prompts.chat_prompt(req)
        else:  # continued from the episode's tokens (episodes.py)
            if req.images:
                raise RequestError(f"{req.images[0].where}: a request of an episode takes no "
                                   "images", req.images[0].where, "images_not_supported")  # fmt: skip
            if sampling.n != 1:
                raise RequestError("a request of an episode takes n = 1", "n")
            self.prompts.check_chat(req)
            plan = self.episodes.plan(episode, req.messages, req.tools)
            prompt = self.prompts.check_length(self.prompts.check_ids(plan.prompt_ids, "messages"),
                                               "messages")  # fmt: skip
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if sampling.stream and self._streams() and not req.parse_tool_calls and plan is None:
            return await self._stream_chat(request, req, prompt, rid, created, images)
        outputs = (await self._generate([prompt], sampling, episode, plan, images))[0]
        if plan is not None:
            out = outputs[0]
            self.episodes.record(episode, plan, out.token_ids, out.logprobs, out.finish_reason,
                                 self._params(sampling)[1])  # fmt: skip
        choices, chosen = [], []
        for index, out in enumerate(outputs):
            message, finish = self._message(out, req.parse_tool_calls)
            lp = chat_logprobs(out.tokens, out.logprobs) if req.logprobs else None
            choices.append({"index": index, "message": message, "logprobs": lp,
                            "finish_reason": finish})  # fmt: skip
            chosen.append((index, prompt, out, finish, message))
        counts = usage(len(prompt) * sampling.n, sum(len(c[2].token_ids) for c in chosen))
        self._record(rid, "chat.completions", created, [c[:4] for c in chosen], sampling,
                     req.user, req.metadata)  # fmt: skip
        if not sampling.stream:
            return json_response(chat_response(rid, created, self.model_name, choices, counts))

        def chunk(index, delta, logprobs=None, finish=None):
            return chat_chunk(rid, created, self.model_name, [
                {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            ])  # fmt: skip

        def events():
            for index, _, out, finish, message in chosen:
                yield chunk(index, {"role": "assistant", "content": ""})
                calls = message.get("tool_calls")
                if calls:  # the content (what the calls left) in one piece, then the calls
                    delta = {"content": message["content"]} if message["content"] else {}
                    lp = chat_logprobs(out.tokens, out.logprobs) if req.logprobs else None
                    if delta or lp:
                        yield chunk(index, delta, lp)
                    yield chunk(index, {"tool_calls": [{"index": k, **call}
                                                       for k, call in enumerate(calls)]})  # fmt: skip
                else:
                    for k, piece in enumerate(out.pieces):
                        lp = (chat_logprobs([out.tokens[k]], [out.logprobs[k]])
                              if req.logprobs else None)  # fmt: skip
                        if piece or lp:
                            yield chunk(index, {"content": piece}, lp)
                yield chunk(index, {}, None, finish)
            if sampling.include_usage:
                yield chat_chunk(rid, created, self.model_name, [], counts)

        return await stream_events(request, events())

    async def _stream_completions(self, request, req, prompts, rid, created):
        """`stream: true` on /v1/completions: chunks as the tokens decode."""
        model, want_logprobs = self.model_name, req.logprobs is not None

        def event(index, emits):
            text = "".join(e.text for e in emits)
            lp = (completion_logprobs([e.token for e in emits], [e.logprob for e in emits],
                                      [e.offset for e in emits]) if want_logprobs else None)  # fmt: skip
            if not text and lp is None:
                return None
            return completion_chunk(rid, created, model, [
                {"index": index, "text": text, "logprobs": lp, "finish_reason": None}])  # fmt: skip

        def finish(index, reason):
            return completion_chunk(rid, created, model, [
                {"index": index, "text": "", "logprobs": None, "finish_reason": reason}])  # fmt: skip

        response, chosen = await self._stream(
            request, prompts, req.sampling, event, finish,
            lambda counts: completion_chunk(rid, created, model, [], counts),
        )  # fmt: skip
        self._record(rid, "completions", created, chosen, req.sampling, req.user, req.metadata)
        return response

    async def _stream_chat(self, request, req, prompt, rid, created, images=None):
        """`stream: true` on /v1/chat/completions without tool parsing: content chunks as
        the tokens decode (with tools the calls are parsed from the whole text: buffered)."""
        model = self.model_name

        def chunk(index, delta, logprobs=None, finish=None):
            return chat_chunk(rid, created, model, [
                {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            ])  # fmt: skip

        def event(index, emits):
            text = "".join(e.text for e in emits)
            lp = (chat_logprobs([e.token for e in emits], [e.logprob for e in emits])
                  if req.logprobs else None)  # fmt: skip
            return chunk(index, {"content": text}, lp) if text or lp else None

        response, chosen = await self._stream(
            request, [prompt], req.sampling, event, lambda index, reason: chunk(index, {}, None, reason),
            lambda counts: chat_chunk(rid, created, model, [], counts),
            start_event=lambda index: chunk(index, {"role": "assistant", "content": ""}),
            images=None if images is None else [images],
        )  # fmt: skip
        self._record(rid, "chat.completions", created, chosen, req.sampling, req.user,
                     req.metadata)  # fmt: skip
        return response

    # -- pieces --------------------------------------------------------------------------------

    async def _body(self, request: web.Request) -> dict:
        return await read_json(request, self.max_request_bytes, self.limits.body_timeout_s)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise RequestError(f"the model {model!r} does not exist; this server serves "
                               f"{self.model_name!r}", "model", "model_not_found",
                               status=404)  # fmt: skip

    def _single_token_stops(self, stops: list[str]) -> set[int]:
        """Stop strings that are one token: the engine can stop on them itself."""
        out = set()
        for stop in stops:
            ids = self.tokenizer.encode(stop, add_special_tokens=False)
            if len(ids) == 1 and self.tokenizer.decode(ids) == stop:
                out.add(int(ids[0]))
        return out

    def _params(self, sampling: Sampling) -> tuple[list, set[int]]:
        """One SamplingParams per choice (each its own seed), and the stop token ids."""
        from hybridflow.engine.sampling import SamplingParams

        stop_ids = set(self.prompts.check_ids(sampling.stop_token_ids, "stop_token_ids"))
        stop_ids |= self._single_token_stops(sampling.stop)
        if not sampling.ignore_eos and self.eos_id is not None:
            stop_ids.add(int(self.eos_id))
        # Not cut to each prompt's room (the engine stops at max_seq_len, finish "length").
        max_new = self.max_seq_len if sampling.max_tokens is None else sampling.max_tokens
        try:
            params = [
                SamplingParams(
                    n=1, temperature=sampling.temperature, top_k=sampling.top_k,
                    top_p=sampling.top_p, min_p=sampling.min_p, max_new_tokens=max_new,
                    stop_token_ids=tuple(sorted(stop_ids)), seed=sampling.choice_seed(j),
                    ignore_eos=sampling.ignore_eos,
                )
                for j in range(sampling.n)
            ]  # fmt: skip
        except ValueError as error:
            raise RequestError(str(error)) from None
        return params, stop_ids

    async def _generate(self, prompts: list[list[int]], sampling: Sampling,
                        episode: str | None = None, plan=None,
                        images=None) -> list[list[Output]]:  # fmt: skip
        """sampling.n outputs per prompt. episode: the one prompt is that episode's next turn
        (its trainer's sampling and budget; its KV kept between turns). images: the one
        prompt's."""
        params, _ = self._params(sampling)
        if episode is not None:
            params = [self._episode_params(episode, params[0], plan)]
            if params[0] is None:
                return [[finish_output(self.tokenizer, [], [], "length", [])]]
        extra = {} if episode is None or not hasattr(self.client, "close_session") else {
            "session": ("episode", episode)}  # fmt: skip
        if images is not None:
            extra["images"] = images
        calls = [self.client.generate(prompt, p, **extra) for prompt in prompts for p in params]
        try:
            completions = await asyncio.gather(*calls)
        except Exception as error:
            log.exception("generation failed")
            raise generation_failed(error) from None
        outputs = [
            finish_output(self.tokenizer, c.token_ids, c.logprobs, c.finish_reason,
                          sampling.stop, sampling.skip_special_tokens)
            for c in completions
        ]  # fmt: skip
        n = sampling.n
        return [outputs[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _episode_params(self, episode: str, params, plan):
        """The trainer's sampling for the episode's turn, within the episode's budget
        (None: the budget is spent)."""
        state = self.episodes.get(episode)
        params = self.episodes.turn_sampling(episode, params)
        if plan.restart or not state.messages:
            remaining = state.max_tokens  # the episode starts (again) from this prompt
        else:
            remaining = state.remaining(len(plan.delta))
        if remaining is not None:
            if remaining <= 0:
                return None  # no room left: an empty completion, finish "length"
            params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens,
                                                                    remaining))  # fmt: skip
        return params

    def _streams(self) -> bool:
        """Whether the client streams tokens as they decode (EngineClient does)."""
        return callable(getattr(self.client, "stream", None))

    async def _stream(self, request, prompts, sampling: Sampling, event, finish_event,
                      usage_event, start_event=lambda index: None, images=None):  # fmt: skip
        params, stop_ids = self._params(sampling)
        return await stream_choices(self.client, self.tokenizer, request, prompts, sampling,
                                    params, stop_ids, event, finish_event, usage_event,
                                    start_event, images)  # fmt: skip

    def _message(self, out: Output, parse_tool_calls: bool) -> tuple[dict, str]:
        message = {"role": "assistant", "content": out.text, "refusal": None}
        if parse_tool_calls:
            parsed = self.parser.parse(out.text)
            if parsed.calls:
                message["content"] = parsed.content or None
                message["tool_calls"] = [
                    {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                     "function": {"name": call.name,
                                  "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
                    for call in parsed.calls
                ]  # fmt: skip
                return message, "tool_calls"
        return message, out.finish_reason

    def _record(self, request_id: str, endpoint: str, created: int, chosen, sampling: Sampling,
                user: str | None, metadata: dict | None) -> None:  # fmt: skip
        prompts: dict[int, array] = {}  # the choices of one prompt share its array
        choices = []
        for index, prompt, out, finish in chosen:
            stored = prompts.setdefault(id(prompt), array("i", prompt))
            choices.append(choice_record(index, stored, out.token_ids, out.logprobs, finish))
        settings = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                    "top_k": sampling.top_k, "min_p": sampling.min_p, "seed": sampling.seed,
                    "max_tokens": sampling.max_tokens, "stop": list(sampling.stop)}  # fmt: skip
        self.records.add(RequestRecord(request_id, endpoint, self.model_name, created, choices, settings,
                                       user, metadata))  # fmt: skip


def build_app(engine, tokenizer, model_name: str, *, client=None, max_seq_len: int | None = None,
              vocab_size: int | None = None, max_records: int = 10_000,
              limits: ServerLimits | None = None, parser=None,
              image_processor=None) -> web.Application:  # fmt: skip
    """The server's Application.

    engine: a hybridflow Engine (None when `client` is given). tokenizer: encodes prompts,
    decodes completions, renders chats (its chat template). client: any object with
    `async generate(prompt_ids, params) -> Completion` (default: EngineClient(engine), closed
    with the app). max_seq_len / vocab_size: default to the engine's. max_records: request
    records kept (app[RECORDS]). limits: request sizes, counts and timeouts (limits.py;
    app[LIMITS]). parser: the ToolCallParser of chat completions with tools (default
    HermesParser). image_processor: a vision-language model's (data.images.ImageProcessor;
    required for one): chat messages may then carry image_url parts (serve/images.py)."""
    owned = client is None
    if client is None:
        if engine is None:
            raise ValueError("build_app needs an engine or a client")
        from hybridflow.agents.client import EngineClient

        client = EngineClient(engine)
    if max_seq_len is None:
        if engine is None:
            raise ValueError("build_app without an engine needs max_seq_len")
        max_seq_len = engine.max_seq_len
    if vocab_size is None:
        config = getattr(engine, "config", None)
        vocab_size = getattr(config, "vocab_size", None) or len(tokenizer)
    limits = limits or ServerLimits()
    records = RequestRecords(max_records)
    images = chat_images(engine, tokenizer, image_processor, max_seq_len, limits)
    server = OpenAIServer(tokenizer, model_name, client, max_seq_len, vocab_size, records,
                          limits, parser=parser, images=images)  # fmt: skip
    app = web.Application(middlewares=[request_deadlines, json_errors],
                          client_max_size=server.max_request_bytes)  # fmt: skip
    app[RECORDS] = records
    app[EPISODES] = server.episodes
    app[LIMITS] = limits
    if owned:  # the engine's thread stops with the server (not at interpreter exit)

        async def close_client(app: web.Application) -> None:
            client.close()

        app.on_cleanup.append(close_client)
    app.add_routes([
        web.get("/health", server.health),
        web.get("/v1/models", server.models),
        web.get("/v1/models/{model}", server.model),
        web.post("/v1/completions", server.completions),
        web.post("/v1/chat/completions", server.chat_completions),
        web.get("/v1/hybridflow/requests", server.list_records),
        web.get("/v1/hybridflow/requests/{id}", server.get_record),
    ])  # fmt: skip
    return app
