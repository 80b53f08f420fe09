"""Reading a text file named by the user: one-line errors, never a traceback (pure).

Every read is bounded: at most ``limit`` bytes are kept, and a larger input
(``/dev/zero``, an endless pipe) is refused with one line naming it and the
limit instead of filling the memory.  Text never holds a NUL byte, so reading
also stops at the first chunk holding one: the caller's decoding
(:func:`decode_text`) then refuses it as binary, naming the line.
"""

from __future__ import annotations

from pathlib import Path

from .errors import MarsError

__all__ = ["read_bytes", "read_stream", "decode_text", "read_text", "is_file_path", "format_size",
           "MAX_PROMPT_BYTES", "MAX_TEMPLATE_BYTES", "MAX_BATCH_BYTES"]

# A prompt: far more text than any model's context holds (1M tokens are ~4 MiB of text).
MAX_PROMPT_BYTES = 64 << 20
# A chat template: real ones are 1-50 KB; the template sandbox caps its strings near 1 MB anyway.
MAX_TEMPLATE_BYTES = 1 << 20
# A batch input (JSONL, `mars batch`): many records, each up to a prompt, but the whole file is
# held in memory while it is checked (~4x its size as bytes, text and lines): 256 MiB is some
# 100,000 records of long documents, days of generation; split larger batches into files.
MAX_BATCH_BYTES = 256 << 20
_CHUNK = 1 << 20


def format_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def read_stream(stream, limit: int, name: str, kind: str) -> bytes:
    """The bytes of a binary stream (a file, standard input) up to ``limit``; MarsError
    naming ``name`` and ``kind`` ("a prompt") when there are more.  Never reads more than ``limit`` + 1 bytes, and
    stops early at a chunk holding a NUL byte (binary input: see the module's note)."""
    parts, total = [], 0
    while True:
        chunk = stream.read(min(_CHUNK, limit + 1 - total))
        if not chunk:
            break
        if isinstance(chunk, str):  # a text stream (no binary buffer): its characters as UTF-8
            chunk = chunk.encode("utf-8", "surrogateescape")
        parts.append(chunk)
        total += len(chunk)
        if total > limit:
            raise MarsError(f"{name} is larger than {format_size(limit)}, the limit for {kind}")
        if b"\x00" in chunk:
            break
    return b"".join(parts)


def is_file_path(value: str | Path) -> bool:
    """Whether ``value`` names an existing file system entry; a value that cannot be a path
    at all (too long for the file system, a NUL byte, ...) is not one (False, no error)."""
    try:
        return Path(value).exists()
    except (OSError, ValueError):
        return False


def read_bytes(path: str | Path, what: str, limit: int = MAX_PROMPT_BYTES) -> bytes:
    """The bytes of ``path`` (at most ``limit``, see :func:`read_stream`); ``what`` names it in
    errors ("prompt file", "input file", ...)."""
    try:
        with open(path, "rb") as fh:
            return read_stream(fh, limit, f"{what} {path}", ("an " if what[:1] in "aeiou" else "a ") + what)
    except FileNotFoundError:
        raise MarsError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise MarsError(f"{what} {path} is a directory") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the name
        raise MarsError(f"cannot read the {what} {path}: {getattr(exc, 'strerror', None) or exc}") from None


def decode_text(raw: bytes, name: str, kind: str = "text") -> str:
    """``raw`` as UTF-8 text; a NUL byte (binary data) or invalid UTF-8 is a one-line error naming the line."""
    if b"\x00" in raw:
        line = raw.count(b"\n", 0, raw.index(b"\x00")) + 1
        raise MarsError(f"{name} is binary, not {kind} (a NUL byte on line {line})")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise MarsError(
            f"{name} is not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line}); convert it to UTF-8"
        ) from None


def read_text(path: str | Path, what: str, limit: int = MAX_PROMPT_BYTES) -> str:
    """The UTF-8 text of ``path`` (strict: binary data or invalid UTF-8 is refused)."""
    return decode_text(read_bytes(path, what, limit), f"{what} {path}")
