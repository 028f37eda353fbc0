"""Fill-in-the-middle prompts, assembled as llama-server's format_prompt_infill
does, from the model's own FIM tokens (llama.cpp's vocab finds them by the
tokenizer.ggml.fim_* keys or by their known texts: <|fim_prefix|>, <PRE> ...).

The repository-level layout (arXiv 2409.12186), where the model has the tokens:

    [extra: FIM_REP myproject\\n  FIM_SEP filename\\n text ...  FIM_SEP filename\\n]
    [BOS] FIM_PRE prefix prompt FIM_SUF suffix FIM_MID

Truncation is llama-server's: the prefix keeps its last 3/4 of a batch, the
suffix its first 1/4 (less 2 and the prompt), and the extra context keeps its
last tokens within what the slot has left after a batch and twice n_predict.
On top of that the whole prompt is kept within the slot's context (the
extra first, then the prefix, lose their oldest tokens), so a FIM request is
never refused for its size.

Every text is tokenized by bounded windows (the prefix's tail, the suffix's
head): tokenizing runs on the thread that decodes every slot, so the work
stays proportional to the context, not to a 6 MB file sent as the prefix.
User text is tokenized without parsing special tokens (as llama-server): a
"<|fim_middle|>" typed in the code stays text.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from daemon import protocol as p
from daemon.worker.errors import RequestError
from daemon.worker.llama_lib import llama

REPO_NAME = "myproject\n"  # llama-server's fixed project name
CURRENT_FILE = "filename\n"  # ... and its name for the file being edited
# Between extra chunks when the model has no file separator token.
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"
DEFAULT_FILENAME = "tmp"


@dataclass(frozen=True)
class FimTokens:
    """The model's FIM token ids; -1 where it has none (llama_vocab_fim_*)."""

    pre: int
    suf: int
    mid: int
    rep: int
    sep: int

    @classmethod
    def of(cls, vocab) -> FimTokens:
        return cls(llama.llama_vocab_fim_pre(vocab), llama.llama_vocab_fim_suf(vocab),
                   llama.llama_vocab_fim_mid(vocab), llama.llama_vocab_fim_rep(vocab),
                   llama.llama_vocab_fim_sep(vocab))

    def missing(self) -> list[str]:
        return [name for name, token in (("prefix", self.pre), ("suffix", self.suf), ("middle", self.mid))
                if token < 0]


def text_tokens(vocab, text: str, parse_special: bool = False) -> list[int]:
    """The text's tokens, no BOS/EOS added."""
    data = text.encode("utf-8", errors="replace")
    capacity = len(data) + 8
    buf = (llama.llama_token * capacity)()
    n = llama.llama_tokenize(vocab, data, len(data), buf, capacity, False, parse_special)
    if n < 0:
        capacity = -n
        buf = (llama.llama_token * capacity)()
        n = llama.llama_tokenize(vocab, data, len(data), buf, capacity, False, parse_special)
    return list(buf[:n])


def _window(n: int) -> int:
    return max(4096, n * 8)  # ~4 bytes a token in code: usually one pass


def head_tokens(tokenize: Callable[[str], list[int]], text: str, n: int) -> list[int]:
    """The first `n` tokens of `text` (all of them if it has fewer), tokenizing
    growing heads: a head with more than n + 1 tokens settles it (the last may
    be a word cut at the window's edge)."""
    if n <= 0:
        return []
    chars = _window(n)
    while chars < len(text):
        tokens = tokenize(text[:chars])
        if len(tokens) > n + 1:
            return tokens[:n]
        chars *= 2
    return tokenize(text)[:n]


def tail_tokens(tokenize: Callable[[str], list[int]], text: str, n: int) -> list[int]:
    """The last `n` tokens of `text`, tokenizing growing tails (the first token
    of a tail may be a word cut at its edge, so one more is asked for)."""
    if n <= 0:
        return []
    chars = _window(n)
    while chars < len(text):
        tokens = tokenize(text[-chars:])
        if len(tokens) > n + 1:
            return tokens[-n:]
        chars *= 2
    return tokenize(text)[-n:]


def _extra_tokens(tokenize, fim: FimTokens, extra: list[tuple[str, str]], budget: int) -> list[int]:
    """The last `budget` tokens of the repository context, built from its end:
    chunks that would be cut off entirely are never tokenized."""
    if budget <= 0 or not extra:
        return []
    # In order: (fixed tokens) or (text to tokenize); walked from the end.
    parts: list[list[int] | str] = []
    if fim.rep >= 0:
        parts.append([fim.rep, *tokenize(REPO_NAME)])
    separator = tokenize(CHUNK_SEPARATOR) if fim.sep < 0 else []
    for filename, text in extra:
        parts.append([fim.sep, *tail_tokens(tokenize, filename + "\n", 256)] if fim.sep >= 0 else separator)
        parts.append(text)
    if fim.sep >= 0:
        parts.append([fim.sep, *tokenize(CURRENT_FILE)])
    taken: list[list[int]] = []
    left = budget
    for part in reversed(parts):
        if left <= 0:
            break
        tokens = part[-left:] if isinstance(part, list) else tail_tokens(tokenize, part, left)
        taken.append(tokens)
        left -= len(tokens)
    return [t for tokens in reversed(taken) for t in tokens]


def infill_prompt(vocab, infill: p.Infill, *, n_batch: int, n_ctx: int, n_predict: int, add_bos: bool,
                  prompt_tokens: Callable[[str, int], list[int]], model_name: str) -> list[int]:
    """The FIM prompt's tokens, within the slot's context `n_ctx`.

    n_batch: the decode batch (the FIM window is sized by it, as llama-server);
    n_predict: the request's token limit (n_ctx or more: unbounded, llama-server's -1);
    prompt_tokens(text, limit): the typed `prompt`, special tokens parsed, refused past limit."""
    fim = FimTokens.of(vocab)
    missing = fim.missing()
    if missing:
        raise RequestError(f"model {model_name} has no fill-in-the-middle tokens (no FIM {', '.join(missing)} "
                           "token): /infill and suffix need a code model that has them")

    def tokenize(text: str) -> list[int]:
        return text_tokens(vocab, text)

    typed = prompt_tokens(infill.prompt, n_ctx) if infill.prompt else []
    n_prefix_take = 3 * (n_batch // 4)
    n_suffix_take = max(0, n_batch // 4 - (2 + len(typed)))
    prefix = tail_tokens(tokenize, infill.prefix, n_prefix_take)
    suffix = head_tokens(tokenize, infill.suffix, n_suffix_take)
    reserve = -1 if n_predict >= n_ctx else n_predict  # llama-server's n_predict -1 reserves nothing
    bos = [llama.llama_vocab_bos(vocab)] if add_bos else []
    core = len(bos) + 1 + len(prefix) + len(typed) + 1 + len(suffix) + 1
    room = n_ctx - 1  # at least one token of answer
    # The extra context is what the slot has left (llama-server's rule), and never more than fits.
    budget = min(max(0, n_ctx - n_batch - 2 * reserve), max(0, room - core))
    extra = _extra_tokens(tokenize, fim, infill.extra, budget)
    over = core - room
    if over > 0:  # a batch larger than the slot: the prefix's oldest tokens go
        prefix = prefix[min(over, len(prefix)):]
        over = len(bos) + 3 + len(prefix) + len(typed) + len(suffix) - room
        if over > 0:
            suffix = suffix[:max(0, len(suffix) - over)]
    # As llama-server: the extra context comes first, before BOS.
    return [*extra, *bos, fim.pre, *prefix, *typed, fim.suf, *suffix, fim.mid]


def model_label(path: str) -> str:
    return repr(os.path.basename(path))
