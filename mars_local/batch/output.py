"""Batch output: marked records, the scan and fix-up of an existing OUTPUT, the lock, the writer; see :mod:`mars_local.batch`."""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..chat.session import short_json as _show
from ..core.errors import MarsError
from ..core.interrupts import held
from .records import FORMAT, MARK, RECORD_PREFIX, id_key, is_int, valid_id

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no output lock (see OutputLock)
    fcntl = None

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
    if not (isinstance(obj, dict) and valid_id(obj.get("id")) and isinstance(obj.get("text"), str)):
        return None, None
    mark = obj.get(MARK)
    if is_int(mark) and mark == FORMAT:
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
        self.written = 0  # lines written whole (counted with Ctrl-C held off: what an interrupt reports)

    def write(self, line: str) -> None:
        data = memoryview((line + "\n").encode("utf-8"))
        with held():  # (Ctrl-C waits until the line is written whole and counted)
            start = os.lseek(self.fd, 0, os.SEEK_END) if self.regular else None
            try:
                while data:
                    data = data[os.write(self.fd, data):]
                if self.regular:
                    os.fsync(self.fd)
                self.written += 1
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
