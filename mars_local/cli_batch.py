"""`mars batch`: scripted generation over a JSONL file, resumable.

The records, their validation, the output's safety rules and the runner are
in :mod:`mars_local.batch` (its docstring states the policies); this module
parses flags, renders progress and warnings, and writes the output lines.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import typer
from typer import echo

from . import batch as B
from . import cli_common as opt
from .errors import MarsError

EPILOG = (
    "Exit status: 0 when every record is in OUTPUT (also when there was nothing left to do); "
    "2 on an error (one line on stderr); 3 when records were skipped (each is named on stderr, the rest "
    "was generated). Duplicate ids are refused before anything is generated."
)


@opt.generation_options
def batch(
    input: str = typer.Argument(..., help="Input JSONL ('-' for standard input)."),
    output: str = typer.Option(
        ..., "-o", "--output",
        help="Output JSONL ('-' for standard output). An existing file is resumed only if it is "
        "mars batch output; anything else is refused and left as it is.",
    ),
    strict: bool = typer.Option(False, "--strict", help="Stop at the first malformed or unusable record (exit 2)."),
    n_predict: int = opt.N_PREDICT,
    gen: opt.GenOptions = None,
) -> None:
    """Generate for every line of INPUT, appending {id, text, stats} lines to OUTPUT.

    The flags are every record's defaults; a record may set max_tokens, temperature,
    top_k, top_p, min_p, seed, verify, theta, draft_max, max_relaxed, stop,
    ignore_eos, repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty,
    grammar (GBNF text), json_schema, format ("json") and logprobs (0..20; the
    output record then has "logprobs").

    Rerunning with the same OUTPUT resumes: ids already there are skipped. Every
    id must be unique: a duplicate id is refused before anything is generated.
    A record with a bad field is skipped with a warning naming the line and the
    field, and the exit status is then 3 (--strict: an error instead).
    """
    opt.check_n_predict(n_predict)
    choice = gen.choice()
    base = gen.config(choice, n_predict)
    name, lines = B.read_input(input)
    to_stdout = output == "-"
    if not to_stdout:
        B.check_output_path(output, input)
    state = B.OutputState(Path(output)) if to_stdout else B.scan_output(Path(output))
    records, problems = B.read_records(lines, base, gen.ctx_size, name)
    if problems and strict:
        raise MarsError(problems[0][1])
    for _, msg in problems:
        echo(f"warning: skipped {msg}", err=True)
    skipped = len(problems)

    def finish(written: int) -> None:
        if skipped:
            where = "" if to_stdout else f" to {output}"
            echo(f"warning: {skipped} record(s) skipped (see above); {written} written{where}", err=True)
            raise typer.Exit(B.EXIT_SKIPPED)

    todo = B.pending(records, state.ids)
    if not records:
        echo(f"no usable record in {name}", err=True)
        finish(0)
    if not todo:
        echo(f"nothing to do: all {len(records)} record(s) are already in {output}", err=True)
        finish(0)
        return
    eng = gen.engine(choice)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    written = tokens = accepted = drafted = 0
    elapsed = 0.0
    out = None
    try:
        if to_stdout:
            out = sys.stdout
        else:
            state = B.scan_output(Path(output))  # again: the model load took a while
            note = state.apply()
            if note:
                echo(f"note: {note}", err=True)
            out = open(output, "a", encoding="utf-8")
        sync = not to_stdout and stat.S_ISREG(os.fstat(out.fileno()).st_mode)  # fsync fails on /dev/null, pipes
        with Progress(
            TextColumn("[bold]batch"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(), transient=False, disable=to_stdout and not sys.stderr.isatty(),
        ) as progress:
            task = progress.add_task("batch", total=len(todo), rate="")
            for res in B.run_batch(eng, todo, state.ids):
                if res.error is not None:
                    if strict:
                        raise MarsError(f"line {res.record.line_no}: {res.error}")
                    echo(f"warning: skipped line {res.record.line_no}: {res.error}", err=True)
                    skipped += 1
                if res.line is None:
                    progress.advance(task)
                    continue
                out.write(res.line + "\n")  # one complete line per record
                out.flush()
                if sync:
                    os.fsync(out.fileno())
                written += 1
                s = res.stats
                tokens += s.n_generated
                elapsed += s.time_total_s
                accepted += s.n_accepted
                drafted += s.n_drafted
                acc = f", acceptance {accepted / drafted:.0%}" if drafted else ""
                progress.update(task, advance=1, rate=f"{tokens / max(elapsed, 1e-9):.1f} tok/s{acc}")
    finally:
        if out is not None and not to_stdout:
            out.close()
        eng.close()
    finish(written)
