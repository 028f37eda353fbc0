"""llama-server's command line and LLAMA_ARG_* variables, translated for `dormouse serve`.

People come from llama-server command lines (scripts, systemd units, llama-swap's
`cmd:`). `translate()` reads one as llama.cpp's own parser does (common/arg.cpp:
the variables first, the command line over them, `--foo_bar` as `--foo-bar`, the
last of a repeated option wins) and says what it means for Dormouse: settings,
llama.cpp parameters passed through (`llama_options`), notes for options that
change nothing, and Dormouse's own arguments left untouched for its argparse.
An option Dormouse refuses, an unknown one or a bad value raises one
LlamaServerArgsError that names it. The table is daemon/llama_server_options.py.

    python -m daemon.llama_server_args -m x.gguf -c 2048 -ngl all -fa on
        prints the equivalent `dormouse serve` command line
    python -m daemon.llama_server_args --docs
        prints docs/llama-server-options.md
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from functools import lru_cache
from typing import Any, Mapping

from config.llama_options import check_llama_options
from daemon.llama_server_handling import LlamaServerArgsError, Translation, parse_bool, parse_int
from daemon.llama_server_options import LEGACY, LLAMA_CPP_COMMIT, OPTIONS, Option, by_env, by_spelling

__all__ = ["LlamaServerArgsError", "Translation", "translate", "main", "docs_table", "serve_command_line"]

MAX_ARGS = 4096
MAX_VALUE_BYTES = 1 << 20
_ENV_PREFIXES = ("LLAMA_ARG_",)
LLAMA_SERVER_N_BATCH = 2048  # llama-server's -b when it is not given (common/common.h)
BARE_FLASH_ATTN = ("-fa", "--flash-attn")  # a flag before llama.cpp gave it a value; scripts still say `-fa -c ...`


@lru_cache(maxsize=1)
def dormouse_serve_flags() -> dict[str, bool]:
    """`dormouse serve`'s own option strings -> whether each takes a value (from its argparse parser)."""
    from daemon.cli import _parser

    parser = _parser()
    serve = next(action for action in parser._subparsers._group_actions if action.dest == "command")  # noqa: SLF001
    flags: dict[str, bool] = {}
    for action in serve.choices["serve"]._actions:  # noqa: SLF001
        for flag in action.option_strings:
            flags[flag] = action.nargs != 0
    return flags


def translate(argv: list[str], environ: Mapping[str, str], own_flags: Mapping[str, bool] | None = None) -> Translation:
    """What `dormouse serve <argv>` means, with llama-server's spellings and variables read as llama-server reads
    them. own_flags: Dormouse's own option strings (default: those of `dormouse serve`), passed through in `rest`."""
    if not isinstance(argv, (list, tuple)) or not all(isinstance(arg, str) for arg in argv):
        raise LlamaServerArgsError("the arguments must be a list of strings")
    if len(argv) > MAX_ARGS:
        raise LlamaServerArgsError(f"more than {MAX_ARGS} arguments")
    own = dormouse_serve_flags() if own_flags is None else own_flags
    given, rest = _split(list(argv), own)
    out = Translation(rest=rest)
    on_command_line = {id(option) for option, _, _, _ in given}
    _apply_environment(environ, on_command_line, out)
    for option, positive, value, spelling in given:
        _apply(option, positive, value, spelling, out)
    _finish(out)
    return out


def _split(argv: list[str], own: Mapping[str, bool]) -> tuple[list[tuple[Option, bool, Any, str]], list[str]]:
    """llama-server's options with their values, in order, and the arguments that are Dormouse's own."""
    spellings = by_spelling()
    given: list[tuple[Option, bool, Any, str]] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        name, equals, inline = token.partition("=") if token.startswith("--") else (token, "", "")
        # llama.cpp reads --foo_bar as --foo-bar
        looked_up = name.replace("_", "-") if name.startswith("--") else name
        if looked_up in spellings:
            option, positive = spellings[looked_up]
            if option.takes in ("flag", "switch"):
                if equals:
                    raise LlamaServerArgsError(f"{name} takes no value (got {inline[:40]!r})")
                given.append((option, positive, True, looked_up))
                continue
            count = 2 if option.takes == "two" else 1
            values = [inline] if equals else []
            bare = i >= len(argv) or (argv[i].startswith("-") and argv[i] != "-1")
            if looked_up in BARE_FLASH_ATTN and not equals and bare:
                values = ["on"]  # older llama-server: -fa alone turned flash attention on
            
            while len(values) < count:
                if i >= len(argv):
                    raise LlamaServerArgsError(f"{looked_up} expects a value")
                values.append(argv[i])
                i += 1
            if any(len(value) > MAX_VALUE_BYTES for value in values):
                raise LlamaServerArgsError(f"{looked_up}: a value longer than {MAX_VALUE_BYTES} bytes")
            given.append((option, positive, tuple(values) if count == 2 else values[0], looked_up))
        elif name in own:
            rest.append(token)
            if own[name] and not equals and i < len(argv):
                rest.append(argv[i])
                i += 1
        elif token.startswith("-") and token != "-":
            raise LlamaServerArgsError(f"{name[:80]}: not an option of llama-server (llama.cpp "
                                       f"{LLAMA_CPP_COMMIT[:12]}) nor of dormouse serve")
        else:
            raise LlamaServerArgsError(f"unexpected argument {token[:80]!r}: llama-server and dormouse serve take "
                                       "options only")
    return given, rest


def _apply(option: Option, positive: bool, value: Any, spelling: str, out: Translation,
           handling: Any = None) -> None:
    """One option: its value parsed as llama-server parses it, then its handling."""
    if option.takes == "switch":
        value = positive
    elif option.takes == "int" or option.parse is not None:
        parse = option.parse or parse_int
        try:
            value = parse(value)
        except ValueError as exc:
            raise LlamaServerArgsError(f"{spelling}: {exc}") from None
    (handling or option.does).apply(value, spelling, out)


def _apply_environment(environ: Mapping[str, str], on_command_line: set[int], out: Translation) -> None:
    """LLAMA_ARG_* variables, as llama.cpp reads them: before the command line, which wins over them."""
    variables = by_env()
    for name in sorted(environ):
        if name not in variables:
            if name.startswith(_ENV_PREFIXES):
                out.notes.append(f"{name}: ignored; not a variable of llama-server (llama.cpp "
                                 f"{LLAMA_CPP_COMMIT[:12]})")
            continue
        option, positive = variables[name]
        if id(option) in on_command_line:
            out.notes.append(f"{name}: the command line's {option.spellings[-1]} wins over it")
            continue
        text = environ[name]
        if len(text) > MAX_VALUE_BYTES:
            raise LlamaServerArgsError(f"environment {name}: longer than {MAX_VALUE_BYTES} bytes")
        try:
            if option.takes == "flag":
                if not parse_bool(text):
                    continue  # llama.cpp: a falsey value leaves the flag unset
                value: Any = True
            elif option.takes == "switch":
                positive = positive and parse_bool(text)  # LLAMA_ARG_NO_*: set at all means off
                value = positive
            else:
                value = text
        except ValueError as exc:
            raise LlamaServerArgsError(f"environment {name}: {exc}") from None
        _apply(option, positive, value, f"environment {name}", out, option.env_does)


def _finish(out: Translation) -> None:
    """What needs the whole command line: -c 0 reads the model's context; -ub with embeddings; -c without -np."""
    if out.context_from_model:
        out.settings["ctx_size"] = _trained_context(out.settings.get("model"), out.origins.get("ctx_size", "-c"))
    if "ctx_size" in out.origins and "parallel" not in out.settings and "kv_unified" not in out.settings:
        # llama-server's -np auto (its default) turns on -kvu: any one slot may grow to all of -c. Not copied:
        # which spelling a flag came in decides nothing else in Dormouse; said, so no conversation is cut short.
        out.notes.append(f"{out.origins['ctx_size']} with no number of slots (-np absent or -1): llama-server's "
                         "automatic slots share the whole context (-np auto turns -kvu on); here each slot has "
                         "ctx_size / parallel (4 slots by default): add -kvu to share it as llama-server does")
    _check_speculation(out)
    if out.settings.get("embeddings") and "n_ubatch" in out.llama_options:
        _fold_ubatch_into_batch(out)
    try:
        out.llama_options = check_llama_options(out.llama_options)
    except ValueError as exc:  # the table passes only what the check allows: this is a bug, said plainly
        raise LlamaServerArgsError(f"llama_options: {exc}") from None


def _check_speculation(out: Translation) -> None:
    """--spec-type against the draft model, whatever their order. none: no speculation, so a draft model on
    the command line (-md, --model-draft) is not loaded. draft-simple: drafts are proposed whatever their
    probability unless --spec-draft-p-min says otherwise (llama-server's default p-min is 0; Dormouse's own,
    without --spec-type, is 0.75). What the line cannot reach (a model_draft or draft_p_min of the config
    file or the environment) is said in a note."""
    spelling = out.origins.pop("speculation", "--spec-type")
    if out.speculation == "draft-simple":
        if "draft_p_min" not in out.settings:
            out.settings["draft_p_min"] = 0.0
            out.origins["draft_p_min"] = spelling
            out.notes.append(f"{spelling} draft-simple: draft_p_min = 0 (llama-server's default), over a "
                             "draft_p_min of the config file or the environment")
        if "model_draft" not in out.settings:
            out.notes.append(f"{spelling} draft-simple without -md: drafts only with a model_draft of the config "
                             "file or the environment")
    if out.speculation != "none":
        return
    if out.settings.pop("model_draft", None):
        out.notes.append(f"{spelling} none: the draft model ({out.origins.pop('model_draft', '-md')}) is not loaded")
    else:
        out.notes.append(f"{spelling} none: a model_draft of the config file or the environment would still be "
                         "loaded and used (remove it there)")


def _fold_ubatch_into_batch(out: Translation) -> None:
    """-ub with --embeddings, read as llama-server reads it: a pooled input must sit in one micro-batch, so
    llama-server lowers n_batch to n_ubatch (its default n_batch, 2048, when -b is not given). Dormouse's
    embeddings context already reads in micro-batches of batch_size (-b), so -ub becomes that batch size."""
    ubatch = out.llama_options.pop("n_ubatch")
    spelling = out.origins.pop("n_ubatch", "-ub")
    batch = out.settings.get("batch_size", LLAMA_SERVER_N_BATCH)
    if batch > ubatch:
        out.notes.append(f"{spelling} {ubatch} with --embeddings: batch_size {batch} lowered to {ubatch}, as "
                         "llama-server does (a pooled input sits in one micro-batch)")
        out.settings["batch_size"] = ubatch
        out.origins["batch_size"] = spelling


def _trained_context(model: Any, spelling: str) -> int:
    if not model:
        raise LlamaServerArgsError(f"{spelling} 0 (the model's trained context) needs the model file: give -m, or "
                                   "a context size")
    from daemon.model.gguf_header import GgufError, read_header

    try:
        metadata = read_header(str(model)).metadata
    except (GgufError, OSError) as exc:
        raise LlamaServerArgsError(f"{spelling} 0: cannot read the trained context of {str(model)[:200]}: "
                                   f"{exc}") from None
    value = metadata.get(f"{metadata.get('general.architecture')}.context_length")
    if not isinstance(value, int) or isinstance(value, bool) or value < 64:
        raise LlamaServerArgsError(f"{spelling} 0: {str(model)[:200]} names no usable context length; give one")
    return value


# -- the equivalent `dormouse serve` command line --

def serve_command_line(translation: Translation) -> tuple[dict[str, str], list[str]]:
    """DORMOUSE_* variables and `dormouse serve` arguments with the same meaning: a flag where
    dormouse serve has one, a variable where it has none."""
    flags = _flag_for_setting()
    environment: dict[str, str] = {}
    argv = ["dormouse", "serve"]
    for key, value in translation.serve_settings().items():
        flag = flags.get(key)
        if flag is not None and isinstance(value, bool):
            if flag[1] == "negatable":
                argv.append(flag[0] if value else "--no-" + flag[0][2:])
                continue
            if flag[1] == "store_true" and value:
                argv.append(flag[0])
                continue
        elif flag is not None and flag[1] == "value" and isinstance(value, (str, int, float)):
            argv += [flag[0], str(value)]
            continue
        environment["DORMOUSE_" + key.upper()] = _env_value(value)
    return environment, argv + translation.rest


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


@lru_cache(maxsize=1)
def _flag_for_setting() -> dict[str, tuple[str, str]]:
    """setting -> (its `dormouse serve` flag, "value", "store_true" or "negatable")."""
    import argparse

    from daemon.cli import _parser

    parser = _parser()
    serve = next(action for action in parser._subparsers._group_actions if action.dest == "command")  # noqa: SLF001
    out: dict[str, tuple[str, str]] = {}
    for action in serve.choices["serve"]._actions:  # noqa: SLF001
        longs = [flag for flag in action.option_strings if flag.startswith("--") and not flag.startswith("--no-")]
        if not longs or action.dest in ("help", "config"):
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            out[action.dest] = (longs[0], "negatable")
        elif action.nargs == 0:
            out[action.dest] = (longs[0], "store_true")
        else:
            out[action.dest] = (longs[0], "value")
    return out


# -- docs/llama-server-options.md --

def docs_table() -> str:
    lines = [
        "# llama-server's options in Dormouse",
        "",
        "`dormouse serve` takes llama-server's command line unchanged: every option of llama-server's `--help`, "
        "long and short, and its `LLAMA_ARG_*` variables, as llama.cpp "
        f"`{LLAMA_CPP_COMMIT}` (the one llama-cpp-python 0.3.36 vendors) defines them. Each is **mapped** onto a "
        "Dormouse setting, **passed to llama.cpp** (the `llama_options` setting: a `llama_context_params` / "
        "`llama_model_params` field of the main model), **accepted** where Dormouse already behaves so (a note "
        "at start says so), or **refused** with one line that says why. `dormouse serve`'s own flags keep their "
        "names. A variable is read only when the command line does not give its option; a switch's "
        "`LLAMA_ARG_NO_*` form turns it off. `python -m daemon.llama_server_args <llama-server options>` prints "
        "the equivalent `dormouse serve` command line.",
        "",
        "Generated by `python -m daemon.llama_server_args --docs` from daemon/llama_server_options.py; "
        "tests/unit/test_llama_server_args.py checks that this file is what it generates.",
        "",
        "| option | environment | Dormouse |",
        "|---|---|---|",
    ]
    for option in OPTIONS + LEGACY:
        spellings = ", ".join(f"`{s}`" for s in option.spellings)
        if option.negative:
            spellings += "; off: " + ", ".join(f"`{s}`" for s in option.negative)
        if option.takes not in ("flag", "switch"):
            spellings += " VALUE" if option.takes != "two" else " VALUE VALUE"
        env = ""
        if option.env:
            env = f"`{option.env}`"
            if option.negative:
                env += f", `{option.env.replace('LLAMA_ARG_', 'LLAMA_ARG_NO_', 1)}`"
        doc = option.does.doc if option.env_does is None else \
            f"{option.does.doc} (the variable: {option.env_does.doc})"
        if option in LEGACY:
            doc += " (a spelling of older llama-server versions)"
        lines.append(f"| {spellings} | {env} | {doc.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--docs"]:
        sys.stdout.write(docs_table())
        return 0
    try:
        translation = translate(argv, os.environ)
    except LlamaServerArgsError as exc:
        print(f"dormouse: {exc}", file=sys.stderr)
        return 2
    for note in translation.notes:
        print(f"# {note}", file=sys.stderr)
    environment, command = serve_command_line(translation)
    words = [f"{name}={shlex.quote(value)}" for name, value in environment.items()] + [shlex.quote(w) for w in command]
    print(" ".join(words))
    return 0


if __name__ == "__main__":
    sys.exit(main())
