"""One sequence of a :class:`~mars_local.speculate.batched.Scheduler`: its state (``_Seq``) and
the stream its caller reads (:class:`BatchStream`: iterating drives the scheduler)."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..core.config import Chunk, GenerateConfig, Generation
from ..core.stats import SpecStats
from ..llama.streams import SeqView
from .run import Run as _Run

__all__ = ["BatchStream"]


# ------------------------------------------------------------ sequences
@dataclass
class _Seq:
    run: _Run
    view: SeqView | None = None
    dview: SeqView | None = None  # the draft model's cells, when it drafts
    pending: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    ready: bool = False  # prompt prefilled, drafter begun: it decodes from the next round
    chunks: collections.deque = field(default_factory=collections.deque)
    done: bool = False
    error: BaseException | None = None
    t_start: float = 0.0


class BatchStream(Iterator[Chunk]):
    """The chunks of one sequence of a Scheduler (iterating drives the scheduler)."""

    def __init__(self, sched, seq: _Seq):  # sched: the Scheduler
        self._sched, self._seq = sched, seq
        self.stats: SpecStats = seq.run.stats
        self.config: GenerateConfig = seq.run.cfg

    def __iter__(self) -> "BatchStream":
        return self

    def __next__(self) -> Chunk:
        s = self._seq
        while not s.chunks:
            if s.done:
                if s.error is not None:
                    err, s.error = s.error, None
                    raise err
                raise StopIteration
            self._sched.step()
        return s.chunks.popleft()

    @property
    def done(self) -> bool:
        """Finished and every chunk read."""
        return self._seq.done and not self._seq.chunks

    @property
    def finished(self) -> bool:
        """The sequence has ended (chunks may still be unread)."""
        return self._seq.done

    def result(self) -> Generation:
        """The whole generation (runs the scheduler until this sequence ends; chunks already
        taken are not in it); raises the sequence's error."""
        chunks = list(self)
        lp = [x for c in chunks for x in (c.logprobs or [])] if self.config.logprobs else None
        return Generation("".join(c.text for c in chunks), [t for c in chunks for t in c.tokens],
                          [x for c in chunks for x in c.kinds], self.stats, lp)

    def take(self) -> list[Chunk]:
        """The chunks made so far and not yet read, without driving the scheduler (a
        server's worker steps it itself); raises the sequence's error once it has ended."""
        s = self._seq
        out = list(s.chunks)
        s.chunks.clear()
        if s.done and s.error is not None and not out:
            err, s.error = s.error, None
            raise err
        return out

    def cancel(self) -> None:
        """Ask the sequence to stop, from any thread: a chunk of its prompt being evaluated stops
        within milliseconds (a decode that carries other sequences' rows too goes on), else it
        leaves at the next round (stop_reason "interrupted")."""
        self._seq.run.stop.set()

    def close(self) -> None:
        """Cancel: the sequence leaves before the next round (stop_reason "interrupted")."""
        self._sched._cancel(self._seq)

    def __enter__(self) -> "BatchStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
