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
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import os
import signal
import stat
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from ..chat.session import check_messages, short_json as _show
from ..core.choices import VERIFY_METHODS
from ..core.errors import MarsError
from ..core.textfile import MAX_BATCH_BYTES, decode_text, read_bytes, read_stream
from ..core.sampling import SamplingParams

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no output lock (see OutputLock)
    fcntl = None

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


# ----------------------------------------------------------------- input
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _valid_id(v) -> bool:
    """A string or a whole number (an integral float such as 1.0 or 1e3 counts)."""
    return isinstance(v, str) or _is_int(v) or (_is_num(v) and float(v).is_integer())


def id_key(v) -> str:
    """The key that says which ids are the same (see the module's docstring):
    a string as it is, a number as its integer's decimal digits."""
    return v if isinstance(v, str) else str(v if _is_int(v) else int(v))


def _same_id_note(a, b) -> str:
    """Why two ids written differently are one id, or nothing when written alike."""
    return "" if json.dumps(a) == json.dumps(b) else f" ({_show(a)} and {_show(b)} are the same id)"


def _is_str(v) -> bool:
    return isinstance(v, str)


def _is_int_or_null(v) -> bool:
    return v is None or _is_int(v)


def _is_bool(v) -> bool:
    return isinstance(v, bool)


def _is_stop(v) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))


def _is_schema(v) -> bool:
    return isinstance(v, (dict, str))


# Each per-line setting: its JSON type and its allowed values in words.  The
# ranges themselves are GenerateConfig's (with SamplingParams and VerifyConfig).
SETTINGS = {
    "max_tokens": (_is_int, "a whole number from 1{top}, or -1 (until end of generation or a full context)"),
    "seed": (_is_int, "a whole number (negative = random)"),
    "temperature": (_is_num, "a finite number >= 0"),
    "top_k": (_is_int, "a whole number >= 0 (0 = off)"),
    "top_p": (_is_num, "a number in (0, 1] (1 = off)"),
    "min_p": (_is_num, "a number in [0, 1) (0 = off)"),
    "theta": (_is_num, "a number in (0, 1]"),
    "draft_max": (_is_int, "a whole number from 0 to {max_draft}"),
    "max_relaxed": (_is_int_or_null, "a whole number >= 0 or null (no cap)"),
    "verify": (_is_str, "{methods}"),
    "stop": (_is_stop, "a non-empty string or a list of non-empty strings"),
    "ignore_eos": (_is_bool, "true or false"),
    "repeat_penalty": (_is_num, "a number > 0 (1 = off)"),
    "repeat_last_n": (_is_int, "a whole number >= -1 (-1 = the whole context, 0 = off)"),
    "presence_penalty": (_is_num, "a finite number (0 = off)"),
    "frequency_penalty": (_is_num, "a finite number (0 = off)"),
    "grammar": (_is_str, "GBNF grammar text (a non-empty string)"),
    "json_schema": (_is_schema, "a JSON Schema (an object, or a string holding one)"),
    "format": (_is_str, '"json"'),
    "logprobs": (_is_int, "a whole number from 0 to 20 (0 = none)"),
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
    if not _valid_id(obj["id"]):
        raise MarsError(f"'id' must be a string or a whole number, got {_show(obj['id'])}")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise MarsError("needs exactly one of 'prompt' or 'messages'")
    if has_prompt and (not isinstance(obj["prompt"], str) or not obj["prompt"].strip()):
        raise MarsError(f"'prompt' must be a non-empty string, got {_show(obj['prompt'])}")
    if has_messages:
        check_messages(obj["messages"])
    extra = set(obj) - {"id", "prompt", "messages"} - LINE_SETTINGS
    if extra:
        raise MarsError(f"unknown field(s) {', '.join(sorted(extra))}")
    settings = {k: obj[k] for k in LINE_SETTINGS if k in obj}
    check_settings(settings, ctx_size)
    return Record(0, obj["id"], obj.get("prompt"), obj.get("messages"), settings)


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
        if isinstance(obj, dict) and _valid_id(obj.get("id")):
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


# ----------------------------------------------------------------- output
def output_error(verb: str, name, exc: OSError) -> MarsError:
    """An OS error on OUTPUT as one line naming it ("cannot write out.jsonl: No space left on device")."""
    return MarsError(f"cannot {verb} {name}: {exc.strerror or exc}")


@dataclass
class OutputState:
    """What an existing OUTPUT holds, and the one fix-up it may need."""

    path: Path
    ids: set = field(default_factory=set)  # id keys (see id_key)
    size: int = 0
    cut_to: Optional[int] = None  # a torn last line starts here
    add_newline: bool = False
    duplicates: list = field(default_factory=list)  # (the id as first written, its line numbers) of ids there twice+

    def duplicates_warning(self) -> Optional[str]:
        """A warning naming the ids OUTPUT holds more than once (an older version's two runs on one file), or None."""
        if not self.duplicates:
            return None
        shown = ", ".join(f"{_show(i)} (lines {', '.join(map(str, ns))})" for i, ns in self.duplicates[:5])
        more = f" and {len(self.duplicates) - 5} more" if len(self.duplicates) > 5 else ""
        return (f"{self.path} holds {len(self.duplicates)} id(s) more than once: {shown}{more}; the first record of "
                "each counts and none of them is generated again")

    def apply(self) -> Optional[str]:
        """Cut a torn last line, or end the last record's line; nothing else.
        Returns a note for the user when a line was cut."""
        if self.cut_to is None and not self.add_newline:
            return None
        try:
            with self.path.open("r+b") as fh:
                if fh.seek(0, os.SEEK_END) != self.size:
                    raise MarsError(f"{self.path} changed while mars batch was reading it; run again")
                if self.cut_to is not None:
                    fh.truncate(self.cut_to)
                else:
                    fh.write(b"\n")
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            raise output_error("write", self.path, exc) from None
        note = None
        if self.cut_to is not None:
            note = f"removed an incomplete last line (a record cut off mid-write) from {self.path}"
        self.size = self.cut_to if self.cut_to is not None else self.size + 1
        self.cut_to, self.add_newline = None, False
        return note


def _output_record(raw: bytes) -> tuple[Optional[str], object]:
    """What one line of an existing OUTPUT is: ("ours", id) for a record mars batch writes
    today, ("old", id) for one of the versions before the mark (no "mars_batch", with
    "stats"), (None, None) for anything else."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None, None
    if not (isinstance(obj, dict) and _valid_id(obj.get("id")) and isinstance(obj.get("text"), str)):
        return None, None
    mark = obj.get(MARK)
    if _is_int(mark) and mark == FORMAT:
        return "ours", obj["id"]
    if MARK not in obj and isinstance(obj.get("stats"), dict):
        return "old", obj["id"]
    return None, None


def scan_output(path: Path) -> OutputState:
    """Ids already in OUTPUT; MarsError (file untouched) unless every line is
    one of mars-local's records, bar a torn last line."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return OutputState(path)
    except OSError as exc:
        raise output_error("read", path, exc) from None
    if not stat.S_ISREG(st.st_mode):  # /dev/null, a pipe: nothing to resume, nothing to read
        return OutputState(path)
    try:
        data = path.read_bytes()
    except OSError as exc:  # e.g. /proc/self/mem: a "regular file" that cannot be read
        raise output_error("read", path, exc) from None
    state = OutputState(path, size=len(data))
    *lines, tail = data.split(b"\n")
    first: dict = {}  # id key -> (the id as written, line numbers)

    def refuse(n: int, kind: Optional[str]):
        if kind == "old":
            raise MarsError(
                f'{path} was written by an older mars-local (line {n} has no "mars_batch" mark) and is left as it '
                'is: rename or delete it to start over, or add "mars_batch": 1 to each record to resume it'
            )
        raise MarsError(
            f"{path}: line {n} is not a mars batch record; mars batch appends only to its own output (JSONL records "
            'marked "mars_batch") and leaves this file as it is: choose another -o'
        )

    def add(n: int, id_) -> None:
        key = id_key(id_)
        if key in first:
            first[key][1].append(n)
        else:
            first[key] = (id_, [n])
        state.ids.add(key)

    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        kind, id_ = _output_record(raw)
        if kind != "ours":
            refuse(n, kind)
        add(n, id_)
    if tail.strip():
        kind, id_ = _output_record(tail)
        if kind == "ours":  # a complete record without its newline: keep it
            add(len(lines) + 1, id_)
            state.add_newline = True
        elif tail.startswith(RECORD_PREFIX):  # a record cut off mid-write
            state.cut_to = len(data) - len(tail)
        else:
            refuse(len(lines) + 1, kind)
    state.duplicates = [(id_, ns) for id_, ns in first.values() if len(ns) > 1]
    return state


_APPEND = os.O_WRONLY | os.O_APPEND | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)


def _open_append(output: str) -> tuple[int, bool]:
    """(descriptor open for appending, whether this call created the file)."""
    try:
        try:
            return os.open(output, _APPEND), False
        except FileNotFoundError:
            pass
        try:
            return os.open(output, _APPEND | os.O_CREAT | os.O_EXCL, 0o666), True
        except FileExistsError:  # created meanwhile, or a symlink to a missing file
            return os.open(output, _APPEND | os.O_CREAT, 0o666), False
    except OSError as exc:
        raise output_error("write", output, exc) from None


def _lock_holder(st: os.stat_result) -> Optional[int]:
    """The PID holding a flock on the file ``st`` describes, from Linux's /proc/locks
    (lines like ``1: FLOCK  ADVISORY  WRITE 5650 fe:00:2146369 0 EOF``); None where
    the system does not say (other systems, a holder on another machine)."""
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as fh:
            rows = [line.split() for line in fh]
    except OSError:
        return None
    exact, same_inode = set(), set()
    for f in rows:
        if len(f) < 6 or f[1] != "FLOCK":  # "->" rows wait for a lock, they do not hold it
            continue
        try:
            pid = int(f[4])
            major, minor, ino = f[5].split(":")
            dev, ino = (int(major, 16), int(minor, 16)), int(ino)
        except ValueError:
            continue
        if ino == st.st_ino and pid > 0:
            (exact if dev == (os.major(st.st_dev), os.minor(st.st_dev)) else same_inode).add(pid)
    pids = exact or same_inode  # an overlay file system may show another device number
    return next(iter(pids)) if len(pids) == 1 else None


class OutputLock:
    """One run per OUTPUT: an exclusive advisory lock (``flock``) on the output file
    itself, so every name of the file (a path, a symlink, a hard link) shares it, and
    the kernel drops it when its holder exits or is killed (nothing stale is left).
    ``fd`` (open for appending) is where the records go.  Devices and pipes are not
    locked (``fd`` None: the writer opens them); without ``fcntl`` (Windows) nothing is
    locked.  ``note``: why a regular file could not be locked (the run goes on)."""

    def __init__(self, path: str, fd: Optional[int] = None, created: bool = False, note: Optional[str] = None):
        self.path, self.fd, self.created, self.note = path, fd, created, note

    @classmethod
    def acquire(cls, output: str) -> "OutputLock":
        """Lock OUTPUT (created when missing); MarsError naming the holder when another run has it."""
        try:
            st = os.stat(output)
        except FileNotFoundError:
            st = None
        except OSError as exc:
            raise output_error("write", output, exc) from None
        if st is not None and not stat.S_ISREG(st.st_mode):
            return cls(output)
        for _ in range(10):
            fd, created = _open_append(output)
            try:
                note = cls._lock(fd, output)
                try:  # the name may have been removed or replaced before the lock was ours
                    same = _same_file(os.stat(output), os.fstat(fd))
                except FileNotFoundError:
                    same = False
            except BaseException:
                os.close(fd)
                raise
            if same:
                return cls(output, fd, created, note)
            os.close(fd)
        raise MarsError(f"cannot lock {output}: it keeps being replaced")

    @staticmethod
    def _lock(fd: int, output: str) -> Optional[str]:
        if fcntl is None:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return f"cannot lock {output} ({exc.strerror or exc}): a second run on it would not be refused"
            pid = _lock_holder(os.fstat(fd))
            who = f"PID {pid}" if pid else "its PID is not known here: another machine, or no /proc/locks"
            raise MarsError(
                f"{output} is locked by another run writing it ({who}); wait for that run to end or choose another -o"
            ) from None
        return None

    def release(self) -> None:
        """Unlock; an output this run created and left empty is removed first (still locked)."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            if self.created and os.fstat(fd).st_size == 0 and _same_file(os.stat(self.path), os.fstat(fd)):
                os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(fd)


@contextlib.contextmanager
def _ctrl_c_deferred():
    """Ctrl-C (SIGINT) waits until the block has run, so a record is written whole."""
    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None:  # Windows; a torn line is cut on the next run anyway
        yield
        return
    old = mask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        mask(signal.SIG_SETMASK, old)  # a Ctrl-C meanwhile is raised now, between records


class RecordWriter:
    """Appends records to OUTPUT (the locked descriptor, or a device or pipe opened
    here): each line whole, then fsync'ed on a regular file.  An OS error is one
    MarsError naming OUTPUT, and a line the error cut short is cut off again."""

    def __init__(self, lock: OutputLock):
        self.name, self._own = lock.path, lock.fd is None
        try:
            self.fd = _open_append(lock.path)[0] if self._own else lock.fd
            self.regular = stat.S_ISREG(os.fstat(self.fd).st_mode)  # fsync fails on /dev/null, pipes
        except OSError as exc:
            raise output_error("write", lock.path, exc) from None

    def write(self, line: str) -> None:
        data = memoryview((line + "\n").encode("utf-8"))
        with _ctrl_c_deferred():
            start = os.lseek(self.fd, 0, os.SEEK_END) if self.regular else None
            try:
                while data:
                    data = data[os.write(self.fd, data):]
                if self.regular:
                    os.fsync(self.fd)
            except OSError as exc:
                if start is not None:
                    try:
                        os.ftruncate(self.fd, start)
                    except OSError:
                        pass
                raise output_error("write", self.name, exc) from None

    def close(self) -> None:
        if self._own:
            os.close(self.fd)


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def check_output_path(output: str, input: str) -> None:
    """Refuse an OUTPUT that cannot be written or that is the input, before any model loads."""
    p = Path(output)
    try:
        st = p.stat()
    except FileNotFoundError:
        st = None
    except OSError as exc:  # e.g. a path through a regular file
        if exc.errno == errno.ENOTDIR:
            parent = next((a for a in p.parents if a.is_file()), p.parent)
            raise MarsError(f"cannot write {output}: {parent} is not a directory") from None
        raise MarsError(f"cannot write {output}: {exc.strerror or exc}") from None
    if st is None:
        parent = p.parent
        if not parent.exists():
            raise MarsError(f"cannot write {output}: directory {parent} does not exist")
        if not parent.is_dir():
            raise MarsError(f"cannot write {output}: {parent} is not a directory")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise MarsError(f"cannot write {output}: directory {parent} is not writable")
        return
    if stat.S_ISDIR(st.st_mode):
        raise MarsError(f"output {output} is a directory; give a file name, e.g. {p / 'out.jsonl'}")
    if input == "-":
        try:
            same = _same_file(os.fstat(sys.stdin.fileno()), st) and stat.S_ISREG(st.st_mode)
        except (AttributeError, OSError, ValueError):  # no real stdin (a test runner, closed)
            same = False
        if same:
            raise MarsError(f"output {output} is the input (redirected to standard input); choose another -o")
    else:
        try:
            same = _same_file(os.stat(input), st)
        except OSError:
            same = False
        if same:
            raise MarsError(f"output {output} is the input file {input}; choose another -o")
    if not os.access(p, os.W_OK):
        raise MarsError(f"cannot write {output}: the file is not writable")


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


def output_line(rec: Record, generation, piece=None) -> str:
    """A record's output line: ``{"mars_batch": 1, "id", "text", "stats"}`` (it starts with
    RECORD_PREFIX; the id as the input wrote it), with ``"logprobs"`` when the record asked
    for them (``piece(token) -> str`` names each token's text)."""
    obj = {MARK: FORMAT, "id": rec.id, "text": generation.text, "stats": generation.stats.to_dict()}
    lps = getattr(generation, "logprobs", None)
    if lps is not None:
        obj["logprobs"] = [lp.to_dict(piece) for lp in lps]
    return json.dumps(obj, ensure_ascii=False)


def token_text(engine):
    """``piece(token) -> str`` of an engine: the token's text (bytes that are not UTF-8 replaced)."""
    return lambda t: engine.piece(t).decode("utf-8", "replace")


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
            prompt = engine.chat_prompt(rec.messages) if rec.messages is not None else rec.prompt
            result = engine.generate(prompt, rec.config)
        except MarsError as exc:
            yield Outcome(rec, error=str(exc))
            continue
        yield Outcome(rec, output_line(rec, result, token_text(engine)), result.stats)


def _run_parallel(engine, records: Iterable[Record], done: Iterable, parallel: int) -> Iterator[Outcome]:
    from ..speculate.batched import Scheduler

    sched = Scheduler(engine, parallel)
    live: list = []  # (record, its BatchStream), at most 2 x parallel planned ahead
    todo = iter(records)
    try:
        while True:
            while len(live) < 2 * parallel and (rec := next(todo, None)) is not None:
                if id_key(rec.id) in done:
                    yield Outcome(rec)
                    continue
                try:
                    prompt = engine.chat_prompt(rec.messages) if rec.messages is not None else rec.prompt
                    live.append((rec, sched.submit(prompt, rec.config)))
                except MarsError as exc:
                    yield Outcome(rec, error=str(exc))
            if not live:
                return
            sched.step()
            for item in [x for x in live if x[1].finished]:
                live.remove(item)
                rec, stream = item
                try:
                    result = stream.result()
                except MarsError as exc:
                    yield Outcome(rec, error=str(exc))
                    continue
                yield Outcome(rec, output_line(rec, result, token_text(engine)), result.stats)
    finally:
        sched.close()
