"""llama_options (llama-server's -ub, -ctk, -fa, ... passed through) reach llama.cpp in a real
worker: the context llama.cpp creates has them, the daemon carries them from its settings, and a
bad table is a load error that names it, never a crash inside llama.cpp."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.e2e

# Loads the bundled model with the given llama_options, decodes 600 tokens into slot 0, and
# prints what llama.cpp holds: the micro-batch size and the bytes of the slot's KV state.
MEASURE = r"""
import json, sys
from daemon.protocol import ModelSpec
from daemon.worker.llama_lib import llama
from daemon.worker.runtime import LoadError, Runtime

model, options = sys.argv[1], json.loads(sys.argv[2])
rt = Runtime(ModelSpec(model=model, ctx_size=2048, parallel=1, threads=2, llama_options=options))
try:
    rt.load()
except LoadError as exc:
    print(json.dumps({"error": str(exc)}))
    sys.exit(0)
batch = llama.llama_batch_init(512, 0, 1)
pos = 0
while pos < 600:
    n = min(512, 600 - pos)
    batch.n_tokens = n
    for j in range(n):
        batch.token[j], batch.pos[j], batch.n_seq_id[j] = 100 + (pos + j) % 1000, pos + j, 1
        batch.seq_id[j][0], batch.logits[j] = 0, j == n - 1
    assert llama.llama_decode(rt.ctx, batch) == 0
    pos += n
print(json.dumps({"n_ubatch": llama.llama_n_ubatch(rt.ctx), "state": llama.llama_state_seq_get_size(rt.ctx, 0)}))
rt.teardown()
"""


def measure(model: str, options) -> dict:
    done = subprocess.run([sys.executable, "-c", MEASURE, model, json.dumps(options)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_llama_options_set_the_context_llama_cpp_creates(bundled_model):
    plain = measure(bundled_model, {})
    tuned = measure(bundled_model, {"n_ubatch": 64, "type_k": 8, "flash_attn_type": 0})  # -ub 64 -ctk q8_0 -fa off
    print(f"\nplain {plain}, tuned {tuned}")
    assert plain["n_ubatch"] == 512 and tuned["n_ubatch"] == 64
    # q8_0 keys take 34 bytes per 32 values where f16 takes 64: the slot's saved state shrinks by about a
    # quarter (values stay f16).
    assert tuned["state"] < plain["state"] * 0.85


@pytest.mark.parametrize("options, message", [
    ({"kv_unified": True}, "llama_options: kv_unified: the worker sets it"),
    ({"type_k": "q8_0"}, "llama_options: type_k: must be an integer"),
    ({"tensor_split": 1}, "llama_options: 'tensor_split' is not a llama.cpp context or model parameter"),
])
def test_a_bad_table_that_reaches_the_worker_is_a_load_error_naming_it(bundled_model, options, message):
    assert message in measure(bundled_model, options)["error"]


def test_the_daemon_carries_llama_options_from_its_settings_to_the_worker(start_daemon):
    def context_bytes(env):
        d = start_daemon("--sleep-idle-seconds", "-1", "--ctx-size", "8192", "--parallel", "1", env=env)
        d.wait_state("ready", timeout=300)
        phases = {phase["name"]: phase for phase in d.props()["last_wake"]["phases"]}
        d.stop()
        return phases["context"]["bytes"]

    plain = context_bytes({})
    quantized = context_bytes({"DORMOUSE_LLAMA_OPTIONS": json.dumps({"type_k": 8, "type_v": 8, "flash_attn_type": 1})})
    print(f"\ncontext bytes: f16 KV {plain}, q8_0 KV {quantized}")
    assert 0 < quantized < plain * 0.8  # KV in q8_0: 34 bytes per 32 values, not 64
