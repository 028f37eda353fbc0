"""Comparing a cached answer with a fresh read, token for token, where
rounding cannot decide it.

A kept cell decoded in another batch than a fresh read's (a generated
token, a chunk cut elsewhere, a restored window in other KV cells) holds
slightly other bits, so the logits of what follows move a little (rounding
of a sum taken in another order); a window with a hole in it, or a state of
another prompt, moves them by whole units. So while the two answers agree,
each next position's distribution is compared (the log-probabilities of
the tokens both top lists name, within `tolerance`), and the greedy
choices must be equal, unless the fresh read itself was a near-tie there:
its top token and the cached answer's choice within `tie_margin` of each
other, where rounding may pick either. After such a fork the answers read
other prefixes, so the comparison stops there (a `tie`).

The entries are /completion's `completion_probabilities` with `n_probs`:
{"id", "logprob", "top_logprobs": [{"id", "logprob"}, ...]}.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Match:
    compared: int  # positions whose distributions and choices were compared
    tie_at: int | None  # the position where the answers forked at a near-tie of the fresh read; None: no fork
    largest_drift: float  # the largest log-probability difference seen over the compared positions
    smallest_gap: float  # the fresh read's smallest margin between its top two tokens at a compared position
    fork_margin: float | None = None  # at the fork: the fresh read's margin between its choice and the cached one


class Mismatch(AssertionError):
    """The cached answer differs from the fresh read where rounding cannot explain it."""


def top_gap(entry: dict) -> float:
    """The fresh read's margin between its two likeliest tokens (inf with a single one)."""
    ranked = sorted((t["logprob"] for t in entry["top_logprobs"]), reverse=True)
    return ranked[0] - ranked[1] if len(ranked) > 1 else float("inf")


def compare_position(i: int, mine: dict, ref: dict, tolerance: float,
                     with_chosen: bool) -> tuple[dict[int, float], dict[int, float], float]:
    """Position i's top lists (token -> log-probability; with_chosen: each read's choice added), checked to
    share a token and to differ by at most `tolerance` there: (ours, theirs, the largest difference)."""
    theirs = {t["id"]: t["logprob"] for t in ref["top_logprobs"]}
    ours = {t["id"]: t["logprob"] for t in mine["top_logprobs"]}
    if with_chosen:
        theirs.setdefault(ref["id"], ref["logprob"])
        ours.setdefault(mine["id"], mine["logprob"])
    common = theirs.keys() & ours.keys()
    if not common:
        raise Mismatch(f"position {i}: no token in common between the top lists {ours} and {theirs}")
    here = max(abs(theirs[t] - ours[t]) for t in common)
    if here > tolerance:
        raise Mismatch(f"position {i}: log-probabilities differ by {here:.4f} (> {tolerance}): "
                       f"compared {ours}, reference {theirs}")
    return ours, theirs, here


def match_until_tie(got: list[dict], fresh: list[dict], tie_margin: float, tolerance: float) -> Match:
    """Compare the cached answer `got` with the `fresh` read; raise Mismatch where they
    differ by more than rounding. Returns what was compared."""
    drift, gap = 0.0, float("inf")
    for i, ref in enumerate(fresh):
        if i == len(got):
            raise Mismatch(f"position {i}: the cached answer ended, the fresh read went on with {ref['id']} "
                           f"(margin {top_gap(ref):.4f})")
        mine = got[i]
        ours, theirs, here = compare_position(i, mine, ref, tolerance, with_chosen=True)
        drift = max(drift, here)
        if mine["id"] != ref["id"]:
            # Rounding may swap two tokens only where the fresh read holds them nearly level.
            forked = theirs[ref["id"]] - theirs.get(mine["id"], float("-inf"))
            if forked >= tie_margin:
                raise Mismatch(f"position {i}: cached chose {mine['id']}, fresh {ref['id']} with a margin of "
                               f"{forked:.4f} (>= {tie_margin}): cached {ours}, fresh {theirs}")
            return Match(i, i, drift, gap, forked)
        gap = min(gap, top_gap(ref))
    if len(got) > len(fresh):
        raise Mismatch(f"position {len(fresh)}: the fresh read ended, the cached answer went on with "
                       f"{got[len(fresh)]['id']}")
    return Match(len(fresh), None, drift, gap)


def match_sampled_until_fork(got: list[dict], fresh: list[dict], tolerance: float) -> int | None:
    """The same for a seeded sampled answer: the random draws are taken in the same order, so the
    answers agree, each position's log-probabilities within `tolerance`, until a draw falls within
    rounding of the boundary between two tokens; there they may fork, but only between tokens that
    both reads hold as candidates (each in the other's top list). Returns the fork's position (None:
    none); raises Mismatch otherwise."""
    for i, (mine, ref) in enumerate(zip(got, fresh)):
        ours, theirs, _ = compare_position(i, mine, ref, tolerance, with_chosen=False)
        if mine["id"] != ref["id"]:
            if mine["id"] not in theirs or ref["id"] not in ours:
                raise Mismatch(f"position {i}: the answers forked to {mine['id']} and {ref['id']}, not both "
                               f"candidates of both reads: {ours}, {theirs}")
            return i
    if len(got) != len(fresh):
        raise Mismatch(f"the answers agree for {min(len(got), len(fresh))} tokens, then one ends ({len(got)} "
                       f"against {len(fresh)})")
    return None
