"""llama-server's router --models-preset: an INI file of model presets, read as [models.ID] tables.

Its format is llama-server's (tools/server/README.md, "Model presets"): one section per model, its
keys llama-server's options without their dashes (`n-gpu-layers = 123`), their short forms (`c =
4096`) or their LLAMA_ARG_* variables; a `[*]` section gives every preset its defaults; top-level
keys (`version = 1`) precede the sections. Each section's options are translated as the same
command line would be (llama_server_args.translate), and what they set becomes the model's table:
`model` its path, `hf-repo` its hf, `mmproj`, `ctx-size`, llama.cpp's own parameters and the other
per-model keys. `[*]` is read as the router's command line (which wins over it): its options set the
daemon's settings, which every model inherits (those of --models-dir too), but for the keys that name
a model, laid under each section's. In a model's section, an option that is the daemon's and not a
model's (`port`, `cache-ram`...) is refused with the section named: llama-server drops some of those
in silence, Dormouse says so. One difference: a section's option wins over the same option on the
command line (in Dormouse a [models.ID] table wins over the top level; in llama-server the command
line wins over a preset).
"""

from __future__ import annotations

import configparser
from pathlib import Path
from typing import Any

from config.models import PER_MODEL_KEYS
from daemon.llama_server_handling import LlamaServerArgsError, Translation, parse_bool

MAX_PRESET_BYTES = 1 << 20
MAX_SECTIONS = 66  # 64 models (the fleet's bound), [*] and the keys before the first section
TOP = "__top__"  # the keys before the first section (configparser needs a section for them)
# The preset's own keys (not options). load-on-startup: Dormouse loads the default model and pinned ones.
PRESET_ONLY = {"load-on-startup", "stop-timeout", "dedup-cache-models"}
TABLE_KEYS = {"model": "path", "hf_repo": "hf", "hf_file": "hf_file", **{k: k for k in PER_MODEL_KEYS}}
MODEL_NAMING = {"model", "hf_repo", "hf_file", "models"}  # in [*]: laid under each section, not the daemon's


def _parser(path: Path, spelling: str) -> configparser.ConfigParser:
    try:
        data = path.read_bytes()[:MAX_PRESET_BYTES + 1]
    except OSError as exc:
        raise LlamaServerArgsError(f"{spelling}: cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_PRESET_BYTES:
        raise LlamaServerArgsError(f"{spelling}: {path} is larger than {MAX_PRESET_BYTES} bytes")
    parser = configparser.ConfigParser(interpolation=None, delimiters=("=",), comment_prefixes=(";", "#"),
                                       default_section="\0none")
    parser.optionxform = str  # LLAMA_ARG_* names keep their case
    try:
        parser.read_string(f"[{TOP}]\n" + data.decode("utf-8"), source=str(path))
    except (UnicodeDecodeError, configparser.Error) as exc:
        raise LlamaServerArgsError(f"{spelling}: {path} is not an INI file: {str(exc).splitlines()[0]}") from None
    return parser


def _command_line(keys: dict[str, str], where: str) -> tuple[list[str], dict[str, str]]:
    """A section's keys as llama-server's argv and variables."""
    from daemon.llama_server_options import by_env, by_spelling

    spellings = by_spelling()
    argv: list[str] = []
    environ: dict[str, str] = {}
    variables = by_env()
    for key, value in keys.items():
        if key.startswith("LLAMA_ARG_"):
            if key not in variables:
                raise LlamaServerArgsError(f"{where}: {key} is not a variable of llama-server")
            option, _ = variables[key]
            environ[key] = value
        else:
            spelling = next((s for s in (f"--{key}", f"-{key}") if s in spellings), None)
            if spelling is None:
                raise LlamaServerArgsError(f"{where}: {key} is not an option of llama-server")
            option, _ = spellings[spelling]
        if "--models-preset" in option.spellings:
            raise LlamaServerArgsError(f"{where}: {key}: a preset cannot name another preset")
        if key.startswith("LLAMA_ARG_"):
            continue
        if option.takes in ("flag", "switch"):
            try:
                on = parse_bool(value)
            except ValueError as exc:
                raise LlamaServerArgsError(f"{where}: {key}: {exc}") from None
            if on:
                argv.append(spelling)
            elif option.negative:
                argv.append(option.negative[-1])
            continue
        argv += [spelling, *value.split()] if option.takes == "two" else [spelling, value]
    return argv, environ


def _table(translation: Translation, where: str) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for key, value in translation.settings.items():
        if key == "models":  # -a/--alias: the section names the model, so every name is an alias
            (first, own), = value.items()
            table["aliases"] = [first, *own["aliases"]]
        elif key in TABLE_KEYS:
            table[TABLE_KEYS[key]] = value
        else:
            raise LlamaServerArgsError(f"{where}: {translation.origins.get(key, key)} sets `{key}`, which is the "
                                       "daemon's, not a model's: give it on the command line or in the config file")
    if translation.llama_options:
        table["llama_options"] = translation.llama_options
    return table


def _split_common(common: dict[str, str], where: str) -> tuple[dict[str, str], Translation]:
    """[*]'s keys: those that name a model (laid under each section's), and the rest as the router's
    command line would set them: once, for the daemon, so that every model inherits them, those of
    --models-dir too (a table leaves out what the top level sets)."""
    from daemon.llama_server_args import translate

    per_model: dict[str, str] = {}
    daemon: dict[str, str] = {}
    for key, value in common.items():  # each alone, only to learn whether it names a model
        if key in PRESET_ONLY:
            per_model[key] = value
            continue
        try:
            alone = translate(*_command_line({key: value}, where), own_flags={})
        except LlamaServerArgsError as exc:
            raise LlamaServerArgsError(f"{where}: {exc}") from None
        (per_model if set(alone.settings) & MODEL_NAMING else daemon)[key] = value
    try:  # together, as one command line: options that read each other (mlock and mmap, -c 0 and -m) agree
        daemon_wide = translate(*_command_line(daemon, where), own_flags={})
    except LlamaServerArgsError as exc:
        raise LlamaServerArgsError(f"{where}: {exc}") from None
    daemon_wide.notes = [f"{where}: {note}" for note in daemon_wide.notes]
    return per_model, daemon_wide


def models_from_preset(path_text: str, spelling: str,
                       notes: list[str]) -> tuple[dict[str, dict[str, Any]], Translation]:
    """({model id: table} for each section of the preset file, what [*] sets for the daemon);
    `notes` gets what was accepted as is."""
    from daemon.llama_server_args import translate

    path = Path(path_text).expanduser()
    parser = _parser(path, spelling)
    common, daemon_wide = _split_common(dict(parser["*"]) if parser.has_section("*") else {},
                                        f"{spelling} {path} [*]")
    tables: dict[str, dict[str, Any]] = {}
    if len(parser.sections()) > MAX_SECTIONS:
        raise LlamaServerArgsError(f"{spelling}: {path} has more than {MAX_SECTIONS} sections (the fleet's bound)")
    for key in parser[TOP]:
        if key != "version":
            notes.append(f"{spelling} {path}: {key} before the first section: ignored (llama-server reads `version` "
                         "there, nothing else)")
    for section in parser.sections():
        if section in (TOP, "*"):
            continue
        where = f"{spelling} {path} [{section}]"
        keys = {**common, **parser[section]}
        for key in PRESET_ONLY & keys.keys():
            value = keys.pop(key)
            try:
                on = parse_bool(value) if key == "load-on-startup" else False
            except ValueError as exc:
                raise LlamaServerArgsError(f"{where}: {key}: {exc}") from None
            if on:
                raise LlamaServerArgsError(f"{where}: load-on-startup: Dormouse loads the default model "
                                           "(default_model) and pinned ones at start: pin it in the config file")
            notes.append(f"{where}: {key} accepted; it changes nothing in Dormouse")
        argv, environ = _command_line(keys, where)
        try:
            translation = translate(argv, environ, own_flags={})
        except LlamaServerArgsError as exc:
            raise LlamaServerArgsError(f"{where}: {exc}") from None
        notes.extend(f"{where}: {note}" for note in translation.notes)
        table = _table(translation, where)
        if not ({"path", "hf"} & table.keys()):
            raise LlamaServerArgsError(f"{where}: names no model: give `model = /path/to/file.gguf` or `hf-repo`")
        tables[section] = table
    if not tables:
        raise LlamaServerArgsError(f"{spelling}: {path} has no model section")
    return tables, daemon_wide
