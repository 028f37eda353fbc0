"""What the prompt cache may change in an answer (issue 16, sections 1 and 2),
on the real model: random prompts sharing prefixes of random lengths (none,
inside Gemma 3's 512-token sliding window, past it), in random orders of live
reuse, regenerates, edits, unrelated prompts on the same slots, sleeps and
restores. Each answer is compared with the same prompt read in full
(`cache_prompt: false`). The tiers the kept tokens came from are logged per
step: a conversation whose slots both went to other prompts (`away`) comes
back from the RAM tier (issue 18), one after a sleep from the disk tier.

- cache_deterministic = true: every greedy answer equals the
  full read token for token, whatever was reused or restored.
- cache_deterministic = false (the default): a prompt that keeps nothing is a full read,
  and one that keeps cells never keeps a window with a hole in it.

The seed is printed; DORMOUSE_PROPERTY_SEED replays one.
"""

from __future__ import annotations

import os
import random

import pytest

from tests.metrics_text import value

pytestmark = pytest.mark.e2e

WORDS = ("river mill dawn baker rye bread miller stone bridge lamp market winter cart horse salt ledger clock "
         "harbor rope lantern orchard well").split()
N_PREDICT = 12
TIERS = ("slot", "ram", "disk")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def complete(d, prompt: str, cache: bool) -> tuple[str, int, int, list]:
    """The greedy answer, the tokens kept from the cache, the prompt's tokens,
    and each answer token with its log-probability and the 5 likeliest (the bits of the logits)."""
    r = d.http.post("/completion", json={"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0,
                                         "cache_prompt": cache, "n_probs": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["content"], body["tokens_cached"], body["tokens_evaluated"], body["completion_probabilities"]


def chat_text(d, messages: list[dict]) -> str:
    """A chat prompt as the model reads it (the shared template header included)."""
    r = d.http.post("/apply-template", json={"messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


class Trial:
    """Random conversations and the operations that can happen between their turns."""

    def __init__(self, d, fresh, rng: random.Random, script: tuple[str, ...] = ()) -> None:
        self.d, self.fresh_daemon, self.rng = d, fresh, rng
        self.script = list(script)  # operations that come first, whatever the draw
        self.base = words(rng, 900)  # ~1000 tokens: prefixes inside the window and past it
        self.last: str | None = None
        self.kept = 0
        self.tiers: dict[str, int] = {}  # prompts that kept cells, by the tier they came from
        self.deterministic = False
        self.log: list[str] = []

    def prompt(self) -> tuple[str, str]:
        rng = self.rng
        op = self.script.pop(0) if self.script else rng.choice(
            ["shared", "shared", "turn", "turn", "regenerate", "edit", "unrelated", "chat", "sleep", "away"])
        if op.startswith("sleep"):
            r = self.d.http.post("/sleep")
            assert r.status_code == 200, r.text
            op = op[len("sleep "):] or rng.choice(["turn", "regenerate", "unrelated"])  # what comes after a wake
        if op == "away" and self.last is not None:
            # Both slots given to other prompts (distinct first words: neither keeps the other's): the
            # conversation's cells leave the slots for the RAM tier, and its next turn comes back from there.
            for lead in ("Aside", "Meanwhile"):
                self.check("away-other", lead + " " + words(rng, rng.randint(20, 40)))
            op = "turn"
        if self.last is None or op in ("shared", "long"):  # a new conversation, often one past the window
            cut = rng.choice([0, 4, rng.randint(10, 500), rng.randint(520, 900), rng.randint(520, 900)])
            cut = rng.randint(700, 900) if op == "long" else cut
            return op, " ".join(self.base.split()[:cut]) + " " + words(rng, rng.randint(3, 200))
        if op == "turn":
            return op, self.last + " " + words(rng, rng.randint(20, 150))
        if op == "regenerate":
            return op, self.last
        if op == "edit":  # the last few words replaced: a common prefix shorter than the saved one
            spaces = [i for i, c in enumerate(self.last) if c == " "][-60:] or [len(self.last)]
            return op, self.last[:rng.choice(spaces)] + " " + words(rng, 10)
        if op == "unrelated":
            return op, words(rng, rng.randint(3, 40))
        return op, chat_text(self.d, [{"role": "user", "content": words(rng, rng.randint(5, 400))}])

    def tier_hits(self) -> dict[str, float]:
        text = self.d.http.get("/metrics").text
        return {tier: value(text, "dormouse_prompt_cache_hits_total", tier=tier) for tier in TIERS}

    def step(self, deterministic: bool) -> None:
        self.deterministic = deterministic
        op, prompt = self.prompt()
        answer = self.check(op, prompt)
        if op != "unrelated":  # the conversation goes on from here
            self.last = prompt + answer

    def check(self, op: str, prompt: str) -> str:
        """One prompt, with the cache and read in full; the answers compared as the mode promises."""
        deterministic = self.deterministic
        before = self.tier_hits()
        answer, cached, n, probs = complete(self.d, prompt, cache=True)
        # The reference reads the prompt in full in its own daemon, so that the
        # trial's slots see only the trial's own history.
        reference, ref_cached, _, ref_probs = complete(self.fresh_daemon, prompt, cache=False)
        assert ref_cached == 0
        tier = next((t for t, hits in self.tier_hits().items() if hits > before[t]), "")
        if cached:
            self.tiers[tier] = self.tiers.get(tier, 0) + 1
        self.log.append(f"{op}: {n} tokens, {cached} kept{' from ' + tier if tier else ''}, same={answer == reference}")
        if cached:
            self.kept += 1
        if deterministic or cached == 0:
            assert answer == reference, "\n".join(self.log) + f"\n{answer!r}\n{reference!r}"
            assert probs == ref_probs  # tokens and log-probabilities alike: the same bits
        else:  # kept cells may round otherwise, but never read a hole: the first token is the fresh read's, nearly
            top = {t["id"]: t["logprob"] for t in probs[0]["top_logprobs"]}
            first = ref_probs[0]
            assert first["id"] in top and abs(top[first["id"]] - first["logprob"]) < 0.5, self.log
        return answer


def seed(default: int) -> int:
    """Fixed unless DORMOUSE_PROPERTY_SEED says otherwise (=random draws one), so CI is reproducible."""
    chosen = os.environ.get("DORMOUSE_PROPERTY_SEED", str(default))
    return random.SystemRandom().randrange(2**32) if chosen == "random" else int(chosen)


# The deterministic run begins with what a review found: a conversation past the
# window, saved at a sleep, and its next turn (a restore that lacks its first
# positions would land in other cells and round otherwise). Both runs then send
# the conversation's slots away and bring it back from the RAM tier, whatever
# the draw does after.
@pytest.mark.parametrize("deterministic, batch_size, steps, default_seed, script", [
    (True, 128, 14, 16, ("long", "sleep turn", "away")),
    (False, 512, 10, 17, ("long", "away", "sleep turn")),
])
def test_the_cache_never_changes_a_deterministic_answer(start_daemon, tmp_path, deterministic, batch_size, steps,
                                                        default_seed, script):
    s = seed(default_seed)
    print(f"\nDORMOUSE_PROPERTY_SEED={s}")
    # Two slots of 2048 tokens. A live slot keeps every window position (swa_full);
    # only a restored one lacks the first ones.
    d, fresh = (start_daemon("--parallel", "2", "--ctx-size", "4096", "--batch-size", str(batch_size),
                             "--sleep-idle-seconds", "-1", "--state-dir", str(tmp_path / name),
                             env={"DORMOUSE_KV_CACHE_MIN_TOKENS": "16",
                                  "DORMOUSE_CACHE_DETERMINISTIC": str(deterministic).lower()})
                for name in ("trial", "fresh"))
    d.wait_state("ready")
    fresh.wait_state("ready")
    trial = Trial(d, fresh, random.Random(s), script=script)
    for _ in range(steps):
        trial.step(deterministic)
    print("\n".join(trial.log))
    print(f"kept cells by tier: {trial.tiers}")
    assert trial.kept >= 3, trial.log  # not vacuous: cells were kept and compared
    # Not vacuous either for the tiers: answers were compared after a RAM restore and a disk restore.
    assert trial.tiers.get("ram", 0) >= 1 and trial.tiers.get("disk", 0) >= 1, trial.log
    restored = value(d.http.get("/metrics").text, "dormouse_kv_cache_restored_tokens_total")
    print(f"restored {restored} tokens from disk over {steps} steps")


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
    answer, _, n1, _ = complete(d, chat_text(d, history), cache=True)
    assert 700 < n1 < 1000
    for _ in range(2):
        assert d.http.post("/sleep").status_code == 200
        history += [{"role": "assistant", "content": answer}, {"role": "user", "content": words(rng, 5)}]
        answer, restored, _, _ = complete(d, chat_text(d, history), cache=True)
        assert restored > n1  # the conversation came back from disk
        unrelated = chat_text(d, [{"role": "user", "content": words(rng, 8)}])
        got, kept, _, _ = complete(d, unrelated, cache=True)
        reference, _, _, _ = complete(fresh, unrelated, cache=False)  # a daemon that never saw the long chat
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
    assert value(d.http.get("/metrics").text, "dormouse_kv_cache_restored_tokens_total") == 200 + 299
