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

import bisect
import ctypes
import json
import os
import threading
import weakref
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
    from ..llama.json_schema import schema_to_gbnf

    try:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        obj = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise MarsError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise MarsError("a JSON schema must be a JSON object")
    try:
        return schema_to_gbnf(text)
    except MarsError:
        raise
    except Exception as exc:  # the converter raises bare exceptions on schemas it does not support
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise MarsError(f"cannot convert the JSON schema to a grammar: {msg}") from None


_FIRST_CANDIDATES = 64  # mask(row, need): the best candidates checked before the whole vocabulary


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
    if not why:  # (what llama.cpp logged while it refused: the log was cleared before)
        why = _last_llama_error().strip() or next((ln.strip() for ln in reversed(_recent_log) if ln.strip()), "")
    if len(why) > 160:
        why = why[:157] + "..."
    raise MarsError("invalid GBNF grammar" + (f": {why}" if why else ""), field="grammar")  # (a server: 400, param)


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
    grammar forbids (an end-of-generation token before the grammar is complete)
    is a fatal error inside llama.cpp: callers accept only tokens :meth:`mask`
    left finite, and where one does not, :meth:`accept` raises MarsError and
    :meth:`try_accept` answers False instead of the process aborting.

    ``triggers`` (words) make the grammar lazy (llama.cpp's lazy grammar sampler): it constrains
    nothing until one of the words appears in the accepted text, then constrains the rest from
    that word on (so the grammar must accept the word first), e.g. a tool call's ``<tool_call>``.
    While it waits, the one kind of token it forbids is a token that would set it off with text
    the grammar does not allow (" hello" for the trigger "h" and a grammar wanting a digit next):
    llama.cpp replays that text into the grammar at once and throws, which through its C API
    aborts the process.  Such tokens are found by accepting them on a clone
    (``llama_sampler_try_accept``, ``patches/0012``), once per token and text before it.
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
        self._sets_off: dict = {}  # (tail, token) -> whether the token sets the grammar off allowed; shared by clones
        n = model.n_vocab
        self._buf = np.zeros(n, dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
        self._buf["id"] = np.arange(n, dtype=np.int32)
        self._arr = C.llama_token_data_array(
            self._buf.ctypes.data_as(C.llama_token_data_p), n, -1, False
        )
        self._small = None  # the candidates of mask(row, need)
        self._one = self._one_arr = None  # the one candidate of _allows
        self._broken = False  # a forbidden token was offered to accept(): the sampler refuses all

    def clone(self) -> "GrammarState":
        twin = GrammarState(self.model, _handle=self._C.llama_sampler_clone(self._h))
        twin._triggers, twin._awaiting, twin._tail = self._triggers, self._awaiting, self._tail
        twin._sets_off = self._sets_off  # a waiting grammar's stacks never move: the answers hold for both
        twin._broken = self._broken
        return twin

    def triggered_by(self, token: int) -> bool:
        """Whether accepting ``token`` would set a lazy grammar off (its text completes a trigger word)."""
        return self._awaiting and self._triggering(self._tail + self.model.piece(int(token), special=True))

    def _triggering(self, text: bytes) -> bool:
        return any(w in text for w in self._triggers)

    def _allows_trigger(self, token: int) -> bool:
        """Whether ``token``, which sets the waiting grammar off, brings text the grammar allows
        (tested on a clone; the answer is kept: a waiting grammar's stacks are its initial ones)."""
        key = (self._tail, token)
        ok = self._sets_off.get(key)
        if ok is None:
            ok = self._accept_on_clone(token, keep=False)
            self._sets_off[key] = ok
        return ok

    def _accept_on_clone(self, token: int, keep: bool) -> bool:
        """Accept ``token`` on a clone of the sampler; where it is allowed and ``keep``, the
        clone becomes this state's sampler.  Without ``patches/0012`` (a stock libllama) the
        clone cannot refuse: the token is taken as allowed, as llama.cpp itself would."""
        C, fn = self._C, _try_accept_fn()
        twin = C.llama_sampler_clone(self._h)
        if fn is None:
            C.llama_sampler_accept(twin, token)
            ok = True
        else:
            ok = bool(fn(twin, token))
        if ok and keep:
            C.llama_sampler_free(self._h)
            self._h = twin
        else:
            C.llama_sampler_free(twin)
        return ok

    def _refused_triggers(self, row: np.ndarray) -> np.ndarray:
        """The ids, among the row's finite logits, of the tokens that would set the waiting grammar
        off with text it does not allow (only tokens whose text can complete a trigger word after
        the accepted text's tail are tested)."""
        ids = _trigger_index(self.model, self._triggers).candidates(self._tail)
        ids = ids[ids < len(row)]
        ids = ids[np.isfinite(row[ids])] if len(ids) else ids
        return np.asarray([t for t in ids.tolist() if not self._allows_trigger(t)], dtype=np.int64)

    def mask(self, row: np.ndarray, need: int = 0) -> None:
        """Forbidden tokens' logits → -inf, in place (the first n_vocab entries of ``row``).

        ``need`` > 0 says the caller reads only the ``need`` best allowed tokens
        of the row (greedy: 1, or 2 for MARS's runner-up; top-k sampling: k).
        Then the best candidates are checked first, and when at least ``need``
        of them are allowed and rank strictly above every unchecked token, the
        row keeps just the allowed candidates (everything else → -inf): the
        same best ``need`` tokens with the same logits as the full mask, for a
        fraction of its cost.  Otherwise the whole vocabulary is checked."""
        if self._awaiting:
            refused = self._refused_triggers(row)
            if len(refused):
                row[refused] = -np.inf
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
        """Advance by ``token``; MarsError where the grammar does not allow it (callers accept only
        tokens :meth:`mask` left finite: this is the clear error of a broken promise, where
        llama.cpp would abort the process)."""
        if not self.try_accept(token):
            shown = self.model.piece(int(token), special=True).decode("utf-8", "replace")
            raise MarsError(f"the grammar does not allow the token {shown!r} here")

    def try_accept(self, token: int) -> bool:
        """Advance by ``token`` where the grammar allows it; False where not: for a token that
        would set a waiting lazy grammar off, with the state unchanged; for any other token
        (one :meth:`mask` would have set to -inf), the state is unusable after it."""
        token = int(token)
        if self._broken:
            return False
        if self._awaiting:
            text = self._tail + self.model.piece(token, special=True)
            if not self._triggering(text):
                self._C.llama_sampler_accept(self._h, token)  # buffered text only: it cannot refuse
                self._tail = text[-max(map(len, self._triggers)):]
                return True
            # the clone's answer is kept (_allows_trigger); the success path runs once per generation
            if not self._allows_trigger(token) or not self._accept_on_clone(token, keep=True):
                return False
            self._awaiting, self._tail = False, b""
            return True
        if self.model.is_eog(token) or not 0 <= token < len(self._buf):
            if not self._allows(token):  # llama.cpp aborts (GGML_ABORT) on an end the grammar forbids
                return False
        fn = _try_accept_fn()
        if fn is None:
            self._C.llama_sampler_accept(self._h, token)
        elif not fn(self._h, token):
            # a token the grammar forbids: callers accept only tokens mask() left finite, so this is a
            # bug's path; its refusal emptied the sampler's stacks, which refuse everything from now on
            self._broken = True
            return False
        return True

    def _allows(self, token: int) -> bool:
        """Whether the (constraining) grammar allows ``token`` next: llama.cpp's own check of one
        candidate, which accepting an allowed token then passes (an end-of-generation token
        only where the grammar is complete, as llama.cpp's accept demands)."""
        if not 0 <= token < len(self._buf):
            return False
        if self._one is None:
            self._one = np.zeros(1, dtype=self._buf.dtype)
            self._one_arr = self._C.llama_token_data_array(self._one.ctypes.data_as(self._C.llama_token_data_p), 1, -1, False)
        one, arr = self._one, self._one_arr
        one[0] = (token, 0.0, 0.0)
        arr.size, arr.selected, arr.sorted = 1, -1, False
        self._C.llama_sampler_apply(self._h, ctypes.byref(arr))
        return one[0]["logit"] != -np.inf

    def close(self) -> None:
        if getattr(self, "_h", None):
            self._C.llama_sampler_free(self._h)
            self._h = None

    def __del__(self):  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass


_TRY_ACCEPT = "llama_sampler_try_accept"  # patches/0012
_try_accept: list = []  # [the function, or None where the loaded libllama lacks it], once looked up


def _try_accept_fn():
    if not _try_accept:
        from ..llama.backend import C

        lib = getattr(C, "_lib", None)
        fn = None
        if lib is not None and hasattr(lib, _TRY_ACCEPT):
            fn = lib[_TRY_ACCEPT]
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int32]
            fn.restype = ctypes.c_bool
        _try_accept.append(fn)
    return _try_accept[0]


class _TriggerIndex:
    """Which tokens of a vocabulary can complete one of a lazy grammar's trigger words: those whose
    text holds a whole word, and per proper prefix w[:j] of a word the tokens whose text starts
    with the rest w[j:] (they complete it after a text ending in w[:j])."""

    def __init__(self, pieces: list[bytes], words: tuple[bytes, ...]):
        self.whole = {t for t, p in enumerate(pieces) if any(w in p for w in words)}
        order = sorted(range(len(pieces)), key=pieces.__getitem__)
        keys = [pieces[t] for t in order]
        self.rest: dict[bytes, set[int]] = {}
        for w in words:
            for j in range(1, len(w)):
                i = bisect.bisect_left(keys, w[j:])  # the texts starting with w[j:] sort together
                while i < len(keys) and keys[i].startswith(w[j:]):
                    self.rest.setdefault(w[:j], set()).add(order[i])
                    i += 1
        self._cache: dict[bytes, np.ndarray] = {}

    def candidates(self, tail: bytes) -> np.ndarray:
        ids = self._cache.get(tail)
        if ids is None:
            got = set(self.whole)
            for head, toks in self.rest.items():
                if tail.endswith(head):
                    got |= toks
            ids = self._cache[tail] = np.asarray(sorted(got), dtype=np.int64)
        return ids


_indexes: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {words: _TriggerIndex}
_indexes_lock = threading.Lock()


def _trigger_index(model, words: tuple[bytes, ...]) -> _TriggerIndex:
    """The model's :class:`_TriggerIndex` for ``words``, built once (one pass over the vocabulary)."""
    with _indexes_lock:
        per_model = _indexes.setdefault(model, {})
        index = per_model.get(words)
        if index is None:
            pieces = [model.piece(t, special=True) for t in range(model.n_vocab)]
            index = per_model[words] = _TriggerIndex(pieces, words)
    return index
