"""OpenAI tool calling (mars_local.chat.tools): request checks, template families, parsing
model output (whole and streamed), and the grammars that force a call."""

from __future__ import annotations

import itertools
import json
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mars_local.chat.tools import (
    MAX_TOOLS, SUPPORTED_FORMATS, ContentDelta, StreamingToolParser, Tool, ToolCallArgs, ToolCallStart,
    ToolChoice, new_call_id, parse_parallel_tool_calls, parse_tool_calls, parse_tool_choice,
    parse_tools, tool_format,
)
from mars_local.chat.tool_grammar import call_schema, tools_gbnf
from mars_local.core.errors import MarsError


def fn(name="f", **kw) -> dict:
    return {"type": "function", "function": {"name": name, **kw}}


def nested(depth: int) -> dict:
    """Parameters whose objects and arrays nest ``depth`` levels (the parameters object is 1)."""
    inner: list = []
    for _ in range(depth - 2):
        inner = [inner]
    return {"type": "object", "properties": inner} if depth > 1 else {"type": "object"}


WEATHER = fn("get_weather", description="The weather in a city", parameters={
    "type": "object", "required": ["city"],
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}})
TOOLS = parse_tools([WEATHER, fn("noop")])


# ------------------------------------------------------------------ requests
@pytest.mark.parametrize("value, field, words", [
    ("get_weather", "tools", "must be an array of tools, got a string"),
    ({"type": "function"}, "tools", "must be an array of tools, got an object"),
    ([fn()] * (MAX_TOOLS + 1), "tools", f"may hold at most {MAX_TOOLS} tools, got {MAX_TOOLS + 1}"),
    ([fn("a"), 3], "tools[1]", "must be an object, got an integer"),
    ([{"type": "retrieval", "function": {"name": "f"}}], "tools[0].type", "must be 'function', got 'retrieval'"),
    ([{"function": {"name": "f"}}], "tools[0].type", "must be 'function', got None"),
    ([{"type": "function"}], "tools[0].function", "must be an object, got null"),
    ([{"type": "function", "function": "f"}], "tools[0].function", "must be an object, got a string"),
    ([{"type": "function", "function": {}}], "tools[0].function.name", "must be a string, got null"),
    ([fn(7)], "tools[0].function.name", "must be a string, got an integer"),
    ([fn("get weather")], "tools[0].function.name", "1 to 64 letters, digits, '_' or '-', got 'get weather'"),
    ([fn("")], "tools[0].function.name", "1 to 64 letters"),
    ([fn("a" * 65)], "tools[0].function.name", "1 to 64 letters"),
    ([fn("f\n")], "tools[0].function.name", "1 to 64 letters"),
    ([fn("ünïcode")], "tools[0].function.name", "1 to 64 letters"),
    ([fn("a"), fn("b"), fn("c"), fn("b")], "tools[3].function.name", "'b' is already the name of tools[1]"),
    ([fn(description=3)], "tools[0].function.description", "must be a string, got an integer"),
    ([fn(parameters=[])], "tools[0].function.parameters", "must be an object (a JSON Schema), got an array"),
    ([fn(parameters="{}")], "tools[0].function.parameters", "must be an object (a JSON Schema), got a string"),
    ([fn(parameters={"type": "string"})], "tools[0].function.parameters", "must describe an object"),
    ([fn(strict="yes")], "tools[0].function.strict", "must be a boolean, got a string"),
    ([fn("a"), fn("b", description="x" * (256 << 10))], "tools", "is too large: more than 256 KiB of JSON"),
    ([fn("a"), fn("b", parameters={"type": "object", "enum": ["é" * 1000] * 140})], "tools", "too large"),
    ([fn("a"), fn("b", parameters=nested(33))], "tools[1].function.parameters", "deeper than 32 levels"),
])
def test_bad_tools_are_one_line_errors_naming_the_field(value, field, words):
    with pytest.raises(MarsError) as exc:
        parse_tools(value)
    assert exc.value.field == field
    assert words in str(exc.value) and f"'{field}'" in str(exc.value)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("value, expected", [
    (None, ()),
    ([], ()),
    ([fn("get_weather-2", description="d", parameters={"type": "object"}, strict=True)],
     (Tool("get_weather-2", "d", {"type": "object"}),)),
    ([fn("A" * 64), fn("b", parameters=nested(32))], (Tool("A" * 64), Tool("b", None, nested(32)))),
    ([fn("b", parameters={"properties": {"x": {"type": "integer"}}}, extra="ignored")],
     (Tool("b", None, {"properties": {"x": {"type": "integer"}}}),)),
    ([fn(str(i)) for i in range(MAX_TOOLS)], tuple(Tool(str(i)) for i in range(MAX_TOOLS))),
])
def test_good_tools(value, expected):
    assert parse_tools(value) == expected


def test_ten_thousand_tools_are_refused_before_any_is_read():
    value = [{"type": "function", "function": {"name": f"t{i}", "parameters": nested(20)}} for i in range(10_000)]
    t0 = time.perf_counter()
    with pytest.raises(MarsError, match="at most 128 tools") as exc:
        parse_tools(value)
    assert time.perf_counter() - t0 < 0.05
    assert exc.value.field == "tools"


@pytest.mark.parametrize("kind", ["arrays", "objects"])
def test_a_100000_deep_schema_is_refused_without_recursion(kind):
    deep: object = {}
    for _ in range(100_000):
        deep = [deep] if kind == "arrays" else {"a": deep}
    t0 = time.perf_counter()
    with pytest.raises(MarsError) as exc:  # a RecursionError would fail the test
        parse_tools([fn("f", parameters={"type": "object", "default": deep})])
    assert time.perf_counter() - t0 < 0.5
    # 200 KB of arrays fits in 256 KiB (refused for its depth); 600 KB of objects does not
    want = ("tools[0].function.parameters", "deeper") if kind == "arrays" else ("tools", "too large")
    assert (exc.value.field, want[1] in str(exc.value)) == (want[0], True)


@pytest.mark.parametrize("value, tools, expected", [
    (None, TOOLS, ToolChoice("auto")),
    (None, (), ToolChoice("none")),
    ("none", (), ToolChoice("none")),
    ("auto", TOOLS, ToolChoice("auto")),
    ("none", TOOLS, ToolChoice("none")),
    ("required", TOOLS, ToolChoice("required")),
    ({"type": "function", "function": {"name": "noop"}}, TOOLS, ToolChoice("function", "noop")),
    ("required", (), ("tool_choice", "needs 'tools'")),
    ({"type": "function", "function": {"name": "noop"}}, (), ("tool_choice", "needs 'tools'")),
    ("any", TOOLS, ("tool_choice", "must be 'auto', 'none', 'required' or")),
    (["auto"], TOOLS, ("tool_choice", "must be a string or an object, got an array")),
    ({"type": "tool", "function": {"name": "noop"}}, TOOLS, ("tool_choice.type", "must be 'function'")),
    ({"type": "function"}, TOOLS, ("tool_choice.function.name", "must be a string, got null")),
    ({"type": "function", "function": {"name": 1}}, TOOLS, ("tool_choice.function.name", "must be a string")),
    ({"type": "function", "function": {"name": "nope"}}, TOOLS,
     ("tool_choice.function.name", "'nope' is not one of the tools")),
])
def test_tool_choice(value, tools, expected):
    if isinstance(expected, ToolChoice):
        assert parse_tool_choice(value, tools) == expected
        return
    with pytest.raises(MarsError) as exc:
        parse_tool_choice(value, tools)
    assert (exc.value.field, expected[1] in str(exc.value), "\n" in str(exc.value)) == (expected[0], True, False)


@pytest.mark.parametrize("value, expected", [(None, True), (True, True), (False, False), (0, None), ("no", None)])
def test_parallel_tool_calls(value, expected):
    if expected is not None:
        assert parse_parallel_tool_calls(value) is expected
        return
    with pytest.raises(MarsError, match="'parallel_tool_calls' must be a boolean") as exc:
        parse_parallel_tool_calls(value)
    assert exc.value.field == "parallel_tool_calls"


# ------------------------------------------------------------------ templates
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- endif %}
{%- for message in messages %}{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}
    {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}{%- endif %}{%- endfor %}"""
QWEN3_CODER = """{%- if tools %}<tools>{% for tool in tools %}<function><name>{{ tool.name }}</name></function>{% endfor %}</tools>
If you choose to call a function ONLY reply in the following format:
<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call>{% endif %}"""
LLAMA31 = """{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{%- for message in messages %}{%- if 'tool_calls' in message %}
    {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
        {{- "<|python_tag|>" + tool_call.name + ".call(" }}
    {%- endif %}
    {%- if builtin_tools is defined %}{{- "<|eom_id|>" }}{%- else %}{{- "<|eot_id|>" }}{%- endif %}
{%- endif %}{%- endfor %}"""
LLAMA32 = """{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}"""
LLAMA_INSTRUCTION = """{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
{%- endif %}"""
MISTRAL_V3 = """{%- for message in loop_messages %}{%- if message.tool_calls is defined %}
        {{- "[TOOL_CALLS] [" }}{%- for tool_call in tool_calls %}{{- tool_call.function|tojson }}{%- endfor %}
{%- elif message["role"] == "tool" %}{{- '[TOOL_RESULTS] {"content": ' + content|string + "}[/TOOL_RESULTS]" }}
{%- endif %}{%- endfor %}"""
MISTRAL_V11 = """{%- for tool in message.tool_calls %}
    {{- '[TOOL_CALLS]' + tool.function.name + '[ARGS]' + tool.function.arguments|tojson }}
{%- endfor %}"""
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3_NO_TOOLS = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                   "{{ m['content'] | trim }}<|eot_id|>{% endfor %}")
GRANITE = "{%- if tools %}<|start_of_role|>available_tools<|end_of_role|>{{ tools | tojson }}{% endif %}<|tool_call|>"


@pytest.mark.parametrize("source, family", [
    (QWEN25, "hermes"),
    ("{{ '<tool_call>' }}{{ tool_call | tojson }}{{ '</tool_call>' }}", "hermes"),
    (LLAMA31, "llama3"),
    (LLAMA32, "llama3"),
    (LLAMA_INSTRUCTION, "llama3"),
    (MISTRAL_V3, "mistral"),
    (MISTRAL_V11, "mistral"),
    (QWEN3_CODER, "unknown"),
    (GRANITE, "unknown"),
    (CHATML, None),
    (LLAMA3_NO_TOOLS, None),
    ("", None),
    (None, None),
])
def test_tool_format_from_the_template_source(source, family):
    assert tool_format(source) == family
    assert family is None or family == "unknown" or family in SUPPORTED_FORMATS


# ------------------------------------------------------------------ parsing
def counter():
    n = itertools.count()
    return lambda: f"id{next(n)}"


W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
W_ARGS = '{"city":"Paris"}'
UNI = '{"name": "note", "arguments": {"text": "Zürich, 日本 ✓ \\u00e9 \\"q\\""}}'
UNI_ARGS = '{"text":"Zürich, 日本 ✓ é \\"q\\""}'


@pytest.mark.parametrize("fmt, text, content, calls", [
    # hermes
    ("hermes", f"<tool_call>\n{W}\n</tool_call>", "", [("get_weather", W_ARGS)]),
    ("hermes", f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n" '{"name": "noop", "arguments": {}}\n</tool_call>',
     "", [("get_weather", W_ARGS), ("noop", "{}")]),
    ("hermes", f"Let me check.\n<tool_call>{W}</tool_call>\nDone.", "Let me check.\n\nDone.",
     [("get_weather", W_ARGS)]),
    ("hermes", f"<tool_call>   \n\t{W}  </tool_call>", "", [("get_weather", W_ARGS)]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {oops}}\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": {oops}}\n</tool_call>', []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    ("hermes", f"<tool_call>junk <tool_call>{W}</tool_call>", "<tool_call>junk", [("get_weather", W_ARGS)]),
    ("hermes", f"<tool_call>{UNI}</tool_call>", "", [("note", UNI_ARGS)]),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", '{"a":1}')]),
    ("hermes", '<tool_call>{"name": "f"}</tool_call>', "", [("f", "{}")]),
    ("hermes", f"<tool_call>\n{W}\n", "", [("get_weather", W_ARGS)]),  # stopped before </tool_call>
    ("hermes", '<tool_call>\n{"name": "get_weather", "argu', '<tool_call>\n{"name": "get_weather", "argu', []),
    ("hermes", "  Just text, no <tool> calls.  ", "Just text, no <tool> calls.", []),
    # llama3
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", W_ARGS)]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", W_ARGS)]),
    ("llama3", ' \n{"type": "function", "name": "f", "parameters": {}}', "", [("f", "{}")]),
    ("llama3", f"{W}; " '{"name": "noop", "parameters": {}}', "", [("get_weather", W_ARGS), ("noop", "{}")]),
    ("llama3", f"{W}\n" '{"name": "noop", "parameters": {}}\n', "", [("get_weather", W_ARGS), ("noop", "{}")]),
    ("llama3", f"Checking.<|python_tag|>{W}", "Checking.", [("get_weather", W_ARGS)]),
    ("llama3", f"{W}\nIt is sunny.", "It is sunny.", [("get_weather", W_ARGS)]),
    ("llama3", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ("llama3", '{"name": "f", "parameters": {', '{"name": "f", "parameters": {', []),
    ("llama3", f"Here: {W}", f"Here: {W}", []),
    ("llama3", '<|python_tag|>brave_search.call(query="x")', '<|python_tag|>brave_search.call(query="x")', []),
    ("llama3", UNI.replace('"arguments"', '"parameters"'), "", [("note", UNI_ARGS)]),
    # mistral
    ("mistral", f"[TOOL_CALLS][{W}]", "", [("get_weather", W_ARGS)]),
    ("mistral", f'[TOOL_CALLS] [{W[:-1]}, "id": "abcdefghi"}}, ' '{"name": "noop", "arguments": {}}]', "",
     [("get_weather", W_ARGS), ("noop", "{}")]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [("get_weather", W_ARGS)]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]noop[CALL_ID]a1b2c3d4e[ARGS] {}', "",
     [("get_weather", W_ARGS), ("noop", "{}")]),
    ("mistral", f"Sure. [TOOL_CALLS][{W}]", "Sure.", [("get_weather", W_ARGS)]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": }]', '[TOOL_CALLS][{"name": "f", "arguments": }]', []),
    ("mistral", "[TOOL_CALLS]f[ARGS]not json", "[TOOL_CALLS]f[ARGS]not json", []),
    ("mistral", "[TOOL_CALLS]f[ARGZ]{}", "[TOOL_CALLS]f[ARGZ]{}", []),
    ("mistral", "[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
    ("mistral", "[TOOL_CALLS]", "[TOOL_CALLS]", []),
    ("mistral", f"[TOOL_CALLS][{UNI}]", "", [("note", UNI_ARGS)]),
    # no family: all content
    (None, f"<tool_call>{W}</tool_call>", f"<tool_call>{W}</tool_call>", []),
])
def test_parse_tool_calls(fmt, text, content, calls):
    got_content, got = parse_tool_calls(fmt, text, new_id=counter())
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    assert [c.id for c in got] == [f"id{i}" for i in range(len(calls))]


def test_call_ids_are_openai_shaped_and_distinct():
    _, calls = parse_tool_calls("hermes", f"<tool_call>{W}</tool_call><tool_call>{W}</tool_call>")
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", c.id) for c in calls)
    assert calls[0].id != calls[1].id and re.fullmatch(r"call_[A-Za-z0-9]{24}", new_call_id())


def test_an_unknown_format_is_refused():
    with pytest.raises(MarsError, match="unknown tool-call format 'xml'"):
        StreamingToolParser("xml")


# ------------------------------------------------------------------ streaming
START = ToolCallStart(0, "id0", "get_weather")
ARGS = ToolCallArgs(0, W_ARGS)


@pytest.mark.parametrize("fmt, deltas, events", [
    # a possible trigger is held back until it is known not to be one
    ("hermes", ["Hello <tool", "kit is here"], [[ContentDelta("Hello")], [ContentDelta(" <toolkit is here")], []]),
    ("hermes", ["Hi <", "tool_call>\n", W, "\n</tool_", "call> bye"],
     [[ContentDelta("Hi")], [], [], [], [START, ARGS, ContentDelta("  bye")], []]),
    ("hermes", ["Hi ", "there ", "\n"], [[ContentDelta("Hi")], [ContentDelta(" there")], [], []]),
    ("hermes", ["Hi ", "\n", "there"], [[ContentDelta("Hi")], [], [ContentDelta(" \nthere")], []]),
    ("hermes", ["<tool_call>{bad", "}</tool_call>"], [[], [ContentDelta("<tool_call>{bad}</tool_call>")], []]),
    ("hermes", ["<tool_call>{bad"], [[], [ContentDelta("<tool_call>{bad")]]),
    ("llama3", ["  {", '"name": "get_weather", "parameters": {"city": "Paris"}', "}"], [[], [], [START, ARGS], []]),
    ("llama3", ["{", '"x": 1}'], [[], [ContentDelta('{"x": 1}')], []]),
    ("llama3", ['{"x"'], [[], [ContentDelta('{"x"')]]),
    ("llama3", ["Sure", " {}"], [[ContentDelta("Sure")], [ContentDelta(" {}")], []]),
    ("llama3", ["ok <|python", "_tag|>", W], [[ContentDelta("ok")], [], [START, ARGS], []]),
    ("mistral", ["[TOOL", "S] done"], [[], [ContentDelta("[TOOLS] done")], []]),
    ("mistral", ["[TOOL_CALLS]get_wea", "ther[AR", 'GS]{"city": "Paris"', "}"], [[], [], [], [START, ARGS], []]),
    ("mistral", ["[TOOL_CALLS]get weather"], [[ContentDelta("[TOOL_CALLS]get weather")], []]),
])
def test_streaming_events(fmt, deltas, events):
    p = StreamingToolParser(fmt, new_id=counter())
    assert [p.feed(d) for d in deltas] + [p.finish()] == events


FRAGMENTS = {
    "hermes": [f"<tool_call>\n{W}\n</tool_call>", '<tool_call>{"name":"noop","arguments":{}}</tool_call>',
               '<tool_call>{"name": "f", "arguments": {"q": "<tool_call> é"}}</tool_call>',
               "<tool_call>{bad json}</tool_call>", '<tool_call>{"name": 1}</tool_call>', "<tool_call>",
               "</tool_call>", "<tool", "<", "Hello", " ", "\n", "world.", "日本", "{", "}", "tool_call>"],
    "llama3": ['{"name": "f", "parameters": {"x": 1}}', "<|python_tag|>", '{"name": "g", "arguments": {"s": "a;b}"}}',
               ";", "\n", " ", "text", '{"answer": 1}', '{"name": "h"', "<|python", "é", "}", '"', "{", "\\"],
    "mistral": ["[TOOL_CALLS]", f"[TOOL_CALLS][{W}]", '[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": "g", '
                '"arguments": {"s": "]"}}]', '[TOOL_CALLS]f[ARGS]{"a": 1}', "g[CALL_ID]abc123456[ARGS]{}", "[ARGS]",
                "[TOOL_", "name", "{", "]", "[", " ", "text", "é", '"'],
}


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_split_of_the_output_streams_what_the_whole_parses(data):
    fmt = data.draw(st.sampled_from(SUPPORTED_FORMATS))
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS[fmt]), max_size=8)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    p = StreamingToolParser(fmt, new_id=counter())
    events = []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        events += p.feed(text[a:b])
    events += p.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    args = {i: "".join(e.delta for e in events if isinstance(e, ToolCallArgs) and e.index == i)
            for i in range(len(starts))}
    want_content, want_calls = parse_tool_calls(fmt, text, new_id=counter())
    assert content == want_content
    assert [(s.index, s.id, s.name, args[s.index]) for s in starts] == [
        (i, c.id, c.name, c.arguments) for i, c in enumerate(want_calls)]
    assert all(e.text for e in events if isinstance(e, ContentDelta))


# ------------------------------------------------------------------ grammars
@pytest.mark.parametrize("tools, choice, key, expected", [
    (TOOLS, ToolChoice("function", "noop"), "arguments",
     {"$defs": {"args-1": {"type": "object"}}, "anyOf": [
         {"type": "object", "properties": {"name": {"const": "noop"}, "arguments": {"$ref": "#/$defs/args-1"}},
          "required": ["name", "arguments"], "additionalProperties": False}]}),
    (TOOLS[:1], ToolChoice("required"), "parameters",
     {"$defs": {"args-0": TOOLS[0].parameters}, "anyOf": [
         {"type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": {"$ref": "#/$defs/args-0"}},
          "required": ["name", "parameters"], "additionalProperties": False}]}),
    (parse_tools([fn("p", parameters={
        "properties": {"a": {"$ref": "#/$defs/A"}, "b": {"$ref": "#"}},
        "$defs": {"A": {"type": "object", "properties": {"c": {"$ref": "#/$defs/A"}}}}})]),
     ToolChoice("auto"), "arguments",
     {"$defs": {"args-0": {"type": "object",
                           "properties": {"a": {"$ref": "#/$defs/t0-A"}, "b": {"$ref": "#/$defs/args-0"}}},
                "t0-A": {"type": "object", "properties": {"c": {"$ref": "#/$defs/t0-A"}}}},
      "anyOf": [{"type": "object", "properties": {"name": {"const": "p"}, "arguments": {"$ref": "#/$defs/args-0"}},
                 "required": ["name", "arguments"], "additionalProperties": False}]}),
])
def test_call_schema(tools, choice, key, expected):
    assert call_schema(tools, choice, key=key) == expected


@pytest.fixture(scope="module")
def model(request):
    pytest.importorskip("llama_cpp")
    return request.getfixturevalue("plain")


def accepts(eng, gbnf: str, text: str, triggers=()) -> bool:
    """Whether llama.cpp's grammar sampler (on the tiny model's byte-level vocabulary) lets the
    model write exactly ``text`` and then end (``triggers``: a lazy grammar's)."""
    import numpy as np

    from mars_local.speculate.grammar import GrammarState

    m = eng.target
    toks = m.tokenize(text, add_special=False, parse_special=False)
    if toks and m.piece(toks[0]) == b" " and not text.startswith(" "):
        toks = toks[1:]  # the tokenizer's leading space
    gs = GrammarState(m, gbnf, triggers=triggers)
    try:
        for t in toks + [None]:
            row = np.zeros(m.n_vocab, np.float32)
            gs.mask(row)
            if t is None:
                return all(np.isfinite(row[e]) for e in eng.eog_ids)
            if not np.isfinite(row[t]):
                return False
            gs.accept(t)
    finally:
        gs.close()


NOOP = '{"name": "noop", "arguments": {}}'
OUTPUTS = {  # fmt -> (one call to get_weather, two calls, one call to noop)
    "hermes": (f"<tool_call>\n{W}\n</tool_call>", f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{NOOP}\n</tool_call>",
               f"<tool_call>\n{NOOP}\n</tool_call>"),
    "llama3": (W.replace("arguments", "parameters"), W.replace("arguments", "parameters") + "; "
               + NOOP.replace("arguments", "parameters"), NOOP.replace("arguments", "parameters")),
    "mistral": (f"[TOOL_CALLS][{W}]", f"[TOOL_CALLS][{W}, {NOOP}]", "[TOOL_CALLS]noop[ARGS]{}"),
}


@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
@pytest.mark.parametrize("parallel", [False, True])
def test_tools_gbnf_forces_calls_in_the_family_syntax(model, fmt, parallel):
    one, two, noop = OUTPUTS[fmt]
    required = tools_gbnf(fmt, TOOLS, ToolChoice("required"), parallel)
    named = tools_gbnf(fmt, TOOLS, ToolChoice("function", "noop"), parallel)
    assert re.findall(r"(?m)^root ::=", required) == ["root ::="] and re.search(r"(?m)^call ::=", required)
    assert accepts(model, required, one) and accepts(model, required, noop)
    assert accepts(model, required, two) is parallel
    assert not accepts(model, required, one.replace("get_weather", "get_wheather"))
    assert not accepts(model, required, "I will call a tool.")
    assert accepts(model, named, noop) and not accepts(model, named, one)
    for text in (one, two, noop):  # what the grammar lets through parses back as calls
        content, calls = parse_tool_calls(fmt, text)
        assert content == "" and [c.name for c in calls] == re.findall(r"get_weather|noop", text)


@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
def test_an_auto_answer_is_free_until_it_opens_a_call_then_the_call_is_constrained(model, fmt):
    """tool_choice auto: the calls' grammar made lazy by the family's trigger words."""
    from mars_local.chat.tool_grammar import tool_triggers

    one, two, noop = OUTPUTS[fmt]
    g, trig = tools_gbnf(fmt, TOOLS, ToolChoice("auto"), True), tool_triggers(fmt)
    assert all(any(out.startswith(t) for t in trig) for out in OUTPUTS[fmt])  # every call opens with one
    for text in ("I will call a tool.", "no {braces} nor <tags> [here]", ""):
        assert accepts(model, g, text, trig) and not accepts(model, g, text)  # free text, then the end
    for call in (one, two, noop):
        assert accepts(model, g, call, trig) and accepts(model, g, "Let me check. " + call, trig)
    broken = one.replace("get_weather", "get_wheather")
    assert not accepts(model, g, broken, trig)  # once the call opened, a wrong name is refused
    assert not accepts(model, g, one + " and some more text", trig)  # after the calls: only the end


def test_tool_triggers_of_an_unknown_format_are_refused():
    from mars_local.chat.tool_grammar import tool_triggers

    with pytest.raises(MarsError, match="unknown tool-call format 'xml'"):
        tool_triggers("xml")


def test_mistral_gbnf_takes_both_syntaxes(model):
    g = tools_gbnf("mistral", TOOLS, ToolChoice("required"), True)
    for text in ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]noop[ARGS]{}',
                 f"[TOOL_CALLS] [{W}]"):
        assert accepts(model, g, text)
    assert not accepts(model, g, "[TOOL_CALLS]get_weather[ARGS]{}")  # "city" is required


NESTED = parse_tools([fn("order", parameters={
    "type": "object", "required": ["items", "ship"], "additionalProperties": False,
    "properties": {
        "items": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["sku", "qty"],
            "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                           "size": {"enum": ["S", "M", "L"]}}}},
        "ship": {"$ref": "#/$defs/Address"}, "root": {"const": "root"}},
    "$defs": {"Address": {"type": "object", "required": ["city"],
                          "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}}}})])


@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
def test_tools_gbnf_for_nested_objects_enums_arrays_and_refs(model, fmt):
    g = tools_gbnf(fmt, NESTED, ToolChoice("required"), False)
    args = '{"items": [{"sku": "a1", "qty": 2, "size": "M"}], "ship": {"city": "Oslo"}, "root": "root"}'
    call = f'{{"name": "order", "{"parameters" if fmt == "llama3" else "arguments"}": {args}}}'
    text = {"hermes": f"<tool_call>\n{call}\n</tool_call>", "llama3": call, "mistral": f"[TOOL_CALLS][{call}]"}[fmt]
    assert accepts(model, g, text)
    assert not accepts(model, g, text.replace('"M"', '"XL"'))
    assert not accepts(model, g, text.replace("Oslo", "Os\x01lo"))  # JSON strings hold no raw control characters
    assert not accepts(model, g, text.replace('"ship": {"city": "Oslo"}', '"ship": {"zip": "1"}'))
    assert '"\\"root\\""' in g  # a literal "root" is not a rule reference
    assert parse_tool_calls(fmt, text)[1][0].arguments == json.dumps(json.loads(args), separators=(",", ":"))


def test_a_grammar_for_128_tools_compiles_fast(model):
    from mars_local.speculate.grammar import GrammarState

    tools = parse_tools([fn(f"tool_{i}", parameters={
        "type": "object", "required": ["q"],
        "properties": {"q": {"type": "string"}, "n": {"type": "integer"}, "mode": {"enum": ["a", "b"]}}})
        for i in range(MAX_TOOLS)])
    for fmt in SUPPORTED_FORMATS:
        t0 = time.perf_counter()
        GrammarState(model.target, tools_gbnf(fmt, tools, ToolChoice("required"), True)).close()
        assert time.perf_counter() - t0 < 2


@pytest.mark.parametrize("fmt, choice, words", [
    ("hermes", ToolChoice("none"), "needs 'tool_choice' 'auto', 'required' or a function"),
    ("xml", ToolChoice("required"), "unknown tool-call format 'xml'"),
])
def test_tools_gbnf_refuses_what_no_grammar_means(fmt, choice, words):
    with pytest.raises(MarsError, match=re.escape(words)):
        tools_gbnf(fmt, TOOLS, choice, True)


@pytest.mark.parametrize("fmt, whole, open_call", [
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n',
     '<tool_call>\n{"name": "add", "arguments": { "a": 2'),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n', "<tool_c"),
    ("llama3", '{"name": "add", "parameters": {"a": 2, "b": 3}}; ', '{"name": "add", "parameters": {"a'),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}]', '[TOOL_CALLS][{"name": "ad'),
])
def test_an_output_cut_short_inside_a_call_shows_no_call_markup(fmt, whole, open_call):
    """Max tokens cut a model inside its next call (a forced tool_choice lets it write several):
    the unfinished call was returned as content, markup and all, in the answer and in the last
    streamed delta.  Cut short, an open call is dropped; the complete calls stay.  The same text
    as a whole output (nothing cut) keeps the malformed call as content, as before."""
    text = whole + open_call
    content, calls = parse_tool_calls(fmt, text, new_id=counter(), cut=True)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 2, "b": 3})]
    for cuts in ([], [5, 17, len(whole) + 3]):  # streamed, split anywhere
        p = StreamingToolParser(fmt, counter())
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        events = [ev for piece in pieces for ev in p.feed(piece)] + p.finish(cut=True)
        assert not [ev for ev in events if isinstance(ev, ContentDelta)]
        assert sum(isinstance(ev, ToolCallStart) for ev in events) == 1
    if fmt == "hermes" and open_call.endswith("2"):
        kept, _ = parse_tool_calls(fmt, text, new_id=counter())
        assert kept.startswith("<tool_call>")  # (a whole output's malformed call is content)
