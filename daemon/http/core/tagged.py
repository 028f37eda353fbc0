"""Bodies whose items are tagged by `type` (content blocks, input items, tools):
a pydantic union keyed on the tag, where an item of a type not taken is a
`Refused` model that fails with a message saying why (and, in /openapi.json,
matches nothing), so a client learns what it sent that is not supported
rather than a union's list of mismatches. Knows no dialect: each names its own
tags and reasons."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Union

from pydantic import ConfigDict, Discriminator, Tag, model_validator

from daemon.http.core.schemas import RequestModel


def kind_of(value: Any) -> Any:
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


def tagged(tags: dict[str, type], fallback: type, default: str | None = None) -> Discriminator:
    """A discriminator on `type` whose tags are class names: field_name leaves
    them out of an error's location ('input.2.content.0.image_url')."""
    def tag(value: Any) -> str:
        kind = kind_of(value)
        if kind is None and default is not None and isinstance(value, dict) and "role" in value:
            kind = default  # an EasyInputMessage: {role, content} without type
        return tags[kind].__name__ if isinstance(kind, str) and kind in tags else fallback.__name__
    return Discriminator(tag)


def union_of(*models: type) -> Any:
    return Union[tuple(Annotated[m, Tag(m.__name__)] for m in models)]  # noqa: UP007 - a runtime union of tags


def _matches_nothing(schema: dict[str, Any]) -> None:
    # /openapi.json: a refused variant is valid for nothing, so a reader (or a generator) sees the supported ones.
    schema.clear()
    schema.update({"not": {}, "description": "any other type: refused with a 400 that says why"})


class Refused(RequestModel):
    """An item, part or tool of a type Dormouse does not take: refused with a message that says why."""

    model_config = ConfigDict(json_schema_extra=_matches_nothing)
    REASONS: ClassVar[dict[str | None, str]] = {None: "{kind!r} is not supported"}

    type: Any = None

    @model_validator(mode="after")
    def _refuse(self) -> Any:
        table = self.REASONS
        kind = self.type if isinstance(self.type, str) else None
        raise ValueError(table.get(kind) or table[None].format(kind=kind[:64] if kind else self.type))
