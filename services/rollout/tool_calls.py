"""Function calling in the Hermes layout (Qwen2.5, Qwen3, Hermes 2/3 and the models trained on
their templates), as plain text in and out: no tokenizer, no HTTP.

The model is told about the tools in a `<tools>` block of the system message and answers a
call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the OpenAI-compatible API
(asyncrl.rollout.openai_api) renders the block where a model's chat template ignores `tools`
(`hermes_system_prompt`) and turns the tags in the output into OpenAI `tool_calls`
(`parse_tool_calls`). What is not a well-formed call stays text, as vLLM's Hermes parser
leaves it: a tag whose body is not a JSON object with a string `name` is content, and so is an
unclosed tag (generation cut off by max_tokens).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

# Qwen2.5's chat template, word for word (its `tools` branch), so a model trained on it sees
# the layout it knows.
_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's name and its arguments as a JSON string (the
    form OpenAI's `function.arguments` takes)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedOutput:
    """A completion's text split into what the model said (`content`: the text outside the
    calls, None when there is none) and the calls it made, in order."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


def hermes_system_prompt(tools: list[dict[str, Any]], system: str | None = None) -> str:
    """The system message that offers `tools` (OpenAI tool definitions,
    `{"type": "function", "function": {...}}`) in the Hermes layout, after `system` if any."""
    lines = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    block = _TOOLS_HEADER + lines + _TOOLS_FOOTER
    return f"{system}\n\n{block}" if system else block


def tool_call_text(name: str, arguments: str | dict[str, Any]) -> str:
    """A call as the model writes it (how an assistant turn that made calls is shown to a model
    whose template ignores `tool_calls`)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def parse_tool_calls(text: str) -> ParsedOutput:
    """Splits `text` into content and the well-formed `<tool_call>` blocks in it."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    position = 0
    for match in _TOOL_CALL.finditer(text):
        call = _call(match.group(1))
        if call is None:
            continue  # not a call: the tag and its body stay content
        kept.append(text[position:match.start()])
        position = match.end()
        calls.append(call)
    if not calls:
        return ParsedOutput(text)
    kept.append(text[position:])
    content = "".join(kept).strip()
    return ParsedOutput(content or None, tuple(calls))


def _call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return ToolCall(value["name"], arguments)
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))
