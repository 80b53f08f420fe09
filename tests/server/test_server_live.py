"""`mars serve` as a process on a free loopback port, driven by the official `openai`
client and raw HTTP: endpoints, per-request speculation, losslessness, load, faults, metrics."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import httpx
import openai

from helpers import mars
from live_server import LiveServer

pytestmark = pytest.mark.slow  # a live `mars serve` process per module, and `mars run` subprocesses

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = [f"prompt number {i}: the quick brown fox" for i in range(16)]


@pytest.fixture(scope="module")
def server(tiny_target, tiny_draft):
    with LiveServer.start("-m", tiny_target, "-md", tiny_draft, "--api-key", KEY, "--temp", "0",
                          "--verify", "strict") as s:
        yield s


@pytest.fixture(scope="module")
def oa(server):
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def test_chat_completion_and_models(oa):
    r = oa.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}], max_tokens=12)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    spec = r.usage.model_extra["speculative"]
    assert spec["rounds"] >= 1 and spec["drafted"] >= 0
    assert [m.id for m in oa.models.list().data] == ["target"]


def test_streaming_with_usage_matches_the_whole_answer(oa):
    kw = dict(model="target", messages=[{"role": "user", "content": "tell me"}], max_tokens=20, temperature=0,
              extra_body={"ignore_eos": True})
    whole = oa.chat.completions.create(**kw).choices[0].message.content
    chunks = list(oa.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-2].choices[0].finish_reason == "length"


def test_completions_with_logprobs(oa):
    r = oa.completions.create(model="target", prompt="once upon", max_tokens=6, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 6 and "".join(lp.tokens) == r.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)


def test_the_speculative_extension_changes_what_usage_reports(oa):
    kw = dict(model="target", prompt="the the the the the", max_tokens=24)
    on = oa.completions.create(**kw, extra_body={"ignore_eos": True, "speculative": {
        "enabled": True, "verify": "strict", "draft_max": 4, "adaptive": False}})
    off = oa.completions.create(**kw, extra_body={"ignore_eos": True, "speculative": {"enabled": False}})
    s_on, s_off = on.usage.model_extra["speculative"], off.usage.model_extra["speculative"]
    # (the prompt is cached from the request before: its first token from its last row, evaluated
    # alone, in no round)
    assert s_off["drafted"] == 0 and s_off["rounds"] == 23 and s_off["mean_accepted_length"] == 1.0
    assert s_on["drafted"] > 0 and s_on["rounds"] < 24
    assert on.choices[0].text == off.choices[0].text  # strict greedy is lossless
    with pytest.raises(openai.BadRequestError) as e:
        oa.completions.create(**kw, extra_body={"speculative": {"theta": 2}})
    assert e.value.status_code == 400 and "theta" in e.value.body["message"]


def test_strict_greedy_through_the_server_equals_mars_run(server, oa, tiny_target, tiny_draft):
    prompt = "a story about a cat"
    r = oa.completions.create(model="target", prompt=prompt, max_tokens=40, temperature=0,
                              extra_body={"speculative": {"verify": "strict"}})
    out = mars("run", "-m", tiny_target, "-md", tiny_draft, "--verify", "strict", "--temp", "0", "-n", "40", "-t", "2",
               "--json", prompt, text=True, script=True)
    assert out.returncode == 0, out.stderr
    ran = json.loads(out.stdout)
    assert r.choices[0].text == ran["text"] and r.usage.completion_tokens == len(ran["tokens"])


def test_sixteen_concurrent_streaming_clients(server, oa):
    expected = [oa.completions.create(model="target", prompt=p, max_tokens=16).choices[0].text for p in PROMPTS]

    def stream(p: str) -> str:
        client = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)
        return "".join(c.choices[0].text for c in
                       client.completions.create(model="target", prompt=p, max_tokens=16, stream=True))

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(stream, PROMPTS, timeout=120))
    assert got == expected  # every client its own answer: no request sees another's state


@pytest.mark.parametrize("body, status, code", [
    (b'{"prompt": "x",', 400, "invalid_json"),
    (b'{"prompt": "' + b"x" * (10 << 20) + b'"}', 413, "request_too_large"),
    (json.dumps({"prompt": "word " * 5000}).encode(), 400, "context_length_exceeded"),
    (json.dumps({"prompt": "x", "speculative": {"theta": 2}}).encode(), 400, None),
])
def test_faults_get_their_status_and_error_shape(server, body, status, code):
    r = httpx.post(f"{server.url}/completions", content=body, headers={**AUTH, "content-type": "application/json"},
                   timeout=60)
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["code"] == code
    assert httpx.get(f"{server.base}/health", timeout=10).json()["status"] == "ok"


def test_a_wrong_key_is_401(server):
    bad = openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model="target", prompt="x", max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"


def metrics(server) -> dict:
    out = {}
    for line in httpx.get(f"{server.base}/metrics", headers=AUTH, timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_move_by_exactly_what_a_request_reports(server, oa):
    before = metrics(server)
    r = oa.completions.create(model="target", prompt="count with me", max_tokens=30, extra_body={"ignore_eos": True})
    after = metrics(server)
    u, s = r.usage, r.usage.model_extra["speculative"]

    def d(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert d("mars_tokens_generated_total") == u.completion_tokens == 30
    assert d("mars_prompt_tokens_total") == u.prompt_tokens
    assert d("mars_tokens_drafted_total") == s["drafted"] and d("mars_tokens_accepted_total") == s["accepted"]
    assert d("mars_tokens_relaxed_total") == s["relaxed"] and d("mars_rounds_total") == s["rounds"]
    assert d('mars_generations_total{outcome="ok"}') == 1 and d("mars_mean_accepted_length_count") == 1


CLIENT = textwrap.dedent("""
    import sys, httpx
    url, key = sys.argv[1], sys.argv[2]
    body = {"prompt": "go on forever", "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/completions", json=body, headers={"Authorization": "Bearer " + key},
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                print("chunk", flush=True)
""")


def test_a_client_killed_mid_stream_stops_its_generation(server, oa):
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, server.url, KEY], stdout=subprocess.PIPE, text=True)
    seen = 0
    for _ in proc.stdout:
        seen += 1
        if seen == 5:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    line = server.wait_for_line(r"cancelled: .* round\(s\) after the client left", timeout=30)
    after = int(re.search(r"(\d+) round\(s\) after the client left", line).group(1))
    generated = int(re.search(r"generated (\d+)", line).group(1))
    assert after <= 1 and generated < 3000
    r = oa.completions.create(model="target", prompt="next", max_tokens=5)  # served normally
    assert r.usage.completion_tokens == 5


def test_a_full_queue_answers_503_and_the_server_goes_on(tiny_target):
    with LiveServer.start("-m", tiny_target, "--drafter", "ngram", "--queue", "4") as s:
        body = {"prompt": "fill the queue", "max_tokens": 300, "ignore_eos": True}
        barrier = threading.Barrier(16)

        def post(_):
            barrier.wait(30)
            r = httpx.post(f"{s.url}/completions", json=body, timeout=120)
            return r.status_code, r.headers.get("retry-after"), r.json()

        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(post, range(16), timeout=180))
        codes = [c for c, _, _ in results]
        assert set(codes) <= {200, 503} and codes.count(503) >= 1 and codes.count(200) >= 5
        for code, retry, obj in results:
            if code == 503:
                assert retry == "1" and obj["error"]["code"] == "queue_full"
            else:
                assert obj["usage"]["completion_tokens"] == 300
        r = httpx.post(f"{s.url}/completions", json={"prompt": "after", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200


@pytest.mark.slow
def test_strict_greedy_chat_on_smollm2_equals_mars_run_chat(smollm2):
    """The bundled model with its n-gram drafter: the server's chat answer is `mars run --chat`'s, token for token."""
    question = "List three colours of the rainbow."
    with LiveServer.start("-m", smollm2, "--drafter", "ngram", "--verify", "strict", "--temp", "0") as s:
        r = httpx.post(f"{s.url}/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": question}], "max_tokens": 48, "logprobs": True})
        assert r.status_code == 200, r.text
        body = r.json()
    out = mars("run", "-m", smollm2, "--drafter", "ngram", "--verify", "strict", "--temp", "0", "-n", "48", "-t", "2",
               "--chat", "--json", question, text=True, script=True)
    assert out.returncode == 0, out.stderr
    ran = json.loads(out.stdout)
    assert body["choices"][0]["message"]["content"] == ran["text"]
    pieces = [bytes(t["bytes"]) for t in body["choices"][0]["logprobs"]["content"]]
    assert len(pieces) == len(ran["tokens"]) and b"".join(pieces).decode() == ran["text"]
    assert body["usage"]["completion_tokens"] == len(ran["tokens"])


def test_a_shared_system_prompt_is_taken_from_the_kv_cache(oa):
    system = "You are a terse assistant. " * 8

    def ask(q):
        return oa.chat.completions.create(model="target", max_tokens=4, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": q}])

    other = oa.completions.create(model="target", prompt="something else entirely", max_tokens=4)
    first = ask("first question")
    assert first.usage.prompt_tokens_details.cached_tokens <= 2  # nothing shared with the request before
    second = ask("second question")
    # the system prompt (and the template's markup up to the user's text) came from the cache
    assert len(system) // 4 < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens - 1
    again = ask("second question")
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1  # all but the last
    assert again.choices[0].message.content == second.choices[0].message.content
    assert other.usage.prompt_tokens_details.cached_tokens <= 2


def test_bad_serve_flags_are_one_line_before_the_model_loads(tiny_target, server):
    port = server.base.rsplit(":", 1)[1]
    for args, words in [(["--port", "70000"], "--port must be in 0..65535"),
                        (["--port", port], f"cannot listen on 127.0.0.1:{port}"),
                        (["--queue", "0"], "--queue must be >= 1"),
                        (["--host", "no.such.host.invalid"], "cannot listen on no.such.host.invalid"),
                        (["-m", "/nonexistent.gguf"], "not found")]:
        out = mars("serve", "-m", tiny_target, *args, timeout=60, text=True, script=True)
        err = out.stderr.strip()
        assert out.returncode == 2 and words in err and "\n" not in err and "Traceback" not in err, (args, err)


def test_ctrl_c_stops_a_server_in_the_middle_of_a_stream(tiny_target):
    s = LiveServer.start("-m", tiny_target, "--drafter", "ngram")
    try:
        with httpx.stream("POST", f"{s.url}/completions", timeout=60, json={
                "prompt": "long", "max_tokens": 3000, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break
            t0 = time.monotonic()
            s.proc.send_signal(signal.SIGINT)
            s.proc.wait(20)
            assert time.monotonic() - t0 < 15
    finally:
        s.stop()
    assert s.proc.returncode == 130  # Ctrl-C's exit code, as every mars command
    assert not any("Traceback" in line for line in s.lines), s.lines


def test_a_client_that_gives_up_on_a_whole_answer_cancels_it(tiny_target):
    # A context of 64k tokens: the whole answer takes the tiny model many seconds even on a fast
    # CPU (its 4k default was done in under 0.3 s on one), so the client surely gives up first.
    with LiveServer.start("-m", tiny_target, "--drafter", "ngram", "-c", "65536") as s:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{s.url}/completions", timeout=1.0,
                       json={"prompt": "a long wait", "max_tokens": 65000, "ignore_eos": True})
        line = s.wait_for_line(" cancelled: ", timeout=30)
        assert int(re.search(r"generated (\d+)", line).group(1)) < 65000
        r = httpx.post(f"{s.url}/completions", json={"prompt": "next", "max_tokens": 3}, timeout=60)
        assert r.json()["usage"]["completion_tokens"] == 3


def test_a_non_loopback_host_without_a_key_is_warned_about(tiny_target):
    with LiveServer.start("-m", tiny_target, "--drafter", "ngram", "--host", "0.0.0.0") as s:
        line = s.wait_for_line("without --api-key")
        assert "0.0.0.0" in line and "anyone who can reach this port" in line
    with LiveServer.start("-m", tiny_target, "--drafter", "ngram", "--host", "0.0.0.0", "--api-key", "k") as s:
        assert httpx.get(f"{s.base}/health", timeout=10).status_code == 200
        assert not any("without --api-key" in x for x in s.lines)


def test_web_pages_rebinding_and_form_posts_are_refused_by_the_live_server(server):
    """Through uvicorn: a foreign Origin (even a CORS "simple" text/plain POST), a
    DNS-rebinding Host and a body that is not JSON never reach the engine."""
    port = server.base.rsplit(":", 1)[1]
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    url = f"{server.url}/chat/completions"
    cases = [({"Origin": "http://evil.example", "Content-Type": "text/plain"}, 403, "origin_not_allowed"),
             ({"Host": f"rebind.attacker.example:{port}", "Content-Type": "application/json"}, 403, "host_not_allowed"),
             ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "unsupported_media_type")]
    for headers, status, code in cases:
        r = httpx.post(url, content=chat, headers={**AUTH, **headers}, timeout=30)
        assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    assert httpx.get(f"{server.base}/health", headers={"Host": "evil.example"}, timeout=10).status_code == 403
    for host in (f"localhost:{port}", f"[::1]:{port}"):
        r = httpx.post(url, content=chat, headers={**AUTH, "Host": host, "Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 200, r.text


def test_huge_chats_are_refused_in_seconds(server, oa):
    cases = {
        "100k messages": [{"role": "user", "content": "a"}] * 100_000,  # minutes in llama.cpp's special-token search
        "8 MB message": [{"role": "user", "content": "x" * 8_000_000}],  # just under the 8 MiB body limit
        "special text": [{"role": "user", "content": "a <|im_start|> " * 500_000}],  # special-token text, as text
        "4000 messages": [{"role": "user", "content": "é"}] * 4000,  # fewer than the context, each a few tokens
    }
    for name, messages in cases.items():
        t0 = time.monotonic()
        r = httpx.post(f"{server.url}/chat/completions", json={"messages": messages, "max_tokens": 1}, headers=AUTH,
                       timeout=60)
        took = time.monotonic() - t0
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", (name, r.text)
        assert took < 10, (name, took)
    assert oa.completions.create(model="target", prompt="next", max_tokens=2).usage.completion_tokens == 2


@pytest.mark.parametrize("parallel", ["1", "2"])
def test_ctrl_c_answers_every_request_in_flight_with_a_503_and_no_traceback(tiny_target, parallel):
    """Ctrl-C with a whole answer and a stream in flight: uvicorn waits 3 s for requests to end,
    then cancelled their tasks (a traceback each on stderr, a plain-text 500 to the client waiting
    for a whole answer).  Shutting down now cancels the generations first: the whole answer is a
    JSON 503, the stream ends with the same error event, stderr has no traceback nor ERROR line."""
    import threading

    s = LiveServer.start("-m", tiny_target, "--drafter", "ngram", "-c", "65536", "--parallel", parallel)
    whole: dict = {}

    def ask() -> None:
        r = httpx.post(f"{s.url}/completions", timeout=60,
                       json={"prompt": "a whole answer", "max_tokens": 60000, "ignore_eos": True})
        whole.update(status=r.status_code, type=r.headers.get("content-type"), body=r.text)

    t = threading.Thread(target=ask)
    try:
        with httpx.stream("POST", f"{s.url}/completions", timeout=60, json={
                "prompt": "long", "max_tokens": 60000, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            t.start()
            time.sleep(1.0)  # (the whole answer is in flight too, or waiting for the slot)
            s.proc.send_signal(signal.SIGINT)
            rest = [line for line in lines if line.startswith("data:")]
        t.join(30)
        s.proc.wait(20)
    finally:
        s.stop()
    assert s.proc.returncode == 130
    assert whole["status"] == 503 and "application/json" in whole["type"], whole
    assert json.loads(whole["body"])["error"]["message"] == "the server is shutting down"
    assert any("the server is shutting down" in line for line in rest) and rest[-1] == "data: [DONE]", rest[-3:]
    assert not any("Traceback" in line or "ERROR" in line for line in s.lines), s.lines
