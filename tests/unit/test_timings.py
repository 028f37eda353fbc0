"""timings says which tier of the prompt cache the cached tokens came from, and nothing when none did."""

from daemon import protocol as p
from daemon.http.dialects.openai.shapes import timings


def test_cache_tier_in_timings_only_when_the_cache_served():
    for tier in ("slot", "ram", "disk"):
        out = timings(p.Done("r", "stop", prompt_tokens=300, cached_tokens=256, cache_tier=tier))
        assert out["cache_tier"] == tier and out["cache_n"] == 256 and out["prompt_n"] == 44
    assert "cache_tier" not in timings(p.Done("r", "stop", prompt_tokens=300))
