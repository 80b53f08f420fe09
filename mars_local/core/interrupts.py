"""Ctrl-C where Python cannot raise it: inside a function that C calls back.

ctypes prints and drops what a callback raises.  llama.cpp logs hundreds of lines while a model
loads, each through a Python callback (:mod:`mars_local.llama.backend`), so a Ctrl-C that Python's
default handler raised there was lost, and e.g. `mars serve` went on to start.  The CLI's SIGINT
handler (:func:`install`) raises KeyboardInterrupt as the default one does, except in such a
callback: there it sends the signal again a moment later, from a short-lived thread, and it is
raised once the main thread runs Python outside a callback.  In the callback that can stop the C
call it runs in (a long llama_decode's abort callback: :mod:`mars_local.llama.abort`) the handler
only records the Ctrl-C (:func:`take_stop`): the decode stops within a node and the caller raises
KeyboardInterrupt.  Imports nothing of llama.cpp.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import threading
import time

__all__ = ["CALLBACK_CODES", "STOPPING_CODES", "handle_sigint", "held", "install", "ours", "stop_asked", "take_stop",
           "wait_through"]

# code objects of the Python functions C calls back (llama/backend.py adds its log callback's)
CALLBACK_CODES: set = set()
# code objects of those that stop the C call they run in when asked (llama/abort.py adds its one)
STOPPING_CODES: set = set()
_stop_asked = False  # a Ctrl-C landed in one of those, not yet taken (take_stop)
RESEND_AFTER_S = 0.01
_resending = threading.Lock()  # one resending thread at a time


def _in_callback(frame, codes=CALLBACK_CODES) -> bool:
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def stop_asked() -> bool:
    """Whether a Ctrl-C landed in a stopping callback and was not taken yet (cheap: read per node
    of a decode)."""
    return _stop_asked


def take_stop() -> bool:
    """Whether a Ctrl-C landed in a stopping callback since the last call (then the caller raises
    KeyboardInterrupt once its C call has returned)."""
    global _stop_asked
    asked, _stop_asked = _stop_asked, False
    return asked


def _resend() -> None:
    if not _resending.acquire(blocking=False):
        return

    def send() -> None:
        try:
            time.sleep(RESEND_AFTER_S)
            _thread.interrupt_main()  # (runs this handler again, in the main thread)
        finally:
            _resending.release()

    threading.Thread(target=send, name="mars-ctrl-c", daemon=True).start()


def handle_sigint(signum, frame) -> None:
    """KeyboardInterrupt, as Python's default handler, unless ``frame`` runs in a callback from C."""
    global _stop_asked
    if _in_callback(frame, STOPPING_CODES):
        _stop_asked = True
        return
    if _in_callback(frame):
        _resend()
        return
    _stop_asked = False  # (one recorded a moment ago, its decode not yet returned: this one replaces it)
    raise KeyboardInterrupt


def install() -> None:
    """:func:`handle_sigint` for SIGINT, where Python's default handler is in place (an ignored
    SIGINT, or another program's handler, stays as it is).  From the main thread only."""
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, handle_sigint)


def ours() -> bool:
    """Whether :func:`handle_sigint` is SIGINT's handler (a Ctrl-C in a callback is then never lost)."""
    return signal.getsignal(signal.SIGINT) is handle_sigint


def wait_through(event: threading.Event, timeout: float | None = None) -> KeyboardInterrupt | None:
    """Wait until ``event`` is set (at most ``timeout`` seconds), a Ctrl-C meanwhile not cutting the
    wait short: the last one received is returned (None: none) for the caller to raise once what
    it waited for has ended (e.g. a thread still computing with a model the caller would free).
    An Event, not Thread.join/is_alive: on Python 3.11 a KeyboardInterrupt inside join marks a
    thread that still runs as ended."""
    deadline = None if timeout is None else time.monotonic() + timeout
    interrupted = None
    while not event.is_set():
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            break
        try:
            event.wait(left)
        except KeyboardInterrupt as exc:
            interrupted = exc
    return interrupted


@contextlib.contextmanager
def held(*signums: int):
    """``signums`` (default SIGINT) wait until the block has run, then do what their handlers in
    place would have done (a block that writes a record whole and counts it, or starts a process
    and registers it for stopping, is never cut in two).

    Held at Python's level, by handlers that only note the signal, not by a signal mask: Python
    runs its handlers in the main thread whichever thread a signal reached, so masking it in this
    thread does not hold it off while other threads (llama.cpp's) are there to take it; and a
    process started under a mask inherits it through exec, so a server started there could never
    be stopped with Ctrl-C (``mars bench --clients`` waited 10 s for each and then killed it, what
    it learned since it last saved lost).  From the main thread only (handlers can be set there
    only); elsewhere the block runs unguarded."""
    signums = signums or (signal.SIGINT,)
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in signums}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(caught):  # each once, in the order they came
            handler = old[s]
            if callable(handler):
                handler(s, None)
            elif handler == signal.SIG_DFL:
                if s == signal.SIGINT:
                    raise KeyboardInterrupt
                os.kill(os.getpid(), s)  # the default action (SIGTERM: the process ends)
