"""docs/reference/configuration.md, generated from the code so that it cannot drift.

Every key comes from the schema itself (config/settings.py's Settings and
config/models.py's [models.ID] tables): its type, its default and its
description. The flag is read from `dormouse serve`'s own parser
(daemon/cli.py), llama-server's spellings from the table that translates them
(daemon/llama_server_options.py), the environment variable from the prefix
the settings read, and whether a reload applies it from config/reloadable.py.
A key added anywhere shows up here; tests/unit/test_docs_reference.py fails
until the page is written again:

    python -m daemon.config_reference --write
"""

from __future__ import annotations

import argparse
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from config.models import ModelSettings
from config.reloadable import RELOADABLE, RELOADABLE_PER_MODEL
from config.settings import Settings
from config.sources import ENV_PREFIX

PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "configuration.md"
REGENERATE = "python -m daemon.config_reference --write"
# A llama-server option that sets a key says so in its doc: "mapped to `ctx_size` ...".
MAPPED_KEY = re.compile(r"`([a-z_]+)`")


def type_name(annotation: Any) -> str:
    """A reader's name for a field's type: `int or none`, one of `a`, `b`; not typing's repr."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        named = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(named) + (" or none" if type(None) in args else "")
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin is list:
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"table of {type_name(args[1])}" if args else "table"
    if annotation is typing.Any:
        return "value"
    if annotation is SecretStr:
        return "secret string"
    if annotation is Path:
        return "path"
    if isinstance(annotation, type):
        return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(annotation.__name__,
                                                                                          annotation.__name__)
    return str(annotation)


def default_text(key: str, field: FieldInfo) -> str:
    if field.default_factory is not None:
        # An empty container, or a figure computed from this machine (the description says how):
        # the machine's own figure would make the page differ from one host to the next.
        return "empty" if field.default_factory() in ({}, []) else "computed at start"
    if field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "none"
    if value in ({}, []):
        return "empty"
    if isinstance(value, bool):
        return "true" if value else "false"
    if key.endswith("_bytes") and isinstance(value, int) and value >= 2**20 and value % 2**20 == 0:
        unit, size = ("GiB", value // 2**30) if value % 2**30 == 0 else ("MiB", value // 2**20)
        return f"`{value}` ({size} {unit})"
    return f"`{value}`"


def serve_flags() -> tuple[dict[str, list[str]], dict[str, str]]:
    """Settings key -> `dormouse serve`'s flags for it, and their help, read from the parser itself."""
    from daemon.cli import _parser

    parser = _parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags: dict[str, list[str]] = {}
    helps: dict[str, str] = {}
    for action in commands.choices["serve"]._actions:
        if action.dest in ("help", "config"):
            continue
        flags.setdefault(action.dest, []).extend(action.option_strings)
        if action.help:
            helps[action.dest] = action.help.replace("%%", "%")
    return flags, helps


def llama_server_aliases() -> dict[str, list[str]]:
    """Settings key -> llama-server's spellings (and LLAMA_ARG_* variable) that set it."""
    from daemon.llama_server_options import OPTIONS

    keys = set(Settings.model_fields)
    aliases: dict[str, list[str]] = {}
    for option in OPTIONS:
        if option.does.kind != "mapped":
            continue
        for key in dict.fromkeys(MAPPED_KEY.findall(option.does.doc)):
            if key in keys:
                spellings = [*option.spellings, *([option.env] if option.env else [])]
                aliases.setdefault(key, []).extend(s for s in spellings if s not in aliases.get(key, []))
    return aliases


def cell(text: str) -> str:
    """One Markdown table cell: no line breaks, and a `|` that does not end it."""
    return " ".join(text.split()).replace("|", "\\|")


def code_list(names: list[str]) -> str:
    return ", ".join(f"`{name}`" for name in names)


def settings_rows() -> list[str]:
    (flags, helps), aliases = serve_flags(), llama_server_aliases()
    rows = ["| key | type | default | flag | llama-server | environment | reload | description |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, field in Settings.model_fields.items():
        own = flags.get(key, [])
        llama = [a for a in aliases.get(key, []) if a not in own]
        env = "" if key == "worker_module" else f"`{ENV_PREFIX}{key.upper()}`"
        reload = "applied" if key in RELOADABLE else "restart"
        rows.append("| " + " | ".join(cell(c) for c in (
            f"`{key}`", type_name(field.annotation), default_text(key, field), code_list(own) or "-",
            code_list(llama) or "-", env or "-", reload,
            field.description or helps.get(key, ""))) + " |")
    return rows


# A table's own model (daemon/fleet/plans.py _own_model): these never fall back to the top level's,
# since a top-level hf_file belongs to the top-level repository.
NAMES_THE_MODEL = {"path", "hf", "hf_file"}


def model_rows() -> list[str]:
    rows = ["| key | type | default | reload | description |", "| --- | --- | --- | --- | --- |"]
    for key, field in ModelSettings.model_fields.items():
        top = Settings.model_fields.get(key)
        inherited = top is not None and field.default is None and key not in NAMES_THE_MODEL
        default = f"the top-level `{key}`" if inherited else default_text(key, field)
        if key == "llama_options":
            default = "the top-level `llama_options`, this table's keys laid over them"
        description = field.description or (top.description if top is not None else "") or ""
        reload = "applied" if key in RELOADABLE_PER_MODEL else "restart"
        rows.append("| " + " | ".join(cell(c) for c in (
            f"`{key}`", type_name(field.annotation), default, reload, description)) + " |")
    return rows


def render() -> str:
    return "\n".join([
        "# Configuration reference",
        "",
        f"Generated from the code by `{REGENERATE}`; "
        "`tests/unit/test_docs_reference.py` fails when this page and the code differ. "
        "How the layers combine (defaults, the file, the environment, flags) is in "
        "[Configuration](../configuration.md).",
        "",
        "Every key can be set in the TOML file, and by its environment variable "
        "(a list: names separated by commas; a table: a JSON object; `api_keys` also `name:key,name:key`). "
        "*flag* is `dormouse serve`'s own; *llama-server* lists llama-server's spellings and `LLAMA_ARG_*` "
        "variable that set the same key ([every llama-server option](../llama-server-options.md)). "
        "*reload*: `applied` when `SIGHUP` (`systemctl reload dormouse`) applies a new value, "
        "`restart` when a changed value needs a restart (the reload names it in a `reload.needs_restart` "
        "warning).",
        "",
        "## Settings",
        "",
        *settings_rows(),
        "",
        "## `[models.ID]` tables",
        "",
        "One table per model served (see [the fleet](../fleet.md)). A key a table leaves out takes the "
        "top-level value. These keys are set in the file only (or as JSON in `DORMOUSE_MODELS`).",
        "",
        *model_rows(),
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m daemon.config_reference", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {PAGE.name} (default: print it)")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        PAGE.parent.mkdir(parents=True, exist_ok=True)
        PAGE.write_text(text)
        print(f"wrote {PAGE}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
