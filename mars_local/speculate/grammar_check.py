"""How much a GBNF grammar would cost llama.cpp's sampler, checked before llama.cpp sees it (pure).

llama.cpp's grammar sampler costs about one pass over the vocabulary per alternative open at a
position, and its parser recurses per nested group: :func:`check_grammar_text` refuses, in time
linear in the text, what would hold the engine for seconds (measured: BENCHMARKS.md, "Hostile
requests and grammars"; ``benchmarks/grammar_cost.py``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..core.errors import MarsError

__all__ = ["check_grammar_text", "grammar_cost", "GrammarCost", "MAX_GRAMMAR_ALTERNATIVES", "MAX_GRAMMAR_BYTES",
           "MAX_GRAMMAR_DEPTH", "MAX_GRAMMAR_ELEMENTS"]


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
    reader = _Reader()
    for m in _TOKENS.finditer(text):
        kind = m.lastgroup
        if kind is not None and not reader.feed(kind, m.group()):
            return GrammarCost(depth=reader.depth)  # nested too deep: refused without measuring
    return _measure(reader.rules, reader.depth)


class _Reader:
    """The rules of a GBNF text, token by token.

    ``rules[id]``: its alternatives; an alternative: its items ``(ref, optional, fan, elements)``
    (ref: a rule id, -1 a terminal, -2 a wildcard terminal; fan: the parse stacks it opens)."""

    def __init__(self):
        self.rules: list[list[list[tuple]]] = []
        self.ids: dict[str, int] = {}
        self.frames: list[tuple] = []  # (rule id, nested) of the rules and groups being read
        self.depth = 0
        self.name, self.newline_ok = None, True

    def rule_id(self, n: str) -> int:
        if n not in self.ids:
            self.ids[n] = len(self.rules)
            self.rules.append([])
        return self.ids[n]

    def feed(self, kind: str, tok: str) -> bool:
        """Read one token; False when groups nest deeper than MAX_GRAMMAR_DEPTH."""
        frames = self.frames
        if kind == "nl":
            if frames and not frames[-1][1] and not self.newline_ok:
                frames.pop()  # the end of a rule
                self.name, self.newline_ok = None, True
            return True
        if not frames:  # between rules: NAME ::=
            self._header(kind, tok)
            return True
        self.newline_ok = False
        alt = self.rules[frames[-1][0]][-1]
        if kind == "lit":
            size = len(tok) - 2
            alt.append((-1, size <= 0, 1 if size > 0 else 0, max(size, 0)))
        elif kind == "cls":
            alt.append((-2, False, 1, max(len(tok) - 2, 1)))
        elif kind == "name":
            alt.append((self.rule_id(tok), False, 1, 1))
        elif kind == "tok":
            alt.append((-1, False, 1, 1))
        elif kind == "rep":
            if alt:
                alt[-1] = _repeated(alt[-1], tok)
        else:
            return self._operator(tok, alt)
        return True

    def _header(self, kind: str, tok: str) -> None:
        if kind == "name":
            self.name = tok
        elif kind == "def" and self.name is not None:
            r = self.rule_id(self.name)
            self.rules[r].append([])
            self.frames.append((r, False))
            self.newline_ok = True
        else:
            self.name = None

    def _operator(self, op: str, alt: list) -> bool:
        frames, rules = self.frames, self.rules
        if op == "(":
            frames.append((len(rules), True))
            rules.append([[]])
            if len(frames) > self.depth + 1:
                self.depth = len(frames) - 1
                if self.depth > MAX_GRAMMAR_DEPTH:
                    return False
            self.newline_ok = True
        elif op == ")" and frames[-1][1]:
            group = frames.pop()[0]
            rules[frames[-1][0]][-1].append((group, False, 1, 1))
        elif op == "|":
            rules[frames[-1][0]].append([])
            self.newline_ok = True
        elif op == ".":
            alt.append((-2, False, 1, 1))
        return True


def _repeated(item: tuple, rep: str) -> tuple:
    """An item under a repetition (``*``, ``+``, ``?``, ``{m}``, ``{m,}``, ``{m,n}``)."""
    lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}.get(rep, (0, None))
    if rep[0] == "{":
        low, comma, high = rep.strip("{}").partition(",")
        lo = int(low) if low.strip().isdigit() else 0
        hi = (int(high) if high.strip().isdigit() else None) if comma else lo
    ref, opt, fan, size = item
    return (ref, opt or lo == 0, fan, min(size * max(1, lo, hi or 0), _CAP))


def _measure(rules: list, depth: int) -> GrammarCost:
    _weigh_wildcards(rules)
    nullable = _nullable(rules)
    fan = _fan_outs(rules, nullable)
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
    return GrammarCost(alternatives=widest, elements=min(elements, _CAP), rules=len(rules), depth=depth)


def _weigh_wildcards(rules: list) -> None:
    """A wildcard (ref -2: "." or a class) followed by k more weighs 2 + k (at most _MAX_WALK): the
    sampler walks a token that deep into that alternative before refusing it (in place)."""
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


def _nullable(rules: list) -> list[bool]:
    """The rules that match the empty string: a worklist over the alternatives."""
    n = len(rules)
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
    return nullable


def _fan_outs(rules: list, nullable: list[bool]) -> list[int]:
    """The fan-out of each rule: the parse stacks its expansion opens = the sum over its
    alternatives of the fan-outs of their leading items up to the first that is not nullable
    (llama.cpp expands those at once).  Evaluated in a depth-first post-order of these "left
    corner" references; a cycle (left recursion, which llama.cpp refuses) counts 1."""
    n = len(rules)
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
    return fan


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
