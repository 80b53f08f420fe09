"""Token-sequence helpers shared by the KV-cache mirror, the drafters and bench (pure)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def common_prefix_len(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, given that the first ``start`` positions agree."""
    n = min(len(a), len(b))
    if start >= n:
        return n
    diff = np.flatnonzero(np.asarray(a[start:n]) != np.asarray(b[start:n]))
    return start + int(diff[0]) if diff.size else n
