"""llama.cpp keeps its log callback's address for the life of the process: a
Runtime that is gone must not leave it pointing at freed memory (the full run
segfaulted so: an in-process Runtime of an e2e test, then a model loaded by a
later test). Run in a child process, so that a crash fails this test alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import gc
    from daemon.protocol import ModelSpec
    from daemon.worker.llama_lib import llama
    from daemon.worker.runtime import Runtime

    for _ in range(3):  # each one sets the callback; none outlives its loop turn
        Runtime(ModelSpec(model="/nonexistent.gguf", ctx_size=256, parallel=1, threads=1))
        gc.collect()
    llama.llama_backend_init()
    junk = [bytearray(4096) for _ in range(20000)]  # reuse freed memory, as a long run would
    params = llama.llama_model_default_params()
    assert not llama.llama_model_load_from_file(b"/nonexistent/model.gguf", params)
    print("survived")
""")


def test_a_model_loaded_after_every_runtime_is_gone_logs_without_a_crash(tmp_path):
    run = subprocess.run([sys.executable, "-X", "faulthandler", "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "survived" in run.stdout
    # Nobody listens any more, so llama.cpp's error about the file still reaches stderr.
    assert "/nonexistent/model.gguf" in run.stderr
