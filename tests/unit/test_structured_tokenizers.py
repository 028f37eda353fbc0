"""The worker's llguidance tokenizer registry when its build fails: the failure is kept for that
model file (one build, not one per structured request: each build stalls every slot while
llguidance's constructor holds the GIL), a new model file builds again, and a thread that cannot
start fails the request instead of leaving it waiting forever. Builds are counted, no model needed."""

import ctypes
import threading

import pytest

from daemon.worker import structured
from daemon.worker.structured import _Tokenizers


def failing_build(calls):
    def build(vocab, stop=None, parts=None):
        calls.append(vocab.value)
        raise ValueError("this vocabulary cannot be read")
    return build


def test_a_failed_build_is_kept_for_its_model_file_and_redone_for_another(tmp_path, monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(structured, "build_tokenizer", failing_build(calls))
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    first.write_bytes(b"a")
    second.write_bytes(b"bb")
    registry, vocab = _Tokenizers(), ctypes.c_void_p(0x1000)
    registry.attach(vocab, str(first))
    for _ in range(5):  # five structured requests
        with pytest.raises(ValueError, match="cannot be read"):
            registry.get(vocab)
    assert registry.builds == 1 and len(calls) == 1
    registry.attach(vocab, str(first))  # the same file again (a drowsy wake): still the kept failure
    with pytest.raises(ValueError):
        registry.get(vocab)
    assert registry.builds == 1
    registry.attach(vocab, str(second))  # another model file: built again
    with pytest.raises(ValueError):
        registry.get(vocab)
    assert registry.builds == 2


def test_a_thread_that_cannot_start_fails_the_request(monkeypatch):
    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    registry, vocab = _Tokenizers(), ctypes.c_void_p(0x2000)
    registry.attach(vocab)
    with pytest.raises(RuntimeError, match="start new thread"):
        registry.get(vocab)  # returns at once: nothing left waiting on a build that never began
    assert registry._thread is None
