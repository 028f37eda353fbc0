"""What the prompt cache may change in an answer (issues 16 and 26), on the
real model: random conversations sharing prefixes of random lengths (none,
inside Gemma 3's 512-token sliding window, past it), with random turns,
regenerates (the last prompt again, without its answer), edits (the last
prompt's new words replaced), unrelated prompts on the same slots, and
between turns a sleep, the slots given to other prompts (`away`: back from
the RAM tier), the RAM tier pushed past its budget (`evict`: back from disk)
or a restart of the daemon on the same state directory (back from disk).
Each answer is compared with the same prompt read in full
(`cache_prompt: false`) by a daemon of its own.

- cache_deterministic = true: every greedy answer equals the full read
  token for token, with the same log-probabilities (the same bits).
- cache_deterministic = false (the default; window checkpoints on): a prompt
  that keeps nothing equals the full read bit for bit; one that keeps cells
  (a live slot, a checkpoint restored from any tier) gives the full read's
  tokens, with its log-probabilities within LOGPROB_TOLERANCE, up to where
  the full read itself was a near-tie (tests/answer_match.py). Regenerates
  and edits after a sleep, an eviction or a restart kept tokens (the
  checkpoints served), from each tier.

The seed is printed; DORMOUSE_PROPERTY_SEED replays one (=random draws one).
"""

from __future__ import annotations

import os
import random

import pytest

from tests.answer_match import Match, Mismatch, match_until_tie
from tests.metrics_text import value
from tests.soak import rounds

pytestmark = pytest.mark.e2e

WORDS = ("river mill dawn baker rye bread miller stone bridge lamp market winter cart horse salt ledger clock "
         "harbor rope lantern orchard well").split()
N_PREDICT = 12
TIERS = ("slot", "ram", "disk")
MIN_TOKENS = 16  # kv_cache_min_tokens: entries and checkpoints from this many tokens
# Measured on this model: a regenerate restored from a disk checkpoint decodes its last prompt
# token alone, where a fresh read decodes it inside a 345-token chunk; llama.cpp's CPU kernels take
# another path for another batch size (engine.step's note), which moved the first answer token's
# log-probabilities by 0.128 at the first answer token and by 0.31 at the tenth (seed 17: the
# answer's own cells attend to the restored window, so the drift grows), the tokens all equal.
# Over seed 17's trial the largest drift was 0.72 (an edit restored from RAM), and keeping only
# the first token (the rest read in chunks shifted by one) moved them by 0.35: kernel paths, not
# holes (a hole answers garbage: test_an_unrelated_chat_after_a_restore_...). The tolerance is
# twice the largest seen; two tokens may swap only where the fresh read holds them within
# TIE_MARGIN (the one fork seen was at 0.19).
LOGPROB_TOLERANCE = 1.5
TIE_MARGIN = 1.0
# The RAM tier's budget: a conversation with its checkpoints fits (~35 MiB at most here), and a few
# prompts of other users push it out (`evict`).
RAM_BUDGET = "40MiB"
LONGEST = 1200  # tokens of a conversation past which its next turn starts another (2048 per slot)
AFTER_A_BREAK = ("turn", "regenerate", "edit")  # what a user does when coming back


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def complete(d, prompt: str, cache: bool, n_predict: int = N_PREDICT) -> tuple[str, int, int, list, str]:
    """The greedy answer, the tokens kept from the cache, the prompt's tokens, each answer
    token with its log-probability and the 5 likeliest (the bits of the logits), and the
    tier the kept tokens came from."""
    r = d.http.post("/completion", json={"prompt": prompt, "n_predict": n_predict, "temperature": 0,
                                         "cache_prompt": cache, "n_probs": 5},
                    timeout=600)  # a full read on a loaded 2-core machine can take a minute
    assert r.status_code == 200, r.text
    body = r.json()
    return (body["content"], body["tokens_cached"], body["tokens_evaluated"], body["completion_probabilities"],
            body["timings"].get("cache_tier", ""))


def chat_text(d, messages: list[dict]) -> str:
    """A chat prompt as the model reads it (the shared template header included)."""
    r = d.http.post("/apply-template", json={"messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


class Trial:
    """Random conversations and the operations that can happen between their turns.

    `restart`, when given, stops nothing itself: it returns a new daemon on the
    trial's state directory (the caller's fixture stops the old one first)."""

    def __init__(self, d, fresh, rng: random.Random, script: tuple[str, ...] = (), *, restart=None,
                 shared_pool: bool = False) -> None:
        self.d, self.fresh_daemon, self.rng = d, fresh, rng
        # kv_unified: even a prompt that keeps nothing lands in other cells than a fresh read's (among the
        # other slot's), so every answer is compared by the rule of kept cells, none bit for bit.
        self.shared_pool = shared_pool
        self.restart = restart
        self.script = list(script)  # operations that come first, whatever the draw
        self.base = words(rng, 900)  # ~1000 tokens: prefixes inside the window and past it
        self.last: str | None = None  # the conversation so far: its last prompt and answer
        self.asked = ""  # its last prompt, without the answer (what a regenerate sends again)
        self.boundary = 0  # characters of `asked` that the turn before held (an edit changes only what follows)
        self.boundary_kept = 0  # tokens that turn kept: its turn boundary is a checkpoint when >= MIN_TOKENS
        self.n_asked = self.n_last = 0  # tokens of `asked`; of `last`, about
        self.since = ""  # what happened since the conversation's last turn: sleep, away, evict, restart
        self.deterministic = False
        self.kept = 0
        self.tiers: dict[str, int] = {}  # prompts that kept cells, by the tier they came from
        self.comebacks: dict[str, int] = {}  # regenerates and edits after a break that kept cells, by tier
        self.matches: list[Match] = []  # the strict comparisons of prompts that kept cells (default mode)
        self.ops: dict[str, int] = {}
        self.log: list[str] = []

    # -- the draw -----------------------------------------------------------------

    def prompt(self) -> tuple[str, str]:
        rng = self.rng
        draw = ["shared", "shared", "turn", "turn", "regenerate", "edit", "unrelated", "chat", "sleep", "away",
                "evict"] + (["restart"] if self.restart is not None else [])
        op = self.script.pop(0) if self.script else rng.choice(draw)
        op = self.between_turns(op)
        if op in AFTER_A_BREAK and self.last is not None and self.n_last > LONGEST:
            op = "shared"  # the slot's context would overflow: another conversation
        if self.last is None or op in ("shared", "long"):  # a new conversation, often one past the window
            cut = rng.choice([0, 4, rng.randint(10, 500), rng.randint(520, 900), rng.randint(520, 900)])
            cut = rng.randint(700, 900) if op == "long" else cut
            return op, " ".join(self.base.split()[:cut]) + " " + words(rng, rng.randint(3, 200))
        if op == "turn":
            return op, self.last + " " + words(rng, rng.randint(20, 150))
        if op == "regenerate":  # the same prompt again (a retry): its answer is the one to compare
            return op, self.asked
        if op == "edit":  # the last prompt's new words replaced: it shares what the turn before held, and more
            spaces = [i for i, c in enumerate(self.asked) if c == " " and i > self.boundary + 1][-60:]
            cut = rng.choice(spaces) if spaces else len(self.asked)
            return op, self.asked[:cut] + " " + words(rng, 10)
        if op == "unrelated":
            return op, words(rng, rng.randint(3, 40))
        return op, chat_text(self.d, [{"role": "user", "content": words(rng, rng.randint(5, 400))}])

    def between_turns(self, op: str) -> str:
        """Carry out `op` if it happens between turns ("sleep", "away", "evict",
        "restart", optionally followed by what comes next: "sleep edit");
        returns the prompt's op."""
        kind, _, then = op.partition(" ")
        if kind not in ("sleep", "away", "evict", "restart"):
            return op
        if kind != "sleep" and self.last is None:  # no conversation to come back to yet
            return then or "shared"
        self.ops[kind] = self.ops.get(kind, 0) + 1
        if kind == "sleep":
            r = self.d.http.post("/sleep", timeout=600)
            assert r.status_code == 200, r.text
            then = then or self.rng.choice(AFTER_A_BREAK + ("unrelated",))
        elif kind == "restart":
            if self.restart is None:
                return then or "turn"
            self.d.stop(timeout=600)  # SIGTERM: the slots are saved to disk, as at a sleep (given the time)
            self.d = self.restart()
        elif kind == "away":
            # Both slots given to other prompts (distinct first words: neither keeps the other's): the
            # conversation's cells leave the slots for the RAM tier.
            for lead in ("Aside", "Meanwhile"):
                self.check("away-other", lead + " " + words(self.rng, self.rng.randint(20, 40)))
        else:
            self.push_out_of_ram()
        self.since = kind
        return then or self.rng.choice(AFTER_A_BREAK)

    def push_out_of_ram(self) -> None:
        """Other users' prompts until every entry the RAM tier held once the conversation
        left its slot is evicted (least recently used first: those are older than the
        fillers), so the conversation comes back from disk."""
        for lead in ("Other", "Another"):  # both slots to other prompts: the conversation goes to RAM
            complete(self.d, lead + " " + words(self.rng, 300), cache=True, n_predict=1)
        metrics = self.d.http.get("/metrics").text
        held = value(metrics, "dormouse_prompt_cache_entries", tier="ram")
        evicted = value(metrics, "dormouse_prompt_cache_evictions_total", tier="ram")
        for i in range(12):
            if value(self.d.http.get("/metrics").text, "dormouse_prompt_cache_evictions_total", tier="ram") \
                    >= evicted + held:
                self.log.append(f"evict: {held:.0f} entries pushed out by {i + 2} prompts of others")
                return
            complete(self.d, f"Filler{i} " + words(self.rng, 300), cache=True, n_predict=1)
        raise AssertionError(f"12 prompts did not push {held} entries out of the RAM tier:\n" + "\n".join(self.log))

    # -- one prompt, compared -------------------------------------------------------

    def step(self, deterministic: bool) -> None:
        self.deterministic = deterministic
        op, prompt = self.prompt()
        since, self.since = self.since, ""
        answer, cached, n = self.check(op, prompt, since)
        if op == "unrelated":
            return
        if op in ("turn", "shared", "long", "chat"):
            self.boundary = len(self.last) if op == "turn" else 0
            self.boundary_kept = cached if op == "turn" else 0
        self.asked, self.last, self.n_asked, self.n_last = prompt, prompt + answer, n, n + N_PREDICT

    def check(self, op: str, prompt: str, since: str = "") -> tuple[str, int, int]:
        """One prompt, with the cache and read in full; the answers compared as the mode promises."""
        self.ops[op] = self.ops.get(op, 0) + 1
        answer, cached, n, probs, tier = complete(self.d, prompt, cache=True)
        # The reference reads the prompt in full in its own daemon, so that the
        # trial's slots see only the trial's own history.
        reference, ref_cached, _, ref_probs, _ = complete(self.fresh_daemon, prompt, cache=False)
        assert ref_cached == 0
        line = f"{op}{' after ' + since if since else ''}: {n} tokens, {cached} kept" \
               f"{' from ' + tier if cached else ''}, same={answer == reference}"
        if cached:
            self.kept += 1
            self.tiers[tier] = self.tiers.get(tier, 0) + 1
        if self.deterministic or cached == 0 and not self.shared_pool:
            self.log.append(line)
            assert answer == reference, "\n".join(self.log) + f"\n{answer!r}\n{reference!r}"
            assert probs == ref_probs  # tokens and log-probabilities alike: the same bits
        else:
            try:
                match = match_until_tie(probs, ref_probs, TIE_MARGIN, LOGPROB_TOLERANCE)
            except Mismatch as e:  # the trial so far, to replay and diagnose
                raise Mismatch("\n".join(self.log + [line, str(e)]) + f"\ncached {answer!r}\nfresh  {reference!r}") \
                    from None
            self.matches.append(match)
            self.log.append(line + f", {match.compared} compared, drift {match.largest_drift:.2g}"
                            + (f", forked at a near-tie ({match.fork_margin:.2g}) at {match.tie_at}"
                               if match.tie_at is not None else ""))
        print(self.log[-1], flush=True)  # as it goes: a trial cut off by the timeout shows how far it went
        # RAM is empty after a restart, pushed out by evict: what comes back comes from disk. A restore keeps
        # at least an entry's worth (MIN_TOKENS); fewer kept tokens are a slot's incidental share (the BOS of
        # another prompt), as for a prompt under one index block whose entry is no longer among the newest
        # eight of its scope (prefix_index.MAX_SHARERS) and is read again.
        if since in ("evict", "restart") and cached >= MIN_TOKENS:
            assert tier == "disk", "\n".join(self.log)
        if not self.deterministic and since and op in ("regenerate", "edit"):
            # A checkpoint served: the prompt's end (a regenerate) or the turn boundary (an edit),
            # where there is one (a restore keeps at least MIN_TOKENS).
            if (op == "regenerate" and self.n_asked > MIN_TOKENS
                    or op == "edit" and self.boundary_kept >= MIN_TOKENS):
                assert cached > 0, "\n".join(self.log)
            if cached:
                self.comebacks[tier] = self.comebacks.get(tier, 0) + 1
        return answer, cached, n

    def summary(self) -> str:
        compared = sum(m.compared for m in self.matches)
        ties = sum(m.tie_at is not None for m in self.matches)
        drift = max((m.largest_drift for m in self.matches), default=0.0)
        gap = min((m.smallest_gap for m in self.matches), default=float("inf"))
        return (f"ops: {self.ops}\nkept cells by tier: {self.tiers}\ncomebacks (regenerate, edit after a break) "
                f"by tier: {self.comebacks}\nstrict comparisons: {len(self.matches)} prompts, {compared} tokens "
                f"compared, {ties} stopped at a near-tie, largest log-probability drift {drift:.3g}, smallest "
                f"margin compared {gap:.3g}")


def seed(default: int) -> int:
    """Fixed unless DORMOUSE_PROPERTY_SEED says otherwise (=random draws one), so CI is reproducible."""
    chosen = os.environ.get("DORMOUSE_PROPERTY_SEED", str(default))
    return random.SystemRandom().randrange(2**32) if chosen == "random" else int(chosen)


# Both runs begin with what reviews found: a conversation past the window,
# saved at a sleep, and its next turn (a restore that lacks its first positions would
# land in other cells and round otherwise); its slots given away (back from RAM); the
# RAM tier pushed past its budget and a restart (back from disk). Then they draw a
# few more steps (12 in all under `make soak`; any seed with DORMOUSE_PROPERTY_SEED=random).
@pytest.mark.parametrize("deterministic, batch_size, steps, default_seed, script, unified", [
    (True, 128, rounds(7, 12), 16, ("long", "sleep turn", "away", "evict turn", "restart edit"), False),
    (False, 512, rounds(10, 12), 17, ("long", "sleep regenerate", "turn", "away edit", "evict regenerate", "restart edit"),
     False),
    # The slots in one shared KV pool (kv_unified): a slot's cells lie among the other's, restores land
    # wherever cells are free; compared with a fresh read in a daemon of split slots, by the same rule.
    (False, 512, rounds(10, 12), 18, ("long", "sleep regenerate", "turn", "away edit", "evict regenerate", "restart edit"),
     True),
])
def test_the_cache_never_changes_a_deterministic_answer(start_daemon, tmp_path, deterministic, batch_size, steps,
                                                        default_seed, script, unified):
    s = seed(default_seed)
    print(f"\nDORMOUSE_PROPERTY_SEED={s}")

    def start(name: str):
        # Two slots of 2048 tokens (or sharing 4096, the trial's with unified). A live slot keeps every
        # window position (swa_full); only a restored one lacks the first ones.
        shared = ("-kvu",) if unified and name == "trial" else ()
        d = start_daemon("--parallel", "2", "--ctx-size", "4096", "--batch-size", str(batch_size), *shared,
                         "--sleep-idle-seconds", "-1", "--state-dir", str(tmp_path / name),
                         env={"DORMOUSE_KV_CACHE_MIN_TOKENS": str(MIN_TOKENS),
                              "DORMOUSE_PROMPT_CACHE_RAM_BYTES": RAM_BUDGET,
                              "DORMOUSE_CACHE_DETERMINISTIC": str(deterministic).lower()})
        d.wait_state("ready", timeout=600)
        return d

    fresh = start("fresh")
    trial = Trial(start("trial"), fresh, random.Random(s), script=script, restart=lambda: start("trial"),
                  shared_pool=unified)
    for _ in range(steps):
        trial.step(deterministic)
    print(trial.summary())
    assert trial.kept >= 3, trial.log  # not vacuous: cells were kept and compared
    # Not vacuous either for the tiers: answers were compared after a RAM restore and a disk restore.
    assert trial.tiers.get("ram", 0) >= 1 and trial.tiers.get("disk", 0) >= 1, trial.log
    assert all(trial.ops.get(op, 0) >= 1 for op in ("sleep", "away", "evict", "restart")), trial.ops
    if not deterministic:
        # The checkpoints served regenerates and edits after a break, from RAM and from disk;
        # near-ties (where rounding may pick either token) are rare.
        assert trial.comebacks.get("ram", 0) >= 1 and trial.comebacks.get("disk", 0) >= 1, trial.summary()
        assert sum(m.compared for m in trial.matches) >= 5 * N_PREDICT, trial.summary()
        # In a shared pool the kept cells lie out of order among the other slot's, and near-ties come a
        # little more often (3 of 12 prompts, seed 18; split slots: 1-2 of 7-8).
        ties = len(trial.matches) // (3 if unified else 4)
        assert sum(m.tie_at is not None for m in trial.matches) <= ties, trial.summary()


def test_an_unrelated_chat_after_a_restore_is_answered_as_a_fresh_read(start_daemon, tmp_path):
    """The report: an 818-token chat, a sleep, its next turn (restored), then an
    unrelated short chat that shares only the template header landed on the
    restored slot, whose window layers held nothing below position ~300, and
    answered garbage ('user\nuser\n...'). One slot, so that it must land there."""
    d = start_daemon("--parallel", "1", "--sleep-idle-seconds", "-1", "--state-dir", str(tmp_path / "state"))
    fresh = start_daemon("--parallel", "1", "--sleep-idle-seconds", "-1", "--state-dir", str(tmp_path / "fresh"))
    d.wait_state("ready")
    fresh.wait_state("ready")
    rng = random.Random(818)
    history = [{"role": "user", "content": words(rng, 780)}]
    answer, _, n1, _, _ = complete(d, chat_text(d, history), cache=True)
    assert 700 < n1 < 1000
    for _ in range(2):
        assert d.http.post("/sleep").status_code == 200
        history += [{"role": "assistant", "content": answer}, {"role": "user", "content": words(rng, 5)}]
        answer, restored, _, _, _ = complete(d, chat_text(d, history), cache=True)
        assert restored > n1  # the conversation came back from disk
        unrelated = chat_text(d, [{"role": "user", "content": words(rng, 8)}])
        got, kept, _, _, _ = complete(d, unrelated, cache=True)
        reference, _, _, _, _ = complete(fresh, unrelated, cache=False)  # a daemon that never saw the long chat
        assert kept == 0  # the shared header is not in the window layers: read from 0
        assert got == reference


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from tests.fixtures.tiny_model import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"))


def test_a_full_attention_model_restores_by_the_longest_common_prefix(start_daemon, tmp_path, tiny_model):
    """Without a sliding window a saved state holds every position, so after a
    sleep an edited prompt, or the same prompt again, restores up to where it
    differs from what was saved (the saved entry being the prompt and its answer)."""
    d = start_daemon("--model", tiny_model, "--parallel", "1", "--ctx-size", "1024", "--sleep-idle-seconds", "-1",
                     "--state-dir", str(tmp_path / "state"), env={"DORMOUSE_KV_CACHE_MIN_TOKENS": "16"})
    d.wait_state("ready")
    rng = random.Random(5)
    prompt = [rng.randrange(3, 300) for _ in range(300)]

    def ask(tokens):
        r = d.http.post("/completion", json={"prompt": tokens, "n_predict": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["tokens_cached"]

    ask(prompt)
    for edited, kept in ((prompt[:200] + [7] * 50, 200), (prompt, 299)):  # an edit; a regenerate
        assert d.http.post("/sleep").status_code == 200
        assert ask(edited) == kept
    metrics = d.http.get("/metrics").text
    assert sum(value(metrics, "dormouse_prompt_cache_tokens_total", tier=t) for t in ("ram", "disk")) == 200 + 299
