"""AgentOptions: the config section `rollout.agent.*` (a plain dataclass: the config loads it
without torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.agents.sandbox_limits import ISOLATION_LEVELS

LOOPS = ("tools", "openai")


@dataclass(frozen=True)
class AgentOptions:
    loop: str | None = None
    """None: single-turn rollouts (one completion per prompt). "tools": multi-turn episodes
    with tool calls (hybridflow/agents/loop.py, ToolCallingLoop): the model's turns are
    trained on, tool results and template glue are masked out of the loss. "openai": your
    agent program (`program`) talks to the engine through the OpenAI API, in text; its
    episodes train token in, token out (hybridflow/agents/external.py)."""
    program: str | None = None
    """With loop "openai": "path/to/file.py:function", an async function (client, messages,
    *, model, extra_info) -> the final answer (str) or None (docs/agents.md)."""
    tools: list[str] = field(default_factory=list)
    """Tools the model may call: "calculator", "python" (a sandboxed interpreter), or
    "path/to/file.py:function" (a function of yours; its docstring and type hints describe
    it to the model)."""
    max_turns: int = 4
    """Model turns per episode."""
    max_tokens_per_turn: int | None = None
    """Tokens one turn may generate; None: data.max_response_length."""
    tool_timeout_s: float = 10.0
    """A tool call that takes longer is answered with a timeout error."""
    parser: str = "hermes"
    """How tool calls are read from the text: "hermes" (<tool_call>{json}</tool_call>)."""
    concurrency: int = 256
    """Episodes in flight at once per rollout worker."""
    python_timeout_s: float = 10.0
    """Wall-clock limit of one run of the "python" tool's sandbox."""
    sandbox_isolation: str = "auto"
    """How the "python" tool isolates the programs it runs: "strict" (a jail per program:
    no access to the machine's files or processes; refuse to start where the machine cannot
    build one), "basic" (own directory and limits only), "auto" (strict where possible, else
    basic with a warning). docs/agents.md, "The code sandbox"."""

    def validate(self) -> list[str]:
        problems = []
        if self.loop is not None and self.loop not in LOOPS:
            problems.append(f"loop={self.loop!r}: must be null (single turn) or one of {LOOPS}")
        if self.loop == "tools" and not self.tools:
            problems.append("tools=[]: a tool loop needs tools, e.g. [calculator]")
        if self.loop == "openai" and not self.program:
            problems.append("program=null: the openai loop runs your agent program, e.g. "
                            "program=my_agent.py:run")  # fmt: skip
        if self.program is not None and self.loop != "openai":
            problems.append(f"program={self.program!r} is only used with loop=openai")
        for name, value in (("max_turns", self.max_turns), ("concurrency", self.concurrency)):
            if not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r}: must be an integer >= 1")
        if self.max_tokens_per_turn is not None and self.max_tokens_per_turn < 1:
            problems.append(f"max_tokens_per_turn={self.max_tokens_per_turn}: must be >= 1")
        if self.tool_timeout_s <= 0 or self.python_timeout_s <= 0:
            problems.append("tool_timeout_s and python_timeout_s must be > 0")
        if self.sandbox_isolation not in ISOLATION_LEVELS:
            problems.append(f"sandbox_isolation={self.sandbox_isolation!r}: must be one of "
                            f"{ISOLATION_LEVELS}")  # fmt: skip
        if self.parser != "hermes":
            problems.append(f"parser={self.parser!r}: the known parser is 'hermes'")
        return problems
