"""One thread runs the generations, one at a time, in arrival order.

The Engine is single-threaded state (its KV caches are the prefix cache that
requests sharing a system prompt reuse), so every llama.cpp call — tokenizing
included — happens on the worker thread.  Requests wait in a bounded queue
(``--queue``); a full queue refuses new ones (503 with Retry-After) instead
of letting latency grow without bound.

A :class:`Job` is one request's way through: the worker reports
``("start", n_prompt)``, then ``("chunk", Chunk)`` per verify round, then
``("done", SpecStats)`` — or ``("error", ApiError)`` — to the event loop's
queue.  :meth:`Job.cancel` (a client that went away, a shutdown) is seen by the
worker after the round in progress, inside a prompt's chunk being evaluated
(:meth:`Stream.cancel`: within milliseconds, not the seconds a chunk takes), or
between two fragments of a prompt being tokenized: the stream is closed and the
engine is free for the next request.  With
``--parallel N`` :class:`~mars_local.server.batch_worker.BatchWorker` replaces this loop
with the batched scheduler over the same Job interface.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import sys
import threading
import time
from typing import Any, Callable

from ..chat.tokens import PromptTooLong, TokenizingCancelled
from ..core.errors import MarsError
from ..core.interrupts import wait_through
from .requests import ApiError, Request

__all__ = ["Job", "Worker"]

_ids = itertools.count(1)

# How long the generation thread waits for a stream's first chunk to reach its client before it
# goes on.  The next step (a draft model's prefill of the prompt, a verify window) keeps every
# core busy, and the event loop's thread, which writes the chunk, would wait for it: measured on
# 2 cores, 100 ms of time to first token (K-quant stand-in, bundled draft); waiting costs ~1 ms.
FIRST_CHUNK_WAIT_S = 0.1


def generation_error(exc: MarsError) -> ApiError:
    """The answer to a generation that failed on a MarsError: one that names a setting of the
    request (e.g. its grammar, which no token can continue) is the client's (400, that param),
    any other the server's (500)."""
    if exc.field:
        return ApiError(400, str(exc), param=exc.field)
    return ApiError(500, str(exc), type="server_error")


def unexpected_error(what: str, exc: BaseException) -> ApiError:
    """The answer to a failure no path expected (``what`` failed: a request, a round), said on
    stderr too: a 500, the generation thread going on."""
    print(f"mars serve: {what} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    return ApiError(500, f"generation failed: {exc}", type="server_error")


class Job:
    """One request in the queue or on the engine."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop, endpoint: str = ""):
        self.request, self.endpoint = request, endpoint
        self.config = request.config  # what it runs with (a forced tool call adds its grammar)
        self.tool_format: str | None = None  # the chat template's tool-call syntax, when calls are parsed
        self.number = next(_ids)
        self.events: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self._cancel = threading.Event()
        self.rounds_at_cancel: int | None = None  # stats.n_rounds when cancel() was called
        self.stats = None  # the SpecStats while it runs, final once done
        self.t_submit = time.monotonic()
        self.t_start: float | None = None
        self.t_first: float | None = None  # the first chunk with text or tokens
        self.checked = self.t_submit  # when the app last asked whether the client is still there
        self._sent = threading.Event()  # a streamed answer's first chunk has been written (sent())
        self._stop_stream: Callable[[], None] | None = None  # its stream's cancel, once it runs

    def cancel(self) -> None:
        """Stop at the end of the round in progress (or never start); a prompt's chunk being
        evaluated stops at once (Stream.cancel)."""
        if not self._cancel.is_set():
            self.rounds_at_cancel = self.stats.n_rounds if self.stats is not None else 0
            self._cancel.set()
        stop = self._stop_stream
        if stop is not None:
            stop()

    def running_as(self, stream) -> None:
        """(On the generation thread) the job's stream has begun: cancel() stops it from now on."""
        self._stop_stream = stream.cancel
        if self.cancelled:  # (cancelled while it was being made)
            stream.cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def sent(self) -> None:
        """(On the event loop) a chunk has been written to the client."""
        self._sent.set()

    @staticmethod
    def wait_sent(jobs: list["Job"], timeout: float | None = None) -> None:
        """(On the generation thread) wait, ``timeout`` at most in all, until the first chunk of
        every streamed job in ``jobs`` has been written: time to first token is then the
        generation's, not the next round's (see FIRST_CHUNK_WAIT_S)."""
        deadline = time.monotonic() + (FIRST_CHUNK_WAIT_S if timeout is None else timeout)
        for job in jobs:
            if job.request.stream and not job.cancelled:
                job._sent.wait(max(0.0, deadline - time.monotonic()))

    def emit(self, kind: str, value: Any = None) -> None:
        """Hand an event to the event loop (from the worker thread)."""
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop has closed (server shutdown)
            pass


class Worker:
    """The generation thread over one engine, fed by a bounded queue."""

    def __init__(self, engine, queue_size: int, on_done: Callable[[Job, str], None] | None = None):
        if queue_size < 1:
            raise MarsError(f"--queue must be >= 1, got {queue_size}")
        self.engine, self.queue_size = engine, queue_size
        self._q: queue.Queue = queue.Queue(maxsize=queue_size)
        self._on_done = on_done
        self.running: Job | None = None
        self._stopping = threading.Event()
        self._ended = threading.Event()  # the thread's end (stop() waits on it: see there)
        self._thread = threading.Thread(target=self._main, name="mars-generate", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._q.qsize()

    @property
    def n_running(self) -> int:
        """Requests on the engine now (0 or 1 here)."""
        return 0 if self.running is None else 1

    def warm_up(self) -> float:
        """Nothing to time before the first request here (a lone engine times its verify windows
        once, after a request's first token): 0 seconds.  See :meth:`BatchWorker.warm_up`."""
        return 0.0

    def submit(self, job: Job) -> None:
        try:
            self._q.put_nowait(job)
        except queue.Full:
            raise ApiError(503, f"the server is busy ({self.queue_size} requests are waiting); retry later",
                           type="server_error", code="queue_full", headers={"Retry-After": "1"}) from None

    def stop(self, timeout: float = 5.0) -> bool:
        """Cancel what runs and waits, and end the thread; whether it ended within ``timeout``
        (a prompt being evaluated finishes first: the engine must not be freed before)."""
        self.cancel_all()
        self._q.put(None)
        # a Ctrl-C meanwhile (a second one while the server shuts down) does not cut the wait
        # short: the caller frees the models next
        wait_through(self._ended, timeout)
        return self._ended.is_set()

    def cancel_all(self) -> None:
        """Shutting down: cancel what runs and waits, without waiting for the thread.  Each
        request ends with 503 "the server is shutting down" (what it streamed stays sent), so
        its connection closes at once; the thread goes on until :meth:`stop`."""
        self._stopping.set()
        running = self.running  # (the thread may set it to None meanwhile)
        if running is not None:
            running.cancel()
        while True:
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                if isinstance(job, Job):  # (not a BatchWorker's warm-up)
                    job.emit("error", ApiError(503, "the server is shutting down", type="server_error"))

    def _main(self) -> None:
        try:
            self._serve()
        finally:
            self._ended.set()

    # ------------------------------------------------------------ the thread
    def _serve(self) -> None:
        while (job := self._q.get()) is not None:
            self.running = job
            if self._stopping.is_set():  # stop() may have missed it between get() and here
                job.cancel()
            outcome, final = "error", None
            try:
                outcome, final = self._generate(job)
            except BaseException as exc:  # never let one request end the thread
                final = ("error", unexpected_error(f"request {job.number}", exc))
            finally:
                self.running = None
            self._done(job, outcome, final)

    def _done(self, job: Job, outcome: str, final) -> None:
        """A job has ended: the metrics first (current when the last event arrives), then its last event."""
        if self._on_done is not None:
            try:
                self._on_done(job, outcome)
            except Exception as exc:  # pragma: no cover - metrics must not stop the worker
                print(f"mars serve: metrics: {exc}", file=sys.stderr)
        if final is not None:
            job.emit(*final)

    def _prompt(self, job: Job) -> list[int]:
        """The request's prompt tokens.  Tokenizing stops as soon as the prompt is known
        not to fit (a text too long for the context is refused before it is tokenized at
        all) or the client has gone (see :func:`mars_local.chat.tokens.tokenize_text`)."""
        req, eng = job.request, self.engine
        bounds = {"max_tokens": eng.n_ctx - 1, "cancelled": lambda: job.cancelled}
        n, exact = None, True
        try:
            if req.kind == "chat":
                if not eng.has_chat_template:
                    raise ApiError(400, "the model has no chat template; start the server with --chat-template "
                                   "NAME|FILE or use /v1/completions", param="messages")
                toks, job.config, job.tool_format = eng.tool_prompt(
                    req.messages, req.tools, req.tool_choice, job.config, parallel=req.parallel_tool_calls, **bounds)
            else:
                toks = eng.tokenize(req.prompt, **bounds) if isinstance(req.prompt, str) else list(req.prompt)
        except PromptTooLong as exc:
            n, exact = exc.n_tokens, exc.exact
        else:
            if len(toks) >= eng.n_ctx:
                n = len(toks)
        if n is not None:
            param = "messages" if req.kind == "chat" else "prompt"
            raise ApiError(400, f"the prompt is {'' if exact else 'at least '}{n} tokens but the context holds "
                           f"{eng.n_ctx}; shorten it or start the server with a larger -c", param=param,
                           code="context_length_exceeded")
        return toks

    def _pieces(self, chunk) -> dict[int, bytes] | None:
        """The bytes of every token a chunk's log probabilities name (llama.cpp is
        called on this thread only)."""
        if not chunk.logprobs:
            return None
        ids = {lp.token for lp in chunk.logprobs} | {t for lp in chunk.logprobs for t, _ in lp.top}
        return {t: self.engine.piece(t) for t in ids}

    def _generate(self, job: Job) -> tuple[str, tuple | None]:
        """Run one job: its outcome (for the log and the metrics) and its last event."""
        if job.cancelled:
            final = ("error", ApiError(503, "the server is shutting down", type="server_error"))
            return "cancelled", (final if self._stopping.is_set() else None)
        job.t_start = time.monotonic()
        try:
            tokens = self._prompt(job)
            stream = self.engine.stream(tokens, job.config)
        except TokenizingCancelled:  # the client went away while its prompt was being tokenized
            return "cancelled", (("error", ApiError(503, "the server is shutting down", type="server_error"))
                                 if self._stopping.is_set() else None)
        except ApiError as exc:
            return "rejected", ("error", exc)
        except MarsError as exc:
            return "rejected", ("error", ApiError(400, str(exc), param=exc.field))
        job.stats = stream.stats
        job.running_as(stream)
        job.emit("start", len(tokens))
        try:
            for chunk in stream:
                first = job.t_first is None and bool(chunk.tokens or chunk.text)
                if first:
                    job.t_first = time.monotonic()
                job.emit("chunk", (chunk, self._pieces(chunk)))
                if first:
                    Job.wait_sent([job])
                if job.cancelled:
                    break
        except MarsError as exc:
            return "error", ("error", generation_error(exc))
        finally:
            stream.close()
        if job.cancelled and self._stopping.is_set():  # the client is still there: say why it ends
            return "cancelled", ("error", ApiError(503, "the server is shutting down", type="server_error"))
        return ("cancelled" if job.cancelled else "ok"), ("done", stream.stats)
