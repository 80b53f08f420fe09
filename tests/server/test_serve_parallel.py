"""`mars serve --parallel N` through uvicorn: concurrent clients decoded together, each answer
equal to its lone greedy answer, a client leaving mid-stream while the others run."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import openai
import pytest

from live_server import LiveServer
from mars_local import Engine

pytestmark = pytest.mark.slow
PROMPTS = [f"client {i}: the quick brown fox " + "jumps " * (i % 5) for i in range(12)]


@pytest.fixture(scope="module")
def server(tiny_target, tiny_draft):
    with LiveServer.start("-m", tiny_target, "-md", tiny_draft, "--parallel", "4", "--temp", "0",
                          "--verify", "strict") as s:
        yield s


def lone_answers(tiny_target, tiny_draft, n):
    with Engine(tiny_target, tiny_draft, learned=False) as eng:
        return [eng.generate(p, max_tokens=n, temperature=0, draft_max=0, ignore_eos=True).text for p in PROMPTS]


def test_concurrent_clients_each_get_their_lone_answer(server, tiny_target, tiny_draft):
    want = lone_answers(tiny_target, tiny_draft, 24)
    oa = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=120)

    def ask(p):
        r = oa.completions.create(model="target", prompt=p, max_tokens=24, extra_body={"ignore_eos": True})
        return r.choices[0].text

    with cf.ThreadPoolExecutor(12) as pool:
        got = list(pool.map(ask, PROMPTS))
    assert got == want
    health = httpx.get(f"{server.base}/health", timeout=10).json()
    assert health["sequences"] == 0 and health["queue"] == 0
    metrics = httpx.get(f"{server.base}/metrics", timeout=10).text
    assert "mars_batch_rows" in metrics and "mars_batch_draft_length" in metrics
    assert any("4 requests at once" in line for line in server.lines)


def test_a_client_leaving_mid_stream_does_not_disturb_the_others(server, tiny_target, tiny_draft):
    want = lone_answers(tiny_target, tiny_draft, 40)[:6]
    oa = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=120)

    def ask(p):
        return oa.completions.create(model="target", prompt=p, max_tokens=40, extra_body={"ignore_eos": True}
                                     ).choices[0].text

    def leave():
        with httpx.stream("POST", f"{server.url}/completions", timeout=60, json={
                "prompt": "a long one", "max_tokens": 3000, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    return True  # close after the first chunk
        return False

    with cf.ThreadPoolExecutor(8) as pool:
        left = pool.submit(leave)
        got = list(pool.map(ask, PROMPTS[:6]))
    assert left.result() and got == want
    line = server.wait_for_line(" cancelled: ", timeout=30)
    assert line


def _served_greedy_answers(model, drafter: str, *flags) -> None:
    """`mars serve -m MODEL *flags --drafter DRAFTER --parallel 3`: six concurrent clients each get
    the lone greedy answer of plain decoding, and the server says which drafter serves."""
    with Engine(model, learned=False) as eng:
        want = [eng.generate(p, max_tokens=20, temperature=0, ignore_eos=True).text for p in PROMPTS[:6]]
    with LiveServer.start("-m", model, *flags, "--drafter", drafter, "--parallel", "3", "--temp", "0",
                          "--verify", "strict") as s:
        oa = openai.OpenAI(base_url=s.url, api_key="x", max_retries=0, timeout=120)

        def ask(p):
            r = oa.completions.create(model=model.stem, prompt=p, max_tokens=20, extra_body={"ignore_eos": True})
            return r.choices[0].text

        with cf.ThreadPoolExecutor(6) as pool:
            got = list(pool.map(ask, PROMPTS[:6]))
        assert any(f"drafter: {drafter}" in line and "3 requests at once" in line for line in s.lines), s.lines
    assert got == want


def test_mars_serve_drafts_with_mtp_layers_for_concurrent_clients(tiny_dir):
    from tinymodels import make_tiny_mimo2

    _served_greedy_answers(make_tiny_mimo2(tiny_dir / "mimo2-serve.gguf", seed=5), "mtp")


def test_mars_serve_drafts_with_an_eagle3_head_for_concurrent_clients(tiny_dir):
    from tinymodels import make_tiny_eagle3, make_tiny_llama

    model = make_tiny_llama(tiny_dir / "eagle-serve-target.gguf", seed=11, n_layer=3, block_scale=0.05)
    head = make_tiny_eagle3(tiny_dir / "eagle3-serve-head.gguf", seed=11)
    _served_greedy_answers(model, "eagle3", "-md", head)


def test_a_new_server_times_the_target_before_it_listens_and_a_restarted_one_does_not(tiny_target, tiny_draft,
                                                                                       tmp_path):
    """The batched forwards' calibration happens before the ready line (not in the first
    request), is said once, and is kept for the next start on this machine."""
    env = {"MARS_STATE_DIR": str(tmp_path)}
    args = ("-m", tiny_target, "-md", tiny_draft, "--parallel", "2", "--temp", "0")
    for first in (True, False):
        with LiveServer.start(*args, env=env) as s:
            said = [i for i, line in enumerate(s.lines) if "timed the target's batched forwards once" in line]
            ready = next(i for i, line in enumerate(s.lines) if "2 requests at once" in line)
            assert (said and said[0] < ready) if first else not said, s.lines
            r = httpx.post(s.base + "/v1/completions", json={"prompt": "the fox", "max_tokens": 4}, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
