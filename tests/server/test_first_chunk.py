"""A streamed answer's first chunk reaches its client before the generation thread goes on
(server/worker.py's FIRST_CHUNK_WAIT_S): the next step keeps every core busy, and the event
loop that writes the chunk would wait for it (time to first token)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from fake_engine import FakeEngine
from mars_local import Engine, GenerateConfig
from mars_local.server import worker as worker_mod
from mars_local.server.batch_worker import BatchWorker
from mars_local.server.requests import parse_completion
from mars_local.server.worker import Job, Worker

D = GenerateConfig.make(max_tokens=-1, temperature=0.0, verify="strict")


def hand_over_after_first_chunk(jobs, sent_flags):
    """A stand-in for the event loop: once a job's first chunk is out, note the hand-over, then
    call sent() (a little later, as a busy loop would)."""
    def run():
        for job in jobs:
            deadline = time.monotonic() + 30
            while job.t_first is None and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(0.05)
            sent_flags[job.number] = True
            job.sent()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("stream", [True, False])
def test_the_worker_waits_for_the_first_chunk_to_be_written(monkeypatch, stream):
    monkeypatch.setattr(worker_mod, "FIRST_CHUNK_WAIT_S", 30.0)  # only sent() ends the wait here
    sent_flags: dict[int, bool] = {}
    seen_when_resumed = []

    class Recording(FakeEngine):
        def _chunks(self, toks, answer, config, stats):
            for i, chunk in enumerate(super()._chunks(toks, answer, config, stats)):
                if i == 1:  # the generation goes on: was the first chunk written?
                    seen_when_resumed.append(sent_flags.get(job.number, False))
                yield chunk

    eng, loop, done = Recording(chunk=2), asyncio.new_event_loop(), threading.Event()
    w = Worker(eng, 4, on_done=lambda job, outcome: done.set())
    try:
        job = Job(parse_completion({"prompt": "hi", "max_tokens": 8, "stream": stream}, D), loop)
        if stream:
            helper = hand_over_after_first_chunk([job], sent_flags)
        t0 = time.monotonic()
        w.submit(job)
        assert done.wait(30)
        if stream:
            helper.join(5)
            assert seen_when_resumed == [True]
        else:  # nothing is streamed: nothing to wait for
            assert seen_when_resumed == [False] and time.monotonic() - t0 < 10
    finally:
        w.stop()
        loop.close()


def test_a_client_that_never_reads_delays_the_others_by_the_bound_only(monkeypatch):
    monkeypatch.setattr(worker_mod, "FIRST_CHUNK_WAIT_S", 0.2)
    eng, loop, done = FakeEngine(chunk=2), asyncio.new_event_loop(), threading.Event()
    w = Worker(eng, 4, on_done=lambda job, outcome: done.set())
    try:
        job = Job(parse_completion({"prompt": "hi", "max_tokens": 8, "stream": True}, D), loop)
        w.submit(job)  # no one calls sent(): the worker goes on after the bound
        assert done.wait(30)
        assert job.t_first is not None
    finally:
        w.stop()
        loop.close()


def test_the_batched_worker_writes_first_chunks_before_the_next_round(monkeypatch, tiny_target, tiny_draft):
    monkeypatch.setattr(worker_mod, "FIRST_CHUNK_WAIT_S", 30.0)
    sent_flags: dict[int, bool] = {}
    late = []  # (job, round) where a round began with a first chunk delivered but not yet written

    with Engine(tiny_target, tiny_draft, drafter="model", n_ctx=256, n_threads=2, learned=False) as eng:
        async def main():
            loop = asyncio.get_running_loop()
            w = BatchWorker(eng, queue_size=8, parallel=3)
            inner = w.sched._round

            def round_(seqs):
                for j in list(w.active):
                    if j.t_first is not None and not sent_flags.get(j.number):
                        late.append(j.number)
                return inner(seqs)

            w.sched._round = round_
            try:
                jobs = [Job(parse_completion({"prompt": f"p{i} " * (i + 1), "max_tokens": 12, "stream": True,
                                              "ignore_eos": True}, D), loop) for i in range(3)]
                helper = hand_over_after_first_chunk(jobs, sent_flags)
                for j in jobs:
                    w.submit(j)
                for j in jobs:
                    while (await asyncio.wait_for(j.events.get(), 60))[0] not in ("done", "error"):
                        pass
                await asyncio.to_thread(helper.join, 5)
            finally:
                assert w.stop(30)
            return jobs

        jobs = asyncio.run(main())
    assert all(j.t_first is not None for j in jobs)
    assert late == []


def test_the_app_says_when_a_streamed_chunk_is_written(monkeypatch):
    from helpers import server_client

    monkeypatch.setattr(worker_mod, "FIRST_CHUNK_WAIT_S", 30.0)
    calls = []
    real = Job.sent
    monkeypatch.setattr(Job, "sent", lambda self: (calls.append(self.number), real(self)))
    with server_client(None, aliases=("fake.gguf",)) as c:
        r = c.post("/v1/completions", json={"prompt": "ab", "stream": True, "max_tokens": 4})
    text = "".join(line for line in r.text.splitlines() if line.startswith("data: "))
    assert r.status_code == 200 and text.endswith("[DONE]")
    assert len(calls) >= 2 and len(set(calls)) == 1  # one per chunk handled, all of this request
