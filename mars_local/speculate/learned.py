"""What the adaptive controller learned, kept between processes.

Every ``mars run`` is a new process, and a controller that starts from priors
spends its first rounds finding out what a verify window costs and how often
drafts are accepted: on a short answer that start-up is most of the answer.
This store keeps the controller's state in the user's cache, keyed by what it
depends on, so the next process starts informed:

* window costs (seconds per verify forward of w rows): the target file,
  the llama.cpp build, the thread count and the GPU layers;
* draft cost (seconds per drafted token): the draft and target files (they
  share caches and memory bandwidth), build, threads, layers;
* acceptance (decayed counts per key): target, drafter and verification regime.

A file is identified by its resolved path, size and modification time, so a
re-downloaded or requantized model starts afresh.  The store is one small JSON
file (``$MARS_STATE_DIR`` or ``$XDG_CACHE_HOME/mars-local``, default
``~/.cache/mars-local``), written atomically; a damaged file is ignored (and
replaced on the next save).  ``mars doctor`` lists it, ``mars doctor
--reset-learned`` deletes it.  Pure Python: no llama.cpp needed.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from ..core.errors import MarsError

__all__ = ["LearnedStore", "default_store", "file_fingerprint", "state_dir"]

VERSION = 1
MAX_ENTRIES = 200


def state_dir() -> Path:
    env = os.environ.get("MARS_STATE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mars-local"


def file_fingerprint(path: str | os.PathLike) -> str:
    """name + a hash of (resolved path, size, mtime): changes when the file does."""
    p = Path(path).expanduser().resolve()
    try:
        st = p.stat()
        ident = f"{p}|{st.st_size}|{st.st_mtime_ns}"
    except OSError:
        ident = str(p)
    return f"{p.name}@{hashlib.sha1(ident.encode()).hexdigest()[:12]}"


class LearnedStore:
    """A JSON file of named entries (each a small dict), read once and saved atomically."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else state_dir() / "learned.json"
        self._data: dict | None = None
        self.problem: str | None = None  # why an existing file was ignored

    def _load(self) -> dict:
        if self._data is None:
            self._data = {}
            try:
                raw = json.loads(self.path.read_text(encoding="utf-8"))
                if isinstance(raw, dict) and raw.get("version") == VERSION and isinstance(raw.get("entries"), dict):
                    self._data = raw["entries"]
                else:
                    self.problem = "unknown format (ignored)"
            except FileNotFoundError:
                pass
            except (OSError, ValueError) as exc:
                self.problem = f"unreadable ({exc.__class__.__name__}; ignored)"
        return self._data

    def get(self, key: str) -> dict | None:
        v = self._load().get(key)
        return v if isinstance(v, dict) else None

    def put(self, key: str, value: dict) -> None:
        data = self._load()
        data.pop(key, None)  # most recently used last: what `save` keeps when it trims
        data[key] = value

    def entries(self) -> dict[str, dict]:
        return dict(self._load())

    def save(self) -> bool:
        """Write the file atomically; False (and nothing changed) if that is not possible."""
        entries = self._load()
        if len(entries) > MAX_ENTRIES:  # forget the least recently used (old builds, old models)
            for k in list(entries)[: len(entries) - MAX_ENTRIES]:
                del entries[k]
        data = {"version": VERSION, "entries": entries}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".learned-", suffix=".tmp", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    json.dump(data, fh, separators=(",", ":"))
                os.replace(tmp, self.path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except OSError:
            return False
        return True

    def clear(self) -> int:
        """Forget everything; returns how many entries there were."""
        n = len(self._load())
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise MarsError(f"cannot delete {self.path}: {exc.strerror or exc}") from None
        self._data = {}
        return n


_default: LearnedStore | None = None


def default_store() -> LearnedStore:
    """The process-wide store at the default location (re-read if $MARS_STATE_DIR changes)."""
    global _default
    path = state_dir() / "learned.json"
    if _default is None or _default.path != path:
        _default = LearnedStore(path)
    return _default
