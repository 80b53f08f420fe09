"""`core.config.token_logprobs`: the log probabilities reported with a token (CLI --logprobs, the server's)."""

from __future__ import annotations

import json
import math

import numpy as np

from mars_local.core.config import token_logprobs


def test_alternatives_a_grammar_forbids_are_left_out_not_reported_as_minus_infinity():
    row = np.array([2.0, -np.inf, 1.0, -np.inf], dtype=np.float32)  # a grammar left tokens 0 and 2
    (lp,) = token_logprobs([row], [0], n_top=3)
    assert [t for t, _ in lp.top] == [0, 2]  # two candidates, not three with a -inf one
    assert all(math.isfinite(v) for _, v in lp.top) and math.isfinite(lp.logprob)
    json.dumps(lp.to_dict(), allow_nan=False)  # -inf has no JSON form
    total = math.log(math.exp(2.0) + math.exp(1.0))
    assert math.isclose(lp.logprob, 2.0 - total, rel_tol=1e-9)
    assert math.isclose(lp.top[1][1], 1.0 - total, rel_tol=1e-9)


def test_a_row_without_minus_infinity_keeps_its_top_n_most_likely_first():
    row = np.array([0.5, 3.0, 1.0, 2.0], dtype=np.float32)
    (lp,) = token_logprobs([row], [2], n_top=2)
    assert [t for t, _ in lp.top] == [1, 3]
