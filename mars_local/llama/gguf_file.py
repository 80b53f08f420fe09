"""Checks of a model file before llama.cpp opens it (pure Python, no llama.cpp).

:func:`check_gguf_file` refuses, with one MarsError line, a path that does not
exist, is not a file, cannot be read or is not GGUF, and a file that ends
before the tensor data its header declares (a truncated download), judged from
the header alone (memory-mapped: only the header's pages are read).
"""

from __future__ import annotations

import errno
import mmap
import stat
import struct
from contextlib import contextmanager
from pathlib import Path

from ..core.errors import MarsError

__all__ = ["check_gguf_file", "gguf_metadata"]


def check_gguf_file(path: Path) -> None:
    """A MarsError naming what is wrong with ``path``, unless llama.cpp may try it."""
    if not path.exists():
        raise MarsError(f"model file not found: {path}")
    if not path.is_file():
        raise MarsError(f"model path is not a file: {path}")
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise MarsError(f"cannot read model file {path}: {exc.strerror}") from None
    if magic != b"GGUF":
        raise MarsError(f"not a GGUF model file: {path}")
    _check_gguf_extent(path)


# ggml type -> (elements per block, bytes per block), from ggml.c's type traits
_GGML_BLOCKS = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
    16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
    23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2),
    34: (256, 54), 35: (256, 66), 39: (32, 17),
}
# GGUF metadata value types -> fixed size in bytes (8: string, 9: array)
_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_INTS = frozenset({0, 1, 2, 3, 4, 5, 10, 11})  # the integer types


class _Short(Exception):
    pass


class _Reader:
    """Little-endian reads from a buffer of ``size`` bytes; _Short past its end."""

    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos = buf, size, 4  # after the magic

    def take(self, fmt: str):
        n = struct.calcsize(fmt)
        if self.pos + n > self.size:
            raise _Short
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v[0] if len(v) == 1 else v

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Short
        self.pos += n

    def string(self) -> bytes:
        n = self.take("<Q")
        start = self.pos
        self.skip(n)
        return bytes(self.buf[start:self.pos])


@contextmanager
def _header(path: Path):
    """``path``'s header memory-mapped (only its pages are read): (a reader past the counts,
    n_tensors, n_kv), or None for a GGUF version this parser does not know.  Raises _Short when
    the file ends inside the header, OSError when it cannot be read."""
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):  # (opening a FIFO would wait for a writer forever)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    size = st.st_size
    with path.open("rb") as fh:
        if size < 24:
            raise _Short
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        r = _Reader(buf, size)
        if r.take("<I") not in (2, 3):
            yield None
        else:
            n_tensors, n_kv = r.take("<QQ")
            yield r, n_tensors, n_kv
    finally:
        buf.close()


def _gguf_tensor_extent(path: Path) -> tuple[int, int] | None:
    """(bytes the header says the file holds, bytes it has), from the header
    alone (memory-mapped: only the header's pages are read).  None when the
    header uses something this parser does not know (then llama.cpp decides).
    Raises _Short when the file ends inside the header."""
    with _header(path) as h:
        if h is None:
            return None
        r, n_tensors, n_kv = h
        if n_tensors > 1 << 20 or n_kv > 1 << 20:
            return None  # not a header this check can judge cheaply
        alignment = _read_metadata(r, n_kv)
        end = _read_tensor_infos(r, n_tensors) if alignment is not None else None
        if end is None:
            return None
        data_start = -(-r.pos // alignment) * alignment
        return data_start + end, r.size


def gguf_metadata(path: Path, tensors: bool = False) -> dict:
    """The integer and string values of a GGUF file's metadata (integer arrays of up to 64 values
    as tuples, other arrays left out), from its header alone, before llama.cpp loads it (e.g.
    ``general.architecture``, ``<arch>.nextn_predict_layers``, ``eagle3.target_layers``); {} when
    the header is one this parser cannot read.  ``tensors``: also the tensors' names, as the
    set under the key ``"tensors"``."""
    values: dict = {}
    try:
        with _header(Path(path)) as h:
            if h is not None and h[1] <= 1 << 20 and h[2] <= 1 << 20:
                names: list[str] = []
                if _read_metadata(h[0], h[2], values) is not None and tensors:
                    _read_tensor_infos(h[0], h[1], names)
                    values["tensors"] = set(names)
    except (OSError, ValueError, _Short, struct.error):
        pass
    return values


def _read_metadata(r: _Reader, n_kv: int, values: dict | None = None) -> int | None:
    """Past the ``n_kv`` key/value pairs; the data alignment they give (None: a type this parser
    does not know, or an array too long to judge cheaply).  ``values``: filled with the scalar
    and string values by key."""
    alignment = 32
    for _ in range(n_kv):
        key = r.string()
        vtype = r.take("<I")
        if vtype == 8:
            val = r.string()
        elif vtype == 9:
            atype, n = r.take("<IQ")
            if n > 1 << 26:
                return None
            if values is not None and atype in _GGUF_INTS and n <= 64:  # a short integer array
                fmt = "<" + {1: "b", 2: "h", 4: "i", 8: "q"}[_GGUF_SCALAR[atype]]
                if atype in (0, 2, 4, 10):
                    fmt = fmt.upper()
                values[key.decode("utf-8", "replace")] = tuple(r.take(fmt) for _ in range(n))
                continue
            if atype == 8:
                for _ in range(n):
                    r.skip(r.take("<Q"))
            elif atype in _GGUF_SCALAR:
                r.skip(_GGUF_SCALAR[atype] * n)
            else:
                return None
            continue
        elif vtype in _GGUF_SCALAR:
            val = r.take("<" + {1: "B", 2: "H", 4: "I", 8: "Q"}[_GGUF_SCALAR[vtype]])
        else:
            return None
        if values is not None:
            text = key.decode("utf-8", "replace")
            if vtype == 8:
                values[text] = val.decode("utf-8", "replace")
            elif vtype in (0, 1, 2, 3, 4, 5, 10, 11):  # integers (floats and bools left as raw bits: not needed)
                values[text] = val
        if key == b"general.alignment" and vtype == 4 and val > 0:
            alignment = val
    return alignment


def _read_tensor_infos(r: _Reader, n_tensors: int, names: list | None = None) -> int | None:
    """Past the ``n_tensors`` tensor infos; the end of their data, from the data section's start
    (None: a tensor type or shape this parser does not know).  ``names``: filled with the
    tensors' names."""
    end = 0
    for _ in range(n_tensors):
        name = r.string()
        if names is not None:
            names.append(name.decode("utf-8", "replace"))
        n_dims = r.take("<I")
        if n_dims > 8:
            return None
        dims = [r.take("<Q") for _ in range(n_dims)]
        ttype, offset = r.take("<IQ")
        if ttype not in _GGML_BLOCKS:
            return None
        block, nbytes = _GGML_BLOCKS[ttype]
        n_el = 1
        for d in dims:
            n_el *= d
        end = max(end, offset + n_el // block * nbytes)
    return end


def _check_gguf_extent(path: Path) -> None:
    try:
        extent = _gguf_tensor_extent(path)
    except _Short:
        raise MarsError(
            f"cannot load {path}: the file is truncated or corrupt: it ends inside its GGUF header "
            f"(the file has {path.stat().st_size:,} bytes)"
        ) from None
    except Exception:  # noqa: BLE001 - a header this parser cannot read: llama.cpp gives its own reason
        return
    if extent is not None and extent[0] > extent[1]:
        raise MarsError(
            f"cannot load {path}: the file is truncated or corrupt: the header declares tensor data up to "
            f"byte {extent[0]:,}, the file has {extent[1]:,} bytes"
        )
