"""OpenAI request bodies → what the engine takes (no llama.cpp, no web framework).

:func:`parse_chat` and :func:`parse_completion` check a decoded JSON body field
by field (types, ranges, unsupported values) and return a :class:`Request`:
the prompt (chat messages, text or token ids) and the :class:`GenerateConfig`
it runs with — the server's defaults (its command-line flags) with the
request's fields over them.  Every problem is an :class:`ApiError` naming the
field (``param``), which the app answers in OpenAI's error shape.

Field glossary (OpenAI name → GenerateConfig):

max_tokens, max_completion_tokens  max_tokens (absent: the server's -n)
temperature, top_p, seed           sampling (absent: the server's flags)
stop                               stop (a string or a list of non-empty strings, as the CLI)
presence_penalty, frequency_penalty  the same (-2..2, OpenAI's range)
logprobs, top_logprobs             logprobs (the top-N count; see ``n_top``)
response_format                    grammar (json_object: any JSON; json_schema: that schema)
tools, tool_choice, parallel_tool_calls
                                   chat: the functions the chat template is rendered with, and
                                   how the answer may call them (mars_local.chat.tools)
speculative                        our extension: enabled, verify, theta, draft_max, adaptive
top_k, min_p, repeat_penalty, repeat_last_n, ignore_eos, grammar
                                   llama.cpp server extensions, same meaning and ranges as the
                                   CLI flags (GenerateConfig checks them)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal

from ..core.config import GenerateConfig
from ..core.defaults import SETTINGS
from ..core.errors import MarsError

__all__ = ["ApiError", "Request", "parse_chat", "parse_completion", "SPECULATIVE_KEYS"]

SPECULATIVE_KEYS = ("enabled", "verify", "theta", "draft_max", "adaptive")
_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed")
# OpenAI's ranges for OpenAI's fields (narrower than the engine's); llama.cpp's extensions take the
# table's (core.defaults), which GenerateConfig checks
_OPENAI_RANGES = (("temperature", 0, 2), ("top_p", 0, 1), ("min_p", None, None),
                  ("presence_penalty", -2, 2), ("frequency_penalty", -2, 2))
_LOGPROBS = SETTINGS["logprobs"]  # top_logprobs and completions' logprobs: the CLI's --logprobs range
_MAX_TOKENS_MIN = SETTINGS["max_tokens"].lo  # OpenAI's max_tokens has no -1
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Request:
    """One parsed request: exactly one of ``messages`` (chat) and ``prompt`` is set."""

    kind: Literal["chat", "completion"]
    config: GenerateConfig
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False  # whether the response carries log probabilities
    n_top: int = 0  # how many alternatives each position lists (config.logprobs may be 1 more)
    tools: tuple = ()  # chat.tools.Tool: the request's functions (chat only)
    tool_choice: Any = None  # chat.tools.ToolChoice when there are tools
    parallel_tool_calls: bool = True


# ----------------------------------------------------------------- fields
_JSON_TYPE = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
              list: "an array", dict: "an object"}


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    for t in (bool, int, float, str, list, dict):
        if isinstance(v, t):
            return _JSON_TYPE[t]
    return type(v).__name__


def _field(body: dict, name: str, types: tuple, *, where: str = "") -> Any:
    """``body[name]`` when present and not null, checked against ``types`` (JSON's:
    a boolean is not a number; an integer is a number); None when absent."""
    v = body.get(name)
    if v is None:
        return None
    param = f"{where}{name}"
    ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in types)
    if float in types and isinstance(v, float) and not math.isfinite(v):
        ok = False
    if not ok:
        want = " or ".join(dict.fromkeys(_JSON_TYPE[t] for t in types))
        raise ApiError(400, f"'{param}' must be {want}, got {_kind(v)}", param=param)
    return v


def _num(body: dict, name: str, lo: float | None = None, hi: float | None = None, *, where: str = "",
         integer: bool = False) -> Any:
    v = _field(body, name, (int,) if integer else (int, float), where=where)
    if v is not None and ((lo is not None and v < lo) or (hi is not None and v > hi)):
        rng = f"in [{lo}, {hi}]" if lo is not None and hi is not None else (f">= {lo}" if lo is not None else f"<= {hi}")
        raise ApiError(400, f"'{where}{name}' must be {rng}, got {v}", param=f"{where}{name}")
    return v


def _with(cfg: GenerateConfig, param: str, **kw) -> GenerateConfig:
    """``cfg`` with ``kw`` set (sampling fields included), validated by GenerateConfig: its
    message becomes a 400 naming ``param``."""
    s = {k: kw.pop(k) for k in list(kw) if k in _SAMPLING}
    try:
        return replace(cfg, sampling=replace(cfg.sampling, **s) if s else cfg.sampling, **kw)
    except MarsError as exc:
        raise ApiError(400, f"'{param}': {exc}", param=param) from None


def _unsupported(body: dict) -> None:
    """Known OpenAI fields whose non-default values this server cannot honour."""
    n = _num(body, "n", integer=True)
    if n is not None and n != 1:
        raise ApiError(400, f"only n = 1 is supported, got {n}", param="n")
    best_of = _num(body, "best_of", integer=True)
    if best_of is not None and best_of != 1:
        raise ApiError(400, f"only best_of = 1 is supported, got {best_of}", param="best_of")
    for name in ("functions", "logit_bias"):
        if body.get(name):
            why = " (use 'tools': the legacy 'functions' API is not)" if name == "functions" else ""
            raise ApiError(400, f"'{name}' is not supported by this server{why}", param=name)
    if body.get("function_call") is not None:
        raise ApiError(400, "'function_call' is not supported by this server (use 'tool_choice')", param="function_call")
    if body.get("echo"):
        raise ApiError(400, "'echo' is not supported by this server", param="echo")
    if body.get("suffix"):
        raise ApiError(400, "'suffix' is not supported by this server", param="suffix")


def _speculative(cfg: GenerateConfig, spec: Any) -> GenerateConfig:
    """The request's ``speculative`` object over the server's settings."""
    if spec is None:
        return cfg
    if not isinstance(spec, dict):
        raise ApiError(400, f"'speculative' must be an object, got {_kind(spec)}", param="speculative")
    unknown = sorted(set(spec) - set(SPECULATIVE_KEYS))
    if unknown:
        raise ApiError(400, f"unknown 'speculative' field {unknown[0]!r} (known: {', '.join(SPECULATIVE_KEYS)})",
                       param=f"speculative.{unknown[0]}")
    w = "speculative."
    verify = _field(spec, "verify", (str,), where=w)
    if verify is not None:
        cfg = _with(cfg, "speculative.verify", verify=verify)
    theta = _field(spec, "theta", (int, float), where=w)
    if theta is not None:
        cfg = _with(cfg, "speculative.theta", theta=float(theta))
    draft_max = _field(spec, "draft_max", (int,), where=w)
    if draft_max is not None:
        cfg = _with(cfg, "speculative.draft_max", draft_max=draft_max, draft_min=min(cfg.draft_min, max(draft_max, 0)))
    adaptive = _field(spec, "adaptive", (bool,), where=w)
    if adaptive is not None:
        cfg = _with(cfg, "speculative.adaptive", adaptive=adaptive)
    if _field(spec, "enabled", (bool,), where=w) is False:
        cfg = _with(cfg, "speculative.enabled", draft_max=0, draft_min=0, adaptive=False)
    return cfg


def _stop(body: dict) -> tuple[str, ...] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, f"'stop' must be a string or an array of strings, got {_kind(stop)}", param="stop")
    if len(stop) > 16:
        raise ApiError(400, f"'stop' may hold at most 16 strings, got {len(stop)}", param="stop")
    return tuple(stop)  # an empty string is GenerateConfig's error, as on the command line


def _response_format(body: dict) -> str | None:
    """The GBNF that ``response_format`` (or the ``grammar`` extension) asks for, or None."""
    rf = _field(body, "response_format", (dict,))
    grammar = _field(body, "grammar", (str,))
    if grammar is not None:
        from ..speculate.grammar_check import check_grammar_text

        try:  # cheap (linear), before the request waits in the queue: no grammar holds the engine
            check_grammar_text(grammar)
        except MarsError as exc:
            raise ApiError(400, f"'grammar': {exc}", param="grammar") from None
    if rf is None or rf.get("type") in (None, "text"):
        return grammar
    if grammar is not None:
        raise ApiError(400, "'grammar' and 'response_format' cannot be combined", param="grammar")
    from ..speculate.grammar import grammar_from_json_schema, json_grammar

    kind = rf.get("type")
    if kind == "json_object":
        return json_grammar()
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "'response_format.json_schema.schema' must be an object (a JSON Schema)",
                           param="response_format.json_schema.schema")
        try:
            return grammar_from_json_schema(schema)
        except MarsError as exc:
            raise ApiError(400, str(exc), param="response_format.json_schema.schema") from None
    raise ApiError(400, f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   param="response_format.type")


def _common(body: Any, defaults: GenerateConfig, max_tokens_names: tuple[str, ...]) -> tuple[GenerateConfig, dict]:
    """The fields chat and completions share: (config, {model, stream, include_usage})."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_kind(body)}")
    _unsupported(body)
    cfg = defaults
    for name in max_tokens_names:
        n = _num(body, name, _MAX_TOKENS_MIN, integer=True)
        if n is not None:
            cfg = _with(cfg, name, max_tokens=n)
    if _num(body, "top_p", 0, 1) == 0:  # OpenAI allows 0: only the most likely token, i.e. greedy
        cfg = _with(cfg, "top_p", temperature=0.0)
        body = {k: v for k, v in body.items() if k not in ("top_p", "temperature")}
    for name, lo, hi in _OPENAI_RANGES:
        v = _num(body, name, lo, hi)
        if v is not None:
            cfg = _with(cfg, name, **{name: float(v)})
    for name in ("top_k", "repeat_last_n"):
        v = _num(body, name, integer=True)
        if v is not None:
            cfg = _with(cfg, name, **{name: v})
    seed = _num(body, "seed", integer=True)
    if seed is not None:
        cfg = _with(cfg, "seed", seed=seed)
    rp = _num(body, "repeat_penalty")
    if rp is not None:
        cfg = _with(cfg, "repeat_penalty", repeat_penalty=float(rp))
    ignore_eos = _field(body, "ignore_eos", (bool,))
    if ignore_eos is not None:
        cfg = _with(cfg, "ignore_eos", ignore_eos=ignore_eos)
    stop = _stop(body)
    if stop is not None:
        cfg = _with(cfg, "stop", stop=stop)
    grammar = _response_format(body)
    if grammar is not None:
        cfg = _with(cfg, "response_format", grammar=grammar)
    cfg = _speculative(cfg, body.get("speculative"))
    model = _field(body, "model", (str,))
    stream = bool(_field(body, "stream", (bool,)))
    opts = _field(body, "stream_options", (dict,)) or {}
    include_usage = bool(_field(opts, "include_usage", (bool,), where="stream_options."))
    return cfg, {"model": model, "stream": stream, "include_usage": include_usage}


def _with_logprobs(cfg: GenerateConfig, wanted: bool, n_top: int) -> GenerateConfig:
    # The engine gives the chosen token's log probability with its top N (N >= 1).
    return _with(cfg, "logprobs", logprobs=max(n_top, 1)) if wanted else _with(cfg, "logprobs", logprobs=0)


# ------------------------------------------------------------------ chat
def _message(i: int, m: Any) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise ApiError(400, f"'{where}' must be an object, got {_kind(m)}", param=where)
    role = m.get("role")
    if role == "function":
        raise ApiError(400, f"'{where}.role' 'function' is not supported (the legacy functions API); "
                       "use 'tool' messages", param=f"{where}.role")
    if role not in _ROLES and role != "tool":
        raise ApiError(400, f"'{where}.role' must be one of {', '.join(_ROLES)}, tool, got {role!r}",
                       param=f"{where}.role")
    content = m.get("content")
    calls = _tool_calls(where, m.get("tool_calls")) if role == "assistant" else None
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):  # content parts: text only
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"'{where}.content[{j}]' must be a text part "
                               "({\"type\": \"text\", \"text\": ...}); only text is supported",
                               param=f"{where}.content")
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise ApiError(400, f"'{where}.content' must be a string or an array of text parts, got {_kind(content)}",
                       param=f"{where}.content")
    if role == "tool":
        out = {"role": "tool", "content": content}
        call_id = _field(m, "tool_call_id", (str,), where=f"{where}.")
        if call_id is not None:
            out["tool_call_id"] = call_id
        name = _field(m, "name", (str,), where=f"{where}.")
        if name is not None:
            out["name"] = name
        return out
    out = {"role": _ROLES[role], "content": content}
    if calls:
        out["tool_calls"] = calls
    return out


def _tool_calls(where: str, calls: Any) -> list[dict] | None:
    """An assistant message's ``tool_calls``, for the template: arguments given as a JSON text
    are handed over parsed (Hugging Face templates write ``arguments | tojson``)."""
    import json

    if calls is None:
        return None
    if not isinstance(calls, list) or len(calls) > 128:
        raise ApiError(400, f"'{where}.tool_calls' must be an array of at most 128 tool calls", param=f"{where}.tool_calls")
    out = []
    for j, c in enumerate(calls):
        w = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"'{w}' must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                           param=w)
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise ApiError(400, f"'{w}.function.arguments' is not valid JSON", param=f"{w}.function.arguments") from None
        call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        out.append(call)
    return out


def _tools(body: dict) -> dict:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` (chat.tools checks them)."""
    from ..chat.tools import parse_parallel_tool_calls, parse_tool_choice, parse_tools

    raw, choice = body.get("tools"), body.get("tool_choice")
    if not raw:
        if choice is not None:  # as OpenAI: a choice among no tools
            raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice")
        return {}
    try:
        tools = parse_tools(raw)
        return {"tools": tools, "tool_choice": parse_tool_choice(choice, tools),
                "parallel_tool_calls": parse_parallel_tool_calls(body.get("parallel_tool_calls"))}
    except MarsError as exc:
        raise ApiError(400, str(exc), param=exc.field or "tools") from None


def parse_chat(body: Any, defaults: GenerateConfig) -> Request:
    """A ``POST /v1/chat/completions`` body."""
    cfg, common = _common(body, defaults, ("max_tokens", "max_completion_tokens"))
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty array of messages", param="messages")
    messages = [_message(i, m) for i, m in enumerate(msgs)]
    wanted = bool(_field(body, "logprobs", (bool,)))
    n_top = _num(body, "top_logprobs", _LOGPROBS.lo, _LOGPROBS.hi, integer=True) or 0
    if n_top and not wanted:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    cfg = _with_logprobs(cfg, wanted, n_top)
    tools = _tools(body)
    if tools and tools["tool_choice"].mode in ("required", "function") and cfg.grammar is not None:
        raise ApiError(400, "'response_format' (or 'grammar') cannot be combined with a 'tool_choice' that forces a "
                       "call: the call's own grammar applies", param="tool_choice")
    return Request("chat", cfg, messages=messages, logprobs=wanted, n_top=n_top, **common, **tools)


# ----------------------------------------------------------- completions
def parse_completion(body: Any, defaults: GenerateConfig) -> Request:
    """A ``POST /v1/completions`` body: one prompt (a string, or token ids)."""
    cfg, common = _common(body, defaults, ("max_tokens",))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ApiError(400, "'prompt' must be a string or an array of token ids (one prompt per request)",
                           param="prompt")
    elif not isinstance(prompt, str):
        raise ApiError(400, f"'prompt' must be a string or an array of token ids, got {_kind(prompt)}",
                       param="prompt")
    if isinstance(prompt, str) and not prompt:
        raise ApiError(400, "'prompt' is empty", param="prompt")
    n = _num(body, "logprobs", _LOGPROBS.lo, _LOGPROBS.hi, integer=True)
    cfg = _with_logprobs(cfg, n is not None, n or 0)
    return Request("completion", cfg, prompt=prompt, logprobs=n is not None, n_top=n or 0, **common)
