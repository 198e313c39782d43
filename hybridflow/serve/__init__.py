"""An OpenAI-compatible HTTP server over the generation engine, so agent programs written
against the OpenAI API produce episodes that hybridflow can train on (every request's token
ids and log-probs are kept: records.py).

    hybridflow serve --model PATH [--host 127.0.0.1] [--port 8000]

app.py: build_app (the aiohttp Application: routes, streaming, errors); running.py:
BackgroundServer (it in a thread, for tests and a trainer in-process) and serve_forever;
openai_protocol.py: the request fields taken and the response shapes; prompts.py: requests
-> checked prompt ids; limits.py: ServerLimits (body size, prompt size, timeouts);
connections.py: the header deadline of every connection; text.py: token ids -> text, stop
strings; records.py: the request records; cli.py: the `serve` subcommand.

Built on aiohttp: one well-kept dependency, already present on the GPU machines, and a plain
async server with no framework on top (routing, JSON bodies and Server-Sent Events are all
this needs). Names are imported on first use, so the CLI lists `serve` without importing it.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "BackgroundServer": "hybridflow.serve.running",
    "RECORDS": "hybridflow.serve.app",
    "build_app": "hybridflow.serve.app",
    "RequestRecord": "hybridflow.serve.records",
    "RequestRecords": "hybridflow.serve.records",
    "ServerLimits": "hybridflow.serve.limits",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hybridflow.serve' has no attribute {name!r}")
