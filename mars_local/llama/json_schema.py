"""JSON Schema → GBNF through llama-cpp-python's converter (the one place outside speculate's
grammar module that calls it; imported lazily by mars_local.chat.tools)."""

from __future__ import annotations

__all__ = ["schema_to_gbnf"]


def schema_to_gbnf(schema_json: str, prop_order: list[str] | None = None) -> str:
    """The GBNF grammar (start rule ``root``) of the documents ``schema_json`` accepts; the
    converter's own exceptions pass through."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    return json_schema_to_gbnf(schema_json, prop_order=prop_order)
