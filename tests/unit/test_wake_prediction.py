"""The wake prediction's fit (daemon/model/wake_prediction.py) and the keeper's page-cache work (keeper.py)."""

import json
import os

import pytest

from daemon.model.keeper import Keeper, resident_bytes
from daemon.model.wake_prediction import (DEFAULT_DISK_RATE, DEFAULT_DROWSY_SECONDS,
                                          DEFAULT_FIXED_SECONDS, MAX_SAMPLES, WakeHistory)

GB = 10**9


def test_without_samples_the_defaults_stand_and_say_so(tmp_path):
    h = WakeHistory(tmp_path)
    p = h.predict("m", "deep", GB, GB)
    assert p.basis == "default"
    assert p.seconds == pytest.approx(DEFAULT_FIXED_SECONDS + GB / DEFAULT_DISK_RATE)
    assert h.predict("m", "drowsy", 0, 0).seconds == DEFAULT_DROWSY_SECONDS


def test_rates_and_fixed_cost_are_fitted_from_warm_and_cold_samples(tmp_path):
    h = WakeHistory(tmp_path)
    for _ in range(3):
        h.record("m", "light", 2 * GB, 0, seconds=1.5, weights_seconds=1.0)  # cache: 2 GB/s, fixed 0.5 s
        h.record("m", "deep", 2 * GB, 2 * GB, seconds=4.5, weights_seconds=4.0)  # disk: 0.5 GB/s
    assert h.cache_rate() == pytest.approx(2 * GB)
    assert h.disk_rate() == pytest.approx(0.5 * GB)
    light = h.predict("m", "light", 4 * GB, 0)
    assert light.basis == "measured" and light.seconds == pytest.approx(0.5 + 2.0, rel=0.01)
    half = h.predict("m", "deep", 4 * GB, 2 * GB)  # half cached: 1 s + 4 s + fixed
    assert half.seconds == pytest.approx(0.5 + 1.0 + 4.0, rel=0.05)


def test_one_slow_wake_does_not_move_the_median(tmp_path):
    h = WakeHistory(tmp_path)
    for seconds in (1.0, 1.0, 1.0, 30.0):
        h.record("m", "light", GB, 0, seconds=seconds + 0.2, weights_seconds=seconds)
    assert h.cache_rate() == pytest.approx(GB)


def test_a_small_models_wakes_say_nothing_of_a_large_ones_rate(tmp_path):
    """Found on a host whose history held a 0.5 MB test model's wakes (0.05 s of weights phase,
    mostly fixed cost): a first light wake of the 253 MB bundled model was predicted at 26 s."""
    h = WakeHistory(tmp_path)
    for _ in range(20):
        h.record("tiny", "deep", 482_560, 0, seconds=0.11, weights_seconds=0.05)
    assert h.cache_rate("big") is None and h.cache_rate() is None
    assert h.predict("big", "light", 253_000_000, 0).seconds < 1.0  # the default rate, not 10 MB/s
    assert h.cache_rate("tiny") == pytest.approx(482_560 / 0.05)  # its own: the same fixed part each time
    h.record("other", "light", GB, 0, seconds=0.7, weights_seconds=0.5)  # a large one: a host rate
    assert h.cache_rate("big") == pytest.approx(2 * GB)
    # fixed: other models' light wakes' (0.2 s), big having none of its own
    assert h.predict("big", "light", 253_000_000, 0).seconds == pytest.approx(0.2 + 253e6 / 2e9)


def test_each_tier_has_its_own_fixed_cost(tmp_path):
    """A light wake's spare has imported the engine; a deep wake's imports it during the wake."""
    h = WakeHistory(tmp_path)
    for _ in range(3):
        h.record("m", "light", GB, 0, seconds=0.6, weights_seconds=0.5)  # fixed 0.1 s
        h.record("m", "deep", GB, 0, seconds=0.7, weights_seconds=0.5)  # fixed 0.2 s
    assert h.fixed_seconds("m", "light") == pytest.approx(0.1)
    assert h.fixed_seconds("m", "deep") == pytest.approx(0.2)
    assert h.predict("m", "light", GB, 0).seconds == pytest.approx(0.6)
    assert h.predict("m", "deep", GB, 0).seconds == pytest.approx(0.7)
    assert h.fixed_seconds("other", "light") == pytest.approx(0.1)  # no sample of its own: other models' light ones
    assert h.fixed_seconds("other", None) == pytest.approx(0.15)


def test_samples_persist_bounded_and_a_bad_file_is_ignored(tmp_path):
    h = WakeHistory(tmp_path)
    for i in range(MAX_SAMPLES + 10):
        h.record("m", "drowsy", 0, 0, 0.05, 0.0)
    again = WakeHistory(tmp_path)
    assert len(again.samples) == MAX_SAMPLES
    assert again.predict("m", "drowsy", 0, 0).basis == "measured"
    (tmp_path / "wake_history.json").write_text("{not json")
    assert WakeHistory(tmp_path).samples == []
    (tmp_path / "wake_history.json").write_text(json.dumps({"samples": [{"tier": 3}, "x", {"model": "m"}]}))
    assert WakeHistory(tmp_path).samples == []


def test_drowsy_predictions_are_per_model(tmp_path):
    h = WakeHistory(tmp_path)
    h.record("a", "drowsy", 0, 0, 0.02, 0.0)
    assert h.predict("a", "drowsy", 0, 0).seconds == pytest.approx(0.02)
    assert h.predict("b", "drowsy", 0, 0).basis == "default"


def test_a_first_drowsy_wake_is_predicted_from_the_latest_loads_contexts(tmp_path):
    h = WakeHistory(tmp_path)
    first = h.predict("a", "drowsy", 0, 0, contexts_seconds=0.3)
    assert first.seconds == pytest.approx(0.3) and first.basis == "load"  # it refuses no request
    h.record("a", "drowsy", 0, 0, 0.02, 0.0)  # the model's own drowsy wakes take over once there are some
    assert h.predict("a", "drowsy", 0, 0, contexts_seconds=0.3).seconds == pytest.approx(0.02)
    assert h.predict("b", "drowsy", 0, 0, contexts_seconds=None).basis == "default"


def test_the_keeper_reads_back_what_the_page_cache_lost(tmp_path):
    path = tmp_path / "weights.gguf"
    path.write_bytes(os.urandom(4 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    cached, size = resident_bytes(str(path))
    assert size == 4 << 20
    keeper = Keeper([str(path), str(tmp_path / "missing.gguf")]).open()
    try:
        keeper.refresh()
        assert keeper.resident() == size and resident_bytes(str(path))[0] == size
        assert keeper.bytes == size and any("missing.gguf" in e for e in keeper.errors)
        assert keeper.refresh() == 0  # nothing left to read
    finally:
        keeper.close()
    assert keeper.held == []


def test_the_keeper_locks_no_more_than_its_limit(tmp_path):
    path = tmp_path / "w.gguf"
    path.write_bytes(b"\0" * (3 << 20))
    keeper = Keeper([str(path)], mlock_bytes=1 << 20).open()
    try:
        assert keeper.locked_bytes in (0, 1 << 20)  # 0 where RLIMIT_MEMLOCK refuses: then it says so
        assert keeper.locked_bytes or keeper.errors
    finally:
        keeper.close()
