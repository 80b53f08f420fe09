"""One thread decodes up to ``--parallel`` requests together (continuous batching).

:class:`BatchWorker` has the interface of :class:`~mars_local.server.worker.Worker`
(the same :class:`Job` events, the same bounded queue and 503s) over a
:class:`~mars_local.speculate.batched.Scheduler`: each loop it admits the requests
waiting while a sequence slot is free (their prompts tokenized on this thread, as
every llama.cpp call), runs one round for every live sequence, and hands each
job the chunks its sequence made.  A job cancelled (its client went away) leaves
before the next round and frees its slot (a chunk of its prompt being evaluated
stops at once: BatchStream.cancel); one request's failure ends only its own
sequence.
"""

from __future__ import annotations

import queue
import sys
import threading
import time

from ..chat.tokens import TokenizingCancelled
from ..core.errors import MarsError
from ..speculate.batched import Scheduler
from .requests import ApiError
from .worker import Job, Worker, generation_error, unexpected_error

__all__ = ["BatchWorker"]


class BatchWorker(Worker):
    """The generation thread over one engine, ``parallel`` sequences at a time."""

    def __init__(self, engine, queue_size: int, parallel: int, on_done=None, defaults=None):
        self.sched = Scheduler(engine, parallel)
        self.parallel = parallel
        self.defaults = defaults  # the requests' default settings (what the warm-up times for)
        self.active: dict[Job, object] = {}  # job -> its BatchStream
        super().__init__(engine, queue_size, on_done)

    @property
    def n_running(self) -> int:
        return len(self.active)

    def stop(self, timeout: float = 5.0) -> bool:
        ok = super().stop(timeout)
        if ok:
            self.sched.close()
        return ok

    def cancel_all(self) -> None:
        for job in list(self.active):
            job.cancel()
        super().cancel_all()

    def warm_up(self) -> float:
        """Time the target's batched forwards on the generation thread before any request
        (:meth:`Scheduler.warm_up`: once per machine and models); the seconds it took.  `mars
        serve` calls it before it listens, so a new server's first request does not wait for it."""
        ask = _WarmUp()
        self._q.put(ask)
        while not ask.ended.wait(0.5) and not self._ended.is_set():  # (a thread already stopped: 0)
            pass
        return ask.seconds

    # ------------------------------------------------------------ the thread
    def _warm_up(self, ask: "_WarmUp") -> None:
        try:  # on this thread, as every llama.cpp call (llama/runtime.py: one OpenMP pool)
            ask.seconds = self.sched.warm_up(self.defaults)
        except Exception as exc:  # noqa: BLE001 - then the first request times it, as before
            print(f"mars serve: timing the target before the first request failed ({type(exc).__name__}: {exc}); "
                  "the first request will time it", file=sys.stderr)
        finally:
            ask.ended.set()

    def _serve(self) -> None:
        stopping = False
        while not (stopping and not self.active):
            stopping = self._admit() or stopping
            if self.active:
                try:
                    self.sched.step(after_prefill=self._deliver)  # first tokens before the round
                except BaseException as exc:  # never let the loop die: fail what runs
                    err = unexpected_error("a round", exc)
                    for job in list(self.active):
                        self._finish(job, "error", ("error", err))
                self._deliver()

    def _admit(self) -> bool:
        """Start waiting jobs while a slot is free; True once stop() was asked."""
        while len(self.active) < self.parallel:
            try:
                job = self._q.get(block=not self.active)
            except queue.Empty:
                return False
            if job is None:
                return True
            if isinstance(job, _WarmUp):
                self._warm_up(job)
                continue
            self._start(job)
        return False

    def _start(self, job: Job) -> None:
        if job.cancelled or self._stopping.is_set():
            self._done(job, "cancelled", ("error", ApiError(503, "the server is shutting down",
                                                             type="server_error")) if self._stopping.is_set() else None)
            return
        job.t_start = time.monotonic()
        try:
            tokens = self._prompt(job)
            stream = self.sched.submit(tokens, job.config)
        except TokenizingCancelled:
            self._done(job, "cancelled", None)
            return
        except ApiError as exc:
            self._done(job, "rejected", ("error", exc))
            return
        except MarsError as exc:
            self._done(job, "rejected", ("error", ApiError(400, str(exc), param=exc.field)))
            return
        except Exception as exc:  # noqa: BLE001 - this request fails, the thread goes on
            self._done(job, "error", ("error", unexpected_error(f"request {job.number}", exc)))
            return
        job.stats = stream.stats
        job.running_as(stream)
        job.emit("start", len(tokens))
        self.active[job] = stream
        self.running = job  # the latest started (health: something runs)

    def _deliver(self) -> None:
        firsts = []  # jobs whose first chunk goes out now: written before the next round starts
        for job, stream in list(self.active.items()):
            try:
                for chunk in stream.take():
                    if job.t_first is None and (chunk.tokens or chunk.text):
                        job.t_first = time.monotonic()
                        firsts.append(job)
                    job.emit("chunk", (chunk, self._pieces(chunk)))
                if stream.finished:
                    stream.take()  # (nothing left to read: raises the error it ended on, if any,
                    # which the first take() held back while text held back came out with it)
            except MarsError as exc:
                self._finish(job, "error", ("error", generation_error(exc)))
                continue
            except Exception as exc:  # noqa: BLE001 - one request's failure
                self._finish(job, "error", ("error", unexpected_error(f"request {job.number}", exc)))
                continue
            if job.cancelled or self._stopping.is_set():  # (_finish cancels its sequence; a job that
                # started while cancel_all ran was in none of the places it looks)
                final = (("error", ApiError(503, "the server is shutting down", type="server_error"))
                         if self._stopping.is_set() else None)
                self._finish(job, "cancelled", final)
            elif stream.finished:
                self._finish(job, "ok", ("done", stream.stats))
        Job.wait_sent(firsts)

    def _finish(self, job: Job, outcome: str, final) -> None:
        """The job leaves: its sequence cancelled where it still runs, its last event sent.
        Never raises (it runs in the loop's error paths too: the thread must go on)."""
        stream = self.active.pop(job, None)
        try:
            if stream is not None and not stream.finished:
                stream.close()
        except Exception as exc:  # noqa: BLE001 - e.g. its cells could not be removed: said, not fatal
            print(f"mars serve: cancelling request {job.number} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        finally:
            if self.running is job:
                self.running = next(iter(self.active), None)
            self._done(job, outcome, final)


class _WarmUp:
    """:meth:`BatchWorker.warm_up` asking the thread, through the queue (the thread waits there)."""

    def __init__(self):
        self.ended = threading.Event()
        self.seconds = 0.0

    def cancel(self) -> None:  # stop() came first: nothing timed
        self.ended.set()
