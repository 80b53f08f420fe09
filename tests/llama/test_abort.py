"""Stopping a prompt's chunk part-way (llama/abort.py): a cancelled stream, a client gone, a server
shutting down or a Ctrl-C no longer wait for the whole chunk (seconds; a minute for a 7B on 2 cores).
Each test stops the decode at a known callback, so none depends on timing; each checks that the
cache stays in step and that what comes next is exact."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from helpers import run_python
from mars_local import Engine
from mars_local.llama import abort
from mars_local.llama.abort import ABORTABLE_ROWS, DecodeAborted
from mars_local.llama.backend import C
from mars_local.llama.context import Context
from mars_local.llama.runtime import Model
from mars_local.speculate.batched import Scheduler


def on_thread(fn):
    """``fn()`` on another thread (where no Ctrl-C goes: the callback is installed for a check)."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


class StopAt:
    """A check that says stop from its ``n``-th call on (call 1 is asked before the decode begins)."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls >= self.n


@pytest.fixture(scope="module")
def model(tiny_target):
    m = Model(tiny_target, 0, exact_kernels=True)
    yield m
    m.close()


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(10, 250, n).tolist()


def test_a_check_stops_a_wide_decode_part_way_and_the_cache_stays_in_step(model):
    toks = prompt(300)
    ctx = Context(model, n_ctx=512, n_batch=128, n_threads=2)
    fresh = Context(model, n_ctx=512, n_batch=128, n_threads=2)
    try:
        check = StopAt(3)  # inside the second chunk's graph: its 2nd node
        ctx.eval(toks[:128], n_out=0)
        ctx.abort_check = check
        with pytest.raises(DecodeAborted):
            on_thread(lambda: ctx.eval(toks[128:], n_out=1))
        assert check.calls == 3, "stopped where the check said so, not at the decode's end"
        assert ctx.n_past == 128 == int(C.llama_memory_seq_pos_max(ctx.mem, 0)) + 1  # the first chunk stays
        ctx.abort_check = None
        got = ctx.eval(toks[128:], n_out=1)[0].copy()
        want = fresh.eval(toks, n_out=1)[0]
        assert np.array_equal(got, want), "the chunk evaluated again equals a run never stopped"
    finally:
        ctx.close()
        fresh.close()


def test_narrow_decodes_are_never_asked(model):
    """A verify window (at most 64 rows) or one row is never slowed by the callback: a check
    that would stop everything is not called at all."""
    ctx = Context(model, n_ctx=512, n_batch=128, n_threads=2)
    try:
        check = StopAt(1)
        ctx.abort_check = check
        on_thread(lambda: ctx.eval(prompt(ABORTABLE_ROWS - 1), n_out=1))
        on_thread(lambda: ctx.eval([5], n_out=1))
        assert check.calls == 0 and ctx.n_past == ABORTABLE_ROWS
    finally:
        ctx.close()


def test_on_the_main_thread_a_programs_own_sigint_handler_is_left_alone(model):
    """With Python's default handler a KeyboardInterrupt raised inside a ctypes callback would be
    printed and lost: mars's handler is put in place for the decode (so a check still stops it
    part-way there) and Python's again after.  A program's own handler is left alone: then no
    callback, the decode only asked before it begins."""
    import signal

    ctx = Context(model, n_ctx=512, n_batch=128, n_threads=2)
    try:
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ctx.abort_check = check = StopAt(3)
        with pytest.raises(DecodeAborted):
            ctx.eval(prompt(100), n_out=0)
        assert check.calls == 3 and ctx.n_past == 0
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

        def own(*_):
            pass

        old = signal.signal(signal.SIGINT, own)
        try:
            ctx.abort_check = check = StopAt(2)
            ctx.eval(prompt(100), n_out=0)
            assert check.calls == 1 and ctx.n_past == 100 and signal.getsignal(signal.SIGINT) is own
        finally:
            signal.signal(signal.SIGINT, old)
    finally:
        ctx.close()


def test_a_ctrl_c_raised_replaces_one_recorded_a_moment_before():
    """A second Ctrl-C that lands outside the callback before the first one's decode returned is
    raised, and the recorded one is dropped: else the next wide decode stopped for it at once."""
    import sys

    from mars_local.core import interrupts

    interrupts._stop_asked = True  # (the first one, recorded in the callback)
    try:
        with pytest.raises(KeyboardInterrupt):
            interrupts.handle_sigint(2, sys._getframe())
        assert not interrupts.stop_asked()
    finally:
        interrupts.take_stop()


def test_a_ctrl_c_inside_a_prompts_chunk_stops_it_at_once(tiny_target):
    """Under the CLI's handler a Ctrl-C that lands while a chunk is computed stops it within a
    node, raised as KeyboardInterrupt once llama_decode has returned; the cache keeps the chunks
    before it (under Python's own handler no callback is installed on the main thread: above)."""
    code = f"""
import _thread, json
from mars_local.core import interrupts
from mars_local.llama import abort
from mars_local.llama.context import Context
from mars_local.llama.runtime import Model

interrupts.install()
m = Model({str(tiny_target)!r}, 0, exact_kernels=True)
ctx = Context(m, n_ctx=512, n_batch=128, n_threads=2)
ctx.eval(list(range(10, 138)), n_out=0)
calls = [0]
def check():  # the 3rd call "receives" a Ctrl-C (sent to the main thread: the one in the callback)
    calls[0] += 1
    if calls[0] == 3:
        _thread.interrupt_main()
    return False
ctx.abort_check = check
try:
    ctx.eval(list(range(138, 300)), n_out=1)
    out = "finished"
except KeyboardInterrupt:
    out = "interrupted"
print(json.dumps([out, calls[0], ctx.n_past, interrupts.take_stop()]))
"""
    r = run_python(code, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out, calls, n_past, left = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == "interrupted" and n_past == 128 and 3 <= calls <= 4 and left is False


def test_stream_cancel_inside_the_prompt_ends_the_stream_and_the_engine_stays_exact(tiny_target, monkeypatch):
    with Engine(tiny_target, drafter="ngram", n_ctx=512, n_batch=128, n_threads=2, learned=False) as eng:
        toks = prompt(300, seed=1)
        want = eng.generate(toks, max_tokens=6, temperature=0, ignore_eos=True).tokens
        eng.generate(prompt(20, seed=2), max_tokens=1)  # (the cache holds something else)
        stream = eng.stream(toks, max_tokens=6, temperature=0, ignore_eos=True)
        real, decodes = abort.decode, []

        def decode(ctx, batch, n_rows, check=None):
            decodes.append(n_rows)
            calls, nth = [], len(decodes)

            def check_then_cancel():  # Stream.cancel from "another thread" at the 2nd chunk's 1st node
                calls.append(1)
                if nth == 2 and len(calls) == 2:
                    stream.cancel()
                return check()
            return real(ctx, batch, n_rows, check_then_cancel if check is not None else None)

        monkeypatch.setattr(abort, "decode", decode)
        chunks = on_thread(lambda: list(stream))
        monkeypatch.undo()
        s = stream.stats
        assert decodes == [128, 128] and chunks == [] and s.stop_reason == "interrupted" and s.n_generated == 0
        assert s.n_prompt_evaluated == 128 and s.time_prompt_target_s == 0  # chunk 1 kept; the prompt never ended
        assert eng._ctx.n_past == 128
        again = eng.generate(toks, max_tokens=6, temperature=0, ignore_eos=True)
        assert again.tokens == want and again.stats.n_prompt_evaluated == 299 - 128


def test_a_cancelled_sequences_chunk_stops_and_the_others_stay_exact(tiny_target, monkeypatch):
    """The batched scheduler: sequence A is cancelled (its client went away) inside a chunk of its
    prompt; it ends at once ("interrupted"), B's answer equals B alone, and A's prompt again
    later equals A alone."""
    with Engine(tiny_target, drafter="ngram", n_ctx=512, n_batch=128, n_threads=2, learned=False) as eng:
        long, short = prompt(300, seed=3), prompt(12, seed=4)
        want_a = eng.generate(long, max_tokens=6, temperature=0, ignore_eos=True, draft_max=0).tokens
        want_b = eng.generate(short, max_tokens=6, temperature=0, ignore_eos=True, draft_max=0).tokens
        sched = Scheduler(eng, 2)
        try:
            a = sched.submit(long, max_tokens=6, temperature=0, ignore_eos=True)
            b = sched.submit(short, max_tokens=6, temperature=0, ignore_eos=True)
            real, asked = abort.decode, []

            def decode(ctx, batch, n_rows, check=None):
                if check is None or check != a._seq.run.stop.is_set:  # (not a chunk of A alone)
                    return real(ctx, batch, n_rows, check)

                def check_then_cancel():
                    asked.append(n_rows)
                    if len(asked) == 2:
                        a.cancel()
                    return check()
                return real(ctx, batch, n_rows, check_then_cancel)

            monkeypatch.setattr(abort, "decode", decode)
            rb = on_thread(b.result)
            monkeypatch.undo()
            assert asked and a.finished and a.stats.stop_reason == "interrupted" and a.stats.n_generated == 0
            assert a.stats.n_prompt_evaluated == 0 and a.stats.time_prompt_target_s == 0  # (in its first chunk)
            assert rb.tokens == want_b
            c = sched.submit(long, max_tokens=6, temperature=0, ignore_eos=True)
            assert c.result().tokens == want_a
        finally:
            sched.close()


def test_a_sequence_cancelled_while_it_decodes_leaves_at_the_next_round(tiny_target):
    with Engine(tiny_target, drafter="ngram", n_ctx=512, n_threads=2, learned=False) as eng:
        sched = Scheduler(eng, 2)
        try:
            a = sched.submit(prompt(10, seed=5), max_tokens=200, temperature=0, ignore_eos=True)
            b = sched.submit(prompt(10, seed=6), max_tokens=12, temperature=0, ignore_eos=True)
            for _ in range(3):
                sched.step()
            n = a.stats.n_generated
            a.cancel()  # (a thread of its own in a server: the flag is all it sets)
            sched.step()
            assert a.finished and a.stats.stop_reason == "interrupted" and a.stats.n_generated == n > 0
            assert b.result().tokens == eng.generate(prompt(10, seed=6), max_tokens=12, temperature=0,
                                                     ignore_eos=True, draft_max=0).tokens
        finally:
            sched.close()


def test_a_ctrl_c_landing_after_the_last_nodes_question_is_raised_not_lost(model):
    """The CLI's handler only records a Ctrl-C that lands in the callback; one recorded during the
    last node's question no longer stops anything, so it is raised once the decode has returned
    (else it was lost, and the next wide decode stopped at once for it)."""
    import signal

    from mars_local.core import interrupts

    ctx = Context(model, n_ctx=512, n_batch=128, n_threads=2)
    old = signal.signal(signal.SIGINT, interrupts.handle_sigint)
    try:
        ctx.abort_check = counting = StopAt(10 ** 9)
        ctx.eval(prompt(100), n_out=0)
        last = counting.calls  # the pre-check and one question per node
        ctx.truncate(0)

        def ctrl_c_in_the_last_question():
            ctrl_c_in_the_last_question.calls += 1
            if ctrl_c_in_the_last_question.calls == last:
                interrupts._stop_asked = True  # (what the handler does when the signal lands here)
            return False
        ctrl_c_in_the_last_question.calls = 0
        ctx.abort_check = ctrl_c_in_the_last_question
        with pytest.raises(KeyboardInterrupt):
            ctx.eval(prompt(100), n_out=0)
        assert not interrupts.stop_asked()
        ctx.abort_check = counting = StopAt(10 ** 9)
        # the next wide decode is not stopped by a stale Ctrl-C (sync: the cache, which the decode
        # did fill, is trusted over the mirror, as after any Ctrl-C right after llama_decode)
        assert ctx.sync(prompt(170, seed=9)) == 170 and ctx.n_past == 170 and counting.calls > 1
    finally:
        signal.signal(signal.SIGINT, old)
        interrupts.take_stop()
        ctx.close()


def test_a_sequence_cancelled_while_waiting_never_takes_a_slot(tiny_target):
    """BatchStream.cancel while waiting for a slot: it ends "interrupted" without joining, so
    the slot keeps the cells of the prompt before it (the next request with that prefix reuses them)."""
    with Engine(tiny_target, drafter="ngram", n_ctx=512, n_threads=2, learned=False) as eng:
        sched = Scheduler(eng, 1)
        try:
            first = prompt(40, seed=7)  # (chunks of <= 64 rows: a longer prompt reuses them)
            a = sched.submit(first, max_tokens=4, temperature=0, ignore_eos=True)
            b = sched.submit(prompt(40, seed=8), max_tokens=4, temperature=0, ignore_eos=True)
            b.cancel()
            a.result()
            sched.step()
            assert b.finished and b.stats.stop_reason == "interrupted" and b.stats.n_prompt_evaluated == 0
            c = sched.submit(first + [7], max_tokens=4, temperature=0, ignore_eos=True)
            c.result()
            assert c.stats.n_prompt_evaluated < 10  # a's prompt was still there
        finally:
            sched.close()
