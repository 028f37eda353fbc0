"""Tokens and text: a request's prompt as token ids, and token ids as bytes.

A mixin of Engine (daemon/worker/engine.py), kept apart so that the engine
reads as the decode loop it is. These methods turn text into tokens (bounded
by the context, so a huge body cannot stall the one thread that decodes every
slot), render the chat template, build a completion's prompt (plain, token
ids or fill-in-the-middle) and turn tokens back into bytes; none of them
touches a slot or the KV cache.
"""

from __future__ import annotations

import ctypes

from daemon import protocol as p
from daemon.worker.chat import ChatTemplateError, template_messages
from daemon.worker.errors import RequestError, context_advice
from daemon.worker.llama_lib import llama


def joined_parts(parts: list[p.ChatPart], marker: str, continued: bool = False) -> str:
    """A message's parts as the one text its template reads, joined as llama.cpp joins them: a newline
    between two texts, none next to an image's marker; two newlines in the message the answer continues
    (an assistant prefill), as llama.cpp renders a continued message."""
    between = "\n\n" if continued else "\n"
    text, after_text = "", False
    for part in parts:
        if part.type == "image":
            text += marker
            after_text = False
        else:
            text += (between if after_text and text else "") + (part.text or "")
            after_text = True
    return text


class PromptText:
    """Mixed into Engine: uses its vocab, runtime (rt), chat renderer, media, n_batch and slot context."""

    def _check_vocab(self, tokens: list[int]) -> None:
        bad = [t for t in tokens if not 0 <= t < self.n_vocab]
        if bad:
            raise RequestError(f"token ids outside the vocabulary (0..{self.n_vocab - 1}): {bad[:5]}")

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (llama.llama_token * capacity)()
        n = llama.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, True)
        if n < 0:
            capacity = -n
            buf = (llama.llama_token * capacity)()
            n = llama.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, True)
        return list(buf[:n])

    def prompt_tokens_within(self, text: str, limit: int, add_special: bool = True, what: str = "prompt") -> list[int]:
        """The prompt's tokens, refused once it is seen to exceed `limit` tokens.

        Tokenizing runs on the one thread that decodes every slot (a 6 MB
        prompt took 6 s, stalling all of them), so a long text is tokenized
        by growing prefixes: a prefix that already has more than `limit`
        tokens settles it (a prefix never has many more tokens than the whole
        text), and the work stays proportional to the context, not the body."""
        chars = max(4096, limit * 8)  # ~4 bytes a token in prose: usually one pass
        while chars < len(text):
            if len(self.tokenize(text[:chars], add_special=add_special)) > limit + 1:  # +1: a split at the cut
                # A prompt against the slot's context is told which settings size it; other limits (an
                # embeddings input, /tokenize's) are not the slot's.
                advice = f": {context_advice(self.rt.spec.ctx_size, self.rt.spec.parallel, self.rt.spec.kv_unified)}" \
                    if what == "prompt" and limit == self.n_ctx_slot else ""
                raise RequestError(f"{what} has more than {limit} tokens; the context of a slot holds "
                                   f"{self.n_ctx_slot}{advice}", "context_length_exceeded")
            chars *= 2
        return self.tokenize(text, add_special=add_special)

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        n = llama.llama_token_to_piece(self.vocab, token, self._piece, len(self._piece), 0, special)
        if n < 0:
            self._piece = ctypes.create_string_buffer(-n)
            n = llama.llama_token_to_piece(self.vocab, token, self._piece, len(self._piece), 0, special)
        return self._piece.raw[:n]

    def _single_tokens(self, texts: tuple[str, ...]) -> frozenset[int]:
        """Token ids of the markers that this vocabulary has as one special token."""
        ids = set()
        for text in texts:
            tokens = self.tokenize(text, add_special=False)
            if len(tokens) == 1 and self.token_text(tokens[0]) == text:
                ids.add(tokens[0])
        return frozenset(ids)

    def token_text(self, token: int) -> str:
        return self.token_bytes(token, special=True).decode("utf-8", errors="replace") if token >= 0 else ""

    def chat_prompt(self, msg: p.Submit | p.Query) -> tuple[str, list[bytes]]:
        """The rendered chat prompt, and the images in the order their markers appear."""
        contents, images = [], []
        last = len(msg.messages) - 1
        for i, m in enumerate(msg.messages):
            if isinstance(m.content, str):
                contents.append(m.content)
                continue
            if self.media is None and any(part.type == "image" for part in m.content):
                raise RequestError("the request has an image but no multimodal projector is loaded (start with --mmproj)")
            marker = self.media.marker if self.media is not None else ""
            contents.append(joined_parts(m.content, marker, continued=msg.continue_final and i == last))
            images.extend(part.image or b"" for part in m.content if part.type == "image")
        try:
            prompt = self.chat.prompt(template_messages(msg.messages, contents), tools=msg.tools,
                                      add_generation_prompt=msg.add_generation_prompt,
                                      continue_final=msg.continue_final,
                                      kwargs={**self.rt.spec.chat_template_kwargs, **msg.chat_template_kwargs})
        except ChatTemplateError as exc:
            raise RequestError(str(exc)) from exc
        text = prompt.text
        # The answer starts inside a thinking block: said on the request's first Tokens (reasoning_open).
        self.prompt_reasoning_open = prompt.reasoning_open
        if self.add_bos and self.chat.bos_token and text.startswith(self.chat.bos_token):
            text = text[len(self.chat.bos_token) :]  # the tokenizer adds BOS itself
        return text, images

    def prompt_tokens(self, msg: p.Submit) -> list[int]:
        """A completion's prompt as token ids (chat prompts go through chat_prompt)."""
        if msg.infill is not None:  # fill-in-the-middle: built from the model's FIM tokens
            from daemon.worker.fim import infill_prompt, model_label

            return infill_prompt(self.vocab, msg.infill, n_batch=self.n_batch, n_ctx=self.n_ctx_slot,
                                 n_predict=msg.params.max_tokens, add_bos=self.add_bos,
                                 prompt_tokens=lambda text, limit: self.prompt_tokens_within(text, limit, False),
                                 model_name=model_label(self.rt.spec.model))
        if isinstance(msg.prompt, list):
            try:
                self._check_vocab(msg.prompt)
            except RequestError as exc:
                raise RequestError(f"prompt has {exc}") from None
            return list(msg.prompt)
        return self.prompt_tokens_within(msg.prompt or "", self.n_ctx_slot)
