"""Grammars that force a tool call (``tool_choice`` "required" or a named function): the JSON
schema of one call over the allowed tools (:func:`call_schema`), and the GBNF of a whole answer made
of calls in a template family's syntax (:func:`tools_gbnf`; the families: :mod:`.tools`)."""

from __future__ import annotations

import json
import re

from ..core.errors import MarsError
from .tools import SUPPORTED_FORMATS, Tool, ToolChoice

__all__ = ["call_markers", "call_schema", "tool_triggers", "tools_gbnf"]

# The text that opens a call in each family's syntax: with tool_choice "auto" the grammar of the calls
# waits for it (a lazy grammar) and constrains the rest of the answer from it on.
_TRIGGERS = {"hermes": ("<tool_call>",), "llama3": ('{"name"',), "mistral": ("[TOOL_CALLS]",)}
# The markers of each family's calls that a GGUF may make control tokens (hidden from the text unless
# named: GenerateConfig.visible_special), which the parsers need to see.
_MARKERS = {"hermes": ("<tool_call>", "</tool_call>"), "llama3": ("<|python_tag|>",),
            "mistral": ("[TOOL_CALLS]", "[ARGS]")}

_REF = re.compile(r'"\$ref": "#(?:/(?:\$defs|definitions)/([^"]*))?"')
_GBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z0-9_-]+|\s+|.', re.S)


def _allowed(tools: tuple[Tool, ...], choice: ToolChoice) -> list[tuple[int, Tool]]:
    out = [(i, t) for i, t in enumerate(tools) if choice.mode != "function" or t.name == choice.name]
    if not out:
        raise MarsError("there is no tool to call", field="tool_choice")
    return out


def call_schema(tools: tuple[Tool, ...], choice: ToolChoice, *, key: str = "arguments") -> dict:
    """The JSON Schema of one call object: an ``anyOf`` over the allowed tools (the named one only,
    for a named choice) of ``{"name": {"const": N}, key: PARAMS}``, both required, nothing else.
    Tool i's PARAMS is ``$defs["args-i"]`` (``{"type": "object"}`` when it has none); its own
    ``$defs``/``definitions`` move to the root's as ``t<i>-NAME``, their ``$ref``s rewritten."""
    defs: dict = {}
    alts = []
    for i, t in _allowed(tools, choice):
        params = dict(t.parameters or {})
        params.setdefault("type", "object")
        own = {k: v for d in (params.pop("definitions", None), params.pop("$defs", None))
               if isinstance(d, dict) for k, v in d.items()}
        def moved_ref(m: re.Match, i: int = i) -> str:  # "#/$defs/X" -> "#/$defs/t<i>-X", "#" -> args-i
            return '"$ref": "#/$defs/' + (f"args-{i}" if m[1] is None else f"t{i}-{m[1]}") + '"'

        moved = json.loads(_REF.sub(moved_ref, json.dumps({"p": params, "d": own})))
        defs[f"args-{i}"] = moved["p"]
        defs.update({f"t{i}-{k}": v for k, v in moved["d"].items()})
        alts.append({"type": "object", "properties": {"name": {"const": t.name}, key: {"$ref": f"#/$defs/args-{i}"}},
                     "required": ["name", key], "additionalProperties": False})
    return {"$defs": defs, "anyOf": alts}


def _lit(s: str) -> str:
    """A GBNF string literal."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r") + '"'


def tool_triggers(fmt: str) -> tuple[str, ...]:
    """The words that open a call in ``fmt``'s syntax (every :func:`tools_gbnf` output starts with one):
    the triggers of the lazy grammar that constrains an "auto" answer once it starts a call."""
    if fmt not in _TRIGGERS:
        raise MarsError(f"unknown tool-call format {fmt!r} (known: {', '.join(SUPPORTED_FORMATS)})")
    return _TRIGGERS[fmt]


def call_markers(fmt: str) -> tuple[str, ...]:
    """The texts that mark calls in ``fmt``'s syntax: shown in the answer's text even where the model's
    vocabulary makes them control tokens (Mistral's ``[TOOL_CALLS]``, Llama's ``<|python_tag|>``)."""
    tool_triggers(fmt)  # the same check of the name
    return _MARKERS[fmt]


def tools_gbnf(fmt: str, tools: tuple[Tool, ...], choice: ToolChoice, parallel: bool) -> str:
    """A GBNF grammar whose every output is one call (``parallel``: one or more) in ``fmt``'s
    syntax, to a tool ``choice`` allows: "required" or "auto" (any tool) or a named function.
    With "auto" the model may answer in text: the caller makes the grammar lazy, waiting for one
    of :func:`tool_triggers`.  Its cost is not checked here: the caller bounds it as any grammar
    (``speculate.grammar_check``)."""
    if fmt not in SUPPORTED_FORMATS:
        raise MarsError(f"unknown tool-call format {fmt!r} (known: {', '.join(SUPPORTED_FORMATS)})")
    if choice.mode not in ("required", "function", "auto"):
        raise MarsError(f"a grammar of calls needs 'tool_choice' 'auto', 'required' or a function, "
                        f"got {choice.mode!r}", field="tool_choice")
    from ..llama.json_schema import schema_to_gbnf

    key = "parameters" if fmt == "llama3" else "arguments"
    try:
        gbnf = schema_to_gbnf(json.dumps(call_schema(tools, choice, key=key)), prop_order=["name", key])
    except MarsError:
        raise
    except Exception as exc:  # the converter raises bare exceptions on schemas it does not support
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise MarsError(f"cannot convert the tools' parameters to a grammar: {msg}", field="tools") from None
    gbnf = gbnf.rstrip("\n") + "\n"  # (control characters already excluded: llama.json_schema)
    if re.search(r"(?m)^(call|mistral-call) ::=", gbnf):
        raise MarsError("a tool's parameters define a rule named 'call'", field="tools")  # pragma: no cover
    gbnf = "".join("call" if tok == "root" else tok for tok in _GBNF_TOKEN.findall(gbnf))
    if fmt == "hermes":
        one = _lit("<tool_call>\n") + " call " + _lit("\n</tool_call>")
        root = f'{one} ( "\\n" {one} )*' if parallel else one
    elif fmt == "llama3":
        root = 'call ( ";" " "? call )*' if parallel else "call"
    else:
        pairs = " | ".join(f"{_lit(t.name + '[ARGS]')} args-{i}" for i, t in _allowed(tools, choice))
        gbnf += f"mistral-call ::= {pairs}\n"
        v3 = '" "? "[" call ( "," space call )* "]"' if parallel else '" "? "[" call "]"'
        v11 = '( "[TOOL_CALLS]" mistral-call )*' if parallel else ""
        root = f'"[TOOL_CALLS]" ( {v3} | mistral-call {v11} )'
    return gbnf + f"root ::= {root}\n"
