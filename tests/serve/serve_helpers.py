"""What the serve tests share besides fixtures: the server's tokenizer and context length, and
a scripted generation client (a module of its own, not conftest: see
tests/models/model_helpers.py)."""

from types import SimpleNamespace

from hybridflow.agents.templates import with_tool_template
from hybridflow.models.tokenizer import build_char_tokenizer

TOKENIZER = with_tool_template(build_char_tokenizer())
MAX_SEQ_LEN = 512
EOS = TOKENIZER.eos_token_id


class ScriptedClient:
    """Answers request k with script[k] as tokens ending in EOS (log-prob -0.25 each); keeps
    each prompt it was given. A script entry that is an exception is raised instead."""

    def __init__(self, script):
        self.script, self.prompts = list(script), []

    async def generate(self, prompt_ids, params):
        self.prompts.append(list(prompt_ids))
        answer = self.script[(len(self.prompts) - 1) % len(self.script)]
        if isinstance(answer, Exception):
            raise answer
        ids = TOKENIZER.encode(answer, add_special_tokens=False) + [EOS]
        return SimpleNamespace(token_ids=ids, logprobs=[-0.25] * len(ids), finish_reason="stop")
