"""SpecStats' derived figures (pure)."""

from __future__ import annotations

from mars_local.core.stats import SpecStats


def test_tau_counts_the_token_every_round_commits_even_when_it_is_not_shown():
    """9 tokens shown in 10 rounds: the last round's token was the end of generation."""
    s = SpecStats()
    for _ in range(9):
        s.record_round(0, 0, 0, 1)
    s.record_round(0, 0, 0, 0)  # an EOG token (or one completing a stop string)
    assert s.n_generated == 9 and s.n_rounds == 10
    assert s.mean_accepted_length == 1.0  # plain decoding: one token per forward, never below 1


def test_tau_is_one_plus_accepted_drafts_per_round():
    s = SpecStats()
    s.record_round(4, 3, 1, 4)
    s.record_round(4, 0, 0, 1)
    assert s.mean_accepted_length == 1 + 3 / 2 and s.to_dict()["mean_accepted_length"] == 2.5
    assert SpecStats().mean_accepted_length == 0.0  # no round ran
