"""Tokenizing a rendered chat so that message text can never become control tokens.

:func:`tokenize_chat` parses control tokens (``<|im_start|>``) only in the
markup of a :class:`~mars_local.chat.template.ChatTemplate`, never in message
text, so a message cannot forge a turn boundary.  (llama.cpp's server and
llama-cpp-python parse the whole rendered prompt, message text included.)

* When no message contains special-token text, the rendered prompt is
  tokenized exactly as before (the same token ids).
* Otherwise the template is rendered again with each message's text wrapped
  in unique markers (private-use characters and a random nonce), so the
  template still sees the real text; without the markers that render must
  equal the real one, and the markers of every message with special-token
  text must pair up.  The text between a pair is message text, whatever the
  template did to it (``upper``); everything else is markup.
* If that fails (the template trims the text, or cuts the markers off), the
  template is rendered with each message's text *replaced* by a sentinel; the
  markup between sentinels must match the real render and each message with
  special-token text must appear there verbatim or trimmed.  Messages without
  special-token text may be rewritten freely (``content.split('</think>')``):
  their text counts as markup, tokenized as before.
* The markup is searched for control tokens; the text between two control
  tokens (markup and message text joined, the same fragments llama.cpp's
  tokenizer makes) is tokenized with special parsing off.  For benign text
  this gives the same ids as tokenizing the whole prompt.
* A template that leaves BOS to the tokenizer (``prepend_bos``, llama.cpp's
  built-ins of :mod:`mars_local.chat.builtin`) gets the model's BOS token in
  front, once.
* Fallback: when neither split works (the template's markup depends on the
  text in a way the markers change, e.g. ``endswith('\\n')`` checks), a
  message with special-token text is refused with one line (remove the
  special tokens from it) rather than passed through as control tokens.
  Of the 65 templates in llama.cpp's models/templates that render a plain
  conversation, 63 split.
* Bounded work (:func:`tokenize_text`, ``max_tokens``/``cancelled``): where the
  split at control and user-defined tokens is provably llama.cpp's own, every
  prompt goes fragment by fragment (the same ids; llama.cpp's partition is
  quadratic in the number of special tokens), refused unread when its bytes
  cannot fit and as soon as its count passes the limit.
"""

from __future__ import annotations

import re
import secrets
from typing import TYPE_CHECKING, Callable, Sequence

from ..core.errors import MarsError

if TYPE_CHECKING:  # pragma: no cover
    from .template import ChatTemplate

__all__ = ["tokenize_chat", "tokenize_text", "special_text", "PromptTooLong", "TokenizingCancelled"]

_C_SPACE = " \t\n\v\f\r"  # what llama.cpp's lstrip/rstrip remove (C isspace)


class PromptTooLong(MarsError):
    """The prompt has more than ``limit`` tokens: ``n_tokens`` (``exact``) or at least that many."""

    def __init__(self, n_tokens: int, limit: int, exact: bool):
        self.n_tokens, self.limit, self.exact = n_tokens, limit, exact
        super().__init__(f"the prompt is {'' if exact else 'at least '}{n_tokens} tokens; at most {limit} fit")


class TokenizingCancelled(MarsError):
    """The ``cancelled`` callback asked tokenizing to stop."""

    def __init__(self):
        super().__init__("tokenizing was cancelled")


class _Vocab:
    """What splitting and bounding need of a model's vocabulary (built once, cached on it).

    * ``specials``: (text, id, lstrip, rstrip) of the control and unknown tokens
      (special parsing only), longest first; ``pattern`` finds them (a trie: the
      cost of a search does not grow with their number), ``user`` the
      user-defined tokens, which llama.cpp splits out even without special parsing.
    * ``exact``: llama.cpp's partition (every such token, longest first, over the
      whole text) equals splitting here from left to right at the longest match,
      control tokens then user-defined ones: true when no two of these tokens
      overlap partially (a suffix of one the prefix of another), runs of one
      character apart — and for the SentencePiece and BPE tokenizers, which
      tokenize the raw fragments independently (BOS and EOS aside).
    * ``max_bytes``: the most bytes of text one token produced by tokenizing raw
      text covers (at least 4: a character as one unknown token); ``max_all``
      the same with the special tokens' texts.  None where the tokenizer may
      drop text (WordPiece, Unigram normalize it): no bound then.
    """

    def __init__(self, model):
        from ..llama.vocab import adds_eos, special_tokens, splits_raw_text, user_defined_tokens

        self.specials = sorted(special_tokens(model), key=lambda t: -len(t[0]))
        self.pattern = _trie_pattern(t for t, *_ in self.specials)
        partitioned = {t for _, t, *_ in self.specials}
        # control and user-defined: special parsing only
        self.user = [u for u in user_defined_tokens(model) if u[1] not in partitioned]
        partitioned |= {t for _, t, *_ in self.user}
        lengths = [4] + [len(model.piece(t, True)) for t in range(model.n_vocab) if t not in partitioned]
        self.user.sort(key=lambda u: -len(u[0]))
        self.user_pattern = _trie_pattern(t for t, *_ in self.user)
        self.info = {text: (t, ls, rs) for text, t, ls, rs in self.specials + self.user}
        self.strips = any(ls or rs for _, ls, rs in self.info.values())
        plain = splits_raw_text(model)
        self.max_bytes = max(lengths) if plain else None
        self.max_all = max([*lengths, *(len(text.encode()) for text in self.info)]) if plain else None
        self.exact = plain and _overlap_free(list(self.info))
        self.add_eos = adds_eos(model)

    @classmethod
    def of(cls, model) -> "_Vocab":
        cached = getattr(model, "_mars_vocab", None)
        if cached is None:
            cached = cls(model)
            model._mars_vocab = cached
        return cached


def _trie_pattern(texts) -> re.Pattern | None:
    """A regex matching any of ``texts``, the longest at a position (as an alternation
    of them longest first would), built as a trie so that a search costs the length of
    the texts, not their number (Gemma has 6,000 control tokens)."""
    trie: dict = {}
    for text in texts:
        if text:
            node = trie
            for ch in text:
                node = node.setdefault(ch, {})
            node[""] = {}
    if not trie:
        return None

    def emit(node: dict) -> str:
        alts, end = [], "" in node
        for ch, child in node.items():
            if ch:
                alts.append(re.escape(ch) + emit(child))
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if end else body

    try:
        return re.compile(emit(trie))
    except (RecursionError, re.error, OverflowError):  # absurdly long token texts: the plain alternation
        ordered = sorted({t for t in _walk(trie)}, key=len, reverse=True)
        return re.compile("|".join(map(re.escape, ordered)))


def _walk(node: dict, prefix: str = ""):
    for ch, child in node.items():
        if ch:
            yield from _walk(child, prefix + ch)
        else:
            yield prefix


def _overlap_free(texts: list[str]) -> bool:
    """No proper suffix of one text is a proper prefix of another (except between runs of one
    character, ``\\n\\n`` and ``\\n\\n\\n``): matches can then never overlap
    partially, and any order of matching gives the same split."""
    starts: dict[str, list[str]] = {}
    for t in texts:
        for i in range(1, len(t)):
            starts.setdefault(t[:i], []).append(t)
    for a in texts:
        for i in range(1, len(a)):
            for b in starts.get(a[i:], ()):
                if b != a and not (len(set(a)) == 1 and set(a) == set(b)):
                    return False
    return True


def _special_tokens(model) -> tuple[list[tuple[str, int, bool, bool]], re.Pattern | None]:
    """(text, id, lstrip, rstrip) of the tokens llama.cpp parses as special
    (longest first) and a pattern matching their texts; cached on the model."""
    v = _Vocab.of(model)
    return v.specials, v.pattern


def _has_special_text(model, text: str) -> bool:
    """Would special parsing find a control token in ``text``?  (llama.cpp
    matches their texts literally, so a text search answers exactly.)"""
    return special_text(model, text) is not None


def special_text(model, text: str) -> str | None:
    """The first control-token text special parsing would find in ``text``, or None."""
    pattern = _special_tokens(model)[1]
    m = pattern.search(text) if pattern is not None else None
    return m.group(0) if m else None


def _split_wrapped(template: ChatTemplate, messages: Sequence[dict], reference: str,
                   special: set[int]) -> list[tuple[str, bool]] | None:
    """Render with every content wrapped in markers (the template still sees
    the real text, so templates that inspect it behave the same); the render
    without the markers must equal ``reference``.  The markers of each message
    in ``special`` must pair up: the text between them is message text
    (whatever the template did to it); other messages' text is markup."""
    nonce = "".join(secrets.choice("0123456789") for _ in range(12))
    wrapped = [dict(m, content=f"\ue000{nonce}{i}\ue001{m['content']}\ue002{nonce}{i}\ue003")
               for i, m in enumerate(messages)]
    try:
        render = template.render(wrapped)
    except MarsError:
        return None
    marker = re.compile(f"([\ue000\ue002]){nonce}(\\d+)[\ue001\ue003]")
    if marker.sub("", render) != reference:
        return None
    out: list[tuple[str, bool]] = []
    markup: list[str] = []
    inside = None  # the special message whose text is being read
    pos = 0
    for m in marker.finditer(render):
        i, opening = int(m.group(2)), m.group(1) == "\ue000"
        text = render[pos:m.start()]
        pos = m.end()
        if inside is None and i not in special:
            markup.append(text)  # a harmless message's text counts as markup
        elif inside is None and opening:
            markup.append(text)
            out.append(("".join(markup), True))
            markup.clear()
            inside = i
        elif inside == i and not opening:
            out.append((text, False))
            inside = None
        else:
            return None
    if inside is not None:
        return None
    markup.append(render[pos:])
    out.append(("".join(markup), True))
    return out


def _split(template: ChatTemplate, messages: Sequence[dict], reference: str,
           special: set[int]) -> list[tuple[str, bool]] | None:
    """[(text, is_markup)] covering ``reference``, or None when it cannot be
    split safely.  A message in ``special`` (its content has special-token
    text) must appear verbatim or trimmed; any other message the template may
    transform (then its text is markup, tokenized as before)."""
    nonce = secrets.token_hex(6)
    contents = [m["content"] for m in messages]
    marked = [dict(m, content=f"\ue000{nonce}{i}\ue001") for i, m in enumerate(messages)]
    try:
        render = template.render(marked)
    except MarsError:  # the template judges the content (raise_exception): no split
        return None
    parts = re.split(f"\ue000{nonce}(\\d+)\ue001", render)
    out: list[tuple[str, bool]] = []
    pos = 0
    for j, part in enumerate(parts):
        if j % 2 == 0:  # markup
            if not reference.startswith(part, pos):
                return None
            out.append((part, True))
            pos += len(part)
            continue
        i = int(part)
        c, after = contents[i], parts[j + 1]
        for v in dict.fromkeys((c, c.strip(), c.lstrip(), c.rstrip())):
            if reference.startswith(v, pos) and reference.startswith(after, pos + len(v)):
                out.append((v, False))
                pos += len(v)
                break
        else:
            if i in special:
                return None
            if after:  # the template rewrote this (harmless) content: it ends where the next markup begins
                end = reference.find(after, pos)
            else:
                end = len(reference) if j + 1 == len(parts) - 1 else -1
            if end < 0:
                return None
            out.append((reference[pos:end], True))
            pos = end
    return out if pos == len(reference) else None


def tokenize_chat(template: ChatTemplate, model, messages: Sequence[dict], *, force_split: bool = False,
                  max_tokens: int | None = None, cancelled: Callable[[], bool] | None = None) -> list[int]:
    """Token ids of ``messages`` rendered with ``template``; control tokens are
    parsed in the template's markup only (see the module docstring).

    A template whose render leaves the BOS token to the tokenizer (its
    ``prepend_bos``: llama.cpp's built-ins) gets the model's BOS token in
    front when the vocabulary adds one and the prompt does not already begin
    with it (never two); a Jinja template places ``bos_token`` itself.

    ``max_tokens``: a prompt of more tokens raises :class:`PromptTooLong` as soon
    as that is known (see :func:`tokenize_text`); ``cancelled`` is asked between
    fragments and raises :class:`TokenizingCancelled` when it says so."""
    ids = _tokenize_chat(template, model, messages, force_split, max_tokens, cancelled)
    if getattr(template, "prepend_bos", False) and model.add_bos and model.bos >= 0 and ids[:1] != [model.bos]:
        ids.insert(0, model.bos)
    if max_tokens is not None and len(ids) > max_tokens:
        raise PromptTooLong(len(ids), max_tokens, exact=True)
    return ids


def tokenize_text(model, text: str, *, add_special: bool = True, parse_special: bool = True,
                  max_tokens: int | None = None, cancelled: Callable[[], bool] | None = None) -> list[int]:
    """``model.tokenize(text, add_special, parse_special)``'s ids, refusing early a
    text of more than ``max_tokens`` tokens (:class:`PromptTooLong`).

    Where the split is exact (:class:`_Vocab`), the text is cut at special and
    user-defined tokens here and the fragments are tokenized one by one without
    special parsing: llama.cpp's own partition costs the number of matches
    squared (100,000 chat turns took minutes).  Before any of it, a text whose
    fragments need more tokens than allowed, at ``max_bytes`` bytes a token, is
    refused without tokenizing; then the count is checked after every fragment,
    and ``cancelled`` before each."""
    if not isinstance(text, str):
        raise MarsError(f"the text to tokenize must be a string, got {type(text).__name__}")
    v = _Vocab.of(model)
    if not v.exact:
        return _tokenize_items(model, v, [text], max_tokens, cancelled, parse_special=parse_special,
                               add_special=add_special)
    prefix = [model.bos] if add_special and model.add_bos and model.bos >= 0 else []
    suffix = [model.eos] if add_special and v.add_eos and model.eos >= 0 else []
    return _tokenize_items(model, v, _split_user(v, _split_control(v, [(text, parse_special)])), max_tokens,
                           cancelled, prefix=prefix, suffix=suffix)


def _tokenize_items(model, v: _Vocab, items: list, max_tokens: int | None, cancelled, *,
                    parse_special: bool = False, add_special: bool = False,
                    prefix: Sequence[int] = (), suffix: Sequence[int] = ()) -> list[int]:
    """Token ids of ``items`` (token ids, and texts tokenized by llama.cpp) between
    ``prefix`` and ``suffix``; the bounds of :func:`tokenize_text`."""
    fixed = len(prefix) + len(suffix)
    if max_tokens is not None:
        least = fixed + _least_tokens(v, items, raw_only=v.exact)
        if least > max_tokens:
            raise PromptTooLong(least, max_tokens, exact=False)
    ids = list(prefix)
    for n, item in enumerate(items):
        if cancelled is not None and cancelled():
            raise TokenizingCancelled()
        if isinstance(item, int):
            ids.append(item)
        else:
            ids.extend(model.tokenize(item, add_special=add_special, parse_special=parse_special))
        if max_tokens is not None and len(ids) + len(suffix) > max_tokens:
            raise PromptTooLong(len(ids) + len(suffix), max_tokens, exact=n == len(items) - 1)
    ids.extend(suffix)
    return ids


def _least_tokens(v: _Vocab, items: list, raw_only: bool) -> int:
    """At least how many tokens ``items`` make: one a token id, and a text's bytes over
    the most bytes a token covers (``raw_only``: texts without special or user-defined
    tokens; otherwise their whitespace may be stripped beside such tokens, so it does
    not count).  0 where the tokenizer has no such bound."""
    most = v.max_bytes if raw_only else v.max_all
    if most is None:
        return sum(isinstance(x, int) for x in items)
    n = 0
    for x in items:
        if isinstance(x, int):
            n += 1
            continue
        size = len(x.encode("utf-8", "surrogatepass"))
        if v.strips and not raw_only:
            size -= sum(x.count(c) for c in _C_SPACE)
        n += -(-size // most)
    return n


def _split_control(v: _Vocab, pieces: Sequence[tuple[str, bool]]) -> list:
    """Token ids of the control tokens in the markup pieces (``(text, True)``), and the
    texts between them (markup and message text joined, as llama.cpp's partition makes
    the fragments), whitespace stripped beside the tokens that strip it."""
    return _cut(((text, v.pattern if markup else None) for text, markup in pieces), v.info)


def _split_user(v: _Vocab, items: list) -> list:
    """``items`` with each text split at the user-defined tokens (llama.cpp splits them
    out even without special parsing)."""
    if v.user_pattern is None:
        return items
    out: list = []
    for item in items:
        if isinstance(item, int):
            out.append(item)
        else:
            out.extend(_cut([(item, v.user_pattern)], v.info))
    return out


def _cut(parts, info: dict) -> list:
    """Texts and token ids: each part's text cut where its pattern (if any) matches."""
    out: list = []
    raw: list[str] = []
    strip_next = False  # the last token strips whitespace to its right

    def add(seg: str) -> None:
        nonlocal strip_next
        if strip_next:
            seg = seg.lstrip(_C_SPACE)
            strip_next = not seg
        if seg:
            raw.append(seg)

    def flush(rstrip: bool) -> None:
        text = "".join(raw)
        raw.clear()
        if rstrip:  # the next token strips whitespace to its left
            text = text.rstrip(_C_SPACE)
        if text:
            out.append(text)

    for text, pattern in parts:
        if pattern is None:
            add(text)
            continue
        pos = 0
        for m in pattern.finditer(text):
            add(text[pos:m.start()])
            tok, lstrip, rstrip = info[m.group(0)]
            flush(lstrip)
            out.append(tok)
            strip_next = rstrip
            pos = m.end()
        add(text[pos:])
    flush(False)
    return out


def _tokenize_chat(template: ChatTemplate, model, messages: Sequence[dict], force_split: bool,
                   max_tokens: int | None, cancelled) -> list[int]:
    reference = template.render(messages)
    v = _Vocab.of(model)
    special_in = [i for i, m in enumerate(messages) if _has_special_text(model, m["content"])]
    if not special_in and not force_split:
        if v.exact:  # the same ids as tokenizing the whole prompt with special parsing, in bounded steps
            return _tokenize_items(model, v, _split_user(v, _split_control(v, [(reference, True)])), max_tokens,
                                   cancelled)
        return _tokenize_items(model, v, [reference], max_tokens, cancelled, parse_special=True)
    special = set(range(len(messages))) if force_split else set(special_in)  # force_split: tests
    pieces = _split_wrapped(template, messages, reference, special) or _split(template, messages, reference, special)
    if pieces is None:
        if not special_in:
            return _tokenize_items(model, v, [reference], max_tokens, cancelled, parse_special=True)
        raise MarsError(
            f"message {special_in[0] + 1} contains special-token text and the chat template of {template.name} "
            "transforms message content, so that text cannot be kept apart from the template's markup; "
            "remove the special tokens from the message"
        )
    # Fragments as llama.cpp's partition makes them: control tokens (markup
    # only) and the raw text between them, markup and content joined.
    items = _split_control(v, pieces)
    return _tokenize_items(model, v, _split_user(v, items) if v.exact else items, max_tokens, cancelled)
