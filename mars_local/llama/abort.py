"""Stopping a long ``llama_decode`` part-way: a cancelled request or a Ctrl-C inside a prompt's chunk.

A prompt is evaluated in chunks of up to n_batch rows, and one chunk is one C call: 512 rows took
7.3 s on the F16 stand-in on 2 cores, and take about a minute for a 7B there.  Python runs nothing
meanwhile, so a client that went away, a server shutting down (uvicorn waits 3 s) or a Ctrl-C
waited for the chunk's end.  llama.cpp asks an abort callback after every graph node on the CPU
backend (ggml-cpu: thread 0, i.e. the calling thread); returning true stops the decode, which
then returns 2 and removes that ubatch's positions (earlier ubatches of the call stay).

The callback is Python, so it is installed only for decodes of :data:`ABORTABLE_ROWS` rows or
more, where its ~1 us per node is nothing (a 4,085-node graph: ~4 ms against 1.3 s for 72 rows,
7.3 s for 512; measured on the F16 stand-in); a verify window or one row is never slowed.  It
stops the decode when its owner's check says so (``OwnsContext.abort_check``, called from the
decoding thread) or when a Ctrl-C landed in it (the main thread, under the CLI's SIGINT handler:
:mod:`mars_local.core.interrupts`; with Python's default handler a KeyboardInterrupt raised inside
a ctypes callback would be printed and lost, so the main thread decodes under ours: put in place
for the decode where Python's default handler is, and no callback where a program has its own).
The callback needs the GIL at every node: a thread running Python meanwhile can slow the decode
(the server's event loop mostly waits).  A recurrent/hybrid target's state cannot keep part of a
decode: stopped, it is dropped whole (llama/recurrent.py).
"""

from __future__ import annotations

import signal
import threading
from typing import Callable

from ..core import interrupts
from .backend import C

__all__ = ["ABORTABLE_ROWS", "DecodeAborted", "aborted", "decode"]

# Decodes this wide or wider can be stopped: a prompt's chunk (the lone path's chunks, the batched
# scheduler's one-sequence chunks) or a round of many windows; no single verify window is (64 rows
# at most: the exact bound).
ABORTABLE_ROWS = 65


class DecodeAborted(Exception):
    """A decode stopped by its owner's check (a cancelled stream): its ubatch was not kept."""


_local = threading.local()  # the check of the decode in progress on this thread


_MAIN = threading.main_thread().ident  # (only the main thread receives a Ctrl-C)


def _stop(_data) -> bool:
    if interrupts.stop_asked() and threading.get_ident() == _MAIN:
        return True
    check = getattr(_local, "check", None)
    return check is not None and bool(check())


interrupts.STOPPING_CODES.add(_stop.__code__)
_CALLBACK = C.ggml_abort_callback(_stop)  # (kept alive here: llama.cpp holds the pointer)
_NONE = C.ggml_abort_callback()


def decode(ctx, batch, n_rows: int, check: Callable[[], bool] | None = None) -> int:
    """``llama_decode(ctx, batch)`` of ``n_rows`` rows, stoppable by ``check()`` or a Ctrl-C where
    it is that wide (see the module's docstring); llama_decode's return code (2: stopped)."""
    if n_rows < ABORTABLE_ROWS:
        return C.llama_decode(ctx, batch)
    if check is not None and check():  # asked before it began: nothing decoded, nothing to clean up
        raise DecodeAborted("the decode was stopped before it began (the generation was cancelled)")
    main = threading.current_thread() is threading.main_thread()
    if not main and check is None:  # (no Ctrl-C reaches another thread)
        return C.llama_decode(ctx, batch)
    swapped = False
    if main:
        interrupts.take_stop()  # (none may be left over: see interrupts.handle_sigint)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            # Python's handler would raise a Ctrl-C inside the callback, where ctypes prints and
            # drops it: mars's, which records it there, for this decode (an embedding program's
            # own handler, or an ignored SIGINT, is left alone: then no callback on this thread)
            signal.signal(signal.SIGINT, interrupts.handle_sigint)
            swapped = True
        elif not interrupts.ours():
            return C.llama_decode(ctx, batch)
    _local.check = check
    C.llama_set_abort_callback(ctx, _CALLBACK, None)
    try:
        rc = C.llama_decode(ctx, batch)
    finally:
        C.llama_set_abort_callback(ctx, _NONE, None)
        _local.check = None
        if swapped:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if rc != 2 and main and interrupts.take_stop():
        # the Ctrl-C landed after the last node had been asked: the decode ended, the Ctrl-C is owed
        # (raised as one right after llama_decode would be: the caller's mirror has not grown yet)
        raise KeyboardInterrupt
    return rc


def aborted() -> BaseException:
    """What to raise for a decode that returned 2, once the caller's mirrors are in step again:
    KeyboardInterrupt where a Ctrl-C stopped it, else :class:`DecodeAborted`."""
    if interrupts.take_stop():
        return KeyboardInterrupt()
    return DecodeAborted("the decode was stopped (the generation was cancelled)")
