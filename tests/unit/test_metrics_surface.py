"""What a scrape lists (issue 30): no `_created` series, and each prompt-cache
figure in one family (dormouse_prompt_cache_*), not again under another name."""

import shutil
import subprocess

import pytest

from daemon import protocol as p
from daemon.metrics import MetricFamilies, Metrics
from daemon.metrics_compat import KINDS
from tests.metrics_text import samples


def scrape_after_a_disk_restore() -> str:
    """One model that served a prompt of 1009 tokens, 37 of them restored from the disk tier in 0.0123 s;
    the controller's accounting (daemon/model/controller.py _account) reduced to what metrics see."""
    families = MetricFamilies()
    m = Metrics(families, "a")
    done = p.Done("r", "stop", prompt_tokens=1009, completion_tokens=5, cached_tokens=37, restored_tokens=37,
                  restore_seconds=0.0123, kv_lookup="hit", cache_tier="disk", prompt_seconds=0.1,
                  generation_seconds=0.2)
    m.prompt_tokens.inc(done.prompt_tokens)
    m.kv_restore_seconds.observe(done.restore_seconds)
    m.observe_request(done, accepted_at=0.0)
    m.set_disk_tier({"files": 3, "bytes": 987654, "prefixes": []})
    return families.render(KINDS)[0].decode()


def own(text: str) -> list[tuple[str, float]]:
    """Dormouse's own samples, (name, value), the compatibility names left out."""
    from prometheus_client.parser import text_string_to_metric_families
    return [(s.name, s.value) for f in text_string_to_metric_families(text) if f.name.startswith("dormouse_")
            for s in f.samples]


def test_a_scrape_has_no_created_series():
    text = scrape_after_a_disk_restore()
    assert "_created" not in text
    # ...while the counters and histograms are all still there.
    assert samples(text, "dormouse_prompt_tokens_total") == [1009]
    assert samples(text, "dormouse_prompt_cache_restore_seconds_count") == [1]


def test_each_prompt_cache_figure_appears_once():
    text = scrape_after_a_disk_restore()
    names = {name for name, _ in own(text)}
    assert not [n for n in names if n.startswith("dormouse_kv_cache")], "the old family is gone"
    assert "dormouse_prompt_cached_tokens_total" not in names  # the sum of dormouse_prompt_cache_tokens_total
    # A figure that is counted twice shows its value under two names: each of these values is
    # distinctive, so it must be found in exactly one of Dormouse's samples.
    for figure, name in ((37, "dormouse_prompt_cache_tokens_total"), (987654, "dormouse_prompt_cache_bytes"),
                         (3, "dormouse_prompt_cache_entries"), (0.0123, "dormouse_prompt_cache_restore_seconds_sum")):
        holders = [n for n, v in own(text) if v == figure]
        assert holders == [name], (figure, holders)
    assert samples(text, "dormouse_prompt_cache_hits_total", tier="disk") == [1]
    # The compatibility exports read the one family: llama-server's cached tokens are those 37.
    assert samples(text, "llamacpp:prompt_tokens_cached_total") == [37]
    assert samples(text, "llamacpp:prompt_tokens_total") == [1009 - 37]


def test_every_cache_family_is_a_prompt_cache_family():
    names = [getattr(MetricFamilies(), n)._name for n in MetricFamilies().names]
    cache = [n for n in names if "cache" in n]
    assert cache and all(n.startswith("dormouse_prompt_cache_") for n in cache), cache


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_finds_nothing_in_dormouses_own_text():
    families = MetricFamilies()
    Metrics(families, "a")
    text = families.render()[0].decode()
    proc = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), proc.stdout + proc.stderr
