"""What the serve tests share besides fixtures: the server's tokenizer and context length (a
module of its own, not conftest: see tests/models/model_helpers.py)."""

from hybridflow.agents.templates import with_tool_template
from hybridflow.models.tokenizer import build_char_tokenizer

TOKENIZER = with_tool_template(build_char_tokenizer())
MAX_SEQ_LEN = 512
