"""`mars batch`: scripted generation over a JSONL file, resumable.

The records, their validation, the output's safety rules and the runner are
in :mod:`mars_local.batch` (its docstring states the policies); this module
parses flags, renders progress and warnings, and writes the output lines.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import typer
from typer import echo

from .. import batch as B
from . import flags as opt
from ..core.defaults import DEFAULTS
from ..core.errors import MarsError

EPILOG = (
    "Exit status: 0 when every record is in OUTPUT (also when there was nothing left to do); "
    "2 on an error (one line on stderr); 3 when records were skipped (each is named on stderr, the rest "
    "was generated); 130 on Ctrl-C (the records written so far stay: rerun to resume). Duplicate ids are "
    "refused before anything is generated."
)


PARALLEL = typer.Option(
    DEFAULTS.parallel, "--parallel", "-np", metavar="N",
    help="Records decoded together, one batch per round (0 = auto: 8, fewer when memory is short; "
         "1 = one at a time, in input order). With N > 1 records are written as they finish.",
)


@opt.generation_options
def batch(
    input: str = typer.Argument(..., help="Input JSONL ('-' for standard input)."),
    output: str = typer.Option(
        ..., "-o", "--output",
        help="Output JSONL ('-' for standard output). An existing file is resumed only if it is "
        "mars batch output (records marked \"mars_batch\": 1); anything else is refused and left as it is. "
        "One run at a time per output file: a second one is refused (the file is locked).",
    ),
    strict: bool = typer.Option(False, "--strict", help="Stop at the first malformed or unusable record (exit 2)."),
    parallel: int = PARALLEL,
    n_predict: int = opt.N_PREDICT,
    gen: opt.GenOptions = None,
) -> None:
    """Generate for every line of INPUT, appending {mars_batch, id, text, stats} lines to OUTPUT.

    The flags are every record's defaults; a record may set max_tokens, temperature,
    top_k, top_p, min_p, seed, verify, theta, draft_max, max_relaxed, stop,
    ignore_eos, repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty,
    grammar (GBNF text), json_schema, format ("json") and logprobs (0..20; the
    output record then has "logprobs").

    Rerunning with the same OUTPUT resumes: ids already there are skipped. Every
    id must be unique: a duplicate id is refused before anything is generated.
    Ids are strings or whole numbers; 7, 7.0 and "7" are the same id.
    With --parallel N, N records are generated together and each is written the
    moment it finishes (resuming works the same; strict greedy output is the same).
    A record with a bad field is skipped with a warning naming the line and the
    field, and the exit status is then 3 (--strict: an error instead).
    """
    opt.check_flag("max_tokens", n_predict)
    opt.check_flag("parallel", parallel, parallel=PARALLEL)
    choice = gen.choice()
    base = gen.config(choice, n_predict)
    name, lines = B.read_input(input)
    lock = None
    if output != "-":
        B.check_output_path(output, input)
        lock = B.OutputLock.acquire(output)  # one run per output file, from here to the end
    try:
        _batch(output, lock, name, lines, base, gen, choice, strict, parallel)
    finally:
        if lock is not None:
            lock.release()


def _to_stdout(line: str) -> None:
    try:
        sys.stdout.write(line + "\n")  # one complete line per record
        sys.stdout.flush()
    except BrokenPipeError:  # a reader that stopped reading: the command ends quietly
        raise
    except OSError as exc:
        raise B.output_error("write", "standard output", exc) from None


@dataclass
class _Tally:
    """What the run has done so far (records skipped and written, tokens, acceptance)."""

    skipped: int = 0
    written: int = 0
    writer: object = None  # the RecordWriter: its count is exact even when Ctrl-C lands mid-record

    @property
    def n_written(self) -> int:
        return self.writer.written if self.writer is not None else self.written
    tokens: int = 0
    accepted: int = 0
    drafted: int = 0
    t_start: float = 0.0  # when generating began (records may run side by side: the rate is over wall time)

    def add(self, s) -> str:
        """Count a written record's stats; the progress line's rate."""
        self.written += 1
        self.tokens += s.n_generated
        self.elapsed = time.monotonic() - self.t_start
        self.accepted += s.n_accepted
        self.drafted += s.n_drafted
        acc = f", acceptance {self.accepted / self.drafted:.0%}" if self.drafted else ""
        return f"{self.tokens / max(self.elapsed, 1e-9):.1f} tok/s{acc}"


def _batch(output: str, lock, name: str, lines: list, base, gen, choice, strict: bool, parallel: int = 1) -> None:
    """The run after the input is read and OUTPUT locked (``lock`` None: standard output)."""
    to_stdout = lock is None
    if lock is not None and lock.note:
        echo(f"warning: {lock.note}", err=True)
    state = B.OutputState(Path(output)) if to_stdout else B.scan_output(Path(output))
    if state.duplicates:
        echo(f"warning: {state.duplicates_warning()}", err=True)
    records, problems = B.read_records(lines, base, gen.ctx_size, name)
    if problems and strict:
        raise MarsError(problems[0][1])
    for _, msg in problems:
        echo(f"warning: skipped {msg}", err=True)
    tally = _Tally(skipped=len(problems))
    todo = B.pending(records, state.ids)
    if not records:
        echo(f"no usable record in {name}", err=True)
        _finish(tally, output, to_stdout)
    if not todo:
        echo(f"nothing to do: all {len(records)} record(s) are already in {output}", err=True)
        _finish(tally, output, to_stdout)
        return
    try:
        _generate(output, lock, todo, state, gen, choice, strict, tally, parallel)
    except KeyboardInterrupt:
        if to_stdout:
            msg = f"interrupted: {tally.n_written}/{len(todo)} records written to standard output"
        else:
            done = len(records) - len(todo) + tally.n_written
            msg = f"interrupted: {done}/{len(records)} records written to {output}; rerun the same command to resume"
        echo(msg, err=True)
        raise typer.Exit(130) from None
    _finish(tally, output, to_stdout)


def _finish(tally: _Tally, output: str, to_stdout: bool) -> None:
    """Exit 3 (EXIT_SKIPPED) with a summary line when records were skipped."""
    if tally.skipped:
        where = "" if to_stdout else f" to {output}"
        echo(f"warning: {tally.skipped} record(s) skipped (see above); {tally.written} written{where}", err=True)
        raise typer.Exit(B.EXIT_SKIPPED)


def _generate(output: str, lock, todo: list, state, gen, choice, strict: bool, tally: _Tally,
              parallel: int = 1) -> None:
    """Open the engine and write each pending record's line as it is generated, with a progress bar."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    eng = gen.engine(choice)
    from ..speculate.batch_cost import resolve_parallel

    parallel = min(resolve_parallel(eng, parallel), len(todo))
    tally.t_start = time.monotonic()
    writer = None
    try:
        if lock is not None:
            state = B.scan_output(Path(output))  # again: the model load took a while
            note = state.apply()
            if note:
                echo(f"note: {note}", err=True)
            writer = tally.writer = B.RecordWriter(lock)
        console = Console(stderr=True)  # standard output is for the records (-o -) or a pipe
        with Progress(
            TextColumn("[bold]batch"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(), console=console, transient=False, disable=not console.is_terminal,
        ) as progress:
            task = progress.add_task("batch", total=len(todo), rate="")
            for res in B.run_batch(eng, todo, state.ids, parallel):
                if res.error is not None:
                    if strict:
                        raise MarsError(f"line {res.record.line_no}: {res.error}")
                    echo(f"warning: skipped line {res.record.line_no}: {res.error}", err=True)
                    tally.skipped += 1
                if res.line is None:
                    progress.advance(task)
                    continue
                if writer is None:
                    _to_stdout(res.line)
                else:
                    writer.write(res.line)  # whole, flushed and synced, or an error naming OUTPUT
                progress.update(task, advance=1, rate=tally.add(res.stats))
    finally:
        if writer is not None:
            writer.close()
        eng.close()
