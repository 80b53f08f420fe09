"""Rolling back a hybrid/recurrent target's state after a rejected draft (pure bookkeeping).

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
* anything else (a prefix from several decodes ago) cannot be reached: the
  sequence is cleared and evaluated again.

A verify window of k+1 rows rolls back k - a <= k tokens, always reachable when
R >= k: targets with recurrent layers draft at most :data:`ROLLBACK_DEPTH` tokens.
Each snapshot costs one more copy of the recurrent state per sequence.
"""

from __future__ import annotations

__all__ = ["ROLLBACK_ARCHS", "ROLLBACK_DEPTH", "Rollback", "supports_rollback"]

# architectures whose recurrent memory llama.cpp can roll back (llm_arch_supports_rs_rollback
# in src/llama-arch.cpp of the pinned release); other recurrent/hybrid models are refused for
# speculation (qwen3next, mamba, rwkv, jamba, ...)
ROLLBACK_ARCHS = frozenset({
    "kimi-k3", "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "glm5-next", "nemotron_h", "nemotron_h_moe",
    "lfm2", "lfm2moe", "bailingmoe3",
})
# snapshots kept per sequence: the longest draft on such a target (the default draft_max)
ROLLBACK_DEPTH = 8


def supports_rollback(arch: str) -> bool:
    return arch in ROLLBACK_ARCHS


class Rollback:
    """What one sequence of a recurrent context can still be rolled back by."""

    __slots__ = ("depth", "last", "pending")

    def __init__(self, depth: int):
        self.depth = depth  # n_rs_seq of the context
        self.last = 0  # tokens of this sequence in its last decode
        self.pending = False  # rolled back since that decode

    def decoded(self, n: int) -> None:
        if n:
            self.last, self.pending = n, False

    def allows(self, r: int) -> bool:
        """Whether rolling back the last ``r`` tokens reads a valid snapshot."""
        return not self.pending and 1 <= r <= self.depth and r < self.last

    def rolled_back(self) -> None:
        self.pending = True

    def cleared(self) -> None:
        self.last, self.pending = 0, False
