"""Many sequences in one llama.cpp context, each in its own KV stream.

:class:`MultiContext` holds up to ``n_seq`` sequences; :meth:`MultiContext.seq`
gives a :class:`SeqView` with the interface of :class:`~mars_local.llama.context.Context`
(``tokens``, ``n_past``, ``n_ctx``, ``eval``, ``truncate``, ``sync``) for one
sequence, so the per-sequence steps of the speculative loop run unchanged on it;
:meth:`MultiContext.decode_windows` evaluates the windows of many sequences in as
few ``llama_decode`` calls as exactness allows.

Why per-sequence streams (``kv_unified = false``)
  In a unified cache a sequence's cells are wherever the cache had room: after
  another sequence rolls its draft back, the next tokens fill the freed cells, so
  a sequence's keys stop being in position order.  Attention sums its keys in
  cell order, so the rows come out different in the last bits from a lone run
  (measured: 20 of 240 windows differ, max |logit diff| 0.09, SmolLM2 F16, 8
  sequences).  With a stream per sequence every sequence's cells sit exactly
  where a lone run would put them, and its rows equal a lone run's bit for bit.

What one decode may carry (exactness)
  * Windows of at most ``invariant_rows`` rows in all (``Model.invariant_rows``): our
    patched CPU kernels compute a row the same whatever else shares the batch up to
    64 rows (``patches/0002``, ``0003``); above it quantized weights take tiled kernels
    (measured: 72 rows of a Q4_K_M model differ from lone rows).  Layers on a GPU
    keep it up to 16 rows (``runtime.GPU_INVARIANT_ROWS``, measured on CUDA).
  * Windows of equal length from sequences with consecutive ids: llama.cpp splits
    a batch over several streams into "equal" micro-batches (the same number of
    rows per sequence, consecutive streams), so unequal windows would cost one
    forward per distinct length.  Callers pad windows to a common length (the
    padded rows are computed and then rolled back, never verified).
  * A prompt is prefilled in decodes of its own, chunked by ``n_batch`` like a
    lone run, never mixed with other sequences' windows.

Reusing cells a sequence left behind (:func:`exact_reuse`)
  A row's keys and values are those of a lone run when both were computed by
  the same kernels: any two decodes of at most 64 rows, or the same chunk of
  more than 64 rows.  So a new prompt may keep the cells of a common prefix only
  as far as that holds for each of its lone run's chunks.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from ..core.errors import MarsError
from ..core.tokens import common_prefix_len
from . import abort
from .backend import C
from .context import MAX_INVARIANT_ROWS, OwnsContext, context_params, create_context, hidden_rows
from .recurrent import Rollback, drop_state, truncate_state
from .runtime import Model

__all__ = ["MAX_INVARIANT_ROWS", "MultiContext", "SeqView", "exact_reuse"]



def exact_reuse(cached: Sequence[int], old_prompt: int, new: Sequence[int], n_batch: int,
                inv: int = MAX_INVARIANT_ROWS, wide_alike: bool = False) -> int:
    """How many leading cells of ``cached`` a sequence prefilling ``new`` may keep, its rows
    staying exactly a lone run's (pure).

    ``cached``: the tokens whose cells are held, of which the first ``old_prompt`` were a
    prompt prefilled as a lone run does (chunks of ``n_batch`` from position 0) and the
    rest came from windows of at most ``inv`` rows; ``new``: the tokens to prefill (a
    prompt without its last token), chunked the same way.  Per chunk [c, e) of ``new``:
    kept when both computations of its rows used the invariant kernels (``new``'s chunk
    and ``cached``'s chunk at c, or windows, of at most ``inv`` rows), or when both were
    the same chunk of more than ``inv`` rows of the same tokens; else reuse ends at c.

    ``wide_alike``: this model's chunks of more than ``inv`` rows compute every row alike
    whatever their length (measured: :meth:`.Scheduler.warm_up`).  Then a wide chunk of
    ``new`` keeps the rows a wide chunk of the old prompt computed, but for the last ``inv``
    + 1 at least, computed again in one decode that is still wide: a chat's next turn (its
    conversation so far, then a short new message) keeps all but a few dozen tokens, where
    it had to evaluate the whole conversation again.
    """
    common = common_prefix_len(cached, new)
    kept = c = 0
    while c < common:
        e_new = min(c + n_batch, len(new))
        e_old = min(c + n_batch, old_prompt) if c < old_prompt else None
        new_inv = e_new - c <= inv
        old_inv = e_old is None or e_old - c <= inv
        if new_inv and old_inv:
            kept = min(common, e_new)
        elif not new_inv and not old_inv and e_new == e_old and e_new <= common:
            kept = e_new
        elif wide_alike and not new_inv and not old_inv:
            done = min(common, e_old)  # this chunk's rows a wide chunk computed
            if done >= e_new:
                kept = e_new
            else:  # the rest of the chunk again, in a decode of more than inv rows
                kept = max(c, min(done, e_new - inv - 1))
                break
        else:
            break
        c += n_batch
    return kept


class MultiContext(OwnsContext):
    """One llama_context with ``n_seq`` sequences of up to ``n_ctx_seq`` tokens each.

    The KV cache holds ``n_seq * n_ctx_seq`` cells (llama.cpp gives each stream an
    equal share).  Sequences are numbered 0 .. n_seq-1; a free one is empty.
    """

    def __init__(self, model: Model, n_seq: int, n_ctx_seq: int = 4096, n_batch: int = 512,
                 n_threads: int | None = None, flash_attn: bool | None = None, kv_type: str = "f16",
                 unified: bool = False, *, configure=None, n_embd_in: int = 0):
        """``configure(cp)``: a last change to the context params (llama/mtp.py: an MTP context);
        ``n_embd_in``: rows carry an input embedding of that width beside their token."""
        if not 1 <= n_seq <= 256:
            raise MarsError(f"the number of parallel sequences must be in 1..256, got {n_seq}")
        self.model = model
        cp, info = context_params(model, n_ctx_seq * n_seq, n_batch, n_threads, flash_attn, kv_type)
        cp.n_seq_max = n_seq
        # unified: one cache all sequences share, any window lengths in one micro-batch, rows
        # not exact (cell order): for a draft model, whose numerics never change strict output
        cp.kv_unified = unified
        if configure is not None:
            configure(cp)
        self._ctx = create_context(model, cp, info)
        # a recurrent state per sequence, rolled back a few tokens at most (llama/recurrent.py); an
        # MTP context of a hybrid model holds its nextn layers' KV cells only
        self._rs_depth = (int(C.llama_n_rs_seq(self._ctx))
                          if model.recurrent and cp.ctx_type != C.LLAMA_CONTEXT_TYPE_MTP else None)
        self.n_seq = n_seq
        self.unified = unified
        # tokens per sequence (shared cells when unified: each may use the share it would have)
        self.n_ctx = int(C.llama_n_ctx_seq(self._ctx)) // (n_seq if unified else 1)
        self.n_batch = info.n_batch
        self.n_threads = info.n_threads
        self.mem = C.llama_get_memory(self._ctx)
        self.n_vocab = model.n_vocab
        self.invariant_rows = model.invariant_rows  # rows one exact decode may carry (Model)
        # rows one decode of windows carries at most: that bound, and llama.cpp's n_batch (a
        # decode of more tokens than n_batch aborts the process)
        self.max_rows = min(self.invariant_rows, self.n_batch)
        rows = max(self.n_batch, MAX_INVARIANT_ROWS)
        self._batch = C.llama_batch_init(rows, n_embd_in, 1)
        b = self._batch
        for i in range(rows):
            b.n_seq_id[i] = 1
        self._emb = None
        if n_embd_in:  # llama_batch_init gives an embedding buffer and no token one: ours
            self._tok_buf = (C.llama_token * rows)()
            b.token = self._tok_buf
            self._emb = np.ctypeslib.as_array(b.embd, shape=(rows, n_embd_in))
        self._tok = np.ctypeslib.as_array(b.token, shape=(rows,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(rows,))
        self._out = np.ctypeslib.as_array(ctypes.cast(b.logits, ctypes.POINTER(ctypes.c_int8)), shape=(rows,))
        self._seq_ptrs = [b.seq_id[i] for i in range(rows)]
        self._adopt(own_tokens=self._emb is not None)
        self.seqs = [self._view(i) for i in range(n_seq)]
        self.n_decodes = 0  # llama_decode calls so far (the scheduler's statistics)
        self._read_hidden = None  # capture_hidden: what to keep of each row, per sequence

    def _view(self, i: int) -> "SeqView":
        return SeqView(self, i)

    def capture_hidden(self, width: int, read=None) -> None:
        """Keep a row of ``width`` floats per position every sequence evaluates (``SeqView.hidden[p]``):
        ``read(n_rows)`` gives them for the last decode's rows (default: the trunk's last hidden
        rows, what an MTP layer reads, llama/mtp.py; an EAGLE-3 head's encoded features,
        llama/eagle3.py); (n_ctx, width) float32 per sequence."""
        self._read_hidden = read or hidden_rows(self._ctx, width)
        for v in self.seqs:
            v.hidden = np.zeros((self.n_ctx, width), np.float32)

    def seq(self, i: int) -> "SeqView":
        return self.seqs[i]

    # ------------------------------------------------------------ decoding
    # A context whose row for sequence position p sits at llama position p - pos_shift (an
    # EAGLE-3 head: llama/eagle3.py); positions below pos_shift have no row.
    pos_shift = 0
    # A model whose graph computes logits for every row and hands out the first n_outputs of
    # them (an EAGLE-3 head): a decode that needs any output row makes every row one.
    all_rows_out = False

    def _decode(self, parts: Sequence[tuple[int, Sequence[int], int]]) -> list[tuple[int, int]]:
        """One llama_decode of ``parts``: (sequence, tokens, output rows at the end); per part,
        (index of its first output row among the decode's outputs, its output rows)."""
        if not self._ctx:
            raise MarsError("this context was closed")
        i = 0
        layout = []  # (sequence, its position of the part's first row, rows, output rows)
        for s, toks, n_out in parts:
            view = self.seqs[s]
            start = len(view.tokens)
            skip = min(max(self.pos_shift - start, 0), len(toks))
            p0, n = start + skip, len(toks) - skip
            n_out = min(n_out, n)
            if n:
                self._tok[i:i + n] = toks[skip:]
                self._pos[i:i + n] = np.arange(p0 - self.pos_shift, p0 - self.pos_shift + n)
                self._out[i:i + n] = 0
                if n_out:
                    self._out[i + n - n_out:i + n] = 1
                for r in range(i, i + n):
                    self._seq_ptrs[r][0] = s
                if self._emb is not None:
                    self._fill_embeddings(view, p0, self._emb[i:i + n])
            layout.append((s, p0, n, n_out))
            i += n
        got, first = [], 0
        every = self.all_rows_out and any(n_out for *_, n_out in layout)
        if every:
            self._out[:i] = 1
        for _, _, n, n_out in layout:
            got.append(((first + n - n_out) if every else first, n_out))
            first += n if every else n_out
        if i:
            self._batch.n_tokens = i
            # one sequence's chunk stops when that sequence's check says so, any decode when its owner's does
            check = self.abort_check or (self.seqs[parts[0][0]].abort_check if len(parts) == 1 else None)
            rc = abort.decode(self._ctx, self._batch, i, check)
            self.n_decodes += 1
            if rc != 0:
                for s, _, _ in parts:  # llama.cpp removed this batch's positions; keep the mirrors in step
                    view = self.seqs[s]
                    if view._rollback is not None:  # a recurrent state may have moved on in part: whole
                        drop_state(view._rollback, self.mem, s, view.tokens)
                    else:
                        C.llama_memory_seq_rm(self.mem, s, self._cell(len(view.tokens)), -1)
                if rc == 1:
                    raise self._context_full()
                if rc == 2:
                    raise abort.aborted()
                raise RuntimeError(f"llama_decode failed with code {rc}")
        self._decoded(layout, i)
        for s, toks, _ in parts:
            view = self.seqs[s]
            view.tokens.extend(int(t) for t in toks)
            if view._rollback is not None:
                view._rollback.after_decode(self._ctx, s, len(toks), len(view.tokens))
        return got

    def _context_full(self) -> MarsError:
        return MarsError(f"the context is full ({self.n_ctx} tokens per sequence); use a larger -c")

    def _cell(self, p: int) -> int:
        """The llama position of sequence position ``p`` (where a rollback to ``p`` cuts)."""
        return max(p - self.pos_shift, 0)

    def _fill_embeddings(self, view: "SeqView", start: int, out: np.ndarray) -> None:
        """The input embeddings of ``view``'s rows at positions start.. (contexts with n_embd_in)."""
        raise NotImplementedError

    def _decoded(self, layout, n_rows: int) -> None:
        """After a decode (before the token mirrors grow): keep the hidden rows.  ``layout``:
        per part (sequence, position of its first row, rows, output rows), in batch order."""
        if self._read_hidden is None or not n_rows:
            return
        rows = self._read_hidden(n_rows)
        i = 0
        for s, p0, n, _ in layout:
            self.seqs[s].hidden[p0:p0 + n] = rows[i:i + n]
            i += n

    def _rows(self, n: int, first: int = 0) -> np.ndarray:
        ptr = C.llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(ptr, shape=(first + n, self.n_vocab))[first:]

    def decode_windows(self, windows: Sequence[tuple[int, Sequence[int]]],
                       max_rows: int | None = None, last_only: bool = False) -> list[np.ndarray]:
        """Evaluate each (sequence, window) and return every window's rows of logits (copies;
        ``last_only``: its last row only, shape (1, V)).

        Windows go in sequence order, ``max_rows`` rows per decode at most (whole
        windows; a window longer than that is refused; default: ``max_rows``, the model's
        exact bound or n_batch if less, so that a batch of more rows on a GPU takes several decodes).
        For one micro-batch per decode give windows of equal length from consecutive sequences.
        """
        if max_rows is None:
            max_rows = self.max_rows
        order = sorted(range(len(windows)), key=lambda j: windows[j][0])
        out: list[np.ndarray | None] = [None] * len(windows)
        group: list[int] = []
        rows = 0

        def flush():
            nonlocal rows
            if not group:
                return
            got = self._decode([(windows[j][0], windows[j][1], 1 if last_only else len(windows[j][1]))
                                for j in group])
            for j, (first, n) in zip(group, got):
                out[j] = self._rows(n, first).copy()
            group.clear()
            rows = 0

        for j in order:
            s, toks = windows[j]
            n = len(toks)
            if not 1 <= n <= max_rows:
                raise ValueError(f"a window must have 1..{max_rows} rows, got {n}")
            if len(self.seqs[s].tokens) + n > self.n_ctx:
                raise self._context_full()
            if rows + n > max_rows:
                flush()
            group.append(j)
            rows += n
        flush()
        return out  # type: ignore[return-value]



    def extend(self, parts: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Append each (sequence, tokens), no output rows, in as few decodes as they fit in
        (``n_batch`` rows each; a part longer than the room left goes on in the next decode).
        For a unified cache (a draft model catching up on several sequences at once): one
        decode instead of one per sequence, and above 64 rows prefill's faster kernels."""
        if not self.unified:
            raise ValueError("extend packs sequences into shared decodes: a unified cache only")
        for s, toks in parts:
            if len(self.seqs[s].tokens) + len(toks) > self.n_ctx:
                raise self._context_full()
        batch, room = [], self.n_batch
        for s, toks in parts:
            toks, i = list(toks), 0
            while i < len(toks):
                take = min(room, len(toks) - i)
                batch.append((s, toks[i:i + take], 0))
                i, room = i + take, room - take
                if room == 0:
                    self._decode(batch)
                    batch, room = [], self.n_batch
        if batch:
            self._decode(batch)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Make sequence ``dst`` hold the first ``n`` cells of ``src`` (their keys and values,
        bit for bit).  Per-sequence streams copy the whole stream buffer (llama.cpp copies
        streams whole, at the start of the next decode), then drop what lies past ``n``; a
        unified cache shares the cells (no data moves)."""
        a, b = self.seqs[src], self.seqs[dst]
        if not 0 < n <= a.n_past or src == dst or (a._rollback is not None and n != a.n_past):
            raise ValueError(f"cannot copy {n} cells of sequence {src} into {dst}")  # (a state: whole)
        C.llama_memory_seq_rm(self.mem, dst, 0, -1)
        if self.unified:
            C.llama_memory_seq_cp(self.mem, src, dst, 0, self._cell(n))
        else:
            C.llama_memory_seq_cp(self.mem, src, dst, -1, -1)
            C.llama_memory_seq_rm(self.mem, dst, self._cell(n), -1)
        b.tokens = a.tokens[:n]
        if b._rollback is not None:  # its state was copied, not decoded: no snapshot to go back to,
            b._rollback.cleared()  # the checkpoints of the prefix it now holds
            b._rollback.checkpoints = list(a._rollback.checkpoints)
        if a.hidden is not None:
            b.hidden[:n] = a.hidden[:n]


class SeqView:
    """One sequence of a :class:`MultiContext`, with the Context interface."""

    def __init__(self, owner: MultiContext, seq_id: int):
        self.owner, self.seq_id = owner, seq_id
        self.tokens: list[int] = []  # mirror of this sequence's cells, positions 0..len-1
        self.hidden: np.ndarray | None = None  # (n_ctx, n_embd) hidden rows by position (capture_hidden)
        self._rollback = None if owner._rs_depth is None else Rollback(owner._rs_depth)
        self.abort_check = None  # whether a chunk of this sequence alone in progress should stop (.abort)

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    @property
    def n_ctx(self) -> int:
        return self.owner.n_ctx

    @property
    def n_batch(self) -> int:
        return self.owner.n_batch

    @property
    def n_threads(self) -> int:
        return self.owner.n_threads

    def eval(self, tokens, n_out: int = 1) -> np.ndarray | None:
        """Append ``tokens`` (alone in their decodes, chunked by n_batch); logits of the last n_out rows."""
        tokens = list(tokens)
        if not tokens:
            return None
        if len(self.tokens) + len(tokens) > self.n_ctx:
            raise self.owner._context_full()
        nb, i = self.n_batch, 0
        while len(tokens) - i > nb:
            self.owner._decode([(self.seq_id, tokens[i:i + nb], 0)])
            i += nb
        first, n = self.owner._decode([(self.seq_id, tokens[i:], n_out)])[0]
        return self.owner._rows(n, first) if n else None

    def truncate(self, n_keep: int) -> None:
        """Drop this sequence's positions >= n_keep (KV rollback); a recurrent state that cannot
        go back that far is reached through a checkpoint or dropped whole (as :meth:`Context.truncate`)."""
        if n_keep >= len(self.tokens):
            return
        o = self.owner
        if self._rollback is not None:
            return truncate_state(self._rollback, o._ctx, o.mem, self.seq_id, self.tokens, n_keep, o._cell)
        if not C.llama_memory_seq_rm(o.mem, self.seq_id, o._cell(n_keep), -1):
            raise MarsError("this model's cache cannot be rolled back")
        del self.tokens[n_keep:]

    def reachable(self, n_keep: int) -> int:
        """How many of this sequence's positions a :meth:`truncate` to ``n_keep`` keeps."""
        if self._rollback is not None:
            return self._rollback.reachable(len(self.tokens), n_keep)
        return min(n_keep, len(self.tokens))

    def sync(self, tokens) -> int:
        """Make this sequence hold exactly ``tokens``, reusing the common prefix; tokens evaluated."""
        self.truncate(common_prefix_len(self.tokens, tokens))
        rest = list(tokens[self.n_past:])  # (a view may keep less than asked: llama/mtp.py)
        if rest:
            self.eval(rest, n_out=0)
        return len(rest)

    def clear(self) -> None:
        self.truncate(0)
