"""JSON Schema → GBNF through llama-cpp-python's converter (the one place that calls it; imported
lazily by mars_local.speculate.grammar and mars_local.chat.tool_grammar)."""

from __future__ import annotations

import json
import re

from ..core.errors import MarsError

__all__ = ["MAX_REPEAT", "precheck_schema", "schema_to_gbnf"]

# The converter spells every repetition out: minItems 100000000 wrote a 1.8 GB grammar (14 s,
# several GB of memory, `mars serve`'s event loop blocked) before its size was checked.  A
# count above this is refused before converting: at 18 bytes an item it is past the 1 MiB a
# grammar may have anyway (speculate.grammar.check_grammar_text), and refused in microseconds.
MAX_REPEAT = 100_000
_COUNTS = frozenset({"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties",
                     "minContains", "maxContains"})
_CHOICES = frozenset({"enum", "anyOf", "oneOf"})
_DATA = frozenset({"enum", "const", "default", "examples"})  # keywords whose values are JSON data
_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_LAX_CHAR = r'char ::= [^"\\] |'
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'
_REGEX_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")  # a pattern's {m}, {m,} or {m,n}


def precheck_schema(schema) -> None:
    """MarsError naming what in ``schema`` (a parsed JSON Schema) the converter cannot turn into a
    grammar worth having: a count asking for more than MAX_REPEAT repetitions (a keyword: minItems,
    maxLength, ...; or a pattern's {m,n}), or an empty enum/anyOf/oneOf, which no value matches
    (the converter wrote an invalid grammar, refused with a parser's message about GBNF)."""
    stack = [schema]
    while stack:  # (iterative: a deeply nested schema must not overflow the stack)
        x = stack.pop()
        if isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, dict):
            for key, v in x.items():
                if key in _COUNTS and isinstance(v, (int, float)) and not isinstance(v, bool):
                    if not v <= MAX_REPEAT:  # (also NaN and infinity)
                        shown = f"{v:,}" if isinstance(v, int) else f"{v:g}"
                        raise MarsError(f"the JSON schema's {key} {shown} is more than a grammar can spell out "
                                        f"(at most {MAX_REPEAT:,})")
                elif key in _CHOICES and isinstance(v, list) and not v:
                    raise MarsError(f"the JSON schema has an empty {key}: no value matches it")
                elif key in _NAMED and isinstance(v, dict):  # name -> schema (a property may be named "const")
                    stack.extend(v.values())
                elif key in _DATA:  # (values, not schemas: {"const": {"maxLength": 1e9}} is no count)
                    continue
                elif key == "pattern" and isinstance(v, str):
                    for m in _REGEX_REPEAT.finditer(v):
                        n = max(int(g) for g in m.groups() if g)
                        if n > MAX_REPEAT:
                            raise MarsError(f"the JSON schema's pattern repeats {n:,} times ({m.group(0)}); "
                                            f"a grammar can spell out at most {MAX_REPEAT:,}")
                else:
                    stack.append(v)


def schema_to_gbnf(schema_json: str, prop_order: list[str] | None = None) -> str:
    """The GBNF grammar (start rule ``root``) of the documents ``schema_json`` accepts (JSON strings
    without raw control characters); MarsError
    for a schema it cannot make a grammar of (:func:`precheck_schema`), else the converter's own
    exceptions pass through."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    precheck_schema(json.loads(schema_json))
    # the pinned converter's string character allows raw control characters, which JSON forbids
    # (llama.cpp's own converter and JSON_GBNF exclude them): excluded here, for every caller
    return json_schema_to_gbnf(schema_json, prop_order=prop_order).replace(_LAX_CHAR, _JSON_CHAR)
