"""Thinking blocks read out of a chat answer, as llama-server's reasoning_format.

A reasoning model writes its thinking first, between markers (`<think>` ...
`</think>` for DeepSeek R1, Qwen3, QwQ, GLM; `[THINK]` for Magistral;
`<|START_THINKING|>` for Command R7B; `<seed:think>` for Seed-OSS), then its
answer. Some templates open the block in the prompt itself (DeepSeek R1's
generation prompt ends in `<think>\\n`): the answer then starts inside the
thinking, and the worker says so on the first Tokens (reasoning_open).

Formats, as llama-server's --reasoning-format / `reasoning_format`:
  none             nothing is read out: the text is the content
  auto, deepseek   the thinking goes to reasoning_content (streamed as
                   delta.reasoning_content), the rest is the content; "auto"
                   parses whenever the answer opens with a marker (a model
                   writes one only when its template asks it to think)
  deepseek-legacy  reasoning_content is filled, and the content keeps the
                   thinking inline too; streamed, it is all content

Only a block at the very start of the answer is thinking; a marker later on is
content. An unclosed block (cut short by max_tokens) is all thinking.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")

# (opening, closing) markers, as the models write them.
MARKERS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),
    ("<seed:think>", "</seed:think>"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
    ("[THINK]", "[/THINK]"),
)


def markers_in(template_source: str) -> tuple[str, str] | None:
    """The marker pair a chat template writes, if any (the first it names)."""
    found = [(template_source.find(opening), (opening, closing)) for opening, closing in MARKERS
             if opening in template_source and closing in template_source]
    return min(found)[1] if found else None


def ends_inside_reasoning(prompt: str) -> str | None:
    """The closing marker the answer must write when `prompt` ends with an
    opening one (the template opened the thinking block); None otherwise."""
    tail = prompt.rstrip()
    for opening, closing in MARKERS:
        if tail.endswith(opening):
            return closing
    return None


@dataclass(frozen=True)
class ReasoningMode:
    """How one request's answers are read: the format, and whether its
    prompt left a thinking block open (known from the first Tokens)."""

    format: str = "auto"
    open_at_start: bool = False

    @property
    def parses(self) -> bool:
        return self.format != "none"

    @property
    def streams_reasoning(self) -> bool:
        """Streamed thinking goes out as delta.reasoning_content (else inline, as content)."""
        return self.format in ("auto", "deepseek")

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning_content or None, content) of a whole answer."""
        if not self.parses:
            return None, text
        reasoning, content = split_reasoning(text, self.open_at_start)
        if self.format == "deepseek-legacy":
            return reasoning, text
        return reasoning, content


def split_reasoning(text: str, open_at_start: bool = False) -> tuple[str | None, str]:
    """(the thinking, stripped, or None when there is none; the content)."""
    closing = None
    body = text
    if open_at_start:
        closing = _closing_for_open(text)
    else:
        stripped = text.lstrip()
        for opening, close in MARKERS:
            if stripped.startswith(opening):
                closing, body = close, stripped[len(opening):]
                break
    if closing is None:
        return None, text
    end = body.find(closing)
    if end < 0:  # never closed (cut short): all of it is thinking
        return body.strip(), ""
    return body[:end].strip(), body[end + len(closing):].lstrip()


def _closing_for_open(text: str) -> str:
    """With the block opened by the prompt, the closing marker is whichever
    the answer writes first (the default one if none)."""
    found = [(text.find(closing), closing) for _, closing in MARKERS if closing in text]
    return min(found)[1] if found else MARKERS[0][1]


class ReasoningStream:
    """Incremental split_reasoning: feed(piece) -> (reasoning, content) safe to
    stream now; finish() -> the same for what was held back, once.

    Holds back the start of the answer while it may be an opening marker, a
    tail that may be the start of the closing one, and the whitespace at the
    end of the thinking (split_reasoning strips it), so the pieces streamed
    add up to split_reasoning's answer. Markers never reach either stream.
    """

    def __init__(self, open_at_start: bool = False) -> None:
        self._held = ""
        self._closings = [closing for _, closing in MARKERS]
        self._state = "reasoning" if open_at_start else "start"
        self._reasoning_started = False  # some thinking has gone out (what follows keeps its leading space)
        self._space = ""  # whitespace held at the end of the thinking
        self._found_reasoning = open_at_start

    @property
    def had_reasoning(self) -> bool:
        return self._found_reasoning

    def feed(self, piece: str) -> tuple[str, str]:
        text, self._held = self._held + piece, ""
        if self._state == "start":
            return self._start(text)
        if self._state == "reasoning":
            return self._in_reasoning(text)
        if self._state == "after":
            text = text.lstrip()
            if not text:
                return "", ""
            self._state = "content"
        return "", text

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state == "start":
            self._state = "content"
            return "", held
        if self._state == "reasoning":
            self._state = "content"
            tail = held.rstrip()
            out = self._space + tail if self._reasoning_started and tail else tail
            return (out if self._reasoning_started else out.lstrip()), ""
        return "", held if self._state == "content" else held.lstrip()

    def _start(self, text: str) -> tuple[str, str]:
        stripped = text.lstrip()
        if not stripped:
            self._held = text
            return "", ""
        for opening, closing in MARKERS:
            if stripped.startswith(opening):
                self._state, self._closings, self._found_reasoning = "reasoning", [closing], True
                return self._in_reasoning(stripped[len(opening):])
        if any(opening.startswith(stripped) for opening, _ in MARKERS):
            self._held = text  # may still become a marker
            return "", ""
        self._state = "content"
        return "", text

    def _in_reasoning(self, text: str) -> tuple[str, str]:
        found = [(text.find(closing), closing) for closing in self._closings if closing in text]
        if found:
            at, closing = min(found)
            out = self._release(text[:at].rstrip())
            self._state = "after"
            rest = text[at + len(closing):].lstrip()
            if rest:
                self._state = "content"
            return out, rest
        keep = max((_prefix_overlap(text, closing) for closing in self._closings), default=0)
        cut = len(text) - keep
        self._held = text[cut:]
        body = text[:cut]
        stripped = body.rstrip()
        out = self._release(stripped)
        self._space += body[len(stripped):]
        return out, ""

    def _release(self, text: str) -> str:
        """Thinking that can go out now, after any whitespace held before it."""
        if not text:
            return ""
        if not self._reasoning_started:
            text = text.lstrip()
            if not text:
                return ""
            self._reasoning_started = True
            self._space = ""
            return text
        out, self._space = self._space + text, ""
        return out


def _prefix_overlap(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
