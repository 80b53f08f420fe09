"""Running a batch: one record at a time, or many together (``parallel``); see :mod:`mars_local.batch`."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Optional

from ..core.errors import MarsError
from .records import FORMAT, MARK, Record, id_key

# ----------------------------------------------------------------- running
def pending(records: Iterable[Record], ids: set) -> list[Record]:
    """The records whose id is not among ``ids`` (those already in OUTPUT)."""
    return [r for r in records if id_key(r.id) not in ids]


@dataclass(frozen=True)
class Outcome:
    """One record's result: ``line`` (the JSONL line to write, without its
    newline) and ``stats``, or ``error`` (the record was skipped), or neither
    (its id is already in OUTPUT)."""

    record: Record
    line: Optional[str] = None
    stats: object = None
    error: Optional[str] = None


def output_line(rec: Record, generation, piece=None, tool_format: str | None = None) -> str:
    """A record's output line: ``{"mars_batch": 1, "id", "text", "stats"}`` (it starts with
    RECORD_PREFIX; the id as the input wrote it), with ``"logprobs"`` when the record asked
    for them (``piece(token) -> str`` names each token's text), and with ``"content"`` and
    ``"tool_calls"`` (OpenAI's shape) when the record had tools (``tool_format``: the chat
    template's call syntax)."""
    obj = {MARK: FORMAT, "id": rec.id, "text": generation.text, "stats": generation.stats.to_dict()}
    if tool_format is not None:
        from ..chat.tools import openai_calls, parse_tool_calls, was_cut

        content, calls = parse_tool_calls(tool_format, generation.text, cut=was_cut(generation.stats.stop_reason))
        obj["content"] = content or None
        obj["tool_calls"] = openai_calls(calls)
    lps = getattr(generation, "logprobs", None)
    if lps is not None:
        obj["logprobs"] = [lp.to_dict(piece) for lp in lps]
    return json.dumps(obj, ensure_ascii=False)


def token_text(engine):
    """``piece(token) -> str`` of an engine: the token's text (bytes that are not UTF-8 replaced)."""
    return lambda t: engine.piece(t).decode("utf-8", "replace")


def prepare(engine, rec: Record):
    """A record's (prompt, config, tool-call syntax or None): messages through the chat template
    (with the record's tools, a forced call adding its grammar: chat.tools), or the prompt."""
    if rec.messages is None:
        return rec.prompt, rec.config, None
    if not rec.tools:
        return engine.chat_prompt(rec.messages), rec.config, None
    return engine.tool_prompt(rec.messages, rec.tools, rec.tool_choice, rec.config)


def run_batch(engine, records: Iterable[Record], done: Iterable = (), parallel: int = 1) -> Iterator[Outcome]:
    """Generate every record (messages through the chat template), one Outcome each, in
    the order they finish; an id in ``done`` (written since the records were planned) is
    passed over, and a record the engine refuses (MarsError) is an Outcome with ``error``,
    not an exception.  ``parallel`` > 1 decodes that many records together
    (:class:`~mars_local.speculate.batched.Scheduler`): outcomes then come as records
    finish, not in input order."""
    if parallel > 1:
        yield from _run_parallel(engine, records, done, parallel)
        return
    for rec in records:
        if id_key(rec.id) in done:
            yield Outcome(rec)
            continue
        try:
            prompt, config, fmt = prepare(engine, rec)
            result = engine.generate(prompt, config)
        except MarsError as exc:
            yield Outcome(rec, error=str(exc))
            continue
        yield Outcome(rec, output_line(rec, result, token_text(engine), fmt), result.stats)


def _run_parallel(engine, records: Iterable[Record], done: Iterable, parallel: int) -> Iterator[Outcome]:
    from ..speculate.batched import Scheduler

    sched = Scheduler(engine, parallel)
    try:  # (once per machine and models: the calibration a first round would make, the wide-chunk
        sched.warm_up()  # probe that lets records keep a long shared prefix; a failure: the rounds do it)
    except MarsError:
        pass
    live: list = []  # (record, its BatchStream), at most 2 x parallel planned ahead
    todo = iter(records)
    try:
        while True:
            while len(live) < 2 * parallel and (rec := next(todo, None)) is not None:
                if id_key(rec.id) in done:
                    yield Outcome(rec)
                    continue
                try:
                    prompt, config, fmt = prepare(engine, rec)
                    live.append((rec, sched.submit(prompt, config), fmt))
                except MarsError as exc:
                    yield Outcome(rec, error=str(exc))
            if not live:
                return
            sched.step()
            for item in [x for x in live if x[1].finished]:
                live.remove(item)
                rec, stream, fmt = item
                try:
                    result = stream.result()
                except MarsError as exc:
                    yield Outcome(rec, error=str(exc))
                    continue
                yield Outcome(rec, output_line(rec, result, token_text(engine), fmt), result.stats)
    finally:
        sched.close()
