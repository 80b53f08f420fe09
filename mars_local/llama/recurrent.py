"""Rolling back a hybrid/recurrent target's state: after a rejected draft, and to a prompt's prefix.

A recurrent layer (a gated delta net, Mamba) keeps one state per sequence, not one
row per position: dropping the last tokens of a sequence cannot be done by deleting
cells.  llama.cpp (the pinned release) offers a bounded rollback instead: a context
created with ``n_rs_seq = R`` keeps, after each decode, the states after each of the
last R+1 tokens of every sequence (``llama-memory-recurrent.cpp``), and
``llama_memory_seq_rm(seq, p0, -1)`` then rolls a sequence back by ``r`` tokens by
reading snapshot ``r`` at the next decode.  The rules (read from that file and the
gated-delta-net kernel, ``ggml_compute_forward_gated_delta_net_one_chunk``):

* snapshot ``r`` is the state after the decode's token ``n - 1 - r``: valid for
  ``1 <= r <= R`` and ``r < n``, where ``n`` is how many tokens of the sequence the
  last decode carried (llama.cpp keeps a sequence's trailing R+1 tokens in one
  micro-batch).  Rolling back a whole decode (``r = n``) is accepted by llama.cpp
  and reads a stale snapshot: wrong text, no error.  So we check, not llama.cpp;
* a rollback is single-use: a second one before the next decode is refused;
* a prefix from several decodes ago is reached through a checkpoint: after a
  decode of more tokens than a verify window has (a prompt's chunk), the state is
  copied out (``llama_state_seq_get_data_ext`` with ``PARTIAL_ONLY``: the recurrent
  part, not the attention cells) and, for a later prompt sharing that prefix,
  copied back and the attention cells past it cut (as llama-server's context
  checkpoints do).  The last :data:`MAX_CHECKPOINTS` of a sequence are kept;
* anything else cannot be reached: the sequence is cleared and evaluated again.

A verify window of k+1 rows rolls back k - a <= k tokens, always reachable when
R >= k: targets with recurrent layers draft at most :data:`ROLLBACK_DEPTH` tokens.
Each snapshot costs one more copy of the recurrent state per sequence.
"""

from __future__ import annotations

import ctypes

from .backend import C

__all__ = ["MAX_CHECKPOINTS", "ROLLBACK_ARCHS", "ROLLBACK_DEPTH", "Rollback", "drop_state", "state_bytes",
           "supports_rollback", "truncate_state"]

# architectures whose recurrent memory llama.cpp can roll back (llm_arch_supports_rs_rollback
# in src/llama-arch.cpp of the pinned release); other recurrent/hybrid models are refused for
# speculation (qwen3next, mamba, rwkv, jamba, ...)
ROLLBACK_ARCHS = frozenset({
    "kimi-k3", "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "glm5-next", "nemotron_h", "nemotron_h_moe",
    "lfm2", "lfm2moe", "bailingmoe3",
})
# snapshots kept per sequence: the longest draft on such a target (the default draft_max)
ROLLBACK_DEPTH = 8
# checkpoints kept per sequence (each a copy of its recurrent state: tens of MB for a 9B model)
MAX_CHECKPOINTS = 3


def supports_rollback(arch: str) -> bool:
    return arch in ROLLBACK_ARCHS


class Rollback:
    """What one sequence of a recurrent context can still be rolled back by: the snapshots of its
    last decode, and its checkpoints (``(tokens held, state bytes)``)."""

    __slots__ = ("depth", "last", "pending", "checkpoints")

    def __init__(self, depth: int):
        self.depth = depth  # n_rs_seq of the context
        self.last = 0  # tokens of this sequence in its last decode
        self.pending = False  # rolled back since that decode
        self.checkpoints: list[tuple[int, ctypes.Array]] = []

    def decoded(self, n: int) -> None:
        if n:
            self.last, self.pending = n, False

    def allows(self, r: int) -> bool:
        """Whether rolling back the last ``r`` tokens reads a valid snapshot."""
        return not self.pending and 1 <= r <= self.depth and r < self.last

    def rolled_back(self, n_keep: int) -> None:
        self.pending = True
        self.forget_after(n_keep)

    def cleared(self) -> None:
        self.last, self.pending = 0, False
        self.checkpoints.clear()

    def after_decode(self, ctx, seq_id: int, n_rows: int, n_held: int) -> None:
        """A decode gave the sequence ``n_rows`` more rows (it holds ``n_held`` tokens now): its
        snapshots are of them, and a prompt's chunk leaves a checkpoint."""
        self.decoded(n_rows)
        if self.saves(n_rows):
            self.save(ctx, seq_id, n_held)

    def saves(self, n_rows: int) -> bool:
        """Whether a decode of ``n_rows`` rows of this sequence leaves a checkpoint: more rows than
        a verify window has (a prompt's chunk)."""
        return n_rows > self.depth + 1

    def forget_after(self, n_keep: int) -> None:
        """Checkpoints of tokens no longer held go."""
        self.checkpoints = [c for c in self.checkpoints if c[0] <= n_keep]

    def reachable(self, n_have: int, n_keep: int) -> int:
        """How many of ``n_have`` held tokens a truncation to ``n_keep`` keeps (0: all go)."""
        n_keep = min(n_keep, n_have)
        if n_keep == n_have or self.allows(n_have - n_keep):
            return n_keep
        return max((n for n, _ in self.checkpoints if n <= n_keep), default=0)

    def save(self, ctx, seq_id: int, n: int) -> None:
        """A checkpoint of the state after ``n`` tokens (what the sequence holds now)."""
        flags = C.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = int(C.llama_state_seq_get_size_ext(ctx, seq_id, flags))
        buf = (ctypes.c_uint8 * size)()
        if size and C.llama_state_seq_get_data_ext(ctx, buf, size, seq_id, flags) == size:
            self.checkpoints = [c for c in self.checkpoints if c[0] != n][-(MAX_CHECKPOINTS - 1):] + [(n, buf)]

    def restore(self, ctx, mem, seq_id: int, n: int, cell: int) -> bool:
        """Back to the checkpoint after ``n`` tokens: its state copied in, the attention cells
        from ``cell`` (the llama position of token n) on cut.  False: it failed (the caller drops
        the sequence: :func:`drop_state`)."""
        buf = next(b for m, b in self.checkpoints if m == n)
        flags = C.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        self.last, self.pending = 0, False
        if C.llama_state_seq_set_data_ext(ctx, buf, len(buf), seq_id, flags) != len(buf) \
                or not C.llama_memory_seq_rm(mem, seq_id, cell, -1):
            return False
        self.forget_after(n)
        return True


def drop_state(rb: Rollback, mem, seq_id: int, tokens: list[int]) -> None:
    """Drop a recurrent sequence whole (its cells, state and checkpoints; ``tokens``: its mirror,
    emptied): where no snapshot or checkpoint reaches, or after a failed decode."""
    C.llama_memory_seq_rm(mem, seq_id, 0, -1)
    rb.cleared()
    tokens.clear()


def truncate_state(rb: Rollback, ctx, mem, seq_id: int, tokens: list[int], n_keep: int, cell) -> None:
    """Make a recurrent sequence hold ``tokens[:n_keep]`` (``tokens``: its mirror, cut in place)
    where a snapshot or a checkpoint reaches, else nothing; ``cell(p)``: llama position of token p."""
    n = rb.reachable(len(tokens), n_keep)
    if n == len(tokens):
        return
    if n == n_keep and rb.allows(len(tokens) - n):  # onto a snapshot of the last decode
        if C.llama_memory_seq_rm(mem, seq_id, cell(n), -1):
            rb.rolled_back(n)
            del tokens[n:]
            return
    elif n > 0 and rb.restore(ctx, mem, seq_id, n, cell(n)):  # onto a checkpoint
        del tokens[n:]
        return
    drop_state(rb, mem, seq_id, tokens)


def state_bytes(ctx) -> int:
    """Bytes of one sequence's recurrent state in ``ctx`` (a Context of a recurrent model), what each
    snapshot and each checkpoint copies (an empty context evaluates one token for it, then drops it)."""
    empty = not ctx.tokens
    if empty:
        ctx.eval([ctx.model.bos if ctx.model.bos >= 0 else 0], n_out=0)
    n = int(C.llama_state_seq_get_size_ext(ctx._ctx, 0, C.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY))
    if empty:
        ctx.truncate(0)
    return n
