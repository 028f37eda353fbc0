"""Worker process entry point: `python -m daemon.worker --fd N`.

Lifecycle: say Hello as soon as the imports are done (so a worker spawned
ahead of time holds nothing but the interpreter and the libraries), wait for
Load, load in phases, serve Submit/Cancel through the engine, and on Sleep (or
when the daemon goes away) tear down in order, report, exit.
"""

from __future__ import annotations

import time

_t0 = time.perf_counter()

import argparse  # noqa: E402
import importlib  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402

from daemon import protocol as p  # noqa: E402
from daemon.worker.channel import Channel  # noqa: E402

EXIT_OK = 0
EXIT_LOAD_FAILED = 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m daemon.worker")
    parser.add_argument("--fd", type=int, required=True, help="our end of the socketpair")
    parser.add_argument("--import", dest="imports", default="",
                        help="engine modules to import before Hello, comma-separated (protocol.ENGINE_MODULES)")
    args = parser.parse_args(argv)
    os.dup2(2, 1)  # anything printed goes to the daemon's log, never into the protocol
    ignore_terminal_signals()

    channel = Channel(socket.socket(fileno=args.fd))
    from daemon.worker.llama_lib import llama  # noqa: F401  (the libraries, no device yet)
    from daemon.worker.devices import device_memory
    from daemon.worker.engine import Engine
    from daemon.worker.memory import rss_bytes
    from daemon.worker.runtime import Runtime

    import_engine_modules(args.imports.split(","))
    channel.send(p.Hello(os.getpid(), import_seconds=time.perf_counter() - _t0))
    message = channel.receive()
    if not isinstance(message, p.Load):
        return EXIT_OK  # a spawned-ahead worker that was never needed

    spec = message.spec
    imports = import_beside_the_load(spec)
    runtime = Runtime(spec, on_progress=lambda phase, seconds: channel.send(p.LoadProgress(phase, seconds)))
    try:
        runtime.load()
        imports.join()
        engine = Engine(runtime, channel.send, progressed=channel.step_progressed)
        if spec.warmup:
            warm_up(runtime, engine)
    except Exception as exc:  # noqa: BLE001 - any failure to load is reported, then we exit
        channel.send(p.Error(str(exc), during="load", code="chat_template" if str(exc).startswith("chat template:") else None))
        runtime.teardown()
        return EXIT_LOAD_FAILED

    channel.send(ready(runtime, engine, device_memory))
    while True:
        outcome = serve(channel, engine)  # sleep, eof, or doze (the drowsy tier)
        if outcome != "doze":
            break
        outcome = doze(channel, runtime, engine)
        if outcome != "rouse":
            engine = None
            break
        try:  # a rouse: the contexts again, on the weights this worker kept
            runtime.create_contexts()
            engine = Engine(runtime, channel.send, progressed=channel.step_progressed)
        except Exception as exc:  # noqa: BLE001 - as a failed load: reported, then we exit
            channel.send(p.Error(str(exc), during="rouse"))
            runtime.teardown()
            return EXIT_LOAD_FAILED
        channel.send(ready(runtime, engine, device_memory))
    asked_to_sleep = outcome == "sleep"
    rss_before = rss_bytes()
    if engine is not None:
        engine.close()
    saved_files = save_errors = 0
    kv_phase = []
    if asked_to_sleep and engine is not None and engine.saved is not None:  # the prompt caches go to disk before the context goes
        phase, saved_files, save_errors = engine.saved.save(engine.slots)
        kv_phase = [phase]
    phases = kv_phase + runtime.teardown()
    channel.send(p.SleepReport(phases, rss_before=rss_before, rss_after=rss_bytes(),
                               devices_before=runtime.devices_before, devices_after=runtime.devices_after,
                               kv_saved_files=saved_files, kv_save_errors=save_errors))
    return EXIT_OK


def ignore_terminal_signals() -> None:
    """The daemon decides when this worker ends (Sleep, or EOF when the daemon is gone), never a
    terminal: Ctrl-C, a hang-up or Ctrl-Z meant for `dormouse serve` would kill or stop the worker
    mid-step and lose what a sleep saves. The supervisor also starts it in a session of its own,
    so the terminal's signals do not reach it; this covers a worker started some other way.
    SIGTERM and SIGKILL still end it (the supervisor's kill is SIGKILL)."""
    for name in ("SIGINT", "SIGHUP", "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def import_engine_modules(names) -> None:
    """Import these daemon.worker modules; a name not in protocol.ENGINE_MODULES is ignored
    (the engine imports what it needs anyway)."""
    for name in names:
        if name in p.ENGINE_MODULES:
            importlib.import_module(f"daemon.worker.{name}")


def import_beside_the_load(spec: p.ModelSpec) -> threading.Thread:
    """Import, on a second thread, the modules the engine will need for this spec (the prompt
    cache's numpy, the speculator, the projector's bindings) while the main thread loads the
    weights: the load is llama.cpp's C code, which ctypes runs without the GIL. Measured on 2
    cores: 0.04 s less to the first token of a light wake of the bundled model (0.45 s of weights
    phase to hide them in); nothing gained for a 2 GB model whose weights phase is 0.015 s. A
    worker spawned ahead for a light-tier model imports them before Hello instead (`--import`);
    one spawned for a deep sleep does not: it would hold numpy's ~26 MiB while the daemon sleeps.
    An import that fails here fails again, and is reported, where the engine needs it."""
    def run() -> None:
        try:
            import_engine_modules(p.engine_modules(spec.embeddings, bool(spec.model_draft), bool(spec.mmproj)))
        except Exception:  # noqa: BLE001 - see the docstring
            pass

    thread = threading.Thread(target=run, name="imports", daemon=True)
    thread.start()
    return thread


def ready(runtime, engine, device_memory) -> p.Ready:
    spec = runtime.spec
    return p.Ready(
        n_slots=len(engine.slots),
        n_ctx=spec.ctx_size,
        n_ctx_slot=engine.n_ctx_slot,
        phases=runtime.phases,
        model_info={**runtime.describe(), "memory_by_device": runtime.ledger.by_device(),
                    "devices": device_memory(), "eog_tokens": engine.eog_tokens},
        memory=runtime.ledger.by_component(),
        kv_rejected=engine.saved.rejected_at_load if engine.saved else {},
    )


def doze(channel: Channel, runtime, engine) -> str:
    """The drowsy tier: the prompt caches saved exactly as a sleep saves them, the engine
    and the contexts freed, the weights kept. Then wait: rouse, sleep or eof."""
    from daemon.worker.memory import rss_bytes

    rss_before = rss_bytes()
    engine.close()
    phases, saved_files, save_errors = [], 0, 0
    if engine.saved is not None:  # the same entry point as a sleep's, while the context still holds the KV
        phase, saved_files, save_errors = engine.saved.save(engine.slots)
        phases.append(phase)
    phases += runtime.free_contexts()
    channel.send(p.DozeReport(phases, rss_before=rss_before, rss_after=rss_bytes(),
                              kv_saved_files=saved_files, kv_save_errors=save_errors))
    while True:
        message = channel.receive()
        if message is None:
            return "eof"
        if isinstance(message, p.Sleep):
            return "sleep"
        if isinstance(message, p.Rouse):
            return "rouse"
        # (Pings are answered by the channel's thread.) Submit, Query and Cancel never come while drowsy: the daemon holds requests until Ready.


def warm_up(runtime, engine) -> None:
    """One decode, so the first request does not pay for lazy initialisation."""
    from daemon.worker.llama_lib import llama

    start = time.perf_counter()
    runtime.ledger.component = "context"
    tokens = [llama.llama_vocab_bos(runtime.vocab)]
    batch = llama.llama_batch_get_one((llama.llama_token * 1)(*tokens), 1)
    llama.llama_decode(runtime.ctx, batch)
    llama.llama_synchronize(runtime.ctx)
    llama.llama_memory_clear(engine.memory, True)
    runtime.ledger.component = "other"
    runtime.phases.append(p.Phase("warmup", time.perf_counter() - start))
    runtime.on_progress("warmup", runtime.phases[-1].seconds)


def serve(channel: Channel, engine) -> str:
    """Until Sleep ("sleep"), EOF ("eof") or Doze ("doze"): take messages, run a step whenever there is work.

    Each round (the messages waiting, then one engine step) is a step for the liveness
    check: the channel thread answers pings with its age (channel.py), and the daemon
    kills a worker whose step outlives worker_liveness_timeout. A step is bounded by
    construction: one prompt chunk or one draft catch-up chunk (engine.step); a prompt with images,
    read at once, ends a step after each image and each batch of its text (Engine's `progressed`)."""
    while True:
        message = channel.receive(block=not engine.busy)
        channel.step_begins()
        try:
            while message is not False:
                if message is None or isinstance(message, p.Sleep):
                    return "eof" if message is None else "sleep"
                if isinstance(message, p.Doze):
                    return "doze"
                if isinstance(message, p.Submit):
                    engine.submit(message)
                elif isinstance(message, p.Cancel):
                    engine.cancel(message.request_id)
                elif isinstance(message, p.Query):
                    engine.query(message)
                message = channel.receive(block=False)
            if engine.busy:
                engine.step()
            else:
                engine.report_slots()  # a cancel outside a step changed a slot
        finally:
            channel.step_ends()  # also on the way out: a doze's or a sleep's save has its own bound


if __name__ == "__main__":
    sys.exit(main())
