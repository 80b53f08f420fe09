"""llama.cpp's built-in chat templates: their names, and rendering messages with one.

The ctypes side of :class:`mars_local.chat.builtin.BuiltinChatTemplate` (which checks
the messages and words the errors): this package is the one owner of llama.cpp calls.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

from .backend import C

__all__ = ["builtin_template_names", "apply_builtin_template"]


def builtin_template_names() -> tuple[str, ...]:
    """The names of the built-in chat templates this llama.cpp build knows, sorted."""
    n = int(C.llama_chat_builtin_templates(None, 0))
    out = (ctypes.c_char_p * max(n, 1))()
    n = int(C.llama_chat_builtin_templates(out, n))
    return tuple(sorted(out[i].decode("utf-8") for i in range(n)))


def apply_builtin_template(name: bytes, messages: Sequence[tuple[bytes, bytes]],
                           add_generation_prompt: bool) -> str | None:
    """The prompt llama.cpp's built-in template ``name`` renders from ``messages`` (UTF-8
    (role, content) pairs without NUL), the assistant's turn opened when
    ``add_generation_prompt``; None when llama.cpp refuses them."""
    chat = (C.llama_chat_message * max(len(messages), 1))()
    for i, (role, content) in enumerate(messages):
        chat[i].role, chat[i].content = role, content
    size = 256 + 2 * sum(len(r) + len(c) for r, c in messages)
    for _ in range(2):  # the second buffer has the size the first call asked for
        buf = ctypes.create_string_buffer(size)
        n = int(C.llama_chat_apply_template(name, chat, len(messages), bool(add_generation_prompt), buf, size))
        if n < 0:
            return None
        if n < size:
            return buf.raw[:n].decode("utf-8", "replace")
        size = n + 1
    return None  # pragma: no cover - the size was known
