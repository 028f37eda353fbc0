"""llama-server's seven built-in tools: their definitions (what GET /tools shows a model) and what each does.

Names, parameters, limits and answers are llama-server's (tools/server/
server-tools.cpp), so its web UI and agents work unchanged: an answer is a
JSON object, `plain_text_response` for what the model reads, `error` for a
failure the model should see (still a 200). A parameter of the wrong type is
a ToolInputError (400). Everything here runs in a tool's child process.
"""

from __future__ import annotations

import base64
import os
import platform
import re
from dataclasses import dataclass
from typing import Any, Callable

from daemon.host_tools.runtime import HostIO

READ_MAX = 16 * 1024  # bytes of text read_file returns without a line range
READ_MAX_BASE64 = 32 * 1024 * 1024  # x-resp-type: base64 (the web UI's attachments)
READ_RANGE_MAX = 64 * 1024 * 1024  # a line range still reads the file: a bound on how much
SEARCH_MAX_RESULTS = 100
GREP_MAX_RESULTS = 100
GREP_FILE_MAX = 8 * 1024 * 1024  # a larger file is not searched (logs, binaries)
EXEC_MAX_OUTPUT = 16 * 1024
EXEC_MAX_TIMEOUT = 60  # seconds
INFO_TIMEOUT = 5


TEXT_PARAMS = frozenset({"content", "old_text", "new_text"})  # a file's bytes: NUL allowed
GREP_MAX_OUTPUT = 64 * 1024  # what grep_search answers, context included
GREP_LINE_MAX = 2000  # characters of one line shown


class ToolInputError(ValueError):
    """Parameters of the wrong type or missing: a 400 that names the parameter."""


@dataclass(frozen=True)
class Tool:
    name: str
    display_name: str
    description: str
    properties: dict[str, Any]
    required: tuple[str, ...] = ()
    write: bool = False  # changes files or runs commands: the web UI asks before it calls one
    stream: bool = False

    def definition(self) -> dict[str, Any]:
        parameters: dict[str, Any] = {"type": "object", "properties": self.properties}
        if self.required:
            parameters["required"] = list(self.required)
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": parameters}}

    def listing(self) -> dict[str, Any]:
        """One entry of GET /tools, in llama-server's shape."""
        return {"display_name": self.display_name, "tool": self.name, "type": "server",
                "permissions": {"write": self.write}, "uses_cwd": True, "definition": self.definition()}


def _p(kind: str, text: str) -> dict[str, str]:
    return {"type": kind, "description": text}


_GLOB_NOTE = ("A pattern with no '/' (e.g. \"*.cpp\") matches the file's basename at any depth; a pattern with '/' "
              "matches the relative path, anchored with \"**/\" unless it starts with \"**/\" or '/'.")

TOOLS = {tool.name: tool for tool in (
    Tool("read_file", "Read file",
         "Read the contents of a file. Optionally specify a 1-based line range. If append_loc is true, each line is "
         "prefixed with its line number (e.g. \"1\u2192...\").",
         {"path": _p("string", "Path to the file"),
          "start_line": _p("integer", "First line to read, 1-based (default: 1)"),
          "end_line": _p("integer", "Last line to read, 1-based inclusive (default: end of file)"),
          "append_loc": _p("boolean", "Prefix each line with its line number")}, ("path",)),
    Tool("file_glob_search", "File search",
         "Recursively search for files matching a glob pattern under a directory. Skips files ignored by .gitignore "
         "(inside a git repository) and common junk directories (.git, node_modules, build, dist, etc.). "
         + _GLOB_NOTE + " Use type=\"dir\" or \"all\" to also list directories; they end with '/' in the output.",
         {"path": _p("string", "Base directory to search in"),
          "include": _p("string", "Glob pattern for files to include (e.g. \"*.cpp\" or \"src/**/*.cpp\"). "
                                  "Default: **"),
          "exclude": _p("string", "Glob pattern for files to exclude"),
          "type": _p("string", "Entry type to return: \"file\" (default), \"dir\" or \"all\""),
          "max_depth": _p("integer", "Maximum depth to descend into subdirectories (default: 0 = unlimited; "
                                     "1 = direct children only)"),
          "limit": _p("integer", f"Maximum number of results to return, capped at {SEARCH_MAX_RESULTS} "
                                 f"(default {SEARCH_MAX_RESULTS})")}, ("path",)),
    Tool("grep_search", "Grep search",
         "Search for a pattern in files under a path. Returns matching lines with file paths (relative to the given "
         "directory). Skips files ignored by .gitignore and common junk directories. include/exclude: " + _GLOB_NOTE,
         {"path": _p("string", "File or directory to search in"),
          "pattern": _p("string", "Pattern to search for (regular expression unless literal is true)"),
          "include": _p("string", "Glob pattern to filter files (default: **)"),
          "exclude": _p("string", "Glob pattern to exclude files"),
          "return_line_numbers": _p("boolean", "If true, include line numbers in results"),
          "literal": _p("boolean", "Treat pattern as a literal string instead of a regular expression "
                                   "(default: false)"),
          "ignore_case": _p("boolean", "Case-insensitive search (default: false)"),
          "context_lines": _p("integer", "Number of lines of context to show before and after each match "
                                         "(default: 0)")}, ("path", "pattern")),
    Tool("exec_shell_command", "Execute shell command",
         "Execute a shell command and return its output (stdout and stderr combined).",
         {"command": _p("string", "Shell command to execute"),
          "timeout": _p("integer", f"Timeout in seconds (default 10, max {EXEC_MAX_TIMEOUT})"),
          "max_output_size": _p("integer", f"Maximum output size in bytes (default {EXEC_MAX_OUTPUT})")},
         ("command",), write=True, stream=True),
    Tool("write_file", "Write file",
         "Write content to a file, creating it (including parent directories) if it does not exist. May use with "
         "edit_file for more complex edits.",
         {"path": _p("string", "Path of the file to write"), "content": _p("string", "Content to write")},
         ("path", "content"), write=True),
    Tool("edit_file", "Edit file",
         "Edit a file using exact text replacement. Each edits[].old_text must be unique in the file and is matched "
         "against the original content, not incrementally. Merge nearby changes into one edit instead of "
         "overlapping edits. Use write_file to replace the whole file.",
         {"path": _p("string", "Path to the file to edit"),
          "edits": {"type": "array", "description": "One or more exact text replacements to apply",
                    "items": {"type": "object", "properties": {
                        "old_text": _p("string", "Exact text to find; must be unique in the file and must not "
                                                 "overlap with other edits"),
                        "new_text": _p("string", "Text to replace old_text with")},
                        "required": ["old_text", "new_text"]}}},
         ("path", "edits"), write=True),
    Tool("get_info", "Get Runtime Info",
         "Returns runtime info: the OS name/version and the current working directory", {}),
)}


# -- parameters --

def _get(params: dict[str, Any], name: str, kind: type, default: Any = None, *, required: bool = False) -> Any:
    if name not in params or params[name] is None:
        if required:
            raise ToolInputError(f"params.{name} is required")
        return default
    value = params[name]
    # bool is an int in Python: a boolean where a number is meant (or the reverse) is refused
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ToolInputError(f"params.{name} must be {'an integer' if kind is int else kind.__name__}, "
                             f"not {type(value).__name__}")
    if kind is str and "\x00" in value and name not in TEXT_PARAMS:  # a path or a command cannot hold one
        raise ToolInputError(f"params.{name} holds a NUL character")
    return value


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


# -- globs --

def glob_regex(pattern: str) -> re.Pattern[str]:
    """`*` and `?` stay inside one path segment, `**` crosses them, `[...]` is a class (`[!...]` negated)."""
    out, i = [], 0
    while i < len(pattern):
        char = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")  # "**/x" also matches "x" itself
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[" and "]" in pattern[i + 2:]:
            end = pattern.index("]", i + 2)
            body = pattern[i + 1:end]
            negated = body[:1] in ("!", "^")
            body = body[1:] if negated else body
            out.append("[" + ("^" if negated else "") + body.replace("\\", "\\\\") + "]")
            i = end + 1
            continue
        else:
            out.append(re.escape(char))
        i += 1
    try:
        return re.compile("".join(out) + r"\Z", re.DOTALL)
    except re.error as exc:
        raise ToolInputError(f"invalid glob {pattern[:100]!r}: {exc}") from None


def path_matcher(pattern: str) -> Callable[[str], bool]:
    """The test of one relative path, the pattern compiled once: with no '/' it matches the basename, else the
    path (anchored with **/ unless it starts with **/ or /)."""
    if "/" not in pattern:
        regex = glob_regex(pattern)
        return lambda relative: regex.match(relative.rsplit("/", 1)[-1]) is not None
    if not (pattern == "**" or pattern.startswith(("**/", "/"))):
        pattern = "**/" + pattern
    regex = glob_regex(pattern.lstrip("/") if pattern.startswith("/") else pattern)
    return lambda relative: regex.match(relative) is not None


def path_matches(pattern: str, relative: str) -> bool:
    return path_matcher(pattern)(relative)


def _selected(paths: list[tuple[str, bool]], include: str, exclude: str) -> list[tuple[str, bool]]:
    """The listing's entries that `include` matches and `exclude` (if any) does not."""
    included, excluded = path_matcher(include), path_matcher(exclude) if exclude else None
    return [entry for entry in paths if included(entry[0]) and not (excluded and excluded(entry[0]))]


def _glob(params: dict[str, Any], name: str, default: str) -> str:
    value = _get(params, name, str, default)
    if len(value) > 1024:
        raise ToolInputError(f"params.{name} is longer than 1024 characters")
    return value


# -- the tools --

def read_file(params: dict[str, Any], io: HostIO, emit: Callable[[str], None] | None) -> dict[str, Any]:
    path = _get(params, "path", str, required=True)
    start_line = _get(params, "start_line", int, 1)
    end_line = _get(params, "end_line", int, -1)
    append_loc = _get(params, "append_loc", bool, False)
    if start_line < 1 or (end_line < 1 and end_line != -1) or (end_line != -1 and start_line > end_line):
        return {"error": f"invalid line range: start_line {start_line}, end_line {end_line} (lines count from 1; "
                         "end_line -1 is the end of the file)"}
    size = io.file_size(path)
    if size is None:
        return {"error": f"cannot stat file: {path}"}
    if params.get("resp_type") == "base64":  # from the x-resp-type header: the model cannot ask for it
        if size > READ_MAX_BASE64:
            return {"error": f"file too large ({size} bytes, max {READ_MAX_BASE64})"}
        content = io.read_file(path, READ_MAX_BASE64)
        if content is None:
            return {"error": f"failed to open file: {path}"}
        return {"base64": base64.b64encode(content).decode(), "size_bytes": len(content)}
    if size > READ_MAX and end_line == -1:
        return {"error": f"file too large ({size} bytes, max {READ_MAX}). Use start_line/end_line to read a portion."}
    content = io.read_file(path, READ_RANGE_MAX)
    if content is None:
        return {"error": f"failed to open file: {path}"}
    result: list[str] = []
    used = 0
    lines = content.decode("utf-8", "replace").split("\n")
    if lines[-1] == "":
        lines.pop()  # the text after the last newline: no line
    for number, line in enumerate(lines, start=1):
        if number < start_line:
            continue
        if end_line != -1 and number > end_line:
            break
        out = f"{number}\u2192{line}\n" if append_loc else f"{line}\n"
        if used + len(out.encode()) > READ_MAX:
            result.append("[output truncated]")
            break
        result.append(out)
        used += len(out.encode())
    return {"plain_text_response": "".join(result)}


def file_glob_search(params: dict[str, Any], io: HostIO, emit: Callable[[str], None] | None) -> dict[str, Any]:
    path = _get(params, "path", str, required=True)
    include = _glob(params, "include", "**")
    exclude = _glob(params, "exclude", "")
    kind = _get(params, "type", str, "file")
    max_depth = max(0, _get(params, "max_depth", int, 0))
    limit = _get(params, "limit", int, SEARCH_MAX_RESULTS)
    if limit < 1:
        return {"error": f"invalid limit: {limit} (expected 1 or more)"}
    if kind not in ("file", "dir", "all"):
        return {"error": f"invalid type: {kind} (expected \"file\", \"dir\" or \"all\")"}
    base = io.resolve(path)
    entries, truncated, error = io.list_entries(base, max_depth, kind)
    if error:
        return {"error": f"{error}: {path}"}
    matches = _selected(entries, include, exclude)
    shown = matches[:min(limit, SEARCH_MAX_RESULTS)]
    text = "".join(f"{rel}{'/' if is_dir else ''}\n" for rel, is_dir in shown)
    text += f"\n---\nTotal matches: {len(matches)}\n"
    if len(matches) > len(shown):
        text += (f"[{len(shown)} results limit reached ({len(matches)} total matches). Refine the glob pattern to "
                 "narrow the search.]\n")
    if truncated:
        text += "[results truncated: time budget or unreadable directory]\n"
    return {"plain_text_response": text, "base": base,
            "entries": [{"path": rel, "type": "dir" if is_dir else "file"} for rel, is_dir in shown]}


def grep_search(params: dict[str, Any], io: HostIO, emit: Callable[[str], None] | None) -> dict[str, Any]:
    path = _get(params, "path", str, required=True)
    pattern = _get(params, "pattern", str, required=True)
    include = _glob(params, "include", "**")
    exclude = _glob(params, "exclude", "")
    show_numbers = _get(params, "return_line_numbers", bool, False)
    literal = _get(params, "literal", bool, False)
    ignore_case = _get(params, "ignore_case", bool, False)
    context = _clamp(_get(params, "context_lines", int, 0), 0, 100)
    if len(pattern) > 4096:
        return {"error": "invalid regex: longer than 4096 characters"}
    try:
        regex = re.compile(re.escape(pattern) if literal else pattern, re.IGNORECASE if ignore_case else 0)
    except re.error as exc:
        return {"error": f"invalid regex: {exc}"}
    absolute = io.resolve(path)
    if io.is_file(absolute):
        files = [(absolute, path)]
    elif io.is_dir(absolute):
        entries, _, error = io.list_entries(absolute, 0, "file")
        if error:
            return {"error": f"{error}: {path}"}
        files = [(f"{absolute.rstrip('/')}/{rel}", rel) for rel, _ in _selected(entries, include, exclude)]
    else:
        return {"error": f"path does not exist: {path}"}
    numbered = show_numbers or context > 0
    out: list[str] = []
    used = 0
    total = 0
    truncated = False
    for absolute_file, shown in files:
        if total >= GREP_MAX_RESULTS or truncated:
            break
        size = io.file_size(absolute_file)
        content = io.read_file(absolute_file, GREP_FILE_MAX) if size is not None and size <= GREP_FILE_MAX else None
        if content is None:
            continue
        lines = content.decode("utf-8", "replace").split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        for index, line in enumerate(lines):
            if total >= GREP_MAX_RESULTS:
                break
            if not regex.search(line):
                continue
            for j in range(max(0, index - context), min(len(lines), index + context + 1)):
                mark = ":" if j == index else "-"
                line = lines[j] if len(lines[j]) <= GREP_LINE_MAX else lines[j][:GREP_LINE_MAX] + "[...]"
                out.append(f"{shown}{mark}{f'{j + 1}{mark}' if numbered else ''}{line}\n")
                used += len(out[-1])
            if context:
                out.append("--\n")
            total += 1
            if used > GREP_MAX_OUTPUT:
                truncated = True
                break
    text = "".join(out) + ("[output truncated]\n" if truncated else "") + f"\n---\nTotal matches: {total}\n"
    if total >= GREP_MAX_RESULTS:
        text += f"[{GREP_MAX_RESULTS} matches limit reached. Narrow the path/pattern/include to see more.]\n"
    return {"plain_text_response": text}


def exec_shell_command(params: dict[str, Any], io: HostIO, emit: Callable[[str], None] | None) -> dict[str, Any]:
    command = _get(params, "command", str, required=True)
    timeout = _clamp(_get(params, "timeout", int, 10), 1, EXEC_MAX_TIMEOUT)
    max_output = _clamp(_get(params, "max_output_size", int, EXEC_MAX_OUTPUT), 1, EXEC_MAX_OUTPUT)
    result = io.run(["sh", "-c", command], max_output, timeout, emit)
    tail = f"\n[exit code: {result.exit_code}]" + (" [exit due to timed out]" if result.timed_out else "")
    if emit is not None:
        emit(tail)
        return {}
    return {"plain_text_response": result.output + tail}


def write_file(params: dict[str, Any], io: HostIO, emit: Callable[[str], None] | None) -> dict[str, Any]:
    path = _get(params, "path", str, required=True)
    content = _get(params, "content", str, required=True).encode()
    if not io.write_file(path, content):
        return {"error": f"failed to write file: {path}"}
    return {"result": "file written successfully", "path": path, "bytes": len(content)}


_FUZZY = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201a": "'", "\u201b": "'", "\u201c": '"', "\u201d": '"',
                        "\u201e": '"', "\u201f": '"', "\u2212": "-", "\u00a0": " ", "\u202f": " ", "\u205f": " ",
                        "\u3000": " ", **{chr(c): "-" for c in range(0x2010, 0x2016)},
                        **{chr(c): " " for c in range(0x2002, 0x200b)}})


def _fuzzy(text: str) -> str:
    """Trailing blanks dropped and typographic quotes, dashes and spaces made ASCII, line by line (so a line
    keeps its number): what a model that retyped the text may have changed."""
    return "\n".join(line.rstrip(" \t\r").translate(_FUZZY) for line in text.split("\n"))


def edit_file(params: dict[str, Any], io: HostIO, emit: Callable[[str], None] | None) -> dict[str, Any]:
    path = _get(params, "path", str, required=True)
    edits = _get(params, "edits", list, required=True)
    if not edits:
        return {"error": "\"edits\" must be a non-empty array"}
    pairs: list[tuple[str, str]] = []
    for index, edit in enumerate(edits):
        if not isinstance(edit, dict):
            raise ToolInputError(f"params.edits[{index}] must be an object")
        old = _get(edit, "old_text", str, required=True)
        new = _get(edit, "new_text", str, required=True)
        if not old:
            return {"error": f"edits[{index}].old_text must not be empty"}
        pairs.append((old, new))
    raw = io.read_file(path, READ_RANGE_MAX)
    if raw is None:
        return {"error": f"failed to open file: {path}"}
    original = raw.decode("utf-8", "surrogateescape")
    fuzzy = False
    for index, (old, _) in enumerate(pairs):
        if old in original:
            continue
        if _fuzzy(old) not in _fuzzy(original):
            return {"error": f"could not find edits[{index}].old_text in {path}, it must match the file's current "
                             "content exactly"}
        fuzzy = True
    base = _fuzzy(original) if fuzzy else original
    matched = []
    for index, (old, new) in enumerate(pairs):
        occurrences = _fuzzy(original).count(_fuzzy(old))
        if occurrences > 1:
            return {"error": f"found {occurrences} occurrences of edits[{index}].old_text in {path}, it must be "
                             "unique"}
        needle = _fuzzy(old) if fuzzy else old
        matched.append((base.index(needle), len(needle), new, index))
    matched.sort()
    for before, after in zip(matched, matched[1:]):
        if before[0] + before[1] > after[0]:
            return {"error": f"edits[{before[3]}] and edits[{after[3]}] overlap in {path}; merge them into one edit "
                             "or target disjoint regions"}
    if fuzzy:
        updated = _keep_untouched_lines(original, base, matched)
    else:
        updated = original
        for start, length, new, _ in reversed(matched):
            updated = updated[:start] + new + updated[start + length:]
    if updated == original:
        return {"error": "no changes made: the replacement(s) produced identical content"}
    if not io.write_file(path, updated.encode("utf-8", "surrogateescape")):
        return {"error": f"failed to write file: {path}"}
    return {"result": "file edited successfully", "path": path, "edits_applied": len(matched)}


def _keep_untouched_lines(original: str, base: str, matched: list) -> str:
    """After a fuzzy match the edits are made on the normalised text (`base`): the lines no edit touches come
    back from the original byte for byte (their trailing blanks, their typographic quotes)."""
    original_lines, base_lines = original.split("\n"), base.split("\n")
    line_starts = [0]
    for line in base_lines[:-1]:
        line_starts.append(line_starts[-1] + len(line) + 1)
    groups: list[list] = []  # [first line, last line, edits]: edits that share a line are one group
    for start, length, new, _ in matched:
        first = base.count("\n", 0, start)
        last = first + base.count("\n", start, start + length)
        if groups and first <= groups[-1][1]:
            groups[-1][1] = max(groups[-1][1], last)
            groups[-1][2].append((start, length, new))
        else:
            groups.append([first, last, [(start, length, new)]])
    out: list[str] = []
    position = 0
    for first, last, edits in groups:
        out.extend(original_lines[position:first])
        slice_start = line_starts[first]
        text = base[slice_start:line_starts[last] + len(base_lines[last])]
        for start, length, new in reversed(edits):
            text = text[:start - slice_start] + new + text[start - slice_start + length:]
        out.append(text)
        position = last + 1
    out.extend(original_lines[position:])
    return "\n".join(out)


def get_info(params: dict[str, Any], io: HostIO, emit: Callable[[str], None] | None) -> dict[str, Any]:
    result = io.run(["uname", "-a"], 4096, INFO_TIMEOUT)
    os_info = result.output.strip() if result.exit_code == 0 and not result.timed_out else platform.platform()
    cwd = params.get("cwd") or ""
    if not cwd:
        if type(io) is HostIO:
            cwd = os.getcwd()
        else:
            pwd = io.run(["pwd"], 4096, INFO_TIMEOUT)
            cwd = pwd.output.strip() if pwd.exit_code == 0 and not pwd.timed_out else "unknown"
    return {"os": os_info, "cwd": cwd}


RUN = {"read_file": read_file, "file_glob_search": file_glob_search, "grep_search": grep_search,
       "exec_shell_command": exec_shell_command, "write_file": write_file, "edit_file": edit_file,
       "get_info": get_info}
