"""Hermes-layout function calling as text (asyncrl.rollout.tool_calls): the calls found in a
completion, what stays content, and the tools block offered to a model whose chat template
ignores `tools`."""

from __future__ import annotations

import json

from asyncrl.rollout.tool_calls import (
    ParsedOutput,
    ToolCall,
    hermes_system_prompt,
    parse_tool_calls,
    tool_call_text,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}


def test_text_without_calls_is_all_content():
    assert parse_tool_calls("The answer is 4.") == ParsedOutput("The answer is 4.")
    assert parse_tool_calls("") == ParsedOutput("")


def test_one_call_becomes_name_and_json_arguments():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.content is None
    assert parsed.tool_calls == (ToolCall("get_weather", '{"city": "Paris"}'),)
    assert json.loads(parsed.tool_calls[0].arguments) == {"city": "Paris"}


def test_text_around_calls_stays_content_and_calls_keep_their_order():
    text = ('Let me check both.\n<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call> done')
    parsed = parse_tool_calls(text)
    assert [c.name for c in parsed.tool_calls] == ["a", "b"]
    assert [json.loads(c.arguments) for c in parsed.tool_calls] == [{"x": 1}, {}]
    assert parsed.content == "Let me check both.\n\n done"


def test_arguments_given_as_a_string_are_kept_and_missing_ones_are_empty():
    parsed = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"k\\": 2}"}</tool_call>'
                              '<tool_call>{"name": "g"}</tool_call>')
    assert parsed.tool_calls == (ToolCall("f", '{"k": 2}'), ToolCall("g", "{}"))


def test_malformed_or_unclosed_calls_stay_content():
    for text in (
        "<tool_call>{not json}</tool_call>",
        '<tool_call>["get_weather"]</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa',  # cut off by max_tokens
    ):
        assert parse_tool_calls(text) == ParsedOutput(text), text


def test_a_malformed_call_beside_a_good_one_stays_content():
    text = '<tool_call>oops</tool_call><tool_call>{"name": "f", "arguments": {}}</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.tool_calls == (ToolCall("f", "{}"),)
    assert parsed.content == "<tool_call>oops</tool_call>"


def test_calls_written_by_tool_call_text_parse_back():
    for arguments in ({"city": "Paris"}, '{"city": "Paris"}'):
        text = tool_call_text("get_weather", arguments)
        assert parse_tool_calls(text).tool_calls == (
            ToolCall("get_weather", '{"city": "Paris"}'),)


def test_the_tools_block_lists_each_schema_and_asks_for_tool_call_tags():
    prompt = hermes_system_prompt([WEATHER])
    assert prompt.startswith("# Tools\n")
    inside = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in inside.splitlines()] == [WEATHER]
    assert "<tool_call></tool_call> XML tags" in prompt
    assert hermes_system_prompt([WEATHER], "Be brief.").startswith("Be brief.\n\n# Tools\n")
