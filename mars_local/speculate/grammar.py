"""Grammars for structured output: GBNF text, JSON, JSON schemas, and llama.cpp's grammar sampler.

GBNF text comes from a file, llama-cpp-python's JSON grammar or its JSON-schema converter
(imported lazily, so importing this module loads no llama.cpp); its cost is bounded before
llama.cpp parses it (:mod:`.grammar_check`, pure).  :class:`GrammarState` wraps llama.cpp's
grammar sampler, which the engine masks logits with and clones along each draft.  It calls
llama.cpp outside :mod:`mars_local.llama` (through :data:`mars_local.llama.backend.C`, as
:mod:`.native` does for the verify kernel): the sampler is a per-generation state of the
engine's loop, and the check of a grammar's cost belongs to this package.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from pathlib import Path

import numpy as np

from ..core.errors import MarsError
from .grammar_check import MAX_GRAMMAR_BYTES, check_grammar_text
from ..core.textfile import is_file_path, read_text

__all__ = ["json_grammar", "grammar_from_json_schema", "load_grammar_option", "GrammarState"]


def json_grammar() -> str:
    """GBNF for any JSON value (ollama's ``--format json``; llama.cpp's json.gbnf)."""
    from llama_cpp.llama_grammar import JSON_GBNF

    return JSON_GBNF


def grammar_from_json_schema(schema: str | dict) -> str:
    """GBNF for the JSON documents that ``schema`` (a JSON Schema, as text or a dict) accepts;
    MarsError when it is no schema, or when the grammar would be too costly (see
    :func:`check_grammar_text`: an enum or ``anyOf`` of thousands)."""
    gbnf = _schema_gbnf(schema)
    check_grammar_text(gbnf)
    return gbnf


def _schema_gbnf(schema: str | dict) -> str:
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        obj = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise MarsError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise MarsError("a JSON schema must be a JSON object")
    try:
        gbnf = json_schema_to_gbnf(text)
    except Exception as exc:  # the converter raises bare exceptions on schemas it does not support
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise MarsError(f"cannot convert the JSON schema to a grammar: {msg}") from None
    # The pinned converter's string character allows raw control characters, which JSON
    # forbids (llama.cpp's own converter and JSON_GBNF exclude them): exclude them too.
    return gbnf.replace(_LAX_CHAR, _JSON_CHAR)


_FIRST_CANDIDATES = 64  # mask(row, need): the best candidates checked before the whole vocabulary
_LAX_CHAR = r'char ::= [^"\\] |'
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'


def load_grammar_option(grammar_file: str | Path | None = None, json_schema: str | None = None,
                        format: str | None = None) -> str | None:
    """The GBNF text for the CLI's ``--grammar FILE``, ``--json-schema FILE|JSON`` and ``--format json``
    (at most one of them); None when none is given."""
    given = [n for n, v in (("--grammar", grammar_file), ("--json-schema", json_schema), ("--format", format))
             if v is not None]
    if len(given) > 1:
        raise MarsError(f"{' and '.join(given)} cannot be combined; give one")
    if grammar_file is not None:
        return read_text(grammar_file, "grammar file", MAX_GRAMMAR_BYTES)
    if json_schema is not None:
        text = json_schema
        if not is_inline_json(json_schema):
            text = read_text(json_schema, "JSON schema file", MAX_GRAMMAR_BYTES)
        return grammar_from_json_schema(text)
    if format is not None:
        if format != "json":
            raise MarsError(f"--format must be json, got {format!r}")
        return json_grammar()
    return None


def is_inline_json(value: str) -> bool:
    """Whether a ``--json-schema FILE|JSON`` value is JSON text rather than a file name: it
    starts with ``{``, ``[`` or ``"``, or it is no existing file and parses as JSON (``true``, ``1``)."""
    head = value.lstrip()[:1]
    if head in ("{", "[", '"'):
        return True
    if is_file_path(value):
        return False
    try:
        json.loads(value)
    except (ValueError, RecursionError):
        return False
    return True


_stderr_lock = threading.Lock()


_REGEX_SPECIAL = set("^$\\.*+?()[]{}|/")


def trigger_pattern(word: str) -> str:
    """The ECMAScript regex (std::regex) that finds ``word`` anywhere, in a group (llama.cpp's lazy
    grammar applies from a trigger pattern's first group): only the regex syntax characters are
    escaped, since std::regex rejects an escaped letter, digit or underscore (and aborts)."""
    return "(" + "".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in word) + ")"


def _init_grammar(C, vocab, text: bytes, root: bytes, triggers: tuple[str, ...] = ()):
    """llama.cpp's grammar sampler for ``text``; MarsError with llama.cpp's reason when it refuses.
    ``triggers`` (words) make it lazy: it constrains nothing until one of them appears in the output.

    llama.cpp's GBNF parser prints its errors (with the whole grammar) straight to the
    process's stderr, not through the log callback: file descriptor 2 goes to a temporary
    file while it runs, so the user sees our one line only (anything else written there
    meanwhile is passed on)."""
    from ..llama.backend import last_llama_error as _last_llama_error
    from ..llama.backend import recent_log as _recent_log

    with _stderr_lock:
        _recent_log.clear()
        with _captured_stderr() as captured:
            if triggers:
                pats = [trigger_pattern(w).encode("utf-8") for w in triggers]
                arr = (ctypes.c_char_p * len(pats))(*pats)
                handle = C.llama_sampler_init_grammar_lazy_patterns(vocab, text, root, arr, len(pats), None, 0)
            else:
                handle = C.llama_sampler_init_grammar(vocab, text, root)
    said = captured.get("text", "")
    if handle:
        if said:
            _pass_on(said)
        return handle
    why = ""
    for line in said.splitlines():
        if "error parsing grammar:" in line:
            why = line.split("error parsing grammar:", 1)[1].strip()
            break
    if not why:
        why = _last_llama_error().strip()
    if len(why) > 160:
        why = why[:157] + "..."
    raise MarsError("invalid GBNF grammar" + (f": {why}" if why else ""))


class _captured_stderr:
    """File descriptor 2 into a temporary file for a block; ``as`` gives a dict whose
    "text" is what was written (its first 64 KiB), once the block ends."""

    _LIMIT = 1 << 16

    def __enter__(self) -> dict:
        import sys
        import tempfile

        self.out: dict = {}
        self.saved = self.tmp = None
        try:
            sys.stderr.flush()
        except (AttributeError, OSError, ValueError):
            pass
        try:
            self.tmp = tempfile.TemporaryFile()
            self.saved = os.dup(2)
            os.dup2(self.tmp.fileno(), 2)
        except OSError:  # no fd 2 (closed), no temporary directory: llama.cpp writes where it would
            if self.tmp is not None:
                self.tmp.close()
            if self.saved is not None:
                os.close(self.saved)
            self.saved = self.tmp = None
        return self.out

    def __exit__(self, *exc) -> None:
        if self.saved is None:
            return
        os.dup2(self.saved, 2)
        os.close(self.saved)
        try:
            self.tmp.seek(0)
            self.out["text"] = self.tmp.read(self._LIMIT).decode("utf-8", "replace")
        finally:
            self.tmp.close()


def _pass_on(text: str) -> None:
    try:
        os.write(2, text.encode("utf-8", "replace"))
    except OSError:
        pass


class GrammarState:
    """llama.cpp's grammar sampler (``llama_sampler_init_grammar``) at one point of a generation.

    :meth:`mask` sets the logits of the tokens the grammar forbids next to -inf
    (in place); :meth:`accept` advances it by one allowed token; :meth:`clone`
    gives an independent copy (a verify window advances a clone along the
    draft, so rolling back is dropping the clone).  Accepting a token the
    grammar forbids, or an end-of-generation token, is a fatal error inside
    llama.cpp: callers accept only tokens :meth:`mask` left finite.

    ``triggers`` (words) make the grammar lazy (llama.cpp's lazy grammar sampler): it masks
    nothing until one of the words appears in the accepted text, then constrains the rest from
    that word on (so the grammar must accept the word first), e.g. a tool call's ``<tool_call>``.
    """

    def __init__(self, model, text: str | None = None, root: str = "root", *, triggers=(), _handle=None):
        from ..llama.backend import C

        self._C, self.model = C, model
        if _handle is None:
            check_grammar_text(text)
            if not isinstance(root, str) or not root.isascii() or not root:
                raise MarsError(f"the grammar's root must be a rule name, got {root!r}")
            _handle = _init_grammar(C, model.vocab, text.encode("utf-8"), root.encode("ascii"), tuple(triggers))
        self._h = _handle
        # a lazy grammar's wait for its trigger, mirrored here: llama.cpp sets the grammar off the moment
        # the accepted text holds a trigger word and replays the rest of that token's text into it,
        # which aborts the process when that rest is not allowed (a C++ exception through the C API)
        self._triggers = tuple(w.encode("utf-8") for w in triggers if w)
        self._awaiting = bool(self._triggers)
        self._tail = b""  # the accepted text's last bytes, as many as the longest trigger word
        n = model.n_vocab
        self._buf = np.zeros(n, dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
        self._buf["id"] = np.arange(n, dtype=np.int32)
        self._arr = C.llama_token_data_array(
            self._buf.ctypes.data_as(C.llama_token_data_p), n, -1, False
        )
        self._small = None  # the candidates of mask(row, need)

    def clone(self) -> "GrammarState":
        twin = GrammarState(self.model, _handle=self._C.llama_sampler_clone(self._h))
        twin._triggers, twin._awaiting, twin._tail = self._triggers, self._awaiting, self._tail
        return twin

    def triggered_by(self, token: int) -> bool:
        """Whether accepting ``token`` would set a lazy grammar off (its text completes a trigger
        word).  A drafter stops before such a token: whether the rest of its text is allowed is
        known only once the grammar applies, and llama.cpp aborts where it is not."""
        return self._awaiting and self._triggering(self._tail + self.model.piece(int(token), special=True))

    def _triggering(self, text: bytes) -> bool:
        return any(w in text for w in self._triggers)

    def mask(self, row: np.ndarray, need: int = 0) -> None:
        """Forbidden tokens' logits → -inf, in place (the first n_vocab entries of ``row``).

        ``need`` > 0 says the caller reads only the ``need`` best allowed tokens
        of the row (greedy: 1, or 2 for MARS's runner-up; top-k sampling: k).
        Then the best candidates are checked first, and when at least ``need``
        of them are allowed and rank strictly above every unchecked token, the
        row keeps just the allowed candidates (everything else → -inf): the
        same best ``need`` tokens with the same logits as the full mask, for a
        fraction of its cost.  Otherwise the whole vocabulary is checked."""
        if need > 0 and self._mask_best(row, need):
            return
        n = min(len(row), len(self._buf))
        buf, arr = self._buf, self._arr
        buf["logit"][:n] = row[:n]
        buf["logit"][n:] = -np.inf
        self._apply(arr, buf, len(buf))
        row[:n] = buf["logit"][:n]
        row[n:] = -np.inf

    def _apply(self, arr, buf: np.ndarray, size: int) -> None:
        """llama.cpp's grammar sampler over the first ``size`` candidates of ``buf`` (in place:
        forbidden logits become -inf; the candidates must keep their order)."""
        arr.data = buf.ctypes.data_as(self._C.llama_token_data_p)
        arr.size, arr.selected, arr.sorted = size, -1, False
        self._C.llama_sampler_apply(self._h, ctypes.byref(arr))
        if arr.size != size or ctypes.addressof(arr.data.contents) != buf.ctypes.data:
            raise MarsError("llama.cpp's grammar sampler reordered the candidates")  # pragma: no cover

    def _mask_best(self, row: np.ndarray, need: int) -> bool:
        n = min(len(row), len(self._buf))
        m = max(_FIRST_CANDIDATES, 4 * need)
        if m >= n:
            return False
        z = row[:n]
        if np.isnan(z).any() or np.isposinf(z).any():
            return False  # the full check keeps llama.cpp's and the rules' handling of these
        part = np.argpartition(z, n - m - 1)
        top, outside = part[n - m :], z[part[n - m - 1]]  # the m best; the best logit left out
        if not np.isfinite(outside) and outside < 0:
            return False  # fewer than m finite logits: the full check costs no more
        if self._small is None or len(self._small) < m:
            self._small = np.zeros(max(m, 4 * _FIRST_CANDIDATES), dtype=self._buf.dtype)
        buf = self._small
        buf["id"][:m] = top
        buf["logit"][:m] = z[top]
        self._apply(self._C.llama_token_data_array(), buf, m)
        allowed = buf["id"][:m][buf["logit"][:m] > -np.inf].astype(np.int64)
        if len(allowed) < need:
            return False
        vals = z[allowed]
        if not np.partition(vals, len(vals) - need)[len(vals) - need] > outside:
            return False  # a tie at the edge: the full check decides
        row[:] = -np.inf
        row[allowed] = vals
        return True

    def accept(self, token: int) -> None:
        self._C.llama_sampler_accept(self._h, int(token))
        if self._awaiting:
            text = self._tail + self.model.piece(int(token), special=True)
            self._awaiting = not self._triggering(text)
            self._tail = text[-max(map(len, self._triggers)):] if self._awaiting else b""

    def close(self) -> None:
        if getattr(self, "_h", None):
            self._C.llama_sampler_free(self._h)
            self._h = None

    def __del__(self):  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass
