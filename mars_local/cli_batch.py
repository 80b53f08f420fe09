"""`mars batch`: scripted generation over a JSONL file, resumable.

Input lines: ``{"id": ..., "prompt": "..."}`` or ``{"id": ..., "messages": [...]}``
(rendered with the model's chat template), optionally with per-line settings
(any of ``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``min_p``,
``seed``, ``verify``, ``theta``, ``draft_max``, ``max_relaxed``).
Output lines: ``{"id", "text", "stats"}``, one complete line written and
flushed per record, so a crash or Ctrl-C loses at most the record in flight.
Rerunning skips ids already in the output; a torn last line (a kill in the
middle of a write) is cut off first.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Optional

import typer
from typer import echo

from . import cli_common as opt
from .cli import app
from .errors import MarsError

LINE_SETTINGS = {
    "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "verify", "theta", "draft_max", "max_relaxed",
}
SAMPLING_KEYS = {"temperature", "top_k", "top_p", "min_p", "seed"}


@dataclass
class Record:
    line_no: int
    id: object
    prompt: Optional[str]
    messages: Optional[list]
    settings: dict


def parse_line(line: str, line_no: int) -> Record:
    """One input line; MarsError with the line number when it is malformed."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise MarsError(f"line {line_no}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise MarsError(f"line {line_no}: expected a JSON object")
    if "id" not in obj or isinstance(obj["id"], (dict, list)) or obj["id"] is None:
        raise MarsError(f"line {line_no}: needs an 'id' (string or number)")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise MarsError(f"line {line_no}: needs exactly one of 'prompt' or 'messages'")
    if has_prompt and (not isinstance(obj["prompt"], str) or not obj["prompt"].strip()):
        raise MarsError(f"line {line_no}: 'prompt' must be a non-empty string")
    if has_messages:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
        ):
            raise MarsError(f"line {line_no}: 'messages' must be a list of {{role, content}} strings")
    extra = set(obj) - {"id", "prompt", "messages"} - LINE_SETTINGS
    if extra:
        raise MarsError(f"line {line_no}: unknown field(s) {', '.join(sorted(extra))}")
    settings = {k: obj[k] for k in LINE_SETTINGS if k in obj}
    return Record(line_no, obj["id"], obj.get("prompt"), obj.get("messages"), settings)


def read_records(lines, strict: bool) -> Iterator[Record]:
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield parse_line(line, i)
        except MarsError as exc:
            if strict:
                raise
            echo(f"warning: skipped {exc}", err=True)


def done_ids(path: Path) -> set:
    """Ids already in OUTPUT; cuts a torn (unterminated or unparsable) last line."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    ids = set()
    good_end = 0
    pos = 0
    for raw in data.splitlines(keepends=True):
        end = pos + len(raw)
        try:
            obj = json.loads(raw)
            complete = raw.endswith(b"\n") and isinstance(obj, dict) and "id" in obj
        except (json.JSONDecodeError, UnicodeDecodeError):
            complete = False
        if complete:
            ids.add(json.dumps(obj["id"]))
            good_end = end
        elif end == len(data):  # only the last line can be torn
            break
        else:
            raise MarsError(f"{path}: line {len(ids) + 1} is not a complete JSON record; fix or remove the file")
        pos = end
    if good_end < len(data):
        with path.open("r+b") as fh:
            fh.truncate(good_end)
        echo(f"note: removed an incomplete last line from {path}", err=True)
    return ids


def _config_for(base, settings: dict, line_no: int):
    if not settings:
        return base
    try:
        s_kw = {k: v for k, v in settings.items() if k in SAMPLING_KEYS}
        g_kw = {k: v for k, v in settings.items() if k not in SAMPLING_KEYS}
        return replace(base, sampling=replace(base.sampling, **s_kw), **g_kw)
    except (MarsError, TypeError) as exc:
        raise MarsError(f"line {line_no}: {exc}") from None


@app.command()
@opt.generation_options
def batch(
    input: str = typer.Argument(..., help="Input JSONL ('-' for standard input)."),
    output: str = typer.Option(..., "-o", "--output", help="Output JSONL ('-' for standard output)."),
    strict: bool = typer.Option(False, "--strict", help="Stop at the first malformed input line."),
    n_predict: int = opt.N_PREDICT,
    gen: opt.GenOptions = None,
) -> None:
    """Generate for every line of INPUT, appending {id, text, stats} lines to OUTPUT."""
    choice = gen.choice()
    base = gen.config(choice, n_predict)
    if input == "-":
        lines = sys.stdin.read().splitlines()
    else:
        try:
            lines = Path(input).read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            raise MarsError(f"input file not found: {input}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise MarsError(f"cannot read {input}: {exc}") from None
    records = list(read_records(lines, strict))
    to_stdout = output == "-"
    seen = set() if to_stdout else done_ids(Path(output))
    todo = [r for r in records if json.dumps(r.id) not in seen]
    dup = len(todo) - len({json.dumps(r.id) for r in todo})
    if dup:
        raise MarsError(f"{dup} duplicate id(s) in {input}; ids must be unique")
    if not todo:
        echo(f"nothing to do: all {len(records)} record(s) are already in {output}", err=True)
        return
    eng = gen.engine(choice)
    out = sys.stdout if to_stdout else open(output, "a", encoding="utf-8")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    tokens = 0
    elapsed = 0.0
    accepted = drafted = 0
    try:
        with Progress(
            TextColumn("[bold]batch"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(), transient=False, disable=to_stdout and not sys.stderr.isatty(),
        ) as progress:
            task = progress.add_task("batch", total=len(todo), rate="")
            for rec in todo:
                try:
                    cfg = _config_for(base, rec.settings, rec.line_no)
                    prompt = eng.chat_prompt(rec.messages) if rec.messages is not None else rec.prompt
                    gen = eng.generate(prompt, cfg)
                except MarsError as exc:
                    if strict:
                        raise MarsError(f"line {rec.line_no}: {exc}") from None
                    echo(f"warning: skipped line {rec.line_no}: {exc}", err=True)
                    progress.advance(task)
                    continue
                line = json.dumps({"id": rec.id, "text": gen.text, "stats": gen.stats.to_dict()}, ensure_ascii=False)
                out.write(line + "\n")  # one complete line per record
                out.flush()
                if not to_stdout:
                    os.fsync(out.fileno())
                s = gen.stats
                tokens += s.n_generated
                elapsed += s.time_total_s
                accepted += s.n_accepted
                drafted += s.n_drafted
                acc = f", acceptance {accepted / drafted:.0%}" if drafted else ""
                progress.update(task, advance=1, rate=f"{tokens / max(elapsed, 1e-9):.1f} tok/s{acc}")
    finally:
        if not to_stdout:
            out.close()
        eng.close()
