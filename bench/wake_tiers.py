"""Resume to first token from each sleep tier, beside a bare Llama() load and the
file's size over the sequential read rate measured in the same run; the wake
prediction's error; the time to a 503 for a wake that cannot fit the wait.

    .venv/bin/python -m bench.wake_tiers [--cycles 3] [--big-gb 2] [--load-mode auto]

Two models: the bundled Gemma 3 270M, and a ~2 GB llama GGUF (random F16
weights) that the benchmark writes itself (--big-gb 0 skips it). Tiers:
drowsy (the worker keeps the weights), light (the keeper keeps the pages),
deep with the file in the page cache, deep with it dropped. The cache is
dropped with `echo 3 > /proc/sys/vm/drop_caches` where that is writable (CI
runs as root), else per file with posix_fadvise(DONTNEED), which evicts the
clean pages of exactly those files (the table says which was used).

The daemon runs with the bare load's context (2048 tokens, one slot), so a
ratio is the cost of the wake itself. Goals: light <= 1.05x a warm bare load; deep cold within 1.3x of size/read
rate; drowsy < 0.1 s for the bundled model.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


from bench.common import Daemon, bundled_model, median, run_python, table

BARE = """
import json, time
import llama_cpp
t1 = time.perf_counter()
llm = llama_cpp.Llama({model!r}, n_ctx=2048, n_threads={threads}, verbose=False)
t2 = time.perf_counter()
first = None
for chunk in llm.create_completion("The capital of France is", max_tokens=2, temperature=0, stream=True):
    first = first or time.perf_counter()
print(json.dumps({{"load": t2 - t1, "load_to_first_token": first - t1}}))
"""
SAME_CONTEXT = ("--ctx-size", "2048", "--parallel", "1")  # as BARE's Llama(n_ctx=2048)
BODY = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
READ_CHUNK = 8 * 2**20


def drop_cache(path: str) -> str:
    """Evict `path` from the page cache; returns how."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            os.sync()
            f.write("3\n")
        return "drop_caches"
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return "fadvise"


def warm_cache(path: str) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(READ_CHUNK):
            pass


def read_rate(path: str) -> float:
    """Sequential read rate from a cold cache, bytes/s."""
    drop_cache(path)
    size = os.path.getsize(path)
    start = time.perf_counter()
    warm_cache(path)
    return size / (time.perf_counter() - start)


def write_big_model(path: Path, gigabytes: float) -> Path:
    """A llama GGUF of about `gigabytes` (random F16 weights; the tiny test model's
    vocabulary), written once and reused while its size fits."""
    import gguf
    import numpy as np

    from tests.fixtures.tiny_model import BOS, EOS, UNK, vocabulary

    embd, ff, heads, kv_heads = 2048, 8192, 16, 4
    head = embd // heads
    per_layer = 2 * (embd * embd * 2 + 2 * embd * kv_heads * head + 3 * embd * ff)
    layers = max(1, int(gigabytes * 1e9 // per_layer))
    if path.is_file() and abs(path.stat().st_size - layers * per_layer) < 0.1 * layers * per_layer:
        return path
    tokens, scores, types = vocabulary()
    rng = np.random.default_rng(0)
    blocks: dict[tuple[int, int], np.ndarray] = {}

    def weight(shape: tuple[int, int]) -> np.ndarray:  # one random block per shape, reused by every layer
        if shape not in blocks:
            blocks[shape] = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)
        return blocks[shape]

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("dormouse-bench-big-llama")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(2048)
    writer.add_embedding_length(embd)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(UNK)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    n_vocab = len(tokens)
    writer.add_tensor("token_embd.weight", weight((n_vocab, embd)))
    for il in range(layers):
        writer.add_tensor(f"blk.{il}.attn_norm.weight", np.ones(embd, dtype=np.float32))
        writer.add_tensor(f"blk.{il}.attn_q.weight", weight((embd, embd)))
        writer.add_tensor(f"blk.{il}.attn_k.weight", weight((kv_heads * head, embd)))
        writer.add_tensor(f"blk.{il}.attn_v.weight", weight((kv_heads * head, embd)))
        writer.add_tensor(f"blk.{il}.attn_output.weight", weight((embd, embd)))
        writer.add_tensor(f"blk.{il}.ffn_norm.weight", np.ones(embd, dtype=np.float32))
        writer.add_tensor(f"blk.{il}.ffn_gate.weight", weight((ff, embd)))
        writer.add_tensor(f"blk.{il}.ffn_up.weight", weight((ff, embd)))
        writer.add_tensor(f"blk.{il}.ffn_down.weight", weight((embd, ff)))
    writer.add_tensor("output_norm.weight", np.ones(embd, dtype=np.float32))
    writer.add_tensor("output.weight", weight((n_vocab, embd)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def bare_load(model: str, threads: int, cold: bool) -> dict:
    if cold:
        drop_cache(model)
    else:
        warm_cache(model)
    return run_python(BARE.format(model=model, threads=threads))


def measure_tiers(model: str, cycles: int, threads: int, state_dir: str, load_mode: str) -> dict:
    # The bare load's context (BARE: 2048 tokens, one sequence), so that the ratio is the wake's own
    # cost: with the daemon's default four-slot 4096-token context it would include twice the KV.
    d = Daemon("--sleep-idle-seconds", "-1", *SAME_CONTEXT, model=model, threads=threads,
               env={"DORMOUSE_STATE_DIR": state_dir, "DORMOUSE_DEEP_AFTER": "-1", "DORMOUSE_LOAD_MODE": load_mode,
                    "DORMOUSE_KV_CACHE_DISK_BYTES": "0"})
    results: dict[str, list[float]] = {"drowsy": [], "light": [], "deep_warm": [], "deep_cold": []}
    wakes: dict[str, list[float]] = {name: [] for name in results}  # the wake itself (to Ready), of each
    errors: list[tuple[float, str, str]] = []  # (|measured - predicted| / measured, the prediction's basis, tier)
    how = ""
    try:
        d.wait_state("ready", timeout=600)
        d.stream_first_token("/v1/completions", BODY)  # the first request's lazy initialisation
        for _ in range(cycles):
            for name, tier in (("drowsy", "drowsy"), ("light", "light"), ("deep_warm", "deep"), ("deep_cold", "deep")):
                d.http.post("/sleep", json={"tier": tier}).raise_for_status()
                if tier != "drowsy":
                    d.wait_spare()
                if name == "deep_warm":
                    warm_cache(model)
                if name == "deep_cold":
                    how = drop_cache(model)
                time.sleep(0.3)
                results[name].append(d.stream_first_token("/v1/completions", BODY)[0])
                wake = d.props()["last_wake"]
                wakes[name].append(wake["seconds"])
                if wake.get("predicted"):
                    errors.append((abs(wake["seconds"] - wake["predicted"]["seconds"]) / wake["seconds"],
                                   wake["predicted"]["basis"], name))
        props = d.props()
    finally:
        d.stop()
    return {"tiers": {k: median(v) for k, v in results.items()}, "wakes": {k: median(v) for k, v in wakes.items()},
            "errors": errors, "cache_drop": how, "history": props.get("wake_history")}


def time_to_refusal(model: str, threads: int, state_dir: str) -> float:
    """A daemon whose wake_timeout is shorter than this host's measured wakes: seconds to its 503."""
    d = Daemon("--sleep-idle-seconds", "-1", model=model, threads=threads,
               env={"DORMOUSE_STATE_DIR": state_dir, "DORMOUSE_WAKE_TIMEOUT": "0.05"})
    try:
        d.wait_state("ready", timeout=600)
        d.http.post("/sleep", json={"tier": "deep"}).raise_for_status()
        start = time.perf_counter()
        response = d.http.post("/v1/completions", json=BODY)
        seconds = time.perf_counter() - start
        if response.status_code != 503 or response.json()["error"]["code"] != "wake_too_slow":
            raise RuntimeError(f"expected an early 503, got {response.status_code} {response.text[:200]}")
        return seconds
    finally:
        d.stop()


LOAD_MODES = ("auto", "mmap", "none", "direct_io")


def compare_load_modes(model: str, threads: int, state_dir: str) -> list[list[object]]:
    """Each load mode's weights phase from a warm and from a cold page cache (a deep wake)."""
    rows = []
    for mode in LOAD_MODES:
        d = Daemon("--sleep-idle-seconds", "-1", model=model, threads=threads,
                   env={"DORMOUSE_STATE_DIR": state_dir, "DORMOUSE_LOAD_MODE": mode, "DORMOUSE_KV_CACHE_DISK_BYTES": "0"})
        try:
            d.wait_state("ready", "failed", timeout=600)
            for cache in ("warm", "cold"):
                d.http.post("/sleep", json={"tier": "deep"}).raise_for_status()
                d.wait_spare()
                warm_cache(model) if cache == "warm" else drop_cache(model)
                d.http.post("/wake").raise_for_status()
                wake = d.props()["last_wake"]
                weights = sum(p["seconds"] for p in wake["phases"] if p["name"] == "model")
                rows.append([mode, cache, wake["seconds"], weights, os.path.getsize(model) / weights / 1e9])
        finally:
            d.stop()
    return rows


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run(cycles: int = 3, threads: int = 2, big_gb: float = 2.0, load_mode: str = "auto",
        with_modes: bool = True) -> tuple[str, dict]:
    out: list[str] = []
    print = out.append  # noqa: A001
    models = [("bundled Gemma 3 270M", bundled_model())]
    work = Path(tempfile.gettempdir()) / "dormouse-bench"
    work.mkdir(exist_ok=True)
    if big_gb > 0:
        models.append((f"~{big_gb:g} GB llama (written here)", str(write_big_model(work / "big-llama-f16.gguf", big_gb))))
    data: dict = {}
    modes = compare_load_modes(models[0][1], threads, tempfile.mkdtemp(prefix="load-modes-", dir=work)) \
        if with_modes else []
    all_errors: list[tuple[float, str, str]] = []
    rows = []
    for name, path in models:
        size = os.path.getsize(path)
        rate = median([read_rate(path) for _ in range(2)])
        bare_warm = median([bare_load(path, threads, cold=False)["load_to_first_token"] for _ in range(cycles)])
        bare_cold = median([bare_load(path, threads, cold=True)["load_to_first_token"] for _ in range(max(1, cycles // 2))])
        state = tempfile.mkdtemp(prefix="wake-tiers-", dir=work)
        tiers = measure_tiers(path, cycles, threads, state, load_mode)
        refusal = time_to_refusal(path, threads, state)
        all_errors += tiers["errors"]
        t, w = tiers["tiers"], tiers["wakes"]
        floor = size / rate
        rows += [
            [name, "bare Llama() load + first token, warm cache", bare_warm, "", "", ""],
            [name, "bare Llama() load + first token, cold cache", bare_cold, "", "", ""],
            [name, f"size / sequential read rate ({rate / 1e9:.2f} GB/s)", floor, "", "", ""],
            [name, "drowsy -> first token", t["drowsy"], w["drowsy"], f"{t['drowsy'] / bare_warm:.2f}x warm bare",
             "< 0.1 s" if "bundled" in name else ""],
            [name, "light -> first token", t["light"], w["light"], f"{t['light'] / bare_warm:.2f}x warm bare",
             "<= 1.05x"],
            [name, "deep, warm cache -> first token", t["deep_warm"], w["deep_warm"],
             f"{t['deep_warm'] / bare_warm:.2f}x warm bare", ""],
            [name, f"deep, cold cache ({tiers['cache_drop']}) -> first token", t["deep_cold"], w["deep_cold"],
             f"{t['deep_cold'] / floor:.2f}x size/rate", "<= 1.3x"],
            [name, "503 for a wake that cannot fit the wait", refusal, "", "", "< 0.05 s"],
        ]
        data[name] = {"bytes": size, "read_rate": rate, "bare_warm": bare_warm, "bare_cold": bare_cold,
                      "tiers": t, "wakes": w, "refusal_seconds": refusal, "prediction_errors": tiers["errors"],
                      "history": tiers["history"], "cache_drop": tiers["cache_drop"]}
    print(f"Resume to first streamed token by sleep tier, median of {cycles}, {threads} threads, load_mode {load_mode}\n")
    print(table(["model", "what", "seconds", "wake s (to Ready)", "ratio", "goal"], rows))
    if modes:
        print("\nLoad modes (a deep wake by POST /wake, bundled model): the default is the fastest\n")
        print(table(["load mode", "page cache", "wake seconds", "weights phase s", "weights GB/s"], modes))
        data["load_modes"] = modes
    # The predictions that may refuse a request are those from this host's wakes ("measured"); the
    # first wakes of a fresh state directory are predicted from the defaults and said apart.
    measured = [e for e, basis, _ in all_errors if basis == "measured"]
    everything = [e for e, _, _ in all_errors]
    print(f"\nWake prediction error |measured - predicted| / measured (the wake to Ready): "
          f"over {len(measured)} wakes predicted from this host's wakes p50 {percentile(measured, 0.5):.1%}, "
          f"p90 {percentile(measured, 0.9):.1%}; over all {len(everything)} (defaults before any sample included) "
          f"p50 {percentile(everything, 0.5):.1%}, p90 {percentile(everything, 0.9):.1%}")
    by_tier = {name: [e for e, basis, tier in all_errors if basis == "measured" and tier == name]
               for name in ("drowsy", "light", "deep_warm", "deep_cold")}
    print("  by tier (measured basis): " + ", ".join(
        f"{name} p50 {percentile(v, 0.5):.1%} p90 {percentile(v, 0.9):.1%} (n={len(v)})" for name, v in by_tier.items()))
    data["prediction_error_by_tier"] = {name: [percentile(v, 0.5), percentile(v, 0.9), len(v)] for name, v in by_tier.items()}
    data["prediction_error_p50"] = percentile(measured, 0.5)
    data["prediction_error_p90"] = percentile(measured, 0.9)
    data["prediction_error_all_p50"] = percentile(everything, 0.5)
    data["prediction_error_all_p90"] = percentile(everything, 0.9)
    return "\n".join(out), data


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--big-gb", type=float, default=2.0, help="size of the written GGUF; 0: skip it")
    parser.add_argument("--load-mode", default="auto", choices=["auto", "mmap", "none", "mlock", "mmap+mlock", "direct_io"])
    parser.add_argument("--no-load-modes", action="store_true", help="skip the load-mode comparison")
    args = parser.parse_args()
    text, data = run(args.cycles, args.threads, args.big_gb, args.load_mode, not args.no_load_modes)
    print(text)
    print("\n" + json.dumps(data, default=str))


if __name__ == "__main__":
    main()
