"""The index from chained block keys to prompt-cache entries (issue 26: a
lookup that does not grow with the cache). Used by every tier: the disk
tier's KvIndex (kv_files.py), the RAM tier (daemon/worker/prompt_cache.py)."""

from __future__ import annotations

import hashlib
import struct
from typing import Any

INDEX_BLOCK = 256  # tokens per block of the chained keys (prompt_blocks.BLOCK)
MAX_SHARERS = 8  # entries compared beyond the deepest shared block at most (the most recently added)


def chain_keys(tokens: list[int], scope: str = "", block: int = INDEX_BLOCK) -> list[bytes]:
    """keys[i]: a hash naming the scope and tokens[:i * block] (keys[0]: the scope
    alone), so equal keys mean equal full blocks from 0 in the same scope."""
    previous = hashlib.blake2b(scope.encode("utf-8"), digest_size=16, person=b"dormouse-chain").digest()
    keys = [previous]
    for i in range(len(tokens) // block):
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(struct.pack(f"<{block}i", *tokens[i * block:(i + 1) * block]))
        previous = digest.digest()
        keys.append(previous)
    return keys


class PrefixIndex:
    """Entries (anything with .tokens and .scope) by chained block keys, so that
    finding those that share a prompt's prefix costs in proportion to the
    prompt's blocks, not to the entries held:

    - `tails[keys[f]][t][tuple(tail)]`: entries of f full blocks and a tail of t
      tokens (the exact-prefix lookup: an entry whose tokens all begin the
      prompt, or all but its last one: a regenerate of a window state);
    - `sharers[keys[i]]`: entries that hold full block i (and may be cut back
      to it: full attention), for a prompt that leaves them past block i
      (keys[0]: every such entry of the scope, for a share under a block).

    A lookup walks the prompt's levels; per level it probes at most the
    distinct tail lengths held there (fewer than a block) and compares at most
    MAX_SHARERS entries at the deepest shared block. `work` counts the probes
    and comparisons (the unit test's measure)."""

    def __init__(self, block: int = INDEX_BLOCK) -> None:
        self.block = block
        self.tails: dict[bytes, dict[int, dict[tuple, list]]] = {}
        self.sharers: dict[bytes, dict[int, Any]] = {}
        self.where: dict[int, tuple] = {}  # id(entry) -> what it was filed under
        self.work = 0

    def __len__(self) -> int:
        return len(self.where)

    def add(self, entry: Any, cut_back: bool) -> None:
        """cut_back: the entry's state may be cut back to any prefix (full attention)."""
        if id(entry) in self.where:
            return
        tokens = entry.tokens
        keys = chain_keys(tokens, entry.scope, self.block)
        f = len(tokens) // self.block
        filed = []
        for t_tokens in (tokens, tokens[:-1]) if tokens else ():  # its own tokens, and all but the last
            g = len(t_tokens) // self.block
            tail = tuple(t_tokens[g * self.block:])
            self.tails.setdefault(keys[g], {}).setdefault(len(tail), {}).setdefault(tail, []).append(entry)
            filed.append((keys[g], len(tail), tail))
        shared = keys[:f + 1] if cut_back else []  # keys[0]: the scope alone (a share shorter than a block)
        for key in shared:
            self.sharers.setdefault(key, {})[id(entry)] = entry
        self.where[id(entry)] = (filed, shared)

    def remove(self, entry: Any) -> None:
        filed, shared = self.where.pop(id(entry), ((), ()))
        for key, n, tail in filed:
            by_len = self.tails[key]
            found = by_len[n][tail]
            found[:] = [e for e in found if e is not entry]
            if not found:
                del by_len[n][tail]
                if not by_len[n]:
                    del by_len[n]
                    if not by_len:
                        del self.tails[key]
        for key in shared:
            held = self.sharers[key]
            held.pop(id(entry), None)
            if not held:
                del self.sharers[key]

    def clear(self) -> None:
        self.tails.clear()
        self.sharers.clear()
        self.where.clear()

    def candidates(self, tokens: list[int], scope: str = "") -> list[tuple[Any, int]]:
        """(entry, tokens it shares with `tokens`) for every entry that is a
        prefix of them (or all but its last token is), and for the entries
        that share the deepest full block (at most MAX_SHARERS of them)."""
        keys = chain_keys(tokens, scope, self.block)
        out: list[tuple[Any, int]] = []
        for g, key in enumerate(keys):
            by_len = self.tails.get(key)
            self.work += 1
            if not by_len:
                continue
            start = g * self.block
            for n in by_len:
                self.work += 1
                if start + n > len(tokens):
                    continue
                for entry in by_len[n].get(tuple(tokens[start:start + n]), ()):
                    m = len(entry.tokens)
                    out.append((entry, m if start + n == m else m - 1 if tokens[m - 1:m] != entry.tokens[-1:] else m))
        for key in reversed(keys):
            self.work += 1
            held = self.sharers.get(key)
            if held:
                for entry in list(held.values())[-MAX_SHARERS:]:
                    self.work += 1
                    n = 0
                    for x, y in zip(entry.tokens, tokens):
                        if x != y:
                            break
                        n += 1
                    out.append((entry, n))
                break
        return out

    def exact(self, tokens: list[int], scope: str = "") -> Any | None:
        """The entry of exactly these tokens in this scope."""
        g = len(tokens) // self.block
        key = chain_keys(tokens[:g * self.block], scope, self.block)[-1]
        tail = tuple(tokens[g * self.block:])
        for entry in self.tails.get(key, {}).get(len(tail), {}).get(tail, ()):
            if len(entry.tokens) == len(tokens):
                return entry
        return None
