"""Batch input: records (id, prompt or messages, settings), their checks and configs; see :mod:`mars_local.batch`."""

from __future__ import annotations

import functools
import json
import math
import sys
from dataclasses import dataclass, replace
from typing import Optional

from ..chat.session import check_messages, short_json as _show
from ..core.choices import VERIFY_METHODS
from ..core.errors import MarsError
from ..core.textfile import MAX_BATCH_BYTES, decode_text, read_bytes, read_stream
from ..core.sampling import SamplingParams

EXIT_SKIPPED = 3  # some records were skipped; every other one was generated

SAMPLING_KEYS = frozenset(SamplingParams.__dataclass_fields__)  # the settings GenerateConfig nests
MARK, FORMAT = "mars_batch", 1  # every output record carries "mars_batch": 1 (ours, this format)
RECORD_PREFIX = b'{"mars_batch": 1, "id": '  # how every line mars-local writes begins (see output_line)


@dataclass
class Record:
    line_no: int
    id: object
    prompt: Optional[str]
    messages: Optional[list]
    settings: dict
    config: object = None
    tools: tuple = ()  # chat.tools.Tool: functions the answer may call (records with messages)
    tool_choice: object = None  # chat.tools.ToolChoice when there are tools


# ----------------------------------------------------------------- input
def is_int(v) -> bool:
    """A JSON whole number (a bool is not one)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def valid_id(v) -> bool:
    """A string or a whole number (an integral float such as 1.0 or 1e3 counts)."""
    return isinstance(v, str) or is_int(v) or (_is_num(v) and float(v).is_integer())


def id_key(v) -> str:
    """The key that says which ids are the same (see the module's docstring):
    a string as it is, a number as its integer's decimal digits."""
    return v if isinstance(v, str) else str(v if is_int(v) else int(v))


def _same_id_note(a, b) -> str:
    """Why two ids written differently are one id, or nothing when written alike."""
    return "" if json.dumps(a) == json.dumps(b) else f" ({_show(a)} and {_show(b)} are the same id)"


def _is_str(v) -> bool:
    return isinstance(v, str)


def _is_int_or_null(v) -> bool:
    return v is None or is_int(v)


def _is_bool(v) -> bool:
    return isinstance(v, bool)


def _is_stop(v) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))


def _is_schema(v) -> bool:
    return isinstance(v, (dict, str))


# Each per-line setting: its JSON type and its allowed values in words.  The
# ranges themselves are GenerateConfig's (with SamplingParams and VerifyConfig).
SETTINGS = {
    "max_tokens": (is_int, "a whole number from 1{top}, or -1 (until end of generation or a full context)"),
    "seed": (is_int, "a whole number (negative = random)"),
    "temperature": (_is_num, "a finite number >= 0"),
    "top_k": (is_int, "a whole number >= 0 (0 = off)"),
    "top_p": (_is_num, "a number in (0, 1] (1 = off)"),
    "min_p": (_is_num, "a number in [0, 1) (0 = off)"),
    "theta": (_is_num, "a number in (0, 1]"),
    "draft_max": (is_int, "a whole number from 0 to {max_draft}"),
    "max_relaxed": (_is_int_or_null, "a whole number >= 0 or null (no cap)"),
    "verify": (_is_str, "{methods}"),
    "stop": (_is_stop, "a non-empty string or a list of non-empty strings"),
    "ignore_eos": (_is_bool, "true or false"),
    "repeat_penalty": (_is_num, "a number > 0 (1 = off)"),
    "repeat_last_n": (is_int, "a whole number >= -1 (-1 = the whole context, 0 = off)"),
    "presence_penalty": (_is_num, "a finite number (0 = off)"),
    "frequency_penalty": (_is_num, "a finite number (0 = off)"),
    "grammar": (_is_str, "GBNF grammar text (a non-empty string)"),
    "json_schema": (_is_schema, "a JSON Schema (an object, or a string holding one)"),
    "format": (_is_str, '"json"'),
    "logprobs": (is_int, "a whole number from 0 to 20 (0 = none)"),
}
LINE_SETTINGS = frozenset(SETTINGS)
GRAMMAR_KEYS = ("grammar", "json_schema", "format")  # at most one per record; each becomes the config's grammar


@functools.lru_cache(maxsize=64)
def _schema_grammar(text: str) -> str:
    from ..speculate.grammar import grammar_from_json_schema

    return grammar_from_json_schema(text)


def _config_fields(name: str, v) -> dict:
    """A per-line setting as GenerateConfig fields (MarsError when its value cannot be one)."""
    if name == "stop":
        return {"stop": (v,) if isinstance(v, str) else tuple(v)}
    if name == "json_schema":
        text = v if isinstance(v, str) else json.dumps(v)  # property order kept: it is the output order
        return {"grammar": _schema_grammar(text)}
    if name == "format":
        if v != "json":
            raise MarsError("only json is a format")
        from ..speculate.grammar import json_grammar

        return {"grammar": json_grammar()}
    return {name: v}


def config_fields(settings: dict) -> dict:
    """A record's settings as GenerateConfig fields (stop as a tuple, json_schema/format as GBNF)."""
    out: dict = {}
    for name, v in settings.items():
        out.update(_config_fields(name, v))
    return out


def _in_range(name: str, v, ctx_size: Optional[int]) -> Optional[str]:
    """None when ``v`` is allowed, else why not (empty: the field's description says it)."""
    from ..core.config import GenerateConfig

    if name == "seed":  # any integer is a seed; numpy takes these
        return None if -(2**63) <= v < 2**64 else ""
    if name == "max_tokens" and ctx_size and v > ctx_size:
        return ""
    try:
        GenerateConfig.make(**_config_fields(name, v))
    except MarsError as exc:
        # the converters say what is wrong with a schema; a plain range needs only the description
        return str(exc) if name == "json_schema" else ""
    return None


def check_settings(settings: dict, ctx_size: Optional[int] = None) -> None:
    """Each per-line setting's type and range; MarsError naming the field."""
    from ..core.config import MAX_DRAFT

    given = [k for k in GRAMMAR_KEYS if k in settings]
    if len(given) > 1:
        raise MarsError(f"give at most one of {', '.join(repr(k) for k in GRAMMAR_KEYS)}, got {' and '.join(given)}")
    for name, v in sorted(settings.items()):
        is_type, what = SETTINGS[name]
        why = _in_range(name, v, ctx_size) if is_type(v) else ""
        if why is not None:
            what = what.format(top=f" to {ctx_size} (the context size, -c)" if ctx_size else " or more",
                               max_draft=MAX_DRAFT, methods=" or ".join(VERIFY_METHODS))
            raise MarsError(f"'{name}' must be {what}, got {_show(v)}" + (f" ({why})" if why else ""))


def _check_record(obj: dict, ctx_size: Optional[int]) -> Record:
    """Everything but the line number in the message (the caller adds it once)."""
    if "id" not in obj:
        raise MarsError("needs an 'id' (string or number)")
    if not valid_id(obj["id"]):
        raise MarsError(f"'id' must be a string or a whole number, got {_show(obj['id'])}")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise MarsError("needs exactly one of 'prompt' or 'messages'")
    if has_prompt and (not isinstance(obj["prompt"], str) or not obj["prompt"].strip()):
        raise MarsError(f"'prompt' must be a non-empty string, got {_show(obj['prompt'])}")
    if has_messages:
        check_messages(obj["messages"])
    extra = set(obj) - {"id", "prompt", "messages", "tools", "tool_choice"} - LINE_SETTINGS
    if extra:
        raise MarsError(f"unknown field(s) {', '.join(sorted(extra))}")
    settings = {k: obj[k] for k in LINE_SETTINGS if k in obj}
    check_settings(settings, ctx_size)
    tools, choice = _record_tools(obj, settings)
    return Record(0, obj["id"], obj.get("prompt"), obj.get("messages"), settings, tools=tools, tool_choice=choice)


def _record_tools(obj: dict, settings: dict):
    """A record's ``tools`` and ``tool_choice`` (OpenAI's shapes; chat.tools checks them)."""
    from ..chat.tools import parse_tool_choice, parse_tools

    if not obj.get("tools"):
        if obj.get("tool_choice") is not None:
            raise MarsError("'tool_choice' needs 'tools'")
        return (), None
    if "messages" not in obj:
        raise MarsError("'tools' needs 'messages' (a chat)")
    tools = parse_tools(obj["tools"])
    choice = parse_tool_choice(obj.get("tool_choice"), tools)
    if choice.mode in ("required", "function") and any(k in settings for k in GRAMMAR_KEYS):
        raise MarsError("a 'tool_choice' that forces a call has its own grammar: leave out grammar/json_schema/format")
    return tools, choice


def _load_json(line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise MarsError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise MarsError("not valid JSON (nested too deeply)") from None


def parse_line(line: str, line_no: int, ctx_size: Optional[int] = None) -> Record:
    """One input line; MarsError starting with the line number when it is malformed."""
    try:
        obj = _load_json(line)
        if not isinstance(obj, dict):
            raise MarsError(f"expected a JSON object, got {_show(obj)}")
        rec = _check_record(obj, ctx_size)
    except MarsError as exc:
        raise MarsError(f"line {line_no}: {exc}") from None
    rec.line_no = line_no
    return rec


def read_input(input: str) -> tuple[str, list[str]]:
    """(name for messages, lines) of INPUT ('-': standard input), as UTF-8 text
    with at least one non-blank line; MarsError otherwise."""
    if input == "-":
        name = "standard input"
        if sys.stdin is None:
            raise MarsError("no standard input to read (it is closed)")
        data = read_stream(getattr(sys.stdin, "buffer", None) or sys.stdin, MAX_BATCH_BYTES, name, "a batch input")
    else:
        name = input
        data = read_bytes(input, "input file", MAX_BATCH_BYTES)
    text = decode_text(data, name, "JSONL text").removeprefix("\ufeff")
    if not text:
        raise MarsError(f"{name} is empty: there are no records to generate")
    if not text.strip():
        raise MarsError(f"{name} has no records (only blank lines)")
    # split on "\n" only: str.splitlines would also split at U+2028 and friends inside JSON strings
    return name, [x.removesuffix("\r") for x in text.split("\n")]


def read_records(lines, base, ctx_size: Optional[int] = None, name: str = "the input"):
    """(records, problems) of the non-blank lines; problems are (line number,
    message) of the lines to skip, each record carries its GenerateConfig.
    A duplicate id is an error (naming both lines) whatever else is wrong with
    those lines."""
    records, problems, first = [], [], {}  # id key -> (line number, the id as written)
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            obj = None
        if isinstance(obj, dict) and valid_id(obj.get("id")):
            key = id_key(obj["id"])
            if key in first:
                line0, id0 = first[key]
                raise MarsError(
                    f"duplicate id {_show(id0)} on lines {line0} and {i} of {name}{_same_id_note(id0, obj['id'])}; "
                    "ids must be unique, so nothing was generated"
                )
            first[key] = (i, obj["id"])
        try:
            rec = parse_line(line, i, ctx_size)
            rec.config = config_for(base, rec.settings, i)
        except MarsError as exc:
            problems.append((i, str(exc)))
            continue
        records.append(rec)
    return records, problems



def config_for(base, settings: dict, line_no: int):
    """The command line's GenerateConfig with a record's settings over it;
    MarsError naming the line when the two do not combine."""
    if not settings:
        return base
    fields_ = config_fields(settings)
    s_kw = {k: v for k, v in fields_.items() if k in SAMPLING_KEYS}
    g_kw = {k: v for k, v in fields_.items() if k not in SAMPLING_KEYS}
    try:
        return replace(base, sampling=replace(base.sampling, **s_kw), **g_kw)
    except MarsError as exc:  # a combination with the command-line flags, e.g. --draft-min above draft_max
        raise MarsError(f"line {line_no}: {exc}") from None
