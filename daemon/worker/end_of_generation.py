"""The model's end-of-generation tokens, listed without walking its vocabulary.

llama.cpp marks a token end-of-generation (llama_vocab_is_eog) when it is one of the vocabulary's
special ids (EOS, EOT, the FIM pad/repo/separator) or its text is one of a fixed list
(src/llama-vocab.cpp, load: "<|eot_id|>", "<|im_end|>", "<end_of_turn>"...). Those candidates,
each checked with llama_vocab_is_eog, are the whole set: no token outside them can be one. Asking
llama.cpp about every token instead costs a 262k-token walk (72 ms on Gemma 3) on every wake.
`ignore_eos` biases these to -inf, as llama-server does, and reports them in generation_settings.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable

from daemon.worker.llama_lib import llama

# llama.cpp's list (llama-vocab.cpp at the vendored commit): a token with one of these texts is end-of-generation.
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
             "<｜end▁of▁sentence｜>", "[e~[")
_SPECIAL_IDS = ("llama_vocab_eos", "llama_vocab_eot", "llama_vocab_fim_pad", "llama_vocab_fim_rep", "llama_vocab_fim_sep")


def end_of_generation_tokens(vocab: ctypes.c_void_p, single_tokens: Callable[[Iterable[str]], Iterable[int]]) -> list[int]:
    """Sorted token ids. single_tokens: the ids of those texts that the vocabulary has as one token."""
    candidates = set(single_tokens(EOG_TEXTS))
    candidates.update(getattr(llama, name)(vocab) for name in _SPECIAL_IDS if hasattr(llama, name))
    n_vocab = llama.llama_vocab_n_tokens(vocab)
    return sorted(t for t in candidates if 0 <= t < n_vocab and llama.llama_vocab_is_eog(vocab, t))
