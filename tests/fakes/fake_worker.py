"""A fake worker that speaks the real protocol (daemon.protocol over the real
channel) without llama.cpp, for fast tests of the controller.

Behaviour comes from the environment:
  FAKE_LOAD_SECONDS       time Load takes (default 0.05)
  FAKE_LOAD_ERROR         send Error(message) instead of Ready, exit 3
  FAKE_LOAD_ERROR_CODE    ... with this code (Error.code)
  FAKE_CRASH_ON_LOAD      die by SIGSEGV during Load
  FAKE_CRASH_AFTER_TOKENS die by SIGKILL after emitting this many tokens in total
  FAKE_TOKEN_SECONDS      time per decode step (default 0.01)
  FAKE_LOAD_COUNTER       file to append a line to on every Load (counts wakes)
  FAKE_TEARDOWN_SECONDS   time the ordered teardown takes (default 0)
  FAKE_HANG_AFTER_TOKENS  stop itself (SIGSTOP) after emitting this many tokens in total
  FAKE_MODEL_BYTES        the model bytes it reports having loaded (default 1000; its context is 100 more)
  FAKE_MODEL_SIZES        JSON {file stem: model bytes}: per model, over FAKE_MODEL_BYTES (a fleet of sizes)
  FAKE_NO_FIM             the model has no fill-in-the-middle tokens: a Submit with infill is refused
  FAKE_ROUSE_SECONDS      time a Rouse (context creation after a Doze) takes (default 0.01)
  FAKE_ROUSE_ERROR        answer a Rouse with Error(message) and exit 3
  FAKE_DOZE_COUNTER       file to append a line to on every Doze

Its answer is "t0 t1 t2 ..." (one word per token) up to max_tokens, or, with
one choice, up to a stop string of the request (SamplingParams.stop): the
text before it, then Done("stop") with stopping_word set, as the real worker.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time

from daemon import protocol as p
from daemon.worker.channel import Channel


def env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def fake_answer(query: p.Query) -> p.Answer:
    """The real protocol's answers, on a fake vocabulary: a token per word
    (its length), words back as "w<id>", one-dimensional unit embeddings."""
    if query.kind == "tokenize":
        words = query.text.split()
        return p.Answer(query.request_id, tokens=[len(w) for w in words],
                        pieces=[w.encode() for w in words] if query.with_pieces else [])
    if query.kind == "detokenize":
        return p.Answer(query.request_id, text=" ".join(f"w{t}" for t in query.tokens))
    if query.kind in ("apply_template", "render_chat"):
        return p.Answer(query.request_id, text="".join(f"{m.role}: {m.content}\n" for m in query.messages))
    if query.kind == "count_chat":  # a word per token, as tokenize
        return p.Answer(query.request_id, prompt_tokens=sum(
            len(m.content.split()) if isinstance(m.content, str) else sum(len((part.text or "").split()) + (part.type == "image")
                                                                       for part in m.content)
            for m in query.messages))
    if query.kind in ("slot_save", "slot_restore", "slot_erase"):  # [tokens moved, bytes], as the real worker answers
        if query.text == "busy":
            return p.Answer(query.request_id, error=f"slot {query.tokens[0]} is busy", error_code="slot_busy")
        return p.Answer(query.request_id, tokens=[7, 0 if query.kind == "slot_erase" else 4096])
    if query.kind == "embed":
        return p.Answer(query.request_id, embeddings=[[1.0] for _ in query.inputs], prompt_tokens=len(query.inputs))
    if query.kind == "rerank":  # a document's score: how many of the query's words it has
        words = set(query.text.lower().split())
        return p.Answer(query.request_id, embeddings=[[float(len(words & set(d.lower().split())))]
                                                      for d in query.inputs],
                        prompt_tokens=sum(len(query.text.split()) + len(d.split()) for d in query.inputs))
    return p.Answer(query.request_id, error=f"unknown query kind {query.kind!r}", error_code="invalid_request")


def stop_cut(stops: list[str], n: int) -> tuple[str, str] | None:
    """(what token n sends, the stop string) when the answer "t0 t1 ... t<n> "
    now holds one of `stops` (the first found ends it; the stop is not sent);
    None while none is there."""
    before = "".join(f"t{i} " for i in range(n))
    full = before + f"t{n} "
    found = [(at, stop) for stop in stops if stop and (at := full.find(stop)) >= 0]
    if not found:
        return None
    at, stop = min(found)
    return full[len(before):max(at, len(before))], stop


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--import", dest="imports", default="")  # the real worker's: nothing to import here
    args = parser.parse_args()
    channel = Channel(socket.socket(fileno=args.fd))
    channel.send(p.Hello(os.getpid()))
    message = channel.receive()
    if not isinstance(message, p.Load):
        return 0
    if os.environ.get("FAKE_LOAD_COUNTER"):
        with open(os.environ["FAKE_LOAD_COUNTER"], "a") as f:
            f.write(f"{os.getpid()}\n")
    start = time.perf_counter()
    time.sleep(env_float("FAKE_LOAD_SECONDS", 0.05))
    if os.environ.get("FAKE_CRASH_ON_LOAD"):
        print("fake worker: crashing during load", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    if os.environ.get("FAKE_LOAD_ERROR"):
        channel.send(p.Error(os.environ["FAKE_LOAD_ERROR"], during="load",
                             code=os.environ.get("FAKE_LOAD_ERROR_CODE") or None))
        return 3
    spec = message.spec
    sizes = json.loads(os.environ.get("FAKE_MODEL_SIZES", "{}"))
    stem = os.path.splitext(os.path.basename(spec.model))[0]
    model_bytes = int(sizes.get(stem, os.environ.get("FAKE_MODEL_BYTES", "1000")))
    phases = [p.Phase("backend", 0.0), p.Phase("model", time.perf_counter() - start, model_bytes),
              p.Phase("context", 0.0, 100)]
    info = {"path": spec.model, "fake": True,
            "memory_by_device": {"model": {"CPU": model_bytes}, "context": {"CPU": 100}}}
    channel.send(p.Ready(spec.parallel, spec.ctx_size, spec.ctx_size // spec.parallel, phases, info,
                         {"model": model_bytes, "context": 100}))

    def doze() -> str:
        """The drowsy tier: contexts freed (the model kept); then rouse, sleep or eof."""
        if os.environ.get("FAKE_DOZE_COUNTER"):
            with open(os.environ["FAKE_DOZE_COUNTER"], "a") as f:
                f.write(f"{os.getpid()}\n")
        channel.send(p.DozeReport([p.Phase("draft_context", 0.0, 0, skipped=True), p.Phase("context", 0.001, 100)]))
        while True:
            message = channel.receive()
            if message is None:
                return "eof"
            if isinstance(message, p.Sleep):
                return "sleep"
            if isinstance(message, p.Ping):
                channel.send(p.Pong(message.seq))
            if isinstance(message, p.Rouse):
                time.sleep(env_float("FAKE_ROUSE_SECONDS", 0.01))
                if os.environ.get("FAKE_ROUSE_ERROR"):
                    channel.send(p.Error(os.environ["FAKE_ROUSE_ERROR"], during="rouse"))
                    sys.exit(3)
                channel.send(p.Ready(spec.parallel, spec.ctx_size, spec.ctx_size // spec.parallel,
                                     [p.Phase("context", 0.001, 100)], info, {"model": model_bytes, "context": 100}))
                return "rouse"

    crash_after = int(os.environ.get("FAKE_CRASH_AFTER_TOKENS", "0"))
    hang_after = int(os.environ.get("FAKE_HANG_AFTER_TOKENS", "0"))
    step = env_float("FAKE_TOKEN_SECONDS", 0.01)
    active: dict[str, list] = {}  # request id -> [params, n emitted]; at most spec.parallel, like slots
    queued: dict[str, list] = {}  # requests beyond the slots wait in order, as in the real engine
    emitted_total = 0
    reported: list[str] = []

    def report_slots() -> None:  # as the engine does, only when they changed
        ids = list(active)
        if ids != reported:
            reported[:] = ids
            channel.send(p.SlotStates([p.SlotInfo(i, "generating" if i < len(ids) else "idle",
                                                  ids[i] if i < len(ids) else None) for i in range(spec.parallel)]))

    while True:
        while queued and len(active) < spec.parallel:
            rid = next(iter(queued))
            active[rid] = queued.pop(rid)
        report_slots()
        message = channel.receive(block=not active)
        while message is not False:
            if isinstance(message, p.Doze):
                message = doze()
                if message == "eof":
                    return 0
                message = p.Sleep() if message == "sleep" else False
                if message is False:
                    reported.clear()  # a rouse: the slots are new
                    continue
            if message is None or isinstance(message, p.Sleep):
                for rid in [*active, *queued]:
                    channel.send(p.Done(rid, "cancelled"))
                time.sleep(env_float("FAKE_TEARDOWN_SECONDS", 0.0))
                phases = [p.Phase(n, 0.001, 10, skipped=n in ("draft_context", "draft_model", "mmproj"))
                          for n in ("draft_context", "draft_model", "context", "model", "mmproj", "backend")]
                channel.send(p.SleepReport(phases))
                return 0
            if isinstance(message, p.Submit):
                if message.infill is not None and os.environ.get("FAKE_NO_FIM"):
                    channel.send(p.Done(message.request_id, "error", error="model 'fake.gguf' has no fill-in-the-middle "
                                        "tokens", error_code="invalid_request"))
                elif message.prompt == "FAIL":
                    channel.send(p.Done(message.request_id, "error", error="prompt too long", error_code="context_length_exceeded"))
                elif message.params.max_tokens == 0 and message.n == 1:  # as the engine: the prompt, nothing more
                    channel.send(p.Done(message.request_id, "length", prompt_tokens=3, completion_tokens=0))
                else:
                    queued[message.request_id] = [message.params, 0, message.n]
            elif isinstance(message, p.Ping):
                channel.send(p.Pong(message.seq))
            elif isinstance(message, p.Query):
                channel.send(fake_answer(message))
            elif isinstance(message, p.Cancel) and (message.request_id in active or message.request_id in queued):
                active.pop(message.request_id, None) or queued.pop(message.request_id)
                channel.send(p.Done(message.request_id, "cancelled"))
            message = channel.receive(block=False)
        if not active:
            continue  # a submit goes onto a slot at the top of the loop
        time.sleep(step)
        for rid, state in list(active.items()):
            params, n, choices = state
            cut = stop_cut(params.stop, n) if choices == 1 and params.stop else None
            if cut is not None:  # a stop string ended the answer: the text before it, then Done naming it
                del active[rid]
                if cut[0]:
                    channel.send(p.Tokens(rid, cut[0], n + 1, n_prompt_tokens=3 if n == 0 else 0))
                channel.send(p.Done(rid, "stop", prompt_tokens=3, completion_tokens=n + 1, stopping_word=cut[1]))
                continue
            for index in range(choices):  # choice i writes "c<i>t<n> " when there are several
                text = f"c{index}t{n} " if choices > 1 else f"t{n} "
                channel.send(p.Tokens(rid, text, n + 1, n_prompt_tokens=3 if n == 0 else 0, index=index))
            state[1] = n + 1
            emitted_total += 1
            if crash_after and emitted_total >= crash_after:
                os.kill(os.getpid(), signal.SIGKILL)
            if hang_after and emitted_total >= hang_after:
                os.kill(os.getpid(), signal.SIGSTOP)  # hung, not dead: only the liveness check notices
            if state[1] >= min(params.max_tokens, spec.ctx_size // spec.parallel):  # the slot's context is full
                del active[rid]
                if choices > 1:  # each choice's end, then the request's
                    for index in range(choices):
                        channel.send(p.Tokens(rid, "", state[1], index=index, finish_reason="length"))
                channel.send(p.Done(rid, "length", prompt_tokens=3, completion_tokens=state[1] * choices))


if __name__ == "__main__":
    sys.exit(main())
