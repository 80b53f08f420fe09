"""What the user typed: the command line as given (to name a flag as the user spelled it),
text arguments made valid Unicode, and the one-line warnings.

The bottom of the CLI: imports nothing of it (:mod:`.inputs` and :mod:`.flags` import this).
"""

from __future__ import annotations

from typer import echo

ARGV: list[str] = []  # the command line as MarsGroup received it, to name a flag as the user typed it


def typed_flag(decls) -> str:
    """Which of an option's spellings ``decls`` the user typed (the last one given), or the first."""
    for tok in reversed(ARGV):
        if tok == "--":
            continue
        head = tok.split("=", 1)[0] if tok.startswith("--") else tok
        if head in decls:
            return head
    return decls[0]


def warn(msg: str) -> None:
    echo(f"warning: {msg}", err=True)


def valid_utf8(text: str, what: str) -> str:
    """``text`` as valid Unicode: an argument holding bytes that are not UTF-8
    (Python passes them as lone surrogates, 'caf\\udce9') has each bad byte
    replaced with U+FFFD, with one warning line (llama.cpp's tokenizer does the
    same replacement, silently)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # surrogates that did not come from undecodable bytes
        raw = text.encode("utf-8", "surrogatepass")
    warn(f"{what} is not valid UTF-8; each invalid byte was replaced with U+FFFD")
    return raw.decode("utf-8", "replace")


def decode_utf8(raw: bytes, what: str) -> str:
    """Bytes read from standard input as text, invalid UTF-8 replaced as in :func:`valid_utf8`."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        warn(f"{what} is not valid UTF-8 (first bad byte at offset {exc.start}); "
             "each invalid byte was replaced with U+FFFD")
        return raw.decode("utf-8", "replace")
