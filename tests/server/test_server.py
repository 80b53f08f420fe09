"""The server's app in-process over the scripted FakeEngine (no GGUF): routes, errors, SSE, metrics."""

from __future__ import annotations

import json

import pytest

from fake_engine import FakeEngine
from helpers import api_error as err, server_client
from mars_local.core.config import GenerateConfig
from mars_local.server.app import MAX_BODY

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json"}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def client(engine=None, **settings):
    return server_client(engine, aliases=("fake.gguf",), **{"api_key": KEY, **settings})


@pytest.fixture
def api():
    with client() as c:
        yield c


def sse(r) -> list:
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_chat_completion(api):
    r = api.post("/v1/chat/completions", json={**CHAT, "model": "fake"}, headers=AUTH)
    body = r.json()
    assert r.status_code == 200 and body["object"] == "chat.completion" and body["model"] == "fake"
    assert body["choices"][0]["message"]["content"] == "hello world"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len("hello world")
    assert body["usage"]["speculative"]["rounds"] == 6  # 11 tokens in chunks of 2


def test_request_fields_reach_the_engine(api):
    api.post("/v1/chat/completions", headers=AUTH, json={
        **CHAT, "max_tokens": 5, "temperature": 0.5, "stop": ["x"], "seed": 7,
        "speculative": {"verify": "strict", "draft_max": 3}})
    api.post("/v1/chat/completions", headers=AUTH, json={**CHAT, "speculative": {"enabled": False}})
    a, b = api.engine.configs
    assert (a.max_tokens, a.sampling.temperature, a.stop, a.sampling.seed, a.verify, a.draft_max) == \
        (5, 0.5, ("x",), 7, "strict", 3)
    assert (b.draft_max, b.adaptive, b.max_tokens) == (0, False, -1)


def test_stream_with_usage(api):
    r = api.post("/v1/chat/completions", headers=AUTH,
                 json={**CHAT, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 4})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == "hell"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    assert len({e["id"] for e in events}) == 1


def test_completion_stream_without_usage(api):
    r = api.post("/v1/completions", headers=AUTH, json={"prompt": "ab", "stream": True, "logprobs": 1})
    events = sse(r)
    assert "".join(e["choices"][0]["text"] for e in events) == "hello world"
    assert all("usage" not in e for e in events)
    lp = [t for e in events[:-1] for t in e["choices"][0]["logprobs"]["tokens"]]
    assert "".join(lp) == "hello world"


def test_models_and_health(api):
    assert api.get("/health").json()["status"] == "ok"  # no key needed
    assert [m["id"] for m in api.get("/v1/models", headers=AUTH).json()["data"]] == ["fake"]
    err(api.get("/v1/models"), 401, "invalid_api_key")
    assert api.get("/v1/models/fake", headers=AUTH).json()["id"] == "fake"
    err(api.get("/v1/models/gpt-4", headers=AUTH), 404, "model_not_found")
    assert api.get("/v1/health").json()["status"] == "ok"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}])
def test_wrong_key_is_401(api, headers):
    err(api.post("/v1/chat/completions", json=CHAT, headers=headers), 401, "invalid_api_key")
    err(api.get("/metrics", headers=headers), 401)
    assert api.engine.calls == []


def test_unknown_model_is_404(api):
    err(api.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4"}, headers=AUTH), 404, "model_not_found", "model")
    assert api.post("/v1/chat/completions", json={**CHAT, "model": "fake.gguf"}, headers=AUTH).status_code == 200


@pytest.mark.parametrize("body, status, code, param", [
    (b"{not json", 400, "invalid_json", None),
    (b'{"messages": NaN}', 400, "invalid_json", None),
    (b"\xff\xfe", 400, "invalid_json", None),
    (b"[]", 400, None, None),
    (b"[" * 100_000, 400, "invalid_json", None),
    (json.dumps({**CHAT, "speculative": {"theta": 2}}).encode(), 400, None, "speculative.theta"),
    (json.dumps({**CHAT, "n": 3}).encode(), 400, None, "n"),
    (json.dumps({**CHAT, "max_tokens": "9"}).encode(), 400, None, "max_tokens"),
])
def test_bad_bodies(api, body, status, code, param):
    err(api.post("/v1/chat/completions", content=body, headers={**AUTH, **JSON}), status, code, param)
    assert api.engine.calls == []


def test_a_body_over_the_limit_is_413(api):
    e = err(api.post("/v1/completions", content=b"x" * (MAX_BODY + 10), headers={**AUTH, **JSON}), 413,
            "request_too_large")
    assert "MiB" in e["message"]
    assert api.post("/v1/completions", json={"prompt": "a"}, headers=AUTH).status_code == 200


def test_prompt_over_the_context():
    eng = FakeEngine(reply="hello world", n_ctx_asked=256)
    with client(eng) as c:
        err(c.post("/v1/completions", json={"prompt": "x" * 300}, headers=AUTH), 400, "context_length_exceeded", "prompt")
        err(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 300}]}, headers=AUTH),
            400, "context_length_exceeded", "messages")
        assert c.post("/v1/completions", json={"prompt": "x"}, headers=AUTH).status_code == 200


def test_engine_refusals_are_400_and_failures_500_and_the_server_goes_on():
    eng = FakeEngine(reply="hello world", fail_on="BAD", has_chat_template=False)
    with client(eng) as c:
        err(c.post("/v1/completions", json={"prompt": "a BAD prompt"}, headers=AUTH), 400)
        err(c.post("/v1/chat/completions", json=CHAT, headers=AUTH), 400, None, "messages")  # no chat template
        eng.interrupt_after = 1  # the engine raises in the middle of a generation
        err(c.post("/v1/completions", json={"prompt": "a"}, headers=AUTH), 500)
        eng.interrupt_after = None
        assert c.post("/v1/completions", json={"prompt": "a"}, headers=AUTH).json()["choices"][0]["text"] == "hello world"


def test_unknown_routes_and_methods_have_the_error_shape(api):
    err(api.get("/v1/nothing", headers=AUTH), 404)
    err(api.get("/v1/chat/completions", headers=AUTH), 405)


def metric(c, name: str) -> float:
    for line in c.get("/metrics", headers=AUTH).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_move_by_what_the_request_reports(api):
    names = ["mars_tokens_generated_total", "mars_tokens_drafted_total", "mars_tokens_accepted_total",
             "mars_tokens_relaxed_total", "mars_rounds_total", "mars_prompt_tokens_total",
             'mars_requests_total{endpoint="/v1/chat/completions",status="200"}', "mars_mean_accepted_length_count"]
    before = {n: metric(api, n) for n in names}
    u = api.post("/v1/chat/completions", json=CHAT, headers=AUTH).json()["usage"]
    after = {n: metric(api, n) for n in names}
    d = {n: after[n] - before[n] for n in names}
    s = u["speculative"]
    assert d["mars_tokens_generated_total"] == u["completion_tokens"] > 0
    assert d["mars_prompt_tokens_total"] == u["prompt_tokens"]
    assert (d["mars_tokens_drafted_total"], d["mars_tokens_accepted_total"], d["mars_tokens_relaxed_total"],
            d["mars_rounds_total"]) == (s["drafted"], s["accepted"], s["relaxed"], s["rounds"])
    assert d['mars_requests_total{endpoint="/v1/chat/completions",status="200"}'] == 1
    assert d["mars_mean_accepted_length_count"] == 1


def test_browsers_are_refused_unless_an_origin_is_allowed():
    pre = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    with client() as c:
        r = c.options("/v1/chat/completions", headers=pre)
        assert "access-control-allow-origin" not in r.headers
    with client(cors=("http://localhost:3000",)) as c:
        ok = c.options("/v1/chat/completions", headers={**pre, "Origin": "http://localhost:3000"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://localhost:3000"
        bad = c.options("/v1/chat/completions", headers=pre)
        assert "access-control-allow-origin" not in bad.headers
        r = c.post("/v1/chat/completions", json=CHAT, headers={**AUTH, "Origin": "http://localhost:3000"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_response_format_json_gives_a_grammar():
    from mars_local.server.requests import ApiError, parse_chat

    D = GenerateConfig.make(max_tokens=-1, draft_max=8, temperature=0.0)

    def chat(**fields):
        return parse_chat({"messages": [{"role": "user", "content": "hi"}], **fields}, D)

    g = chat(response_format={"type": "json_object"}).config.grammar
    assert g and "root" in g
    s = chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}})
    assert 'a-kv ::= "\\"a\\""' in s.config.grammar
    with pytest.raises(ApiError) as e:
        chat(response_format={"type": "json_object"}, grammar="root ::= \"x\"")
    assert e.value.param == "grammar"


class SlowFake(FakeEngine):
    """A FakeEngine whose chunks come 20 ms apart (a stream that lasts while the test acts)."""

    def _chunks(self, toks, answer, config, stats):
        import time

        for c in super()._chunks(toks, answer, config, stats):
            time.sleep(0.02)
            yield c


def test_a_stream_in_flight_at_shutdown_ends_with_the_error_event_however_late_it_comes():
    """sse-starlette cuts every stream once it sees uvicorn exiting (it polls every 0.5 s),
    which raced `mars serve`'s own shutdown: the generations are cancelled and each stream
    should end with a 503 error event, but a worker busy for longer than the poll (a loaded
    CPU) left the client an unterminated chunked body.  Here the cancel comes 1.2 s after the
    exit is seen; the stream must still end with the error event and [DONE]."""
    import threading
    import time

    from sse_starlette.sse import AppStatus

    with client(SlowFake(reply="abcdefgh", chunk=1)) as c:
        try:
            with c.stream("POST", "/v1/completions", headers=AUTH, json={
                    "prompt": "long", "max_tokens": 100000, "ignore_eos": True, "stream": True}) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data:"))
                AppStatus.should_exit = True  # what uvicorn's exit handler sets (patched by sse-starlette)
                cancel = threading.Timer(1.2, c.app.state.server.worker.cancel_all)
                cancel.start()
                rest = [line for line in lines if line.startswith("data:")]
                cancel.join()
        finally:
            AppStatus.should_exit = False
    assert rest[-1] == "data: [DONE]", rest[-3:]
    error = json.loads(rest[-2][len("data: "):])["error"]
    assert error["message"] == "the server is shutting down", rest[-3:]
