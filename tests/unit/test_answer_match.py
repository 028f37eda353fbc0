"""tests/answer_match.py: what the property test's strict comparison lets
through (rounding, a fork at a near-tie) and what it catches."""

from __future__ import annotations

import pytest

from tests.answer_match import Mismatch, match_sampled_until_fork, match_until_tie, top_gap

MARGIN, TOLERANCE = 0.05, 0.02


def entry(chosen: int, top: dict[int, float]) -> dict:
    return {"id": chosen, "logprob": top.get(chosen, -30.0),
            "top_logprobs": [{"id": t, "logprob": lp} for t, lp in sorted(top.items(), key=lambda kv: -kv[1])]}


def answer(*tops: dict[int, float]) -> list[dict]:
    """Greedy entries: each position chooses its likeliest token."""
    return [entry(max(top, key=top.get), top) for top in tops]


def shifted(entries: list[dict], by: float) -> list[dict]:
    return [entry(e["id"], {t["id"]: t["logprob"] + by for t in e["top_logprobs"]}) for e in entries]


FRESH = answer({5: -0.1, 6: -2.5, 7: -3.0}, {8: -0.5, 9: -1.2}, {10: -0.01, 11: -5.0})


def test_the_same_answer_is_compared_whole():
    m = match_until_tie(FRESH, FRESH, MARGIN, TOLERANCE)
    assert (m.compared, m.tie_at, m.largest_drift) == (3, None, 0.0)
    assert m.smallest_gap == pytest.approx(0.7)


def test_rounding_within_the_tolerance_passes_and_is_measured():
    m = match_until_tie(shifted(FRESH, 0.001), FRESH, MARGIN, TOLERANCE)
    assert m.compared == 3 and m.largest_drift == pytest.approx(0.001)


def test_log_probabilities_past_the_tolerance_fail():
    with pytest.raises(Mismatch, match="differ by"):
        match_until_tie(shifted(FRESH, 0.5), FRESH, MARGIN, TOLERANCE)


def test_another_choice_where_the_fresh_read_is_clear_fails():
    got = FRESH[:1] + [entry(9, {8: -0.5, 9: -1.2})] + FRESH[2:]  # 9 chosen although 8 leads by 0.7
    with pytest.raises(Mismatch, match="margin of 0.7"):
        match_until_tie(got, FRESH, MARGIN, TOLERANCE)


def test_a_fork_at_a_near_tie_stops_the_comparison_there():
    fresh = answer({5: -0.69, 6: -0.70}, {8: -0.1, 9: -3.0})
    got = [entry(6, {5: -0.695, 6: -0.694}), entry(1, {1: -0.1})]  # rounding flipped the tie; then another prefix
    m = match_until_tie(got, fresh, MARGIN, TOLERANCE)
    assert (m.compared, m.tie_at) == (0, 0) and m.fork_margin == pytest.approx(0.01)


def test_a_near_tie_without_a_fork_is_compared_on():
    fresh = answer({5: -0.69, 6: -0.70}, {8: -0.1, 9: -3.0})
    m = match_until_tie(fresh, fresh, MARGIN, TOLERANCE)
    assert (m.compared, m.tie_at) == (2, None) and m.smallest_gap == pytest.approx(0.01)


def test_an_answer_that_ends_early_or_runs_on_fails():
    with pytest.raises(Mismatch, match="cached answer ended"):
        match_until_tie(FRESH[:2], FRESH, MARGIN, TOLERANCE)
    with pytest.raises(Mismatch, match="fresh read ended"):
        match_until_tie(FRESH, FRESH[:2], MARGIN, TOLERANCE)


def test_top_lists_with_nothing_in_common_fail():
    got = [entry(1, {1: -0.1, 2: -3.0})] + FRESH[1:]
    with pytest.raises(Mismatch, match="no token in common"):
        match_until_tie(got, FRESH, MARGIN, TOLERANCE)


def test_a_top_list_of_one_has_no_gap():
    assert top_gap(entry(3, {3: -0.0})) == float("inf")


def test_nothing_to_compare_is_an_empty_match():
    m = match_until_tie([], [], MARGIN, TOLERANCE)
    assert (m.compared, m.tie_at) == (0, None)


def test_a_sampled_answer_forks_only_between_candidates_of_both_reads():
    # The draft's fork seen on the bundled model: two tokens 0.0015 apart swap places.
    plain = [entry(5, {5: -0.2, 6: -2.0}), entry(600, {600: -1.6673, 764: -1.7794, 761: -1.7809})]
    drafted = [entry(5, {5: -0.21, 6: -2.01}), entry(761, {600: -1.6949, 761: -1.7411, 764: -1.7488})]
    assert match_sampled_until_fork(drafted, plain, TOLERANCE + 0.02) == 1
    assert match_sampled_until_fork(plain, plain, TOLERANCE) is None
    # a token only one read holds as a candidate is no rounding: another draw, or another distribution
    with pytest.raises(Mismatch, match="not both candidates"):
        match_sampled_until_fork([plain[0], entry(9, {600: -1.6, 9: -1.7})], plain, 1.0)
    with pytest.raises(Mismatch, match="differ by"):
        match_sampled_until_fork(shifted(plain, 0.5), plain, TOLERANCE)
    with pytest.raises(Mismatch, match="then one ends"):
        match_sampled_until_fork(plain[:1], plain, TOLERANCE)
