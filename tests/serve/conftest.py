"""A server over the tiny preset (random weights, char tokenizer with the tool template) in
a background thread, shared by the serve tests, and an OpenAI client of it."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

from serve_helpers import MAX_SEQ_LEN, TOKENIZER, ScriptedClient  # noqa: E402


@pytest.fixture(scope="session")
def engine_client():
    """The EngineClient the server's requests go through."""
    from hybridflow.agents.client import EngineClient
    from hybridflow.engine import Engine, EngineOptions
    from hybridflow.models import load_model

    options = EngineOptions(decode_backend="torch", cuda_graphs=False)
    engine = Engine(load_model("tiny"), max_batch_size=32, max_seq_len=MAX_SEQ_LEN,
                    options=options)  # fmt: skip
    return EngineClient(engine)


@pytest.fixture(scope="session")
def tiny_server(engine_client):
    from hybridflow.serve.app import build_app
    from hybridflow.serve.running import BackgroundServer

    app = build_app(engine_client.engine, TOKENIZER, "tiny", client=engine_client)
    with BackgroundServer(app) as server:
        yield server


@pytest.fixture(scope="session")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="session")
def records(tiny_server):
    from hybridflow.serve.app import RECORDS

    return tiny_server.app[RECORDS]


@pytest.fixture
def scripted():
    """start(script, tokenizer=TOKENIZER, **build_app options) -> (OpenAI client, the
    ScriptedClient, app): a server without an engine (max_seq_len 4096 unless given),
    stopped after the test; the client's base_url is the server's URL + /v1."""
    from hybridflow.serve.app import build_app
    from hybridflow.serve.running import BackgroundServer

    servers = []

    def start(script, tokenizer=TOKENIZER, **kwargs):
        fake = ScriptedClient(script)
        kwargs.setdefault("max_seq_len", 4096)
        app = build_app(None, tokenizer, "scripted", client=fake, **kwargs)
        server = BackgroundServer(app).start()
        servers.append(server)
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        return api, fake, app

    yield start
    for server in servers:
        server.stop()
