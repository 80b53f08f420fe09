"""llama.cpp's backend and log: started once per process, the log kept for error messages.

Imported by every module that calls llama.cpp (:mod:`.runtime`, :mod:`.rpc`, grammars), so
llama.cpp's log goes to :data:`recent_log` (never the terminal) from the first import on, and
:func:`init_backend` starts the backend when the first model needs it.
"""

from __future__ import annotations

import collections
import ctypes
import threading

from ..core.interrupts import CALLBACK_CODES

try:  # pragma: no cover - exercised by the import itself
    import llama_cpp as _llama_pkg
    from llama_cpp import llama_cpp as C
except Exception as exc:  # pragma: no cover
    raise ImportError(
        "mars-local needs llama-cpp-python 0.3.36; run `make install` (it builds the patched sdist)"
    ) from exc

__all__ = ["C", "init_backend", "last_llama_error", "recent_log", "LLAMA_CPP_PYTHON_VERSION"]

LLAMA_CPP_PYTHON_VERSION = getattr(_llama_pkg, "__version__", "unknown")

# ----------------------------------------------------------------- logging
recent_log: collections.deque[str] = collections.deque(maxlen=40)


def _log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:  # pragma: no cover - C calls it
    try:
        msg = text.decode("utf-8", errors="replace")
    except Exception:
        return
    recent_log.append(msg)


_log_callback = C.llama_log_callback(_log)
CALLBACK_CODES.add(_log.__code__)  # a Ctrl-C landing here is delivered again (core/interrupts.py)


# llama.cpp's log goes to recent_log (for error messages), not the terminal,
# from the moment this module is imported.
C.llama_log_set(_log_callback, ctypes.c_void_p(0))

_backend_lock = threading.Lock()
_backend_started = False


def init_backend() -> None:
    """Start llama.cpp's backend (once per process, thread-safe): the first
    :class:`Model` does it, so importing this module starts nothing."""
    global _backend_started
    if _backend_started:
        return
    with _backend_lock:
        if not _backend_started:
            C.llama_backend_init()
            _backend_started = True


def last_llama_error() -> str:
    for line in reversed(recent_log):
        line = line.strip()
        if line and ("error" in line.lower() or "failed" in line.lower()):
            return line
    return ""
