"""OpenAI tool calling (issue 26): the request's tools, the model's call syntax, its calls back out (pure).

A request's ``tools`` and ``tool_choice`` are checked here (:func:`parse_tools`,
:func:`parse_tool_choice`, :func:`parse_parallel_tool_calls`) before anything waits in a queue:
their size, count and nesting are bounded, so a hostile body costs microseconds.  The model
writes calls in its chat template's own syntax; :func:`tool_format` tells the family from the
template's Jinja source, :func:`parse_tool_calls` (a whole output) and
:class:`StreamingToolParser` (deltas) turn the output back into content and calls, and
:func:`~mars_local.chat.tool_grammar.tools_gbnf` is a grammar that forces a call
(``tool_choice`` "required" or a named tool).

Families (the call object is ``{"name": N, "arguments": {...}}`` unless said otherwise):

hermes   Qwen2.5, Qwen3, Hermes 2/3: ``<tool_call>\\nCALL\\n</tool_call>``, one block per call;
         text around the blocks is content.
llama3   Llama 3.1-3.3: the output is ``{"name": N, "parameters": {...}}`` ("arguments" accepted),
         optionally after ``<|python_tag|>``; several are separated by ";" or newlines.
mistral  ``[TOOL_CALLS][CALL, ...]`` (v3: Nemo, Small 3.1) or ``[TOOL_CALLS]N[ARGS]{...}``,
         repeated per call (v11: Small 3.2, Devstral, Magistral; an optional ``[CALL_ID]id``).

Guaranteed: parsing never raises on model output; a block that is not a call (bad JSON, no
string name, arguments not an object) stays in the content, trigger included.  Arguments are
re-serialized compactly (``ensure_ascii=False``).  The streaming parser's events, for any split
of an output into deltas, give exactly :func:`parse_tool_calls`' content (stripped) and calls
(both are the same scanner): text that could still start a call is held back until it is known.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any, Callable

from ..core.errors import MarsError

__all__ = ["template_tools", "template_choice", "openai_calls", "Tool", "ToolChoice", "ToolCall", "ContentDelta", "ToolCallStart", "ToolCallArgs", "StreamingToolParser", "parse_tools", "parse_tool_choice", "parse_parallel_tool_calls", "tool_format", "parse_tool_calls", "new_call_id", "SUPPORTED_FORMATS", "MAX_TOOLS", "MAX_TOOLS_BYTES", "MAX_SCHEMA_DEPTH"]

SUPPORTED_FORMATS = ("hermes", "llama3", "mistral")
MAX_TOOLS = 128  # OpenAI's own limit
MAX_TOOLS_BYTES = 256 << 10  # the tools' JSON, all together
MAX_SCHEMA_DEPTH = 32  # nested objects and arrays in one tool's parameters (the object itself is 1)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_ALNUM = string.ascii_letters + string.digits


# ------------------------------------------------------------------ requests
@dataclass(frozen=True)
class Tool:
    """One function the model may call; ``parameters`` is its JSON Schema (None: any object)."""

    name: str
    description: str | None = None
    parameters: dict | None = None


@dataclass(frozen=True)
class ToolChoice:
    """``mode``: "auto" (the model decides), "none" (no call), "required" (at least one call),
    "function" (a call to ``name``)."""

    mode: str
    name: str | None = None


def _kind(v: Any) -> str:
    for t, word in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
                    (list, "an array"), (dict, "an object")):
        if isinstance(v, t):
            return word
    return "null" if v is None else type(v).__name__


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _json_size(value: Any, limit: int) -> int:
    """The UTF-8 size of ``value`` as compact JSON, measured without recursion (a nesting of any
    depth is safe) and given up once it passes ``limit``."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, dict):
            total += 1 + 2 * len(v) if v else 2  # braces, colons, commas
            for k, x in v.items():
                total += _json_size(k, limit) if isinstance(k, str) else len(str(k)) + 2
                stack.append(x)
        elif isinstance(v, (list, tuple)):
            total += 1 + len(v) if v else 2
            stack.extend(v)
        else:
            total += len(json.dumps(v, ensure_ascii=False, default=str).encode("utf-8", "replace"))
    return total


def _depth_over(value: Any, limit: int) -> bool:
    """Whether ``value`` nests objects and arrays more than ``limit`` deep: an explicit stack,
    depth first, so a 100,000-deep chain (which json.loads built) is refused after ``limit`` steps."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if d > limit:
            return True
        items = v.values() if isinstance(v, dict) else v
        stack.extend((x, d + 1) for x in items if isinstance(x, (dict, list)))
    return False


def _need(ok: Any, field: str, what: str) -> None:
    """MarsError "'FIELD' WHAT" (naming ``field``) unless ``ok``."""
    if not ok:
        raise MarsError(f"'{field}' {what}", field=field)


def parse_tools(value: Any) -> tuple[Tool, ...]:
    """An OpenAI ``tools`` array, checked: ``[{"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}}]``.  None or [] is no tools.  The count is checked before any item
    is looked at, the whole size before any schema is walked."""
    if value is None:
        return ()
    _need(isinstance(value, list), "tools", f"must be an array of tools, got {_kind(value)}")
    _need(len(value) <= MAX_TOOLS, "tools", f"may hold at most {MAX_TOOLS} tools, got {len(value)}")
    tools: list[Tool] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(value):
        w = f"tools[{i}]"
        _need(isinstance(item, dict), w, f"must be an object, got {_kind(item)}")
        _need(item.get("type") == "function", f"{w}.type", f"must be 'function', got {_short(item.get('type'))}")
        fn = item.get("function")
        _need(isinstance(fn, dict), f"{w}.function", f"must be an object, got {_kind(fn)}")
        w += ".function"
        name, desc, params, strict = (fn.get(k) for k in ("name", "description", "parameters", "strict"))
        _need(isinstance(name, str), f"{w}.name", f"must be a string, got {_kind(name)}")
        _need(_NAME.fullmatch(name), f"{w}.name", f"must be 1 to 64 letters, digits, '_' or '-', got {_short(name)}")
        _need(name not in seen, f"{w}.name", f"{name!r} is already the name of tools[{seen.get(name)}]")
        seen[name] = i
        _need(desc is None or isinstance(desc, str), f"{w}.description", f"must be a string, got {_kind(desc)}")
        _need(params is None or isinstance(params, dict), f"{w}.parameters",
              f"must be an object (a JSON Schema), got {_kind(params)}")
        _need(params is None or params.get("type", "object") == "object", f"{w}.parameters",  # arguments: an object
              f"must describe an object (type 'object'), got type {_short((params or {}).get('type'))}")
        _need(strict is None or isinstance(strict, bool), f"{w}.strict", f"must be a boolean, got {_kind(strict)}")
        tools.append(Tool(name, desc, params))
    _need(_json_size(value, MAX_TOOLS_BYTES) <= MAX_TOOLS_BYTES, "tools",
          f"is too large: more than {MAX_TOOLS_BYTES >> 10} KiB of JSON")
    for i, t in enumerate(tools):
        w = f"tools[{i}].function.parameters"
        _need(t.parameters is None or not _depth_over(t.parameters, MAX_SCHEMA_DEPTH), w,
              f"nests objects and arrays deeper than {MAX_SCHEMA_DEPTH} levels")
    return tuple(tools)


def parse_tool_choice(value: Any, tools: tuple[Tool, ...]) -> ToolChoice:
    """An OpenAI ``tool_choice``: "auto" (the default with tools), "none" (the default without),
    "required", or ``{"type": "function", "function": {"name": N}}`` naming one of ``tools``."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    _need(tools or value == "none", "tool_choice", "needs 'tools'")
    if isinstance(value, str):
        _need(value in ("auto", "none", "required"), "tool_choice", "must be 'auto', 'none', 'required' or "
              f'{{"type": "function", "function": {{"name": ...}}}}, got {_short(value)}')
        return ToolChoice(value)
    _need(isinstance(value, dict), "tool_choice", f"must be a string or an object, got {_kind(value)}")
    _need(value.get("type") == "function", "tool_choice.type", f"must be 'function', got {_short(value.get('type'))}")
    fn = value.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    _need(isinstance(name, str), "tool_choice.function.name", f"must be a string, got {_kind(name)}")
    _need(any(t.name == name for t in tools), "tool_choice.function.name", f"{_short(name)} is not one of the tools")
    return ToolChoice("function", name)


def parse_parallel_tool_calls(value: Any) -> bool:
    """OpenAI's ``parallel_tool_calls``: whether one answer may hold several calls (default True)."""
    _need(value is None or isinstance(value, bool), "parallel_tool_calls", f"must be a boolean, got {_kind(value)}")
    return True if value is None else value


# ------------------------------------------------------------------ templates
def tool_format(template_source: str | None) -> str | None:
    """The family of a chat template's tool-call syntax, from its Jinja source: one of
    :data:`SUPPORTED_FORMATS`; "unknown" when the template handles tools in a syntax this module
    does not parse (Qwen3-Coder's and GLM's XML-like calls, DeepSeek's, Granite's...); None when it
    never mentions tools."""
    src = template_source or ""
    if "[TOOL_CALLS]" in src:
        return "mistral"
    if "<tool_call>" in src:  # Qwen3-Coder (<function=...>) and GLM (<arg_key>) put XML inside
        return "unknown" if "<function=" in src or "<arg_key>" in src else "hermes"
    if ("<|python_tag|>" in src or "Environment: ipython" in src
            or re.search(r'"parameters": ?dictionary of argument', src)):
        return "llama3"
    return "unknown" if re.search(r"\btools\b|\btool_calls\b", src) else None


# ------------------------------------------------------------------ outputs
@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    index: int
    delta: str


def new_call_id() -> str:
    """"call_" and 24 random letters and digits (Mistral's templates keep an id's last 9)."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _as_call(obj: Any, need_args: bool = False) -> tuple[str, str] | None:
    """(name, arguments as compact JSON) when ``obj`` is a call object, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in ("arguments", "parameters") if k in obj), None)
    if key is None and need_args:  # llama3: a bare JSON answer with a "name" is no call
        return None
    args = {} if key is None else obj[key]
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args = _loads(args)
    if not isinstance(args, dict):
        return None
    try:
        return obj["name"], json.dumps(args, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (ValueError, RecursionError):
        return None


_TRIGGER = {"hermes": "<tool_call>", "llama3": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}
_HERMES_END = "</tool_call>"
_V11 = re.compile(r"[A-Za-z0-9_.-]{1,64}(?:\[CALL_ID\][A-Za-z0-9_-]{1,64})?\[ARGS\]")
_V11_PART = re.compile(r"[A-Za-z0-9_.-]{1,64}(?:\[CALL_ID\][A-Za-z0-9_-]{0,64})?(\[[A-Z_]*)?")
_WAIT, _BAD = "wait", "bad"
_SPACE, _SPACE_SEMI = re.compile(r"\s*"), re.compile(r"[\s;]*")


class StreamingToolParser:
    """Deltas of a model's output → :class:`ContentDelta`, :class:`ToolCallStart` and
    :class:`ToolCallArgs` events (a call's arguments come in one delta, once the call is complete).

    Every decision is taken on text known to be complete for it (a closed block, a balanced JSON
    value, a trigger that cannot be a prefix any more), so it does not depend on where the deltas
    were split; the content is stripped at both ends (trailing whitespace waits for more text).
    ``fmt`` None: all of the output is content."""

    def __init__(self, fmt: str | None, new_id: Callable[[], str] = new_call_id):
        if fmt is not None and fmt not in SUPPORTED_FORMATS:
            raise MarsError(f"unknown tool-call format {fmt!r} (known: {', '.join(SUPPORTED_FORMATS)})")
        self.fmt, self._new_id = fmt, new_id
        self._buf, self._out, self._count = "", [], 0
        self._mode = "start" if fmt == "llama3" else "text"  # llama3: "start"/"after" (a call) take a "{"
        self._js = None  # the bracket scan of the JSON value being waited for: (i, depth, in_str, esc)
        self._hint = 0  # hermes: where to look for </tool_call> next
        self._began, self._ws = False, ""

    def feed(self, delta: str) -> list:
        self._buf += delta
        self._scan(False)
        return self._take()

    def finish(self, cut: bool = False) -> list:
        """The events of the text still held.  ``cut``: the output was cut short (max tokens, a
        full context), so a call still open at its end (or a trigger's first characters) is
        unfinished markup: dropped, never shown as content, where a whole output's malformed call
        is content (a model may write a trigger in prose)."""
        if cut:
            self._scan(False)  # (what is still held after it is an open call or a trigger's beginning)
            self._consume(len(self._buf))
        self._scan(True)
        self._ws = ""  # trailing whitespace of the content is dropped
        return self._take()

    def _take(self) -> list:
        out: list = []
        for ev in self._out:  # one content delta per call of feed, between calls
            if out and isinstance(ev, ContentDelta) and isinstance(out[-1], ContentDelta):
                ev = ContentDelta(out.pop().text + ev.text)
            out.append(ev)
        self._out = []
        return out

    def _content(self, text: str) -> None:
        if not self._began:
            text = text.lstrip()
            self._began = bool(text)
        body = text.rstrip()
        if body:
            self._out.append(ContentDelta(self._ws + body))
            self._ws = ""
        self._ws += text[len(body):]

    def _call(self, name: str, args: str) -> None:
        i, self._count = self._count, self._count + 1
        self._out += [ToolCallStart(i, self._new_id(), name), ToolCallArgs(i, args)]

    def _consume(self, n: int) -> None:
        self._buf, self._js, self._hint = self._buf[n:], None, 0

    def _skip(self, k: int, semicolons: bool = False) -> int:
        """The index of the first character at or after ``k`` that is not whitespace (nor ";")."""
        return (_SPACE_SEMI if semicolons else _SPACE).match(self._buf, k).end()

    def _done(self, calls: list, end: int) -> None:
        for c in calls:
            self._call(*c)
        self._consume(end)

    def _scan(self, final: bool) -> None:
        trig = _TRIGGER.get(self.fmt or "")
        while self._buf:
            buf = self._buf
            if self._mode != "text":  # llama3, at the start or after a call
                s = self._skip(0, self._mode == "after")
                if s == len(buf):
                    if final:
                        self._content(buf if self._mode == "start" else "")
                        self._consume(len(buf))
                    return
                if buf[s] != "{":
                    self._mode = "text"
                    self._consume(s)
                    continue
                got = self._llama3_calls(s, final)
                if got == _WAIT:
                    return
                if got == _BAD:
                    self._content(buf[: s + 1])
                    self._consume(s + 1)
                    self._mode = "text"
                continue
            i = buf.find(trig) if trig else -1
            if i < 0:
                keep = 0 if final or not trig else next(
                    (k for k in range(min(len(trig) - 1, len(buf)), 0, -1) if trig.startswith(buf[-k:])), 0)
                self._content(buf[: len(buf) - keep])
                self._consume(len(buf) - keep)
                return
            if i:
                self._content(buf[:i])
                self._consume(i)
            got = getattr(self, "_at_" + self.fmt)(final)
            if got == _WAIT:
                return
            if got == _BAD:  # the trigger is content; what follows it is scanned again
                self._content(trig)
                self._consume(len(trig))

    def _json_end(self, s: int) -> int | None:
        """The end of the bracketed JSON value that starts at ``s`` (``{`` or ``[``), or None while
        it is open (the scan resumes where it stopped)."""
        i, depth, in_str, esc = self._js or (s, 0, False, False)
        buf, n = self._buf, len(self._buf)
        while i < n:
            c = buf[i]
            i += 1
            if in_str:
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth <= 0:
                    self._js = None
                    return i
        self._js = (i, depth, in_str, esc)
        return None

    def _at_hermes(self, final: bool):
        start = len(_TRIGGER["hermes"])
        j = self._buf.find(_HERMES_END, max(start, self._hint))
        if j < 0:
            if not final:
                self._hint = max(start, len(self._buf) - len(_HERMES_END) + 1)
                return _WAIT
            j = len(self._buf)  # unclosed at the end (a stop string?): still a call if its JSON is whole
        call = _as_call(_loads(self._buf[start:j].strip()))
        return _BAD if call is None else self._done([call], min(j + len(_HERMES_END), len(self._buf)))

    def _llama3_calls(self, s: int, final: bool):
        e = self._json_end(s)
        if e is None:
            return _BAD if final else _WAIT
        call = _as_call(_loads(self._buf[s:e]), need_args=True)
        if call is None:
            return _BAD
        self._mode = "after"
        return self._done([call], e)

    def _at_llama3(self, final: bool):
        s = self._skip(len(_TRIGGER["llama3"]))
        if s == len(self._buf):
            return _BAD if final else _WAIT
        return self._llama3_calls(s, final) if self._buf[s] == "{" else _BAD

    def _at_mistral(self, final: bool):
        buf, s = self._buf, self._skip(len(_TRIGGER["mistral"]))
        if s == len(buf):
            return _BAD if final else _WAIT
        if buf[s] == "[":  # v3: an array of call objects
            e = self._json_end(s)
            if e is None:
                return _BAD if final else _WAIT
            arr = _loads(buf[s:e])
            calls = [_as_call(c) for c in arr] if isinstance(arr, list) and arr else [None]
            return _BAD if None in calls else self._done(calls, e)
        m = _V11.match(buf, s)  # v11: name[ARGS]{...}
        if m is None:
            p = None if final else _V11_PART.fullmatch(buf, s)
            tail = p and (p.group(1) or "")
            return _WAIT if p and ("[ARGS]".startswith(tail) or "[CALL_ID]".startswith(tail)) else _BAD
        a = self._skip(m.end())
        if a == len(buf):
            return _BAD if final else _WAIT
        e = self._json_end(a) if buf[a] == "{" else -1
        if e is None:
            return _BAD if final else _WAIT
        name = buf[s:m.end()].split("[", 1)[0]
        call = _as_call({"name": name, "arguments": _loads(buf[a:e])}) if e > 0 else None
        return _BAD if call is None else self._done([call], e)


def parse_tool_calls(fmt: str | None, text: str, new_id: Callable[[], str] = new_call_id,
                     cut: bool = False) -> tuple[str, list[ToolCall]]:
    """A whole output → (its content outside the calls, stripped; the calls).  ``cut``: the output
    was cut short, its unfinished last call dropped (:meth:`StreamingToolParser.finish`)."""
    p = StreamingToolParser(fmt, new_id)
    content, calls = [], {}
    for ev in p.feed(text) + p.finish(cut):
        if isinstance(ev, ContentDelta):
            content.append(ev.text)
        elif isinstance(ev, ToolCallStart):
            calls[ev.index] = [ev.id, ev.name, ""]
        else:
            calls[ev.index][2] += ev.delta
    return "".join(content), [ToolCall(*c) for c in calls.values()]


def template_tools(tools: tuple[Tool, ...], choice: ToolChoice | None) -> list[dict] | None:
    """``tools`` as a chat template takes them (OpenAI's shape), or None when the model is not
    to see any (no tools, or ``tool_choice`` "none")."""
    if not tools or (choice is not None and choice.mode == "none"):
        return None
    out = []
    for t in tools:
        fn: dict = {"name": t.name}
        if t.description is not None:
            fn["description"] = t.description
        fn["parameters"] = t.parameters if t.parameters is not None else {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out


def template_choice(choice: ToolChoice | None):
    """``tool_choice`` as a chat template takes it (OpenAI's shape)."""
    if choice is None:
        return None
    return {"type": "function", "function": {"name": choice.name}} if choice.mode == "function" else choice.mode


def was_cut(stop_reason: str | None) -> bool:
    """Whether an output that ended so was cut short (max tokens, a full context)."""
    return stop_reason in ("length", "context")


def openai_calls(calls) -> list[dict]:
    """``calls`` (ToolCall) in OpenAI's ``tool_calls`` shape."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
