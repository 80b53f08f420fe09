"""Batch generation over JSONL records, resumable: record parsing and validation,
per-record settings merged over the command line's, output safety, the runner.

`mars batch` (:mod:`mars_local.cli.batch`) parses flags, renders progress and
writes the lines.

Input lines: ``{"id": ..., "prompt": "..."}`` or ``{"id": ..., "messages": [...]}``
(rendered with the model's chat template; roles system, user, assistant or
tool), optionally with per-line settings (any of ``max_tokens`` (-1: no
limit), ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``,
``verify``, ``theta``, ``draft_max``, ``max_relaxed``, and the output
controls ``stop`` (a string or a list), ``ignore_eos``, ``repeat_penalty``,
``repeat_last_n``, ``presence_penalty``, ``frequency_penalty``, at most one
of ``grammar`` (GBNF text), ``json_schema`` (an object or a string) and
``format`` ("json"), and ``logprobs`` (0..20)).  The input must be UTF-8 text
with at least one record; an empty or binary input is an error.
Output lines: ``{"mars_batch": 1, "id", "text", "stats"}`` (plus ``"logprobs"``
when a record asks for them; ``mars_batch`` marks the line as ours and names
the format version), one complete line written and flushed per record, so a
crash or Ctrl-C loses at most the record in flight.

Ids are strings or whole numbers, and one id has one key (:func:`id_key`): a
number with an integral value is that integer (``1``, ``1.0`` and ``1e0`` are
one id) and a number is the same id as the string of its digits (``7`` and
``"7"``; ``"07"`` is another id), since readers of JSON often mix them up.
Duplicates and resuming compare keys; an id is written as the input gave it.

Nothing that mars-local did not write is ever changed:

* an existing OUTPUT is resumed only if every line is one of its records (a
  JSON object with ``"mars_batch": 1``, an ``id`` and a string ``text``);
  anything else (notes, an input file, a model, a user's own ``{"id", "text"}``
  lines) is refused untouched.  Output of mars-local versions before the mark
  is refused too, saying how to go on (rename or delete it, or add the mark to
  each line).  Rerunning skips ids already in the output; an id that is there
  more than once (written by such an older version) is named in a warning, its
  first record counts and it is not generated again.  The only edits ever made
  to an existing output: a last record without its newline gets one, and a
  torn last line (a kill in the middle of a write: unterminated, unparsable,
  starting the way mars-local's records start) is cut off, with a note on
  stderr.  Any other bad line is refused.
* one run per OUTPUT: the run holds an exclusive advisory lock
  (``flock``) on the output file itself, from before the model loads to the
  end, so a second run on the same file (by any path, symlink or hard link)
  is refused, naming the holder's PID where the system tells it (Linux's
  /proc/locks).  The kernel drops the lock when its holder exits or is
  killed, so nothing stale is left to block a later run.  An output this run
  created and left empty is removed.  Where ``fcntl`` is missing (Windows)
  there is no lock.  Standard output, devices and pipes are not locked.
* an OS error on the output (a full disk, ``/dev/full``, ``/proc/self/mem``)
  is one line naming the output and the error (exit 2); a record whose write
  failed is cut off again where possible.
* OUTPUT naming the input (same path, ``./``, a symlink, a hard link, or the
  file redirected to standard input) is refused.
* the output path (missing directory, a directory, not writable) is checked
  before the model loads.

Policies:

* duplicate ids: the batch is refused before anything is generated, naming the
  id and both line numbers (a duplicate makes "which output is which"
  ambiguous, and a half-done batch would have to be untangled by hand).
* a record with a bad field (each field's type and range is checked before any
  generation, ``max_tokens`` against the context size) is skipped with one
  warning naming the line and the field; the rest is generated, then the
  number skipped is printed and the exit code is 3.  ``--strict`` makes the
  first bad record an error (exit 2) instead.

Exit codes: 0 every record is in OUTPUT (including "nothing to do"); 2 an
error, reported as one line; 3 records were skipped (the rest is done); 130
Ctrl-C (one line saying how many records are in OUTPUT; rerun to resume).

Modules: :mod:`.records` (reading and validating records, ids), :mod:`.output` (the lock,
the marks, resuming, writing), :mod:`.jobs` (the runner).  May import anything of
mars_local but :mod:`mars_local.cli`.
"""

from __future__ import annotations

from .jobs import Outcome, output_line, pending, run_batch, token_text
from .output import (OutputLock, OutputState, RecordWriter, check_output_path, output_error, scan_output)
from .records import EXIT_SKIPPED, Record, id_key, parse_line, read_input, read_records

__all__ = ["EXIT_SKIPPED", "Outcome", "OutputLock", "OutputState", "Record", "RecordWriter", "check_output_path",
           "id_key", "output_error", "output_line", "parse_line", "pending", "read_input", "read_records",
           "run_batch", "scan_output", "token_text"]
