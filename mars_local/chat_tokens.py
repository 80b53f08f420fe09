"""Tokenizing a rendered chat so that message text can never become control tokens.

:func:`tokenize_chat` parses control tokens (``<|im_start|>``) only in the
markup of a :class:`~mars_local.chat_template.ChatTemplate`, never in message
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
  built-ins of :mod:`mars_local.chat_builtin`) gets the model's BOS token in
  front, once.
* Fallback: when neither split works (the template's markup depends on the
  text in a way the markers change, e.g. ``endswith('\\n')`` checks), a
  message with special-token text is refused with one line (remove the
  special tokens from it) rather than passed through as control tokens.
  Of the 65 templates in llama.cpp's models/templates that render a plain
  conversation, 63 split.
"""

from __future__ import annotations

import re
import secrets
from typing import TYPE_CHECKING, Sequence

from .errors import MarsError

if TYPE_CHECKING:  # pragma: no cover
    from .chat_template import ChatTemplate

__all__ = ["tokenize_chat"]


def _special_tokens(model) -> tuple[list[tuple[str, int, bool, bool]], re.Pattern | None]:
    """(text, id, lstrip, rstrip) of the tokens llama.cpp parses as special
    (longest first) and a pattern matching their texts; cached on the model."""
    cached = getattr(model, "_mars_special_tokens", None)
    if cached is not None:
        return cached
    from .runtime import special_tokens

    out = sorted(special_tokens(model), key=lambda t: -len(t[0]))
    pattern = re.compile("|".join(re.escape(t) for t, *_ in out)) if out else None
    model._mars_special_tokens = (out, pattern)
    return out, pattern


def _has_special_text(model, text: str) -> bool:
    """Would special parsing find a control token in ``text``?  (llama.cpp
    matches their texts literally, so a text search answers exactly.)"""
    pattern = _special_tokens(model)[1]
    return pattern is not None and pattern.search(text) is not None


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


def tokenize_chat(template: ChatTemplate, model, messages: Sequence[dict], *, force_split: bool = False) -> list[int]:
    """Token ids of ``messages`` rendered with ``template``; control tokens are
    parsed in the template's markup only (see the module docstring).

    A template whose render leaves the BOS token to the tokenizer (its
    ``prepend_bos``: llama.cpp's built-ins) gets the model's BOS token in
    front when the vocabulary adds one and the prompt does not already begin
    with it (never two); a Jinja template places ``bos_token`` itself."""
    ids = _tokenize_chat(template, model, messages, force_split)
    if getattr(template, "prepend_bos", False) and model.add_bos and model.bos >= 0 and ids[:1] != [model.bos]:
        ids.insert(0, model.bos)
    return ids


def _tokenize_chat(template: ChatTemplate, model, messages: Sequence[dict], force_split: bool) -> list[int]:
    reference = template.render(messages)
    special_in = [i for i, m in enumerate(messages) if _has_special_text(model, m["content"])]
    if not special_in and not force_split:
        return model.tokenize(reference, add_special=False, parse_special=True)
    special = set(range(len(messages))) if force_split else set(special_in)  # force_split: tests
    pieces = _split_wrapped(template, messages, reference, special) or _split(template, messages, reference, special)
    if pieces is None:
        if not special_in:
            return model.tokenize(reference, add_special=False, parse_special=True)
        raise MarsError(
            f"message {special_in[0] + 1} contains special-token text and the chat template of {template.name} "
            "transforms message content, so that text cannot be kept apart from the template's markup; "
            "remove the special tokens from the message"
        )
    specials, pattern = _special_tokens(model)
    info = {t: (i, ls, rs) for t, i, ls, rs in specials}
    # Fragments as llama.cpp's partition makes them: control tokens (markup
    # only) and the raw text between them, markup and content joined.
    ids: list[int] = []
    raw: list[str] = []
    strip_next = False  # the last control token strips whitespace to its right

    def add(seg: str) -> None:
        nonlocal strip_next
        if strip_next:
            seg = seg.lstrip()
            strip_next = not seg
        if seg:
            raw.append(seg)

    def flush(rstrip: bool) -> None:
        text = "".join(raw)
        raw.clear()
        if rstrip:  # the next control token strips whitespace to its left
            text = text.rstrip()
        if text:
            ids.extend(model.tokenize(text, add_special=False, parse_special=False))

    for text, markup in pieces:
        if not markup or pattern is None:
            add(text)
            continue
        pos = 0
        for m in pattern.finditer(text):
            add(text[pos:m.start()])
            tok, lstrip, rstrip = info[m.group(0)]
            flush(lstrip)
            ids.append(tok)
            strip_next = rstrip
            pos = m.end()
        add(text[pos:])
    flush(False)
    return ids

