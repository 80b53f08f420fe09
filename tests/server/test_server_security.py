"""`mars serve` against hostile clients: web pages (Origin), DNS rebinding (Host), the
media type of bodies, bad flags, and requests built to hold the engine (huge chats)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import pytest

from fake_engine import FakeEngine
from helpers import api_error as err, invoke, server_client as client
from mars_local.chat.tokens import PromptTooLong, TokenizingCancelled, tokenize_chat, tokenize_text
from mars_local.core.errors import MarsError
from mars_local.core.config import GenerateConfig
from mars_local.server import check_allowed_host, check_origin
from mars_local.server.requests import parse_chat
from mars_local.server.worker import Job, Worker

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
EVIL = "http://evil.example"


# ------------------------------------------------------------------ Origin
def test_a_foreign_page_cannot_make_the_server_generate():
    """A CORS "simple" request (text/plain, no preflight) from any site: refused, even
    when another origin is allowed, and the engine never runs; an allowed origin (or any,
    with '*') and clients that are not web pages (no Origin) get their answer."""
    body = '{"messages": [{"role": "user", "content": "hi"}]}'
    for cors in ((), ("http://good.example",)):
        with client(cors=cors) as c:
            for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/json"}):
                r = c.post("/v1/chat/completions", content=body, headers={"Origin": EVIL, **headers})
                e = err(r, 403, "origin_not_allowed")
                assert EVIL in e["message"] and "--cors" in e["message"]
                assert "access-control-allow-origin" not in r.headers
            err(c.get("/v1/models", headers={"Origin": EVIL}), 403, "origin_not_allowed")
            err(c.post("/v1/completions", json={"prompt": "x"}, headers={"Origin": "null"}), 403)
            assert c.engine.calls == []
            assert c.post("/v1/chat/completions", json=CHAT).status_code == 200  # no Origin: not a web page
    with client(cors=("http://good.example",)) as c:
        r = c.post("/v1/chat/completions", json=CHAT, headers={"Origin": "http://good.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://good.example"
    with client(cors=("*",)) as c:
        assert c.post("/v1/chat/completions", json=CHAT, headers={"Origin": EVIL}).status_code == 200


def test_a_foreign_preflight_is_refused_and_an_allowed_one_granted():
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    for cors in ((), ("http://good.example",)):
        with client(cors=cors) as c:
            r = c.options("/v1/chat/completions", headers={**pre, "Origin": EVIL})
            err(r, 403, "origin_not_allowed")
            assert not any(h.startswith("access-control-") for h in r.headers)
    with client(cors=("http://good.example",)) as c:
        ok = c.options("/v1/chat/completions", headers={**pre, "Origin": "http://good.example"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://good.example"


# -------------------------------------------------------------------- Host
FOREIGN = ["rebind.attacker.example:8080", "rebind.attacker.example", "localhost.evil.example", "app.localhost:8080",
           "127.0.0.1.nip.io", "0.0.0.0:8080", "[::2]:8080", "192.168.1.20:8080", ""]
LOOPBACK = ["localhost", "localhost:8080", "LocalHost:8080", "127.0.0.1", "127.0.0.1:8080", "127.1.2.3:9", "[::1]",
            "[::1]:8080"]


def test_on_loopback_only_loopback_hosts_are_answered():
    with client() as c:
        for host in FOREIGN:
            for r in (c.post("/v1/chat/completions", json=CHAT, headers={"Host": host}),
                      c.get("/v1/models", headers={"Host": host}), c.get("/health", headers={"Host": host})):
                e = err(r, 403, "host_not_allowed")
                assert "--allowed-host" in e["message"]
        assert c.engine.calls == []
        for host in LOOPBACK:
            assert c.post("/v1/chat/completions", json=CHAT, headers={"Host": host}).status_code == 200, host


def test_allowed_hosts_and_the_listening_address():
    with client(allowed_hosts=("mybox.lan",)) as c:
        assert c.post("/v1/chat/completions", json=CHAT, headers={"Host": "MyBox.lan:8080"}).status_code == 200
        assert c.get("/v1/models", headers={"Host": "localhost:8080"}).status_code == 200
        err(c.get("/v1/models", headers={"Host": "other.lan"}), 403, "host_not_allowed")
    with client(host="::1") as c:  # listening on [::1]
        assert c.get("/v1/models", headers={"Host": "[::1]:8080"}).status_code == 200
        err(c.get("/v1/models", headers={"Host": "evil.example"}), 403, "host_not_allowed")
    # elsewhere (a LAN address) any Host, unless --allowed-host names them
    with client(host="0.0.0.0") as c:
        assert c.get("/v1/models", headers={"Host": "192.168.1.20:8080"}).status_code == 200
    with client(host="0.0.0.0", allowed_hosts=("mybox.lan",)) as c:
        assert c.get("/v1/models", headers={"Host": "mybox.lan"}).status_code == 200
        assert c.get("/v1/models", headers={"Host": "0.0.0.0:8080"}).status_code == 200  # the --host value
        err(c.get("/v1/models", headers={"Host": "192.168.1.20:8080"}), 403, "host_not_allowed")


# -------------------------------------------------------------- media type
def test_a_post_body_that_is_not_json_is_415():
    body = b'{"prompt": "hi"}'
    with client() as c:
        for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                     "application/jsonx", None):
            r = c.post("/v1/completions", content=body, headers={"Content-Type": kind} if kind else {})
            e = err(r, 415, "unsupported_media_type")
            assert "application/json" in e["message"]
        assert c.engine.calls == []
        for kind in ("application/json", "application/json; charset=utf-8", "Application/JSON;charset=UTF-8"):
            assert c.post("/v1/completions", content=body, headers={"Content-Type": kind}).status_code == 200


# ------------------------------------------------------------------- flags
def test_cors_values_must_be_origins():
    good = {"http://localhost:3000": "http://localhost:3000", "HTTPS://Example.COM": "https://example.com",
            "http://example.com:80": "http://example.com", "https://example.com:443": "https://example.com",
            "https://example.com:8443": "https://example.com:8443", "http://[::1]:3000": "http://[::1]:3000",
            "*": "*"}
    assert {v: check_origin(v) for v in good} == good  # as browsers write them in Origin
    for bad in ("javascript:alert(1)", "", " ", "localhost:3000", "http://", "ftp://x.example", "http://x.example/",
                "http://x.example/app", "http://x.example?q", "http://u@x.example", "http://x.example:99999", "null",
                "file:///tmp"):
        with pytest.raises(MarsError) as e:
            check_origin(bad)
        assert "--cors" in str(e.value) and "\n" not in str(e.value)


def test_allowed_host_values():
    assert [check_allowed_host(h) for h in ("MyBox.lan", "10.0.0.2", "[fd00::1]", "::1")] == \
        ["mybox.lan", "10.0.0.2", "fd00::1", "::1"]
    for bad in ("", "  ", "mybox.lan:8080", "http://mybox.lan", "a/b", "*.example"):
        with pytest.raises(MarsError):
            check_allowed_host(bad)


@pytest.mark.parametrize("args, words", [
    (["--cors", "javascript:alert(1)"], "--cors 'javascript:alert(1)'"),
    (["--cors", "http://ok.example", "--cors", "http://x.example/"], "an origin is scheme://host[:port]"),
    (["--alias", ""], "--alias is empty"),
    (["--alias", "   "], "--alias is empty"),
    (["--allowed-host", "box:80"], "--allowed-host 'box:80'"),
])
def test_bad_serve_flags_are_one_line_before_any_model_loads(fake_engine, args, words):
    r = invoke("serve", "-m", "fake.gguf", "--port", "0", *args)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in r.output
    assert fake_engine.opened == []


# ------------------------------------------------------- requests that hold the engine
class Counting:
    """A model whose tokenize calls are counted (calls, characters)."""

    def __init__(self, model):
        self._m, self.calls, self.chars = model, 0, 0

    def tokenize(self, text, **kw):
        self.calls += 1
        self.chars += len(text)
        return self._m.tokenize(text, **kw)

    def __getattr__(self, name):
        return getattr(self._m, name)


def test_too_many_messages_are_refused_before_the_engine_sees_them():
    class NoChat(FakeEngine):
        def chat_prompt(self, messages, **kw):
            raise AssertionError("rendered")

    eng = NoChat(n_ctx_asked=256)
    with client(eng) as c:
        many = {"messages": [{"role": "user", "content": ""}] * 256}
        e = err(c.post("/v1/chat/completions", json=many), 400, "context_length_exceeded", "messages")
        assert "256 messages" in e["message"] and "at least one" in e["message"]
        ids = {"prompt": [5] * 256}
        err(c.post("/v1/completions", json=ids), 400, "context_length_exceeded", "prompt")
        assert eng.calls == []


def test_a_long_chat_stops_tokenizing_once_it_cannot_fit(plain):
    tmpl, model = plain._chat_template(), plain.target
    messages = [{"role": "user", "content": "é" * 50}] * 1000  # byte tokens: far more tokens than bytes / 6
    rendered = len(tmpl.render(messages))
    full = len(tokenize_chat(tmpl, model, messages))
    m = Counting(model)
    with pytest.raises(PromptTooLong) as e:
        tokenize_chat(tmpl, m, messages, max_tokens=full // 3)
    assert e.value.n_tokens > full // 3 and e.value.limit == full // 3 and not e.value.exact
    assert 0 < m.chars < rendered / 2  # tokenized until the count passed the limit, not the whole chat
    # a text that cannot fit at the longest token's bytes is refused without tokenizing
    huge = [{"role": "user", "content": "x" * 1_000_000}]
    m = Counting(model)
    with pytest.raises(PromptTooLong) as e:
        tokenize_chat(tmpl, m, huge, max_tokens=4095)
    assert m.calls == 0 and not e.value.exact and e.value.n_tokens > 4095
    m = Counting(model)
    with pytest.raises(PromptTooLong):
        tokenize_text(m, "x " * 500_000, max_tokens=4095)
    assert m.calls == 0
    # what fits is tokenized whole, with the same ids as without a bound
    assert tokenize_chat(tmpl, model, messages[:20], max_tokens=4095) == tokenize_chat(tmpl, model, messages[:20])


def test_tokenizing_asks_whether_the_client_is_still_there(plain):
    tmpl = plain._chat_template()
    messages = [{"role": "user", "content": f"message {i}"} for i in range(500)]
    m = Counting(plain.target)
    asked = []

    def cancelled() -> bool:
        asked.append(1)
        return len(asked) > 10

    with pytest.raises(TokenizingCancelled):
        tokenize_chat(tmpl, m, messages, max_tokens=100_000, cancelled=cancelled)
    assert m.calls <= 10  # stopped after the tenth fragment
    with pytest.raises(TokenizingCancelled):
        plain.chat_prompt(messages, max_tokens=100_000, cancelled=lambda: True)
    with pytest.raises(TokenizingCancelled):
        plain.tokenize("a b c", max_tokens=100, cancelled=lambda: True)


def test_a_client_that_leaves_while_its_prompt_is_tokenized_cancels_it():
    """The worker hands the job's cancel flag to the tokenizer (the fake waits for the
    client to leave, then asks)."""
    entered, left = threading.Event(), threading.Event()

    class Slow(FakeEngine):
        def chat_prompt(self, messages, **kw):
            entered.set()
            left.wait(10)
            return super().chat_prompt(messages, **kw)

    eng, outcomes, loop = Slow(), [], asyncio.new_event_loop()
    worker = Worker(eng, 4, on_done=lambda job, outcome: outcomes.append(outcome))
    try:
        job = Job(parse_chat(CHAT, GenerateConfig.make(max_tokens=-1)), loop)
        worker.submit(job)
        assert entered.wait(10)
        job.cancel()  # what the app does when the client has gone
        left.set()
        deadline = time.monotonic() + 10
        while not outcomes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert outcomes == ["cancelled"] and eng.calls == []
    finally:
        worker.stop()
        loop.close()


# ---------------------------------------------------- the same token ids as before
def random_texts(model, n: int, seed: int = 0, special: bool = True) -> list[str]:
    """Texts of special and user-defined token texts, whitespace and words."""
    from mars_local.chat.tokens import _Vocab

    v = _Vocab.of(model)
    atoms = [t for t, *_ in v.specials] * special + [t for t, *_ in v.user] + [
        " ", "  ", "\n", "\n\n", "\t", "a", "hello", " world", "é", "😀", "<", ">", "|", "\u3000", "x y", "12"]
    rng = random.Random(seed)
    return ["".join(rng.choice(atoms) for _ in range(rng.randint(0, 24))) for _ in range(n)]


def check_same_ids(model, n: int) -> None:
    for text in random_texts(model, n):
        for add_special in (True, False):
            for parse_special in (True, False):
                want = model.tokenize(text, add_special=add_special, parse_special=parse_special)
                got = tokenize_text(model, text, add_special=add_special, parse_special=parse_special,
                                    max_tokens=10**9)
                assert got == want, (text, add_special, parse_special)


def test_bounded_tokenizing_gives_llama_cpps_ids(plain):
    check_same_ids(plain.target, 400)
    tmpl = plain._chat_template()
    for text in random_texts(plain.target, 50, seed=1, special=False):  # benign chats: the template's markup
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
        assert tokenize_chat(tmpl, plain.target, msgs, max_tokens=10**9) == plain.target.tokenize(
            tmpl.render(msgs), add_special=False, parse_special=True)


def test_bounded_tokenizing_gives_llama_cpps_ids_on_smollm2(smollm2):
    from mars_local import Engine

    with Engine(smollm2, n_ctx=512) as eng:
        check_same_ids(eng.target, 300)


def test_costly_or_broken_grammars_are_refused_before_the_queue():
    """A grammar that is not text llama.cpp could read (a lone surrogate, a NUL) or whose first
    mask would hold the engine for seconds (an enum of thousands) is a 400 naming the field."""
    pytest.importorskip("llama_cpp")  # the JSON-schema converter
    eng = FakeEngine(reply="x")
    enum = {"type": "json_schema", "json_schema": {"name": "e", "schema": {"enum": [f"v{i}" for i in range(2000)]}}}
    cases = [({"grammar": 'root ::= "\ud800"'}, "grammar", "UTF-8"),
             ({"grammar": 'root ::= "a\x00"'}, "grammar", "NUL"),
             ({"grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(3000))}, "grammar", "alternatives"),
             ({"response_format": enum}, "response_format.json_schema.schema", "alternatives")]
    with client(eng) as c:
        for extra, param, words in cases:
            body = json.dumps({**CHAT, **extra})  # ASCII: a lone surrogate travels as the escape JSON allows
            e = err(c.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}),
                    400, None, param)
            assert words.lower() in e["message"].lower(), (extra.keys(), e["message"])
        assert eng.calls == []
        small = {"type": "json_schema", "json_schema": {"name": "e", "schema": {"enum": ["a", "b"]}}}
        assert c.post("/v1/chat/completions", json={**CHAT, "response_format": small}).status_code == 200
