"""What Dormouse does with one llama-server option: the building blocks of the option table.

Each option in daemon/llama_server_options.py has one Handling: it maps onto a
Dormouse setting, passes a llama.cpp parameter through (`llama_options`), is
accepted because Dormouse already behaves so (a note says it), or is refused
with one line that says why. The value converters parse as llama-server does
(`-fa on|off|auto`, `-ngl all`, `-c 0`), strictly: a value llama.cpp's stoi
would cut short ("12abc") is an error here, not 12.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from config.llama_options import INT32

_INT = re.compile(r"^[+-]?\d{1,20}$")
_TRUTHY = ("on", "enabled", "true", "1")
_FALSEY = ("off", "disabled", "false", "0")


class LlamaServerArgsError(ValueError):
    """A llama-server option Dormouse refuses, or a value it cannot take; the message names the option."""


@dataclass
class Translation:
    """What a llama-server command line means for `dormouse serve`."""

    settings: dict[str, Any] = field(default_factory=dict)  # Settings keys -> values (load_settings' cli layer)
    llama_options: dict[str, bool | int | float] = field(default_factory=dict)  # llama.cpp params by name
    notes: list[str] = field(default_factory=list)  # accepted options with no effect of their own, and why
    rest: list[str] = field(default_factory=list)  # Dormouse's own arguments, untouched, for its argparse
    origins: dict[str, str] = field(default_factory=dict)  # setting or llama option -> the spelling that set it
    context_from_model: bool = False  # -c 0: the model's trained context, read from its GGUF once -m is known
    speculation: str | None = None  # --spec-type: "none" or "draft-simple", checked against -md at the end

    def serve_settings(self) -> dict[str, Any]:
        """The settings to layer over the config file: the mapped ones and llama_options."""
        out = dict(self.settings)
        if self.llama_options:
            out["llama_options"] = dict(self.llama_options)
        return out


@dataclass(frozen=True)
class Handling:
    kind: str  # "mapped", "llama.cpp", "accepted", "refused" or "dormouse" (its own argparse takes it)
    doc: str  # what Dormouse does with it, for docs/llama-server-options.md
    apply: Callable[[Any, str, Translation], None]
    sides: tuple["Handling", "Handling"] | None = None  # a switch's handlings of its on and off spellings

    def side(self, positive: bool) -> "Handling":
        """The handling of a switch's on or off spelling (itself, for any other option)."""
        return self if self.sides is None else self.sides[0 if positive else 1]


def _convert(convert: Callable[[Any], Any] | None, value: Any, spelling: str) -> Any:
    if convert is None:
        return value
    try:
        return convert(value)
    except (ValueError, TypeError, ZeroDivisionError) as exc:
        raise LlamaServerArgsError(f"{spelling}: {exc}") from None


def setting(key: str, convert: Callable[[Any], Any] | None = None, doc: str | None = None) -> Handling:
    def apply(value: Any, spelling: str, out: Translation) -> None:
        out.settings[key] = _convert(convert, value, spelling)
        out.origins[key] = spelling
    return Handling("mapped", doc or f"mapped to `{key}`", apply)


def const(values: dict[str, Any], doc: str) -> Handling:
    """Sets fixed values (a flag such as --rerank sets two settings)."""
    def apply(value: Any, spelling: str, out: Translation) -> None:
        out.settings.update(values)
        out.origins.update(dict.fromkeys(values, spelling))
    return Handling("mapped", doc, apply)


def llama(name: str, convert: Callable[[Any], Any] | None = None, doc: str | None = None) -> Handling:
    def apply(value: Any, spelling: str, out: Translation) -> None:
        out.llama_options[name] = _convert(convert, value, spelling)
        out.origins[name] = spelling
    return Handling("llama.cpp", doc or f"passed to llama.cpp: `llama_options.{name}`", apply)


def accepted(why: str) -> Handling:
    def apply(value: Any, spelling: str, out: Translation) -> None:
        out.notes.append(f"{spelling}: accepted; {why}")
    return Handling("accepted", f"accepted: {why}", apply)


def refused(why: str) -> Handling:
    def apply(value: Any, spelling: str, out: Translation) -> None:
        raise LlamaServerArgsError(f"{spelling} is not supported: {why}")
    return Handling("refused", f"refused: {why}", apply)


def custom(kind: str, doc: str, apply: Callable[[Any, str, Translation], None]) -> Handling:
    return Handling(kind, doc, apply)


def switch(on: Handling, off: Handling) -> Handling:
    """An option with a --no- form: `on` handles the positive spelling, `off` the negative."""
    def apply(value: Any, spelling: str, out: Translation) -> None:
        (on if value else off).apply(value, spelling, out)
    kind = on.kind if on.kind == off.kind else f"{on.kind} / {off.kind}"
    return Handling(kind, f"on: {on.doc}; off: {off.doc}", apply, (on, off))


def by_value(handlers: dict[str, Handling], doc: str) -> Handling:
    """A handling chosen by the option's value (`-fit on` refused, `-fit off` accepted)."""
    def apply(value: Any, spelling: str, out: Translation) -> None:
        key = truthy_word(value)
        handlers[key].apply(value, spelling, out)
    kinds = list(dict.fromkeys(h.kind for h in handlers.values()))
    return Handling(" / ".join(kinds), doc, apply)


# -- values, parsed as llama-server parses them --

def parse_int(text: str, low: int = INT32[0], high: int = INT32[1]) -> int:
    text = text.strip()
    if not _INT.fullmatch(text):
        raise ValueError(f"expects an integer, got {text[:40]!r}")
    value = int(text)
    if not low <= value <= high:
        raise ValueError(f"{value} is out of range ({low} to {high})")
    return value


def parse_float(text: str) -> float:
    try:
        value = float(text.strip()) if len(text) <= 64 else math.nan
    except ValueError:
        raise ValueError(f"expects a number, got {text[:40]!r}") from None
    if not math.isfinite(value) or abs(value) > 3.4e38:
        raise ValueError(f"expects a finite number, got {text[:40]!r}")
    return value


def parse_bool(text: str) -> bool:
    """An environment variable's boolean, as llama.cpp reads it."""
    value = str(text).strip().lower()
    if value in _TRUTHY or value in _FALSEY:
        return value in _TRUTHY
    raise ValueError(f"expects on/off, true/false, 1/0 or enabled/disabled, got {str(text)[:40]!r}")


def truthy_word(text: Any) -> str:
    """'on', 'off' or 'auto' for llama.cpp's truthy, falsey and auto spellings."""
    if isinstance(text, bool):
        return "on" if text else "off"
    value = str(text).strip().lower()
    if value in _TRUTHY:
        return "on"
    if value in _FALSEY:
        return "off"
    if value in ("auto", "-1"):
        return "auto"
    raise ValueError(f"expects on, off or auto, got {str(text)[:40]!r}")


def choice(names: dict[str, Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        if text not in names:
            raise ValueError(f"expects one of {', '.join(names)}, got {text[:40]!r}")
        return names[text]
    return convert


def comma_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]
