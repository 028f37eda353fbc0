"""One slot: a sequence id in the shared context, the tokens its KV cache holds,
and the request it is serving. Its state follows statemachine.slots."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from daemon.protocol import SamplingParams
from daemon.worker.sampling import SamplerChain
from daemon.worker.text import StopMatcher, Utf8Assembler
from statemachine import SlotState, check_slot_transition


@dataclass
class Job:
    """A request while a slot works on it."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    sampler: SamplerChain
    utf8: Utf8Assembler = field(default_factory=Utf8Assembler)
    stops: StopMatcher = field(init=False)
    n_prompt_done: int = 0  # prompt tokens already in the KV cache
    n_cached: int = 0  # of those, reused from the previous request
    exact_from: int = 0  # the slot's `exact` when the read began (reuse.ReuseRule.exact_after_read)
    n_generated: int = 0
    n_drafted: int = 0  # tokens the draft model proposed
    n_accepted: int = 0  # of those, tokens the target agreed with
    next_token: int | None = None  # sampled, not yet decoded
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    end_tokens: frozenset[int] = frozenset()  # chat: end-of-turn markers that end generation
    restored_tokens: int = 0  # of n_cached, restored from a saved prompt cache
    restore_seconds: float = 0.0
    kv_lookup: str = ""
    kv_rejected: str | None = None
    cache_tier: str = ""  # where n_cached came from: slot, ram, disk
    logprobs: list = field(default_factory=list)  # p.TokenLogprob of tokens not yet sent
    index: int = 0  # the choice, with n > 1
    group: "Choices | None" = None  # with n > 1: the request's choices
    progress: bool = False  # PromptProgress as the prompt is read (Submit.progress)

    @property
    def n(self) -> int:
        return self.group.n if self.group is not None else 1

    def __post_init__(self) -> None:
        self.stops = StopMatcher(self.params.stop)


@dataclass
class Choices:
    """A request with n > 1 choices: its first choice decodes the prompt, the
    others wait on reserved slots and receive a copy of its KV cache when the
    prompt is done. One Done ends them all."""

    n: int
    first: Job
    reserved: list["Slot"]  # slots of choices 1..n-1, until they are forked
    open: int = 0  # choices not yet finished
    completion_tokens: int = 0
    ended: bool = False

    def __post_init__(self) -> None:
        self.open = self.n


@dataclass
class Checkpoint:
    """The window (the sliding-window layers' cells) or the recurrent state of
    a sequence when it held `n` tokens: llama_state_seq_get_data_ext(...,
    LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY). With the attention cells of the same
    n tokens it restores the sequence at n, where a state saved later (whose
    window moved on, or whose recurrent state took in more tokens) cannot."""

    n: int
    state: object  # uint8 numpy array: the state's 8-byte prefix, then the window cache or the recurrent state
    whole: bool = False  # the sequence's whole state (a pure recurrent model: no attention cells beside it)


MAX_CHECKPOINTS = 4  # per slot: the newest are kept (a prompt's end, the last turn boundary, every N before)


class Slot:
    def __init__(self, seq_id: int) -> None:
        self.id = seq_id
        self.state = SlotState.IDLE
        self.cache: list[int] = []  # tokens whose K/V this sequence holds, in order
        self.exact = 0  # leading cells decoded in whole prompt chunks from 0, as a fresh read decodes them
        self.scope = ""  # the cache scope (protocol.Submit.cache_scope) of the prompt whose cells it holds
        self.checkpoints: list[Checkpoint] = []  # by n, ascending; each at most len(cache)
        self.job: Job | None = None
        self.reserved_for: Choices | None = None  # held for a choice that waits for its prompt's KV
        self.last_used = 0.0  # monotonic time its last request started; 0: never used

    def truncate(self, n: int) -> None:
        """Forget the cells from position n on (the caller removed them from llama.cpp)."""
        del self.cache[n:]
        self.exact = min(self.exact, n)
        if self.checkpoints and self.checkpoints[-1].n > n:
            self.checkpoints = [c for c in self.checkpoints if c.n <= n]

    def add_checkpoint(self, checkpoint: Checkpoint) -> None:
        self.checkpoints = [c for c in self.checkpoints if c.n < checkpoint.n][-(MAX_CHECKPOINTS - 1):]
        self.checkpoints.append(checkpoint)

    def move(self, new: SlotState) -> None:
        self.state = check_slot_transition(self.state, new)

    def common_prefix(self, tokens: list[int]) -> int:
        return common_prefix(self.cache, tokens)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two lists share (one C-speed comparison when one holds the other)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# A cached prefix must cover more than this share of a new prompt to claim its
# slot (llama-server's slot_prompt_similarity). Below it, the match is the BOS
# token or a template header that every prompt shares, and taking that slot
# would throw away another conversation's cache while other slots sit empty.
PROMPT_SIMILARITY = 0.1


def choose_slot(idle: list[Slot], tokens: list[int], keepable: Callable[[Slot], int]) -> Slot:
    """The idle slot for a prompt: the most tokens it may keep (reuse.ReuseRule,
    not the raw common prefix: a slot whose window lost the shared header
    keeps nothing) when that is a real share of the prompt, else an empty
    slot, else the least recently used."""
    kept = {s.id: keepable(s) for s in idle}
    best = max(idle, key=lambda s: kept[s.id])
    if kept[best.id] > 1 and kept[best.id] > PROMPT_SIMILARITY * len(tokens):
        return best
    return min(idle, key=least_recently_used)


def least_recently_used(slot: Slot) -> tuple[float, int]:
    """The order in which idle slots are given away: the one used longest ago first."""
    return slot.last_used, slot.id
