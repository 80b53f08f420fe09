"""Tool calling through the server (issue 26): requests, responses and streams over the scripted
FakeEngine, and forced calls (tool_choice required / a named function) on a tiny real model."""

from __future__ import annotations

import json

import pytest

from fake_engine import FakeEngine
from helpers import api_error as err, server_client
from test_server import sse

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                                                    "days": {"type": "integer", "enum": [1, 2, 3, 7]}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = {"messages": [{"role": "user", "content": "weather in Paris?"}], "tools": [WEATHER, TIME]}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


def client(reply: str, syntax: str | None = "hermes"):
    return server_client(FakeEngine(reply=reply, chunk=3, tool_syntax=syntax))


def test_a_call_in_the_answer_becomes_tool_calls():
    with client("Let me look. " + CALL) as c:
        body = c.post("/v1/chat/completions", json=ASK).json()
        tools, choice = c.engine.tools_seen[-1]
    choice0 = body["choices"][0]
    assert choice0["finish_reason"] == "tool_calls"
    msg = choice0["message"]
    assert msg["content"] == "Let me look." and len(msg["tool_calls"]) == 1
    call = msg["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}
    # the template saw the tools in OpenAI's shape, and tool_choice auto
    assert [t["function"]["name"] for t in tools] == ["get_weather", "get_time"] and choice == "auto"


def test_an_answer_without_a_call_is_plain_content():
    with client("It is sunny.") as c:
        body = c.post("/v1/chat/completions", json=ASK).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
    assert body["choices"][0]["finish_reason"] != "tool_calls"


@pytest.mark.parametrize("chunk", [1, 2, 5, 40])
def test_a_streamed_call_reassembles_to_the_whole_answer(chunk):
    reply = "Checking. " + CALL + "\n" + CALL.replace("Paris", "Tokyo")
    with server_client(FakeEngine(reply=reply, chunk=chunk, tool_syntax="hermes")) as c:
        events = sse(c.post("/v1/chat/completions", json={**ASK, "stream": True}))
    content, calls = "", {}
    for e in events:
        delta = e["choices"][0]["delta"]
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls", []):
            slot = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.get("id", slot["id"])
            slot["name"] += tc.get("function", {}).get("name", "")
            slot["arguments"] += tc.get("function", {}).get("arguments", "")
    assert content.strip() == "Checking."
    assert [json.loads(calls[i]["arguments"])["city"] for i in sorted(calls)] == ["Paris", "Tokyo"]
    assert all(c["name"] == "get_weather" and c["id"].startswith("call_") for c in calls.values())
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_tool_round_trip_renders_the_call_and_its_result():
    msgs = [{"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    with client("It is sunny and 21 C in Paris.") as c:
        body = c.post("/v1/chat/completions", json={**ASK, "messages": msgs}).json()
    assert body["choices"][0]["message"]["content"] == "It is sunny and 21 C in Paris."


@pytest.mark.parametrize("patch, param, words", [
    ({"tools": {"x": 1}}, "tools", "array"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "name"),
    ({"tools": [WEATHER] * 10_000}, "tools", "at most 128"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "already the name of tools[0]"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, None, "nope"),
    ({"tool_choice": "sometimes"}, "tool_choice", None),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"functions": [{"name": "f"}]}, "functions", "tools"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "not valid JSON"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined"),
])
def test_bad_tool_requests_are_400_naming_the_field(patch, param, words):
    with client("x") as c:
        r = c.post("/v1/chat/completions", json={**ASK, **patch})
    e = err(r, 400, param=param)
    assert words is None or words in e["message"]


def test_a_template_without_a_known_call_syntax_is_refused():
    with client("x", syntax=None) as c:
        e = err(c.post("/v1/chat/completions", json=ASK), 400, param="tools")
    assert "no tool-call syntax" in e["message"] and "hermes" in e["message"]


def test_tool_choice_none_hides_the_tools_and_parses_nothing():
    with client(CALL) as c:
        body = c.post("/v1/chat/completions", json={**ASK, "tool_choice": "none"}).json()
        tools, _ = c.engine.tools_seen[-1]
    assert tools is None and body["choices"][0]["message"]["content"] == CALL


def test_a_forced_call_runs_with_the_call_grammar():
    with client(CALL) as c:
        c.post("/v1/chat/completions", json={**ASK, "tool_choice": "required"})
        c.post("/v1/chat/completions", json={**ASK, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
        c.post("/v1/chat/completions", json=ASK)
        required, named, auto = c.engine.configs
    assert "get_weather" in required.grammar and "get_time" in required.grammar
    assert "get_time" in named.grammar and "get_weather" not in named.grammar
    assert required.grammar_triggers == named.grammar_triggers == ()  # constrained from the first token
    # auto: the same calls' grammar, lazy: it waits for the answer to open a call
    assert auto.grammar == required.grammar and auto.grammar_triggers == ("<tool_call>",)
    assert {c.visible_special for c in (required, named, auto)} == {("<tool_call>", "</tool_call>")}


def test_auto_with_a_grammar_of_its_own_keeps_it_alone():
    with client(CALL) as c:
        c.post("/v1/chat/completions", json={**ASK, "response_format": {"type": "json_object"}})
        (cfg,) = c.engine.configs
    assert "get_weather" not in cfg.grammar and cfg.grammar_triggers == ()


# ------------------------------------------------------------------ a real (tiny) model
HERMES = """{%- if tools %}<|im_start|>system
You may call functions. <tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools> For each call return <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{%- for tc in m.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.mark.slow
def test_forced_calls_always_parse_and_match_the_schema(tiny_target, tiny_draft):
    """tool_choice required and a named function on a tiny random model, T = 1, speculation on
    (a draft model): 100 answers, every one a call whose arguments parse and match the schema."""
    from mars_local import Engine

    with Engine(tiny_target, tiny_draft, chat_template=HERMES, n_ctx=1024, n_threads=2, learned=False) as eng:
        assert eng.tool_format() == "hermes"
        with server_client(eng) as c:
            drafted = 0
            for i in range(100):
                choice = "required" if i % 2 else {"type": "function", "function": {"name": "get_weather"}}
                body = c.post("/v1/chat/completions", json={
                    **ASK, "tool_choice": choice, "temperature": 1.0, "seed": i, "max_tokens": 160,
                    "parallel_tool_calls": False}).json()
                msg = body["choices"][0]["message"]
                assert body["choices"][0]["finish_reason"] == "tool_calls", body
                (call,) = msg["tool_calls"]
                args = json.loads(call["function"]["arguments"])
                if call["function"]["name"] == "get_weather":
                    assert args["city"] in ("Paris", "Tokyo") and args["days"] in (1, 2, 3, 7)
                    assert set(args) == {"city", "days"}
                else:
                    assert i % 2 and call["function"]["name"] == "get_time" and isinstance(args, dict)
                drafted += body["usage"]["speculative"]["drafted"]
    assert drafted > 0


@pytest.mark.slow
def test_the_openai_client_round_trip(tiny_target):
    """The openai client's tools round trip against the app: a forced call, its result sent back
    as a tool message, and a final answer."""
    import openai

    from mars_local import Engine

    with Engine(tiny_target, chat_template=HERMES, n_ctx=1024, n_threads=2, learned=False) as eng, \
            server_client(eng) as c:
        oa = openai.OpenAI(base_url=str(c.base_url) + "/v1", api_key="x", http_client=c, max_retries=0)
        first = oa.chat.completions.create(model="fake", messages=ASK["messages"], tools=ASK["tools"],
                                           tool_choice="required", temperature=0, max_tokens=160)
        call = first.choices[0].message.tool_calls[0]
        msgs = ASK["messages"] + [first.choices[0].message.model_dump(exclude_none=True),
                                  {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        final = oa.chat.completions.create(model="fake", messages=msgs, tools=ASK["tools"], temperature=0,
                                           max_tokens=8)
    assert first.choices[0].finish_reason == "tool_calls" and isinstance(json.loads(call.function.arguments), dict)
    assert final.choices[0].message is not None and final.usage.prompt_tokens > first.usage.prompt_tokens


# ------------------------------------------------------------------ mars run --tools
def test_mars_run_with_tools_prints_the_calls_as_json(tiny_target, tmp_path):
    from helpers import invoke, one_error_line

    tpl = tmp_path / "hermes.jinja"
    tpl.write_text(HERMES)
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps({"tools": ASK["tools"]}))
    base = ("run", "-m", tiny_target, "--chat-template", tpl, "--tools", tools, "-n", "160", "--temp", "0")
    r = invoke(*base, "--tool-choice", "get_weather", "weather in Paris?")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    (call,) = out["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "get_weather" and args["city"] in ("Paris", "Tokyo")
    r = invoke(*base, "--tool-choice", "required", "--json", "weather?")
    assert r.exit_code == 0 and json.loads(r.stdout)["tool_calls"] and "stats" in json.loads(r.stdout)
    for extra, words in ((("--tool-choice", "nope"), "nope"), (("--tool-choice", "required", "--format", "json"), "own grammar")):
        r = invoke(*base, *extra, "hi")
        assert r.exit_code != 0 and words in one_error_line(r)
    tools.write_text("[1, 2")
    r = invoke(*base, "hi")
    assert r.exit_code != 0 and "not valid JSON" in one_error_line(r)
    r = invoke("run", "-m", tiny_target, "--tools", tmp_path / "missing.json", "hi")
    assert r.exit_code != 0 and "missing.json" in one_error_line(r)


def test_mars_batch_records_with_tools(tiny_target, tmp_path):
    """A batch record's tools and tool_choice (one and four at a time): forced calls come back
    as tool_calls in the output line; bad tool fields name the line."""
    from helpers import invoke, one_error_line

    tpl = tmp_path / "hermes.jinja"
    tpl.write_text(HERMES)
    msgs = ASK["messages"]
    lines = [{"id": i, "messages": msgs, "tools": ASK["tools"],
              "tool_choice": "required" if i % 2 else {"type": "function", "function": {"name": "get_weather"}}}
             for i in range(4)] + [{"id": 9, "messages": msgs}]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    for parallel in ("1", "4"):
        out = tmp_path / f"out{parallel}.jsonl"
        r = invoke("batch", inp, "-o", out, "-m", tiny_target, "--chat-template", tpl, "-n", "160", "--temp", "0",
                   "--parallel", parallel)
        assert r.exit_code == 0, r.output
        got = {o["id"]: o for o in map(json.loads, out.read_text().splitlines())}
        for i in range(4):
            (call,) = got[i]["tool_calls"][:1]
            assert isinstance(json.loads(call["function"]["arguments"]), dict)
            assert i % 2 or call["function"]["name"] == "get_weather"
        assert "tool_calls" not in got[9]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": 1, "prompt": "hi", "tools": ASK["tools"]}) + "\n")
    r = invoke("batch", bad, "-o", tmp_path / "o.jsonl", "-m", tiny_target, "--strict")
    assert r.exit_code != 0 and "needs 'messages'" in one_error_line(r)


MISTRAL = ("{%- for m in messages %}{%- if m.role == 'user' %}{%- if tools and loop.last %}[AVAILABLE_TOOLS]"
           "{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}[INST]{{ m.content }}[/INST]"
           "{%- elif m.role == 'assistant' %}{%- if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}"
           "{%- else %}{{ m.content }}{%- endif %}</s>{%- endif %}{%- endfor %}")


@pytest.mark.slow
def test_mistral_calls_parse_where_tool_calls_is_a_control_token(tmp_path):
    """A GGUF whose [TOOL_CALLS] and [ARGS] are control tokens, as Mistral's are: forced calls at T = 1
    parse whether the model wrote the control token or the same text in bytes (the grammar allows
    both), since the call markers are shown in the answer's text."""
    from mars_local import Engine
    from mars_local.chat.tools import parse_tool_calls, parse_tool_choice, parse_tools
    from mars_local.core.config import GenerateConfig
    from tinymodels import make_tiny_llama

    path = make_tiny_llama(tmp_path / "mistral.gguf", seed=3, extra_control=("[TOOL_CALLS]", "[ARGS]"))
    tools = parse_tools([WEATHER, TIME])
    with Engine(path, chat_template=MISTRAL, n_ctx=1024, n_threads=2, learned=False) as eng:
        assert eng.tool_format() == "mistral"
        (tc,) = eng.tokenize("[TOOL_CALLS]", add_special=False, parse_special=True)
        assert eng.piece(tc) == b""  # hidden unless asked for
        by_control = 0
        for i in range(30):
            prompt, cfg, fmt = eng.tool_prompt(ASK["messages"], tools, parse_tool_choice("required", tools),
                                               GenerateConfig.make(temperature=1.0, seed=i, max_tokens=120),
                                               parallel=False)
            out = eng.generate(prompt, cfg)
            content, calls = parse_tool_calls(fmt, out.text)
            assert len(calls) == 1 and content == "", out.text
            assert calls[0].name in ("get_weather", "get_time")
            by_control += tc in out.tokens
    assert by_control > 0  # the control token's path was taken
