"""Grammars for structured output: GBNF text, JSON, JSON schemas.

The engine constrains generation with llama.cpp's own grammar sampler (see
``runtime.Grammar``); this module only produces GBNF text, with
llama-cpp-python's JSON grammar and JSON-schema converter (imported lazily, so
importing this module loads no llama.cpp).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.errors import MarsError
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


MAX_GRAMMAR_DEPTH = 256  # nested groups; llama.cpp's GBNF parser recurses per level (and crashes near 30,000)
MAX_GRAMMAR_BYTES = 1 << 20
# The alternatives open at once, weighted (see GrammarCost): llama.cpp's sampler keeps one parse
# stack per open alternative and checks each candidate token against each, so masking a full
# vocabulary row costs 0.1-0.96 ms per unit with SmolLM2's 49,152 tokens (benchmarks/grammar_cost.py:
# an enum, anyOf or literal alternatives 0.35, class-led 0.28, wildcard-led 0.95; proportionally more
# with a larger vocabulary).  1,024 keeps the first full mask (and creating the sampler, <5 ms)
# under ~1 s on a 2-core CPU for every measured shape: an enum of 20,000 values took 16 s for 4 tokens.
MAX_GRAMMAR_ALTERNATIVES = 1024
# Grammar elements once repetitions are expanded (x{m,n} is n copies of x): memory and parse time
# (2M elements: 14 ms; 4M ~ 100 MB).  A 1 MiB grammar could otherwise ask for billions ("aaa…"{2000}).
MAX_GRAMMAR_ELEMENTS = 1 << 22


@dataclass
class GrammarCost:
    """What a GBNF text costs llama.cpp, estimated from the text alone in one linear pass.

    ``alternatives``: the most alternatives open at one point of a parse: the parse stacks
    llama.cpp's sampler keeps after expanding a rule reference (an enum of N values, or an
    ``anyOf`` of N schemas, opens N at once; N rules in sequence open a few at a time).  Each
    stack is checked against every candidate token, so this predicts the cost of masking.  A
    stack whose next items are k wildcards (``.`` or a class) counts 1 + k (k at most 8): most
    tokens get that deep into it before they are refused.
    ``elements``: the grammar's elements once repetitions are expanded (memory, parse time).
    ``rules``: named rules and groups; ``depth``: the deepest nesting of groups.
    Text llama.cpp would not parse is estimated leniently (llama.cpp then reports the error)."""

    alternatives: int = 0
    elements: int = 0
    rules: int = 0
    depth: int = 0


_TOKENS = re.compile(
    r"""[ \t]+|\#[^\r\n]*                # space and comments: skipped
    |(?P<nl>\r\n?|\n)
    |(?P<lit>"[^"\\]*(?:\\.[^"\\]*)*"?)    # a literal string
    |(?P<cls>\[[^\]\\]*(?:\\.[^\]\\]*)*\]?)  # a character class
    |(?P<def>::=)
    |(?P<name>[A-Za-z0-9_-]+)
    |(?P<rep>\{[^}]*\}?|[*+?])          # a repetition of the item before
    |(?P<tok>!?<[^>]*>?)                # a token, <[id]> or <text>
    |(?P<op>.)""",
    re.X | re.S,
)
_MAX_WALK = 8  # wildcards in a row that add to an alternative's weight (tokens are rarely longer)
_CAP = 1 << 40  # counts saturate here (an exponential grammar stays cheap to measure)


def grammar_cost(text: str) -> GrammarCost:
    """The :class:`GrammarCost` of GBNF ``text``, in one pass over its tokens and two over its
    items (linear in its length).  It follows the syntax of llama.cpp's parser (rules,
    alternatives, groups, literals, classes, tokens, repetitions), leniently."""
    # rules[id]: alternatives; an alternative: items (ref: a rule id, -1 a terminal, -2 a wildcard
    # terminal; optional; fan: the stacks it opens; elements)
    rules: list[list[list[tuple]]] = []
    ids: dict[str, int] = {}
    frames: list[tuple] = []  # (rule id, nested) of the rules and groups being read
    depth = 0
    name, newline_ok = None, True

    def rule_id(n: str) -> int:
        if n not in ids:
            ids[n] = len(rules)
            rules.append([])
        return ids[n]

    for m in _TOKENS.finditer(text):
        kind = m.lastgroup
        if kind is None:
            continue
        if kind == "nl":
            if frames and not frames[-1][1] and not newline_ok:
                frames.pop()  # the end of a rule
                name, newline_ok = None, True
            continue
        if not frames:  # between rules: NAME ::=
            if kind == "name":
                name = m.group()
            elif kind == "def" and name is not None:
                r = rule_id(name)
                rules[r].append([])
                frames.append((r, False))
                newline_ok = True
            else:
                name = None
            continue
        newline_ok = False
        alt = rules[frames[-1][0]][-1]
        if kind == "lit":
            size = len(m.group()) - 2
            alt.append((-1, size <= 0, 1 if size > 0 else 0, max(size, 0)))
        elif kind == "cls":
            alt.append((-2, False, 1, max(len(m.group()) - 2, 1)))
        elif kind == "name":
            alt.append((rule_id(m.group()), False, 1, 1))
        elif kind == "tok":
            alt.append((-1, False, 1, 1))
        elif kind == "rep":
            if not alt:
                continue
            t = m.group()
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}.get(t, (0, None))
            if t[0] == "{":
                low, comma, high = t.strip("{}").partition(",")
                lo = int(low) if low.strip().isdigit() else 0
                hi = (int(high) if high.strip().isdigit() else None) if comma else lo
            ref, opt, fan, size = alt[-1]
            alt[-1] = (ref, opt or lo == 0, fan, min(size * max(1, lo, hi or 0), _CAP))
        else:
            op = m.group()
            if op == "(":
                frames.append((len(rules), True))
                rules.append([[]])
                if len(frames) > depth + 1:
                    depth = len(frames) - 1
                    if depth > MAX_GRAMMAR_DEPTH:
                        return GrammarCost(depth=depth)
                newline_ok = True
            elif op == ")" and frames[-1][1]:
                group = frames.pop()[0]
                rules[frames[-1][0]][-1].append((group, False, 1, 1))
            elif op == "|":
                rules[frames[-1][0]].append([])
                newline_ok = True
            elif op == ".":
                alt.append((-2, False, 1, 1))
    return _measure(rules, depth)


def _measure(rules: list, depth: int) -> GrammarCost:
    n = len(rules)
    # a wildcard (ref -2: "." or a class) followed by k more weighs 2 + k (at most _MAX_WALK): the
    # sampler walks a token that deep into that alternative before refusing it
    for alts in rules:
        for alt in alts:
            run = 0
            for k in range(len(alt) - 1, -1, -1):
                ref, opt, f, size = alt[k]
                if ref == -2:
                    run = min(run + 1, _MAX_WALK)
                    alt[k] = (ref, opt, 1 + run, size)
                else:
                    run = 0
    # nullable rules (that match the empty string): a worklist over the alternatives
    nullable = [False] * n
    owner, pending, users, work = [], [], [[] for _ in range(n)], []
    for r, alts in enumerate(rules):
        for alt in alts:
            a = len(owner)
            owner.append(r)
            left = 0
            for ref, opt, _, _ in alt:
                if not opt:
                    left += 1
                    if ref >= 0:
                        users[ref].append(a)
            pending.append(left)
            if left == 0:
                work.append(r)
    while work:
        r = work.pop()
        if nullable[r]:
            continue
        nullable[r] = True
        for a in users[r]:
            pending[a] -= 1
            if pending[a] == 0:
                work.append(owner[a])

    # fan-out of a rule: the parse stacks its expansion opens = the sum over its alternatives of
    # the fan-outs of their leading items up to the first that is not nullable (llama.cpp expands
    # those at once).  Evaluated in a depth-first post-order of these "left corner" references;
    # a cycle (left recursion, which llama.cpp refuses) counts 1.
    fan = [1] * n
    done = [False] * n

    def leading(r: int) -> list[int]:
        refs = []
        for alt in rules[r]:
            for ref, opt, _, _ in alt:
                if ref >= 0:
                    refs.append(ref)
                if not (opt or (ref >= 0 and nullable[ref])):
                    break
        return refs

    def rule_fan(r: int) -> int:
        total = 0
        for alt in rules[r]:
            for ref, opt, f, _ in alt:
                total += fan[ref] if ref >= 0 else f
                if not (opt or (ref >= 0 and nullable[ref])):
                    break
        # (an alternative that can end adds its caller's continuation: counted there)
        return min(total, _CAP) if rules[r] else 1

    for start in range(n):
        if done[start]:
            continue
        first = leading(start)
        if not first:  # no rule reference to expand first: the common case, no search
            fan[start], done[start] = rule_fan(start), True
            continue
        stack, open_ = [(start, first, 0)], {start}
        while stack:
            r, refs, k = stack[-1]
            while k < len(refs) and (done[refs[k]] or refs[k] in open_):
                k += 1
            if k < len(refs):
                stack[-1] = (r, refs, k + 1)
                nxt = refs[k]
                open_.add(nxt)
                stack.append((nxt, leading(nxt), 0))
                continue
            stack.pop()
            open_.discard(r)
            fan[r], done[r] = rule_fan(r), True

    # the widest point: a rule's expansion, or a position inside an alternative (its item's
    # fan-out, plus what follows while items are nullable); and the elements
    widest, elements = max(fan + [1]), 0
    for alts in rules:
        elements += len(alts)
        for alt in alts:
            acc = 1
            for ref, opt, f, size in reversed(alt):
                fi = fan[ref] if ref >= 0 else f
                acc = min(fi + acc, _CAP) if opt or (ref >= 0 and nullable[ref]) else fi
                if acc > widest:
                    widest = acc
                elements += size
    return GrammarCost(alternatives=widest, elements=min(elements, _CAP), rules=n, depth=depth)


def check_grammar_text(text: str) -> GrammarCost:
    """Refuse, with a one-line MarsError, GBNF that llama.cpp could not take or that would cost
    too much: text that is not a string or not encodable as UTF-8 (a lone surrogate), a NUL
    character (llama.cpp would stop reading there), over MAX_GRAMMAR_BYTES, groups nested deeper
    than MAX_GRAMMAR_DEPTH (llama.cpp's recursive parser), more than MAX_GRAMMAR_ALTERNATIVES
    alternatives open at once or MAX_GRAMMAR_ELEMENTS elements (see :class:`GrammarCost`).
    Linear in the length of the text; returns the cost."""
    if not isinstance(text, str):
        raise MarsError(f"a grammar must be GBNF text (a string), got {type(text).__name__}")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise MarsError(
            f"the grammar cannot be encoded as UTF-8: it has a lone surrogate U+{ord(text[exc.start]):04X} at "
            f"character {exc.start} (undecodable input bytes?); decode it as UTF-8 first"
        ) from None
    if size > MAX_GRAMMAR_BYTES:
        raise MarsError(f"the grammar is over {MAX_GRAMMAR_BYTES >> 20} MiB ({size} bytes)")
    if "\x00" in text:
        raise MarsError(f"the grammar has a NUL character at character {text.index(chr(0))}")
    cost = grammar_cost(text)
    if cost.depth > MAX_GRAMMAR_DEPTH:
        raise MarsError(f"invalid GBNF grammar: groups nested deeper than {MAX_GRAMMAR_DEPTH} levels")
    if cost.alternatives > MAX_GRAMMAR_ALTERNATIVES:
        raise MarsError(
            f"the grammar is too complex: {_count(cost.alternatives)} alternatives open at once "
            f"(limit {MAX_GRAMMAR_ALTERNATIVES}, wildcard-led ones counting more); each costs time at every token"
        )
    if cost.elements > MAX_GRAMMAR_ELEMENTS:
        raise MarsError(
            f"the grammar is too large: {_count(cost.elements)} elements once repetitions are expanded "
            f"(limit {MAX_GRAMMAR_ELEMENTS})"
        )
    return cost


def _count(v: int) -> str:
    return f"over {_CAP}" if v >= _CAP else str(v)


_stderr_lock = threading.Lock()


def _init_grammar(C, vocab, text: bytes, root: bytes):
    """llama.cpp's grammar sampler for ``text``; MarsError with llama.cpp's reason when it refuses.

    llama.cpp's GBNF parser prints its errors (with the whole grammar) straight to the
    process's stderr, not through the log callback: file descriptor 2 goes to a temporary
    file while it runs, so the user sees our one line only (anything else written there
    meanwhile is passed on)."""
    from ..llama.backend import last_llama_error as _last_llama_error
    from ..llama.backend import recent_log as _recent_log

    with _stderr_lock:
        _recent_log.clear()
        with _captured_stderr() as captured:
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
    """

    def __init__(self, model, text: str | None = None, root: str = "root", *, _handle=None):
        import llama_cpp as C

        self._C, self.model = C, model
        if _handle is None:
            check_grammar_text(text)
            if not isinstance(root, str) or not root.isascii() or not root:
                raise MarsError(f"the grammar's root must be a rule name, got {root!r}")
            _handle = _init_grammar(C, model.vocab, text.encode("utf-8"), root.encode("ascii"))
        self._h = _handle
        n = model.n_vocab
        self._buf = np.zeros(n, dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
        self._buf["id"] = np.arange(n, dtype=np.int32)
        self._arr = C.llama_token_data_array(
            self._buf.ctypes.data_as(C.llama_token_data_p), n, -1, False
        )
        self._small = None  # the candidates of mask(row, need)

    def clone(self) -> "GrammarState":
        return GrammarState(self.model, _handle=self._C.llama_sampler_clone(self._h))

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

    def close(self) -> None:
        if getattr(self, "_h", None):
            self._C.llama_sampler_free(self._h)
            self._h = None

    def __del__(self):  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass
