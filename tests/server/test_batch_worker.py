"""The server's batched worker (server/batch_worker.py): requests decoded together, each answer
equal to its lone greedy answer, a cancelled request leaving the others whole, queue limits."""

from __future__ import annotations

import asyncio

import pytest

from mars_local import Engine, GenerateConfig
from mars_local.server.batch_worker import BatchWorker
from mars_local.server.requests import ApiError, parse_completion
from mars_local.server.worker import Job

D = GenerateConfig.make(max_tokens=-1, temperature=0.0, verify="strict")  # lossless: equal to plain
PROMPTS = [f"request {i}: " + "the quick brown fox " * (i % 3) for i in range(10)]


@pytest.fixture(scope="module")
def engine(tiny_target, tiny_draft):
    with Engine(tiny_target, tiny_draft, drafter="model", n_ctx=512, n_threads=2, learned=False) as eng:
        yield eng


async def collect(job: Job, limit: float = 60.0) -> tuple[list[int], str, object]:
    """(tokens, the last event's kind, its value)."""
    toks = []
    while True:
        kind, value = await asyncio.wait_for(job.events.get(), limit)
        if kind == "chunk":
            toks.extend(value[0].tokens)
        elif kind in ("done", "error"):
            return toks, kind, value


def test_requests_decoded_together_each_equal_to_its_lone_answer(engine):
    want = [engine.generate(p, max_tokens=20 + i, temperature=0, draft_max=0, ignore_eos=True).tokens
            for i, p in enumerate(PROMPTS)]

    async def main():
        loop = asyncio.get_running_loop()
        w = BatchWorker(engine, queue_size=16, parallel=4)
        try:
            jobs = [Job(parse_completion({"prompt": p, "max_tokens": 20 + i, "ignore_eos": True}, D), loop)
                    for i, p in enumerate(PROMPTS)]
            for j in jobs:
                w.submit(j)
            return await asyncio.gather(*(collect(j) for j in jobs)), w.sched.rounds
        finally:
            assert w.stop(30)

    results, rounds = asyncio.run(main())
    assert [r[0] for r in results] == want
    assert all(r[1] == "done" and r[2].stop_reason == "length" for r in results)
    assert rounds < sum(len(x) for x in want)  # several sequences per round


def test_a_cancelled_request_leaves_the_others_complete(engine):
    want = [engine.generate(p, max_tokens=30, temperature=0, draft_max=0, ignore_eos=True).tokens for p in PROMPTS[:3]]

    async def main():
        loop = asyncio.get_running_loop()
        w = BatchWorker(engine, queue_size=8, parallel=4)
        try:
            long = Job(parse_completion({"prompt": "go on", "max_tokens": 400, "ignore_eos": True}, D), loop)
            jobs = [Job(parse_completion({"prompt": p, "max_tokens": 30, "ignore_eos": True}, D), loop)
                    for p in PROMPTS[:3]]
            w.submit(long)
            for j in jobs:
                w.submit(j)
            kind, _ = await asyncio.wait_for(long.events.get(), 30)  # "start"
            await asyncio.wait_for(long.events.get(), 30)  # a first chunk
            long.cancel()
            return await asyncio.gather(*(collect(j) for j in jobs)), long
        finally:
            assert w.stop(30)

    results, long = asyncio.run(main())
    assert [r[0] for r in results] == want
    assert long.stats.stop_reason == "interrupted" and long.stats.n_generated < 400


def test_a_full_queue_is_503_and_a_bad_request_only_fails_itself(engine):
    def job(loop, prompt, n):
        return Job(parse_completion({"prompt": prompt, "max_tokens": n, "ignore_eos": True}, D), loop)

    async def main():
        loop = asyncio.get_running_loop()
        w = BatchWorker(engine, queue_size=1, parallel=2)
        try:
            long, other = job(loop, "go on", 300), job(loop, "and on", 300)
            w.submit(long)
            await asyncio.wait_for(long.events.get(), 30)  # started: the queue is empty again
            w.submit(other)
            await asyncio.wait_for(other.events.get(), 30)  # both slots busy now
            w.submit(job(loop, "waits", 4))  # the one place in the queue
            with pytest.raises(ApiError) as full:
                w.submit(job(loop, "refused", 4))
            too_long, ok = job(loop, [5] * 600, 4), job(loop, "hi", 4)
            long.cancel()
            other.cancel()
            await asyncio.sleep(0.5)
            w.submit(too_long)
            bad = await collect(too_long)
            w.submit(ok)
            return full.value, bad, await collect(ok)
        finally:
            assert w.stop(30)

    full, (_, k1, v1), (t2, k2, _) = asyncio.run(main())
    assert full.status == 503 and full.code == "queue_full"
    assert k1 == "error" and isinstance(v1, ApiError) and v1.status == 400 and v1.code == "context_length_exceeded"
    assert k2 == "done" and len(t2) == 4


def test_the_thread_times_the_target_before_it_takes_requests(tiny_target, tiny_draft, monkeypatch):
    """A new server's first request waited for the scheduler's calibration; the generation
    thread now does it when asked, before any request (`mars serve` listens after), on itself
    (one OpenMP pool: llama/runtime.py)."""
    import threading
    import time

    from mars_local.speculate.batched import Scheduler

    seen = []
    real = Scheduler.warm_up

    def spy(self, config=None):
        seen.append((threading.current_thread().name, config))
        return real(self, config)

    monkeypatch.setattr(Scheduler, "warm_up", spy)
    with Engine(tiny_target, tiny_draft, drafter="model", n_ctx=256, n_threads=2, learned=False) as eng:
        w = BatchWorker(eng, queue_size=4, parallel=2, defaults=D)
        try:
            time.sleep(0.2)
            assert seen == []  # not before it is asked (a Ctrl-C before then frees an idle engine)
            assert w.warm_up() > 0
            assert seen == [("mars-generate", D)] and w.sched.calibrated and w.waiting == 0
        finally:
            assert w.stop(30)
        assert w.warm_up() == 0.0  # a stopped thread: nothing timed, no wait


def test_ctrl_c_while_stopping_still_waits_for_the_thread_to_end():
    """stop() is what keeps the models from being freed under a forward: a Ctrl-C while it waits
    (a second one during shutdown) must neither end the wait early nor report an ended thread
    that still runs (Thread.join on Python 3.11 did: it marks the thread ended)."""
    import signal
    import threading
    import time

    from mars_local.server.worker import Worker

    class Slow(Worker):
        def _serve(self):
            self._q.get()
            time.sleep(0.6)  # a forward finishing
            self.finished = True

    w = Slow(None, queue_size=2)
    threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
    t0 = time.monotonic()
    assert w.stop(timeout=10) is True
    assert getattr(w, "finished", False) and time.monotonic() - t0 >= 0.5
    stuck = Slow(None, queue_size=2)
    assert stuck.stop(timeout=0.1) is False  # still sleeping: not ended within the timeout
    assert stuck.stop(timeout=5) is True


def test_a_request_that_fails_with_text_held_back_is_an_error_not_done(tiny_target, monkeypatch):
    """A sequence that fails (here its drafter, at its third round) ends with the text held
    back (a stop string's prefix, a split character) in a last chunk.  The worker read that
    chunk, saw the stream finished and answered "done" (HTTP 200, finish_reason "stop"): the
    error went unreported.  The request beside it is unaffected."""
    from mars_local.core.config import Chunk
    from mars_local.core.errors import MarsError
    from mars_local.speculate.drafters import Drafter
    from mars_local.speculate.run import Run

    monkeypatch.setattr(Run, "tail", lambda self: Chunk([], "held", [], None))

    class Failing(Drafter):
        calls = 0

        def propose(self, tokens, k, extend=None):
            Failing.calls += 1
            if Failing.calls == 3:
                raise MarsError("the drafter failed")
            return super().propose(tokens, k)

    async def main(eng):
        loop = asyncio.get_running_loop()
        w = BatchWorker(eng, queue_size=4, parallel=2)
        try:
            jobs = [Job(parse_completion({"prompt": p, "max_tokens": 12, "ignore_eos": True}, D), loop)
                    for p in PROMPTS[:1]]
            w.submit(jobs[0])
            return await collect(jobs[0])
        finally:
            assert w.stop(30)

    with Engine(tiny_target, drafter="ngram", n_ctx=256, n_threads=2, learned=False,
                drafter_factory=lambda cfg, seed, controls: Failing()) as eng:
        toks, kind, value = asyncio.run(main(eng))
    assert kind == "error" and isinstance(value, ApiError) and "the drafter failed" in str(value.body())


@pytest.mark.parametrize("fault", ["submit", "cancel"])
def test_an_unexpected_fault_in_one_request_leaves_the_thread_serving(engine, monkeypatch, fault):
    """An exception no path expects, while a request starts (here Scheduler.submit) or while a
    cancelled one is taken out (Scheduler._cancel): that request ends (an error, or its
    cancellation), and the generation thread lives on to serve the next one.  The thread died
    there, and every request after it waited forever."""
    from mars_local.speculate.batched import Scheduler

    real = getattr(Scheduler, "submit" if fault == "submit" else "_cancel")
    calls = []

    def faulty(self, *a, **kw):
        calls.append(a)
        if fault == "submit" and len(calls) > 1:
            return real(self, *a, **kw)
        if fault == "cancel":
            real(self, *a, **kw)
        raise RuntimeError("unexpected")

    monkeypatch.setattr(Scheduler, "submit" if fault == "submit" else "_cancel", faulty)

    async def main():
        loop = asyncio.get_running_loop()
        w = BatchWorker(engine, queue_size=8, parallel=2)
        try:
            first = Job(parse_completion({"prompt": "doomed", "max_tokens": 200, "ignore_eos": True}, D), loop)
            w.submit(first)
            if fault == "submit":
                got = await collect(first)
            else:
                await asyncio.wait_for(first.events.get(), 30)  # "start"
                await asyncio.wait_for(first.events.get(), 30)  # a first chunk
                first.cancel()
                got = None
            after = Job(parse_completion({"prompt": PROMPTS[1], "max_tokens": 12, "ignore_eos": True}, D), loop)
            w.submit(after)
            return got, await collect(after, 30)
        finally:
            monkeypatch.undo()
            assert w.stop(30)

    got, after = asyncio.run(main())
    if fault == "submit":
        assert got[1] == "error" and "unexpected" in str(got[2].body())
    assert after[1] == "done" and after[0] == engine.generate(PROMPTS[1], max_tokens=12, temperature=0, draft_max=0,
                                                              ignore_eos=True).tokens


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_grammar_no_token_continues_is_the_clients_error(smollm2, parallel):
    """A request's grammar that no token can continue fails at generation time: that is the
    request's fault, 400 naming the grammar (it was a 500 server_error), on both workers."""
    from mars_local.server.worker import Worker

    async def main(engine):
        loop = asyncio.get_running_loop()
        w = BatchWorker(engine, queue_size=4, parallel=2) if parallel > 1 else Worker(engine, queue_size=4)
        try:
            job = Job(parse_completion({"prompt": "hi", "max_tokens": 4,
                                        "grammar": 'root ::= [^\\x00-\\U0010FFFF]'}, D), loop)
            w.submit(job)
            return await collect(job)
        finally:
            assert w.stop(30)

    with Engine(smollm2, drafter="ngram", n_ctx=256, n_threads=2, learned=False) as eng:
        _, kind, err = asyncio.run(main(eng))  # (the tiny models' byte tokens continue any grammar)
    body = err.body()["error"]
    assert kind == "error" and err.status == 400 and body["param"] == "grammar"
    assert body["type"] == "invalid_request_error" and "allows no token" in body["message"]


@pytest.mark.parametrize("parallel", [1, 2])
def test_an_invalid_grammar_is_a_400_naming_the_grammar(engine, parallel):
    """A request's grammar llama.cpp cannot parse: 400 with param "grammar" (it was null), on
    both workers, with llama.cpp's reason."""
    from mars_local.server.worker import Worker

    async def main():
        loop = asyncio.get_running_loop()
        w = BatchWorker(engine, queue_size=4, parallel=2) if parallel > 1 else Worker(engine, queue_size=4)
        try:
            job = Job(parse_completion({"prompt": "hi", "max_tokens": 4, "grammar": 'foo ::= "a"'}, D), loop)
            w.submit(job)
            return await collect(job)
        finally:
            assert w.stop(30)

    _, kind, err = asyncio.run(main())
    body = err.body()["error"]
    assert kind == "error" and err.status == 400 and body["param"] == "grammar"
    assert "invalid GBNF grammar" in body["message"] and "root" in body["message"]


@pytest.mark.parametrize("parallel", [1, 2])
def test_shutting_down_while_a_request_starts_still_ends_it_with_a_503(engine, parallel, monkeypatch):
    """cancel_all (a Ctrl-C on mars serve) while the thread tokenizes a request's prompt: the job is
    then in neither the queue nor the running ones, and the BatchWorker let it run to its end
    (400 tokens) for uvicorn to cancel with a traceback.  It ends at once with the 503."""
    import time

    from mars_local.server.worker import Worker

    cls = BatchWorker if parallel > 1 else Worker
    real = cls._prompt

    def slow_prompt(self, job):  # a long prompt tokenized, or a chat template rendered
        time.sleep(0.5)
        return real(self, job)

    monkeypatch.setattr(cls, "_prompt", slow_prompt)

    async def main():
        loop = asyncio.get_running_loop()
        w = cls(engine, queue_size=4, parallel=2) if parallel > 1 else cls(engine, queue_size=4)
        try:
            job = Job(parse_completion({"prompt": "hello world", "max_tokens": 400, "ignore_eos": True}, D), loop)
            w.submit(job)
            await asyncio.sleep(0.2)  # the thread is inside _prompt now
            w.cancel_all()
            toks = []
            while True:
                kind, value = await asyncio.wait_for(job.events.get(), 60)
                if kind == "chunk":
                    toks.extend(value[0].tokens)
                elif kind in ("done", "error"):
                    return toks, kind, value
        finally:
            assert w.stop(30)

    toks, kind, value = asyncio.run(main())
    assert kind == "error" and value.status == 503 and len(toks) < 400


def test_cancelling_a_job_stops_its_stream_whenever_the_cancel_comes():
    """Job.cancel (the event loop: a client gone, a shutdown) reaches the stream, so a prompt's
    chunk in progress stops at once (llama/abort.py): after the stream began, and when the cancel
    came while the worker was making it."""
    class Stream:
        cancels = 0

        def cancel(self):
            self.cancels += 1

    loop = asyncio.new_event_loop()
    try:
        a, b = (Job(parse_completion({"prompt": "x", "max_tokens": 4}, D), loop) for _ in range(2))
        sa, sb = Stream(), Stream()
        a.running_as(sa)
        assert sa.cancels == 0
        a.cancel()
        assert a.cancelled and sa.cancels == 1
        b.cancel()
        b.running_as(sb)
        assert sb.cancels == 1
    finally:
        loop.close()
