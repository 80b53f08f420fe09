"""OpenAI request bodies → Request/GenerateConfig, and the response objects (table tests, no model)."""

from __future__ import annotations

import pytest

from mars_local.core.config import GenerateConfig, TokenLogprob
from mars_local.server.requests import ApiError, parse_chat, parse_completion
from mars_local.server.responses import ResponseMaker, cached_tokens, finish_reason, usage
from mars_local.core.stats import SpecStats

D = GenerateConfig.make(max_tokens=-1, draft_max=8, temperature=0.0)
MSG = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return parse_chat({"messages": MSG, **fields}, D)


def test_defaults_come_from_the_server():
    r = chat()
    assert r.config == D and r.kind == "chat" and not r.stream and not r.logprobs


@pytest.mark.parametrize("fields, check", [
    (dict(max_tokens=7), lambda c: c.max_tokens == 7),
    (dict(max_completion_tokens=9), lambda c: c.max_tokens == 9),
    (dict(temperature=0.7, top_p=0.5, seed=3), lambda c: (c.sampling.temperature, c.sampling.top_p, c.sampling.seed) == (0.7, 0.5, 3)),
    (dict(stop="END"), lambda c: c.stop == ("END",)),
    (dict(stop=["a", "b"]), lambda c: c.stop == ("a", "b")),
    (dict(stop=[]), lambda c: c.stop == ()),
    (dict(min_p=0.0, top_k=0, repeat_last_n=-1), lambda c: (c.sampling.min_p, c.sampling.top_k, c.repeat_last_n) == (0, 0, -1)),
    (dict(presence_penalty=1.5, frequency_penalty=-0.5), lambda c: (c.presence_penalty, c.frequency_penalty) == (1.5, -0.5)),
    (dict(top_k=5, min_p=0.1, repeat_penalty=1.2, ignore_eos=True), lambda c: (c.sampling.top_k, c.sampling.min_p, c.repeat_penalty, c.ignore_eos) == (5, 0.1, 1.2, True)),
    (dict(speculative={"verify": "strict", "theta": 0.5, "draft_max": 3, "adaptive": False}),
     lambda c: (c.verify, c.theta, c.draft_max, c.adaptive) == ("strict", 0.5, 3, False)),
    (dict(speculative={"enabled": False}), lambda c: (c.draft_max, c.adaptive) == (0, False)),
    (dict(speculative={"enabled": True}), lambda c: c.draft_max == 8),
    (dict(n=1, user="u", unknown_field=[1]), lambda c: c == D),  # unknown fields are ignored, n = 1 is fine
    (dict(top_p=0, temperature=1.0), lambda c: c.sampling.greedy),  # OpenAI's top_p 0: the top token only
])
def test_fields_map_onto_the_config(fields, check):
    assert check(chat(**fields).config)


@pytest.mark.parametrize("fields, param, words", [
    (dict(max_tokens=0), "max_tokens", ">= 1"),
    (dict(max_tokens=True), "max_tokens", "an integer"),
    (dict(max_tokens=2.5), "max_tokens", "an integer"),
    (dict(temperature="hot"), "temperature", "a number"),
    (dict(temperature=3), "temperature", "[0, 2]"),
    (dict(top_p=1.5), "top_p", "[0, 1]"),
    (dict(presence_penalty=2.5), "presence_penalty", "[-2, 2]"),
    (dict(stop=[1]), "stop", "strings"),
    (dict(n=2), "n", "n = 1"),
    (dict(tools=[{"type": "function"}]), "tools[0].function", "must be an object"),
    (dict(logit_bias={"1": 5}), "logit_bias", "not supported"),
    (dict(top_logprobs=3), "top_logprobs", "needs 'logprobs'"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs", "[0, 20]"),
    (dict(speculative={"theta": 2}), "speculative.theta", "theta"),
    (dict(speculative={"theta": "x"}), "speculative.theta", "a number"),
    (dict(speculative={"verify": "loose"}), "speculative.verify", "strict"),
    (dict(speculative={"draft_max": 99}), "speculative.draft_max", "draft-max"),
    (dict(speculative={"enabled": "yes"}), "speculative.enabled", "a boolean"),
    (dict(speculative={"k": 3}), "speculative.k", "unknown"),
    (dict(speculative=[1]), "speculative", "an object"),
    (dict(response_format={"type": "xml"}), "response_format.type", "json_object"),
    (dict(response_format={"type": "json_schema", "json_schema": {}}), "response_format.json_schema.schema", "object"),
    (dict(stream_options={"include_usage": 1}), "stream_options.include_usage", "a boolean"),
    (dict(model=5), "model", "a string"),
    # the CLI's rules (GenerateConfig's), not ranges of the server's own
    (dict(stop=""), "stop", "non-empty"),
    (dict(stop=["a", "", "b"]), "stop", "non-empty"),
    (dict(min_p=1), "min_p", "[0, 1)"),
    (dict(min_p=1.5), "min_p", "[0, 1)"),
    (dict(min_p=-0.1), "min_p", "[0, 1)"),
    (dict(top_k=-1), "top_k", "top-k must be >= 0"),
    (dict(repeat_last_n=-2), "repeat_last_n", "repeat-last-n must be >= -1"),
    (dict(tool_choice="auto"), "tool_choice", "needs 'tools'"),
    (dict(tool_choice="none"), "tool_choice", "needs 'tools'"),
    (dict(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice", "needs 'tools'"),
    (dict(function_call="auto"), "function_call", "use 'tool_choice'"),
])
def test_bad_fields_are_400_naming_the_field(fields, param, words):
    with pytest.raises(ApiError) as e:
        chat(**fields)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("messages, param", [
    ([], "messages"), ("hi", "messages"), ([5], "messages[0]"),
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "function", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content"),
])
def test_bad_messages(messages, param):
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": messages}, D)
    assert e.value.param == param


def test_message_forms():
    r = parse_chat({"messages": [{"role": "developer", "content": "be brief"},
                                 {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                                 {"role": "assistant", "content": None}]}, D)
    assert r.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"},
                          {"role": "assistant", "content": ""}]


def test_logprobs_ask_the_engine_for_at_least_one():
    assert chat(logprobs=True).config.logprobs == 1 and chat(logprobs=True).n_top == 0
    r = chat(logprobs=True, top_logprobs=4)
    assert (r.config.logprobs, r.n_top, r.logprobs) == (4, 4, True)
    c = parse_completion({"prompt": "x", "logprobs": 0}, D)
    assert (c.config.logprobs, c.n_top, c.logprobs) == (1, 0, True)
    assert parse_completion({"prompt": "x"}, D).config.logprobs == 0


@pytest.mark.parametrize("prompt, expect", [("hello", "hello"), (["hello"], "hello"), ([1, 2, 3], [1, 2, 3]),
                                            ([[4, 5]], [4, 5])])
def test_completion_prompts(prompt, expect):
    assert parse_completion({"prompt": prompt}, D).prompt == expect


@pytest.mark.parametrize("prompt", [None, "", ["a", "b"], [1, "a"], [True], 5, {}])
def test_bad_completion_prompts(prompt):
    with pytest.raises(ApiError) as e:
        parse_completion({"prompt": prompt}, D)
    assert e.value.param == "prompt"


@pytest.mark.parametrize("body", [[], "x", 3, None])
def test_the_body_must_be_an_object(body):
    with pytest.raises(ApiError) as e:
        parse_chat(body, D)
    assert e.value.status == 400 and "JSON object" in e.value.message


@pytest.mark.parametrize("field", ["echo", "suffix"])
def test_completion_features_not_supported(field):
    with pytest.raises(ApiError) as e:
        parse_completion({"prompt": "x", field: "yes" if field == "suffix" else True}, D)
    assert e.value.param == field



# ---------------------------------------------------------------- responses
def stats(**kw) -> SpecStats:
    s = SpecStats(n_prompt=10, n_prompt_evaluated=4, stop_reason="eog", time_prompt_target_s=0.05)
    s.record_round(4, 3, 1, 4)
    s.record_round(4, 0, 0, 1)
    for k, v in kw.items():
        setattr(s, k, v)
    return s


@pytest.mark.parametrize("reason, expect", [("eog", "stop"), ("stop", "stop"), ("length", "length"),
                                            ("context", "length"), ("interrupted", "stop")])
def test_finish_reason(reason, expect):
    assert finish_reason(reason) == expect


def test_usage_reports_the_speculation():
    u = usage(stats())
    assert u["prompt_tokens"] == 10 and u["completion_tokens"] == 5 and u["total_tokens"] == 15
    assert u["prompt_tokens_details"]["cached_tokens"] == 5  # 10 - 1 (always run) - 4 evaluated
    assert u["speculative"] == {"drafted": 8, "accepted": 3, "relaxed": 1, "rounds": 2,
                                "mean_accepted_length": 2.5, "acceptance_rate": 3 / 8}
    assert cached_tokens(stats(n_prompt_evaluated=9)) == 0
    # a prompt whose evaluation never ended (cancelled while waiting for a slot, or mid-prefill):
    # what it did not evaluate did not come from a cache (it counted 5 here, 9 if never started)
    assert cached_tokens(stats(time_prompt_target_s=0.0)) == 0
    assert cached_tokens(stats(time_prompt_target_s=0.0, n_prompt_evaluated=0)) == 0


def test_chat_objects():
    m = ResponseMaker("chat", "m", "chatcmpl-1", 1, True)
    m.add_pieces({5: b"hi", 6: b"\xe2\x82"})
    lps = [TokenLogprob(5, -0.1, ((5, -0.1), (6, -2.0)))]
    full = m.complete("hi", lps, stats())
    assert full["object"] == "chat.completion" and full["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    content = full["choices"][0]["logprobs"]["content"]
    assert content == [{"token": "hi", "logprob": -0.1, "bytes": [104, 105],
                        "top_logprobs": [{"token": "hi", "logprob": -0.1, "bytes": [104, 105]}]}]
    assert m.first()["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert m.piece_chunk("x", None)["choices"][0]["delta"] == {"content": "x"}
    last = m.last(stats(stop_reason="length"))
    assert last["choices"][0]["finish_reason"] == "length" and last["object"] == "chat.completion.chunk"
    assert m.usage_chunk(stats())["choices"] == [] and m.usage_chunk(stats())["usage"]["completion_tokens"] == 5


def test_completion_logprobs_offsets():
    m = ResponseMaker("completion", "m", "cmpl-1", 2, True)
    m.add_pieces({1: b"ab", 2: b"c", 3: b"d"})
    a = m.piece_chunk("abc", [TokenLogprob(1, -1.0, ((1, -1.0), (3, -2.0))), TokenLogprob(2, -0.5, ((2, -0.5),))])
    b = m.piece_chunk("d", [TokenLogprob(3, -0.2, ((3, -0.2),))])
    assert a["choices"][0]["logprobs"] == {"tokens": ["ab", "c"], "token_logprobs": [-1.0, -0.5],
                                           "top_logprobs": [{"ab": -1.0, "d": -2.0}, {"c": -0.5}], "text_offset": [0, 2]}
    assert b["choices"][0]["logprobs"]["text_offset"] == [3]
    assert m.first() is None and a["object"] == "text_completion"


@pytest.mark.parametrize("stop_reason, reason", [("length", "length"), ("context", "length"), ("eog", "tool_calls")])
def test_calls_cut_short_finish_with_length_and_no_markup(stop_reason, reason):
    """An answer whose calls max tokens cut (the next call open): its complete calls, no content
    (the open call's markup was the content), and finish_reason "length", streamed or not."""
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
    text = call + ('<tool_call>\n{"name": "add", "argu' if stop_reason != "eog" else "")
    m = ResponseMaker("chat", "m", "chatcmpl-1", 1, False)
    full = m.complete_tools(text, "hermes", None, stats(stop_reason=stop_reason))
    choice = full["choices"][0]
    assert choice["finish_reason"] == reason and choice["message"]["content"] is None
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["add"]
    from mars_local.chat.tools import StreamingToolParser

    s = ResponseMaker("chat", "m", "chatcmpl-1", 1, True)
    p = StreamingToolParser("hermes")
    chunks = s.tool_chunks(p.feed(text)) + s.tool_chunks(p.finish(cut=stop_reason != "eog"))
    assert not [c for c in chunks if c["choices"][0]["delta"].get("content")]
    assert s.last(stats(stop_reason=stop_reason))["choices"][0]["finish_reason"] == reason
