"""A tool-capable chat template (Qwen2.5 / Hermes style) and the parser for the tool calls it elicits.

Models whose own template has no tool support (SmolLM2's) get `TOOL_CHAT_TEMPLATE`: ChatML turns,
tools listed in the system turn inside `<tools></tools>`, calls written by the model as

    <tool_call>
    {"name": "calculate", "arguments": {"expression": "3+4"}}
    </tool_call>

and consecutive tool results joined into one user turn of `<tool_response>` blocks. The template is
append-only: rendering a conversation and then a longer one that continues it only adds text at the end,
which token-in-token-out prompt building relies on.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

TOOL_CHAT_TEMPLATE = (
    "{%- macro text(c) -%}"
    "{%- if c is none -%}{%- elif c is string -%}{{- c -}}"
    "{%- else -%}{%- for p in c -%}{%- if p.type == 'text' -%}{{- p.text -}}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if messages and messages[0].role in ['system', 'developer'] -%}"
    "{%- set system = text(messages[0].content) -%}{%- set rest = messages[1:] -%}"
    "{%- else -%}{%- set system = 'You are a helpful assistant.' -%}{%- set rest = messages -%}{%- endif -%}"
    "{{- '<|im_start|>system\\n' + system -}}"
    "{%- if tools -%}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- for m in rest -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set c = text(m.content) -%}"
    "{{- '<|im_start|>assistant\\n' + c -}}"
    "{%- for tc in (m.tool_calls or []) -%}"
    "{%- set f = tc.function if tc.function is defined else tc -%}"
    "{%- if c or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' -}}"
    "{{- (f.arguments if f.arguments is string else (f.arguments | tojson)) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + text(m.content) + '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + text(m.content) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"   # what the template asks the model to write

# A block ends at its closing tag; one left unclosed ends where the next block opens or at the end of the text.
_TOOL_CALL = re.compile(rf"{TOOL_CALL_START}\s*(.*?)\s*(?:{TOOL_CALL_END}|(?={TOOL_CALL_START})|\Z)", re.DOTALL)
_TOOL_ROLE = re.compile(r"""['"]tool['"]""")


def supports_tools(template: str | None) -> bool:
    """Whether a chat template renders `tools` and tool turns (a textual heuristic: it mentions `tools`
    and either `tool_call(s)` or the role string `'tool'`)."""
    return bool(template) and "tools" in template and ("tool_call" in template or bool(_TOOL_ROLE.search(template)))


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split generated text into (content, tool_calls in OpenAI wire format).

    Every `<tool_call>{json}</tool_call>` block whose JSON is an object with a string `name` becomes
    `{"id": "call_<24 hex>", "type": "function", "function": {"name", "arguments": <JSON string>}}`;
    a block at the very end may lack its closing tag (generation hit end-of-turn). Blocks that do not
    parse stay in the content, so nothing the model wrote is lost.

    Args:
        text: the decoded completion (special tokens already removed).

    Returns:
        (content, tool_calls): content is the remaining text, stripped, or None when empty; the calls in
        order of appearance. `arguments` given as a JSON string is passed through; an object is dumped.
        Text the model wrote after the JSON object inside a block is dropped.
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for m in _TOOL_CALL.finditer(text):
        call = _to_call(m.group(1))
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None), calls


def _to_call(body: str) -> dict[str, Any] | None:
    try:  # the first JSON value; text the model wrote after it (before </tool_call>) is ignored
        obj, _ = json.JSONDecoder().raw_decode(body)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
    except (json.JSONDecodeError, RecursionError):   # RecursionError: nested too deeply to parse or dump
        return None
    return {"id": "call_" + secrets.token_hex(12), "type": "function",
            "function": {"name": obj["name"], "arguments": args}}
