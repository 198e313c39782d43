"""Chat templates with tools, for tokenizers that come without one (the built-in char
tokenizer of the tiny presets). Real checkpoints bring their own (Qwen2.5's renders `tools`
and `tool` messages in the same Hermes format)."""

from __future__ import annotations

# ChatML with the Hermes tool format: the tools' JSON schemas in a system block, calls as
# <tool_call>{json}</tool_call> in the assistant's text, results as <tool_response> blocks.
CHATML_TOOL_TEMPLATE = (  # transformers renders with trim_blocks: newlines after tags go in {{ }}
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n' }}{% endif %}"
    "{{ 'Tools:' }}{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    '{{ \'\\nCall one with <tool_call>{"name": NAME, "arguments": {...}}</tool_call>'
    "<|im_end|>\\n' }}"
    "{% elif messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content']"
    " + '\\n</tool_response><|im_end|>\\n' }}"
    "{% elif message['role'] != 'system' %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def with_tool_template(tokenizer):
    """`tokenizer` with CHATML_TOOL_TEMPLATE (a copy; the original keeps its template)."""
    import copy

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = CHATML_TOOL_TEMPLATE
    return tokenizer


def renders_tool_messages(tokenizer) -> bool:
    """Whether the tokenizer's own chat template renders a `tool` message (and shows it)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
             {"role": "tool", "content": "tool-result-7"}]  # fmt: skip
    try:
        text = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    except Exception:  # jinja raise_exception, missing variables: it does not
        return False
    return "tool-result-7" in text
