"""A state llama.cpp refuses at a disk restore: in split slots the file is untrusted and deleted; in a shared
KV pool (kv_unified) the refusal may only mean that no cells were free (cells and positions differ for images
on M-RoPE models, so the pool's free count is an estimate), so it is a miss and the file, checked, is kept."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from daemon.worker import disk_tier
from daemon.worker.kv_cache import NO_ROOM


@pytest.mark.parametrize("pool_shared, answer, deleted", [(False, "corrupt", True), (True, NO_ROOM, False)])
def test_a_refused_state_is_deleted_only_in_split_slots(monkeypatch, pool_shared, answer, deleted):
    monkeypatch.setattr(disk_tier, "load_state", lambda *args: False)
    monkeypatch.setattr(disk_tier.blocks, "restreamed", lambda state, n_stream: state)
    tier = disk_tier.SavedPrompts.__new__(disk_tier.SavedPrompts)
    rejected = []
    tier.ctx, tier.rule, tier.n_stream, tier.shared, tier.pool_shared = None, None, 1, None, pool_shared
    tier._reject = lambda entry, reason: rejected.append(reason)
    entry = SimpleNamespace(tokens=[1, 2, 3])
    assert tier.install(SimpleNamespace(id=0), entry, b"state") == answer
    assert rejected == (["corrupt"] if deleted else [])
