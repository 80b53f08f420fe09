"""A llama.cpp context over one :class:`~mars_local.llama.runtime.Model`: its size and memory
checks, its batch, the mirror of the tokens in its KV cache (so rollback and prefix reuse are
exact), and logits as zero-copy numpy views valid until the next decode."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..core.defaults import DEFAULTS, check
from ..core.errors import MarsError
from ..core.tokens import common_prefix_len
from . import abort
from .backend import C
from .backend import last_llama_error as _last_llama_error
from .backend import recent_log as _recent_log
from .recurrent import Rollback, drop_state, truncate_state
from .runtime import MAX_INVARIANT_ROWS, Model, default_threads

__all__ = ["Context", "OwnsContext", "context_params", "create_context", "kv_cache_bytes", "available_memory", "KV_TYPES",
           "MAX_INVARIANT_ROWS", "last_rides"]


# ----------------------------------------------------------------- context
KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}
_KV_BYTES = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32}


def last_rides(n_rest: int, n_batch: int, inv: int = MAX_INVARIANT_ROWS) -> bool:
    """Whether a prompt's last token may be evaluated in the decode of the prompt's last chunk
    (pure): ``n_rest`` tokens are evaluated in chunks of ``n_batch``, and the last chunk plus
    that token stay within ``inv`` rows, so every row is computed as a lone row would be and
    the chunk's other rows exactly as without it.  Then the first token is known at the end
    of prefill, for the price of one prefill row (no forward of its own)."""
    if n_rest <= 0:
        return False
    return last_chunk(n_rest, n_batch) + 1 <= min(inv, n_batch)  # (one decode: at most n_batch tokens)


def last_chunk(n_rest: int, n_batch: int) -> int:
    """The rows of the last of the chunks of ``n_batch`` that ``n_rest`` tokens are evaluated in (pure)."""
    return n_rest - n_batch * ((n_rest - 1) // n_batch)


def hidden_rows(ctx, n_embd: int):
    """Make llama_context ``ctx`` output the trunk's last hidden row of every batch row (in batch
    order; the llama-ext.h bindings of the pinned release); the function giving the last
    decode's n rows (an (n, n_embd) view, valid until the next decode)."""
    from llama_cpp import llama_cpp_ext

    llama_cpp_ext.llama_set_embeddings_nextn(ctx, True, False)  # every row, not only output rows
    get = llama_cpp_ext.llama_get_embeddings_nextn
    return lambda n: np.ctypeslib.as_array(get(ctx), shape=(n, n_embd))


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux: MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def kv_cache_bytes(model: Model, n_ctx: int, kv_type: str = "f16") -> int:
    """Estimated KV-cache size of a context: exact for standard attention, an
    upper bound for sliding-window models (llama.cpp pads n_ctx to 256)."""
    m = model._model
    n_layer = int(C.llama_model_n_layer(m))
    n_head = max(int(C.llama_model_n_head(m)), 1)
    n_head_kv = int(C.llama_model_n_head_kv(m))
    head_k = head_v = int(C.llama_model_n_embd(m)) // n_head
    arch = model.arch
    if arch:
        for key in ("key_length", "value_length"):
            val = model.meta(f"{arch}.attention.{key}")
            if val and val.isdigit():
                if key == "key_length":
                    head_k = int(val)
                else:
                    head_v = int(val)
    padded = -(-int(n_ctx) // 256) * 256
    return int(padded * n_layer * n_head_kv * (head_k + head_v) * _KV_BYTES.get(kv_type, 2.0))


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


@dataclass(frozen=True)
class _CtxInfo:
    requested: int  # the context size asked for (0 resolved to the training context)
    n_ctx: int
    n_batch: int
    n_threads: int
    kv_bytes: int


def context_params(model: Model, n_ctx, n_batch: int = DEFAULTS.n_batch, n_threads: int | None = None,
                   flash_attn: bool | None = None, kv_type: str = "f16"):
    """llama_context_params for ``model`` (checked: size, KV type, memory) and what they resolve to.

    Shared by :class:`Context` and :class:`~mars_local.llama.streams.MultiContext`
    (which sets n_seq_max and kv_unified on the result)."""
    if n_ctx is None:
        n_ctx = 0
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, (int, np.integer)):
        raise MarsError(f"the context size must be a whole number of tokens, got {n_ctx!r}")
    n_ctx = int(n_ctx)
    if n_ctx < 0:
        raise MarsError(
            f"the context size must be >= 0 (0: the model's training context, {model.n_ctx_train}), got {n_ctx}"
        )
    # 0 means the training context (llama.cpp's convention); a larger size
    # than the training context is allowed, as in llama.cpp (callers warn).
    requested = n_ctx if n_ctx > 0 else (model.n_ctx_train if model.n_ctx_train > 0 else DEFAULTS.n_ctx)
    check("n_ctx", requested)  # at most the table's limit (core.defaults)
    n_ctx = max(16, requested)
    if kv_type not in KV_TYPES:
        raise MarsError(f"KV cache type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
    kv_bytes = 0 if model.recurrent else kv_cache_bytes(model, n_ctx, kv_type)
    # On the CPU llama.cpp clears the whole cache when it allocates it, so a
    # cache larger than the free memory would swap or be OOM-killed: refuse
    # it first.  (A sliding-window model needs less than the estimate.)
    avail = None if model.offloaded or C.llama_model_n_swa(model._model) > 0 else available_memory()
    if avail is not None and kv_bytes > avail:
        raise MarsError(
            f"a context of {requested:,} tokens needs about {_gib(kv_bytes)} of KV cache, more than the "
            f"{_gib(avail)} of memory available; use a smaller -c"
        )
    n_batch = max(1, min(int(n_batch), n_ctx))
    threads = int(n_threads) if n_threads else default_threads()
    cp = C.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = n_batch
    cp.n_ubatch = n_batch
    cp.n_threads = threads
    cp.n_threads_batch = threads
    cp.no_perf = True
    if flash_attn is not None:
        cp.flash_attn_type = 1 if flash_attn else 0
    cp.type_k = cp.type_v = KV_TYPES[kv_type]
    if getattr(model, "cpu_exact_on_gpu_build", False):
        # an exact target kept on the CPU of a GPU build: llama.cpp offloads a forward of 32+ rows
        # of CPU-resident weights to the GPU, whose kernels differ from the CPU's single-row ones, so
        # windows of 32-64 rows (8 sequences of 4 rows) would not equal lone rows (measured on an
        # H200: 33-row windows differ, 17-row ones do not).  Prompts then stay on the CPU too.
        cp.op_offload = False
    if model.rollback_depth:  # recurrent states kept for a rollback of a draft (llama/recurrent.py)
        cp.n_rs_seq = model.rollback_depth
    return cp, _CtxInfo(requested, n_ctx, n_batch, threads, kv_bytes)


def create_context(model: Model, cp, info: _CtxInfo):
    """llama_init_from_model, or a one-line MarsError with llama.cpp's reason."""
    _recent_log.clear()
    ctx = C.llama_init_from_model(model._model, cp)
    if not ctx:
        reason = _last_llama_error()
        size = f" (its KV cache needs about {_gib(info.kv_bytes)})" if info.kv_bytes else ""
        raise MarsError(
            f"cannot create a llama.cpp context of {cp.n_ctx:,} tokens{size}" + (f": {reason}" if reason else "")
            + "; use a smaller -c"
        )
    return ctx


class OwnsContext:
    """Frees a llama_context (``_ctx``) and its batch (``_batch``) once, and before the model
    (``model``) they were made from: close(), collection, or the model's close if it comes
    first (``Model.owns``: a cycle's objects are collected in any order).

    ``abort_check``: set by the context's user (the engine, for a generation), whether a decode
    of many rows in progress should stop (:mod:`.abort`; it then raises
    :class:`~.abort.DecodeAborted` and keeps what the call's earlier chunks decoded)."""

    abort_check: Callable[[], bool] | None = None

    def _adopt(self, own_tokens: bool = False) -> None:
        """Once ``_ctx`` and ``_batch`` exist.  ``own_tokens``: the batch's token array is a
        buffer of ours, not llama_batch_init's, which llama_batch_free must not free."""
        ctx, batch = self._ctx, self._batch

        def free() -> None:
            if own_tokens:
                batch.token = ctypes.POINTER(C.llama_token)()
            C.llama_batch_free(batch)
            C.llama_free(ctx)

        self._free = self.model.owns(free)

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            free = getattr(self, "_free", None)
            if free is not None:
                free()
            else:  # (it failed between the context and its batch)
                C.llama_free(self._ctx)
            self._ctx = None

    def __del__(self):  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass


class Context(OwnsContext):
    """One llama_context with its batch, its KV token mirror and logits views.

    flash_attn: None lets llama.cpp decide; kv_type: "f16" (default), "f32" or
    "q8_0" (a quantized V cache needs flash attention).  Flash attention off
    with an f32 cache makes logits independent of how tokens were batched to
    about 1e-5, which the KV-rollback test relies on.
    """

    def __init__(
        self,
        model: Model,
        n_ctx: int = DEFAULTS.n_ctx,
        n_batch: int = DEFAULTS.n_batch,
        n_threads: int | None = None,
        flash_attn: bool | None = None,
        kv_type: str = "f16",
    ):
        self.model = model
        cp, info = context_params(model, n_ctx, n_batch, n_threads, flash_attn, kv_type)
        self.n_ctx_requested = info.requested
        self._ctx = create_context(model, cp, info)
        n_batch, threads = info.n_batch, info.n_threads
        self.n_ctx = int(C.llama_n_ctx(self._ctx))
        self.n_batch = n_batch
        self.n_threads = threads
        self.mem = C.llama_get_memory(self._ctx)
        self.n_vocab = model.n_vocab
        self._batch = C.llama_batch_init(n_batch, 0, 1)
        b = self._batch
        for i in range(n_batch):  # every row belongs to sequence 0
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
        self._tok = np.ctypeslib.as_array(b.token, shape=(n_batch,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(n_batch,))
        self._out = np.ctypeslib.as_array(ctypes.cast(b.logits, ctypes.POINTER(ctypes.c_int8)), shape=(n_batch,))
        self._adopt()
        self.tokens: list[int] = []  # mirror of the KV cache, positions 0..len-1
        self.hidden: np.ndarray | None = None  # (n_ctx, n_embd) last hidden rows by position, when captured
        # a recurrent target: how far its state can be rolled back (None: cells, any prefix)
        self._rollback = Rollback(int(C.llama_n_rs_seq(self._ctx))) if model.recurrent else None

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def capture_hidden(self, width: int, read=None) -> None:
        """Keep a row of ``width`` floats per position this context evaluates (``hidden[p]``):
        ``read(n_rows)`` gives them for the last decode's rows (default: the trunk's last hidden
        rows, the state before the output norm that an MTP layer reads, llama/mtp.py; an EAGLE-3
        head's encoded features, llama/eagle3.py)."""
        self._read_hidden = read or hidden_rows(self._ctx, width)
        self.hidden = np.zeros((self.n_ctx, width), np.float32)

    def _decode(self, tokens, n_out: int) -> None:
        if not self._ctx:
            raise MarsError("this context was closed (Engine.close() during a generation?)")
        n = len(tokens)
        start = len(self.tokens)
        self._tok[:n] = tokens
        self._pos[:n] = np.arange(start, start + n)
        self._out[:n] = 0
        if n_out:
            self._out[n - n_out : n] = 1
        self._batch.n_tokens = n
        rc = abort.decode(self._ctx, self._batch, n, self.abort_check)
        if rc != 0:
            # llama.cpp removed this batch's positions; keep the mirror in step (a recurrent
            # state may have moved on in part: dropped whole)
            if self._rollback is not None:
                drop_state(self._rollback, self.mem, 0, self.tokens)
            else:
                C.llama_memory_seq_rm(self.mem, 0, start, -1)
            if rc == 1:
                raise MarsError(f"the context is full ({self.n_ctx} tokens); use a larger -c")
            if rc == 2:
                raise abort.aborted()
            raise RuntimeError(f"llama_decode failed with code {rc}")
        if self.hidden is not None:
            self.hidden[start:start + n] = self._read_hidden(n)
        self.tokens.extend(int(t) for t in tokens)
        if self._rollback is not None:
            self._rollback.after_decode(self._ctx, 0, n, len(self.tokens))

    def logits(self, n_rows: int) -> np.ndarray:
        """Zero-copy (n_rows, V) view of the last decode's output rows."""
        ptr = C.llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(ptr, shape=(n_rows, self.n_vocab))

    def eval(self, tokens, n_out: int = 1) -> np.ndarray | None:
        """Append ``tokens`` to the cache (chunked by n_batch); logits for the last n_out rows."""
        tokens = list(tokens)
        if not tokens:
            return None
        if len(self.tokens) + len(tokens) > self.n_ctx:
            raise MarsError(f"the context is full ({self.n_ctx} tokens); use a larger -c")
        if n_out > self.n_batch:
            raise ValueError("more output rows than the batch holds")
        i = 0
        while len(tokens) - i > self.n_batch:
            self._decode(tokens[i : i + self.n_batch], 0)
            i += self.n_batch
        rest = tokens[i:]
        self._decode(rest, min(n_out, len(rest)))
        return self.logits(min(n_out, len(rest))) if n_out else None

    def truncate(self, n_keep: int) -> None:
        """Drop every cached position >= n_keep (KV rollback).  A recurrent model's state goes
        back a few tokens into its last decode, or to a checkpoint a prompt chunk left
        (llama/recurrent.py); else the whole sequence is dropped: ``n_past`` is then less than
        ``n_keep`` (the next sync evaluates the rest again)."""
        if n_keep >= len(self.tokens):
            return
        if not self._ctx:
            raise MarsError("this context was closed")
        if self._rollback is not None:
            return truncate_state(self._rollback, self._ctx, self.mem, 0, self.tokens, n_keep, int)
        if not C.llama_memory_seq_rm(self.mem, 0, n_keep, -1):
            raise MarsError("this model's cache cannot be rolled back")
        del self.tokens[n_keep:]

    def reachable(self, n_keep: int) -> int:
        """How many cached positions a :meth:`truncate` to ``n_keep`` keeps."""
        if self._rollback is not None:
            return self._rollback.reachable(len(self.tokens), n_keep)
        return min(n_keep, len(self.tokens))

    def sync(self, tokens) -> int:
        """Make the cache hold exactly ``tokens``, reusing the common prefix.

        Returns the number of tokens that had to be evaluated.
        """
        rest = self._keep_common(tokens)
        if rest:
            self.eval(rest, n_out=0)
        return len(rest)

    def prefill(self, tokens) -> tuple[int, np.ndarray | None]:
        """Make the cache hold ``tokens[:-1]`` (as :meth:`sync`) and, where the last token rides
        in the last chunk for free (:func:`last_rides`), the last token too.

        Returns the number of tokens evaluated and, when the last one rode, a copy of its
        logits row (the next token's distribution: the first token, known at the end of
        prefill); else None, and the cache holds ``tokens[:-1]``.
        """
        prompt, last = tokens[:-1], tokens[-1]
        rest = self._keep_common(prompt)
        # a recurrent target's last chunk leaves a checkpoint: without the last token, so that the
        # same prompt again reuses it (llama/recurrent.py)
        keep = self._rollback is not None and self._rollback.saves(last_chunk(len(rest), self.n_batch))
        if last_rides(len(rest), self.n_batch, self.model.invariant_rows) and len(tokens) <= self.n_ctx and not keep:
            row = self.eval(rest + [last], n_out=1)[0].copy()
            return len(rest), row
        if rest:
            self.eval(rest, n_out=0)
        return len(rest), None

    def _keep_common(self, tokens) -> list[int]:
        """Drop cached positions past the common prefix with ``tokens``; the tokens left to evaluate."""
        if not self._ctx:
            raise MarsError("this context was closed")
        # An interrupted decode (Ctrl-C between llama_decode and the mirror
        # update) can leave the cache longer than the mirror: trust the cache.
        pos_max = int(C.llama_memory_seq_pos_max(self.mem, 0))
        if pos_max + 1 != len(self.tokens):
            if self._rollback is not None:  # a recurrent state: whole
                drop_state(self._rollback, self.mem, 0, self.tokens)
            else:
                C.llama_memory_seq_rm(self.mem, 0, min(len(self.tokens), pos_max + 1), -1)
                del self.tokens[pos_max + 1 :]
        self.truncate(common_prefix_len(self.tokens, tokens))
        return list(tokens[len(self.tokens):])  # (a recurrent state may keep less: truncate)
