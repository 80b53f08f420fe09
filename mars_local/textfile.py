"""Reading a text file named by the user: one-line errors, never a traceback (pure)."""

from __future__ import annotations

from pathlib import Path

from .errors import MarsError

__all__ = ["read_bytes", "decode_text", "read_text"]


def read_bytes(path: str | Path, what: str) -> bytes:
    """The bytes of ``path``; ``what`` names it in errors ("prompt file", "input file", ...)."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise MarsError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise MarsError(f"{what} {path} is a directory") from None
    except OSError as exc:
        raise MarsError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None


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


def read_text(path: str | Path, what: str) -> str:
    """The UTF-8 text of ``path`` (strict: binary data or invalid UTF-8 is refused)."""
    return decode_text(read_bytes(path, what), f"{what} {path}")
