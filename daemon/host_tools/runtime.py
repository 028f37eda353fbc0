"""Where a built-in tool's files and commands live: this host, a running container, or an ssh host.

llama-server's runtimes, with its spellings: no runtime is this host;
`docker-container:ID` / `podman-container:ID` run everything through
`<engine> exec`; `ssh:[user@]host` through `ssh` with key-based auth only. A
runtime a client names in `x-tool-runtime` is checked before anything runs:
an id or target that starts with `-` would become an option of docker or ssh
(`ssh:-oProxyCommand=...` runs a command here), and an unknown scheme is an
error, never a quiet fall-back to this host.

This module runs in the tool's child process (daemon/host_tools/child.py), not
in the daemon: a slow disk, a hung mount or a stuck command stalls only it.
"""

from __future__ import annotations

import os
import re
import select
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ENGINES = ("docker", "podman")
# Listings report these but never walk into them: they can hold millions of files.
JUNK_DIRS = frozenset({".git", ".svn", ".hg", "node_modules", "__pycache__", ".venv", "venv", "dist", "build",
                       "target", ".cache", ".idea", ".vscode"})
LIST_TIMEOUT = 15  # seconds for one listing, git's and the walker's together
LIST_MAX_OUTPUT = 8 * 1024 * 1024
ISOLATE_TIMEOUT = 30  # seconds for a helper command in a container or over ssh (stat, cat, find)
ISOLATE_READ_MAX = 64 * 1024 * 1024
GIT_SAFE = ("-c", "core.fsmonitor=false", "-c", "core.untrackedCache=false")
_CONTAINER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SSH_TARGET = re.compile(r"^[A-Za-z0-9._@][A-Za-z0-9._@-]*$")


# The process groups of the commands under way: the child's SIGTERM handler kills them (child.py), since each
# command has its own group and killing the child's group would leave them running.
RUNNING_GROUPS: set[int] = set()


class RuntimeSpecError(Exception):
    """A runtime that cannot be used: llama-server answers these 500, with this message."""


@dataclass
class ExecResult:
    output: str
    exit_code: int
    timed_out: bool
    data: bytes = b""  # the output's bytes as read (up to max_output): a file's contents, not text


@dataclass(frozen=True)
class ContainerSpec:
    engine: str
    target: str  # an image to start (`docker:IMAGE`) or a running container's id (`docker-container:ID`)
    attach: bool


def parse_container_spec(spec: str) -> ContainerSpec | None:
    for engine in ENGINES:
        if spec.startswith(f"{engine}-container:"):
            return ContainerSpec(engine, spec[len(engine) + len("-container:"):], True)
        if spec.startswith(f"{engine}:"):
            return ContainerSpec(engine, spec[len(engine) + 1:], False)
    return None


def check_runtime(spec: str, *, startable: bool = False) -> None:
    """Raise RuntimeSpecError for a spec no call may use. `startable`: `docker:IMAGE` (the daemon's own
    --tools-runtime, which it starts) is allowed; a client's header may only name a running container."""
    if not spec:
        return
    container = parse_container_spec(spec)
    if container is not None:
        if not container.attach:
            if not startable:
                raise RuntimeSpecError(f"tool runtime must name a running container: {spec}")
            if not container.target or container.target.startswith("-"):
                raise RuntimeSpecError(f"--tools-runtime {container.engine}:<image> needs an image name: {spec}")
            return
        if not _CONTAINER_ID.match(container.target):
            raise RuntimeSpecError(f"invalid container id: {container.target}")
        return
    if spec.startswith("ssh:"):
        target = spec[4:]
        if not _SSH_TARGET.match(target):
            raise RuntimeSpecError(f"invalid ssh target: {target}")
        return
    raise RuntimeSpecError(f"unknown tool runtime: {spec} (expected docker-container:ID, podman-container:ID, "
                           "ssh:[user@]host or, for --tools-runtime, docker:IMAGE / podman:IMAGE)")


def run_process(argv: list[str], max_output: int, timeout: float, on_chunk: Callable[[str], None] | None = None,
                *, cwd: str | None = None, stdin_data: bytes | None = None,
                combine_stderr: bool = True) -> ExecResult:
    """Run argv in its own process group, reading at most max_output bytes of its output (the rest is drained,
    so the child never blocks on a full pipe) and killing the group at the deadline."""
    try:
        proc = subprocess.Popen(argv, cwd=cwd or None, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT if combine_stderr else subprocess.DEVNULL,
                                start_new_session=True)
    except OSError as exc:
        return ExecResult(f"failed to spawn process: {exc.strerror or exc}", -1, False)
    RUNNING_GROUPS.add(proc.pid)
    try:
        return _read(proc, max_output, timeout, on_chunk, stdin_data)
    finally:
        RUNNING_GROUPS.discard(proc.pid)


def _read(proc: subprocess.Popen, max_output: int, timeout: float, on_chunk: Callable[[str], None] | None,
          stdin_data: bytes | None) -> ExecResult:
    try:
        if stdin_data:
            proc.stdin.write(stdin_data)
        proc.stdin.close()
    except OSError:
        pass  # a child that exits without reading: its exit code says what happened
    deadline = time.monotonic() + timeout
    output = bytearray()
    truncated = timed_out = False
    fd = proc.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([fd], [], [], min(left, 0.5))
        if not ready:
            continue
        data = os.read(fd, 65536)
        if not data:
            break
        if truncated:
            continue
        room = max_output - len(output)
        if len(data) > room:
            data, truncated = data[:room], True
        output += data
        if on_chunk is not None and data:
            on_chunk(data.decode("utf-8", "replace"))
    if timed_out:
        kill_group(proc.pid)
    try:
        exit_code = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        exit_code = proc.wait()
    proc.stdout.close()
    text = output.decode("utf-8", "replace")
    if truncated:
        text += "\n[output truncated]"
    return ExecResult(text, exit_code, timed_out, bytes(output))


def kill_group(pid: int) -> None:
    """SIGKILL to the process group `pid` leads (each command, tool child and MCP server has its own)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class HostIO:
    """Files and commands on this host; relative paths resolve against the call's cwd (x-tool-cwd)."""

    def __init__(self, cwd: str = "") -> None:
        self.cwd = cwd

    def resolve(self, path: str) -> str:
        full = Path(os.path.expanduser(path) if path.startswith("~") else path)
        if not full.is_absolute():
            full = Path(self.cwd or os.getcwd()) / full
        return os.path.normpath(str(full))  # "." and ".." never reach git or the client

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(self.resolve(path))

    def is_file(self, path: str) -> bool:
        return os.path.isfile(self.resolve(path))

    def file_size(self, path: str) -> int | None:
        try:
            return os.stat(self.resolve(path)).st_size
        except OSError:
            return None

    def read_file(self, path: str, limit: int) -> bytes | None:
        try:
            with open(self.resolve(path), "rb") as file:
                return file.read(limit)
        except OSError:
            return None

    def write_file(self, path: str, content: bytes) -> bool:
        target = self.resolve(path)
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as file:
                file.write(content)
        except OSError:
            return False
        return True

    def list_entries(self, base: str, max_depth: int, kind: str) -> tuple[list[tuple[str, bool]], bool, str]:
        """(relative path, is a directory) under base, whether the listing was cut short, and an error."""
        if not os.path.isdir(base):
            return [], False, "path does not exist or is not a directory"
        if kind == "file":  # git knows what .gitignore leaves out (it cannot list directories)
            # -c: a repository's own config must not run anything (core.fsmonitor is a command git starts)
            res = run_process(["git", *GIT_SAFE, "-C", base, "ls-files", "--cached", "--others", "--exclude-standard"],
                              LIST_MAX_OUTPUT, LIST_TIMEOUT, combine_stderr=False)
            if res.exit_code == 0 and not res.timed_out:
                entries = [(line, False) for line in res.output.splitlines()
                           if line and (max_depth == 0 or line.count("/") + 1 <= max_depth)
                           and os.path.isfile(os.path.join(base, line))]
                return entries, False, ""
        return self._walk(base, max_depth, kind)

    @staticmethod
    def _walk(base: str, max_depth: int, kind: str) -> tuple[list[tuple[str, bool]], bool, str]:
        deadline = time.monotonic() + LIST_TIMEOUT
        entries: list[tuple[str, bool]] = []
        truncated = False
        stack = [(base, "", 0)]
        while stack:
            if time.monotonic() >= deadline:
                return entries, True, ""
            directory, relative, depth = stack.pop()
            try:
                children = sorted(os.scandir(directory), key=lambda e: e.name)
            except OSError:
                truncated = True
                continue
            for entry in children:
                rel = f"{relative}/{entry.name}" if relative else entry.name
                try:
                    is_dir = entry.is_dir(follow_symlinks=True)
                    is_link = entry.is_symlink()
                    is_file = not is_dir and entry.is_file()
                except OSError:
                    continue
                if is_dir:
                    if kind in ("dir", "all"):
                        entries.append((rel, True))
                    # a junk directory stays selectable, it is never walked; a link could loop back up
                    if entry.name not in JUNK_DIRS and not is_link and (max_depth == 0 or depth + 1 < max_depth):
                        stack.append((entry.path, rel, depth + 1))
                elif is_file and kind in ("file", "all"):
                    entries.append((rel, False))
        return entries, truncated, ""

    def run(self, argv: list[str], max_output: int, timeout: float,
            on_chunk: Callable[[str], None] | None = None) -> ExecResult:
        return run_process(argv, max_output, timeout, on_chunk, cwd=self.cwd or None)


class IsolateIO(HostIO):
    """Files and commands in a container or on an ssh host, each done by a POSIX command run there."""

    def __init__(self, prefix: Callable[[list[str], bool], list[str]], cwd: str = "") -> None:
        super().__init__(cwd)
        self.prefix = prefix  # inner argv, needs stdin -> the argv to run here

    def resolve(self, path: str) -> str:
        if not self.cwd or path.startswith("/"):
            return path
        return f"{self.cwd}/{path}"

    def _exec(self, inner: list[str], max_output: int = 4096, stdin_data: bytes | None = None,
              combine_stderr: bool = True) -> ExecResult:
        return run_process(self.prefix(inner, stdin_data is not None), max_output, ISOLATE_TIMEOUT,
                           stdin_data=stdin_data, combine_stderr=combine_stderr)

    def _test(self, flag: str, path: str) -> bool:
        result = self._exec(["test", flag, self.resolve(path)])
        return result.exit_code == 0 and not result.timed_out

    def is_dir(self, path: str) -> bool:
        return self._test("-d", path)

    def is_file(self, path: str) -> bool:
        return self._test("-f", path)

    def file_size(self, path: str) -> int | None:
        result = self._exec(["sh", "-c", 'wc -c < "$1"', "_", self.resolve(path)], 64, combine_stderr=False)
        try:
            return int(result.output.strip()) if result.exit_code == 0 and not result.timed_out else None
        except ValueError:
            return None

    def read_file(self, path: str, limit: int) -> bytes | None:
        argv = self.prefix(["head", "-c", str(limit), "--", self.resolve(path)], False)
        result = run_process(argv, min(limit, ISOLATE_READ_MAX), ISOLATE_TIMEOUT, combine_stderr=False)
        return result.data if result.exit_code == 0 and not result.timed_out else None

    def write_file(self, path: str, content: bytes) -> bool:
        result = self._exec(["sh", "-c", 'mkdir -p "$(dirname "$1")" && cat > "$1"', "_", self.resolve(path)],
                            stdin_data=content)
        return result.exit_code == 0 and not result.timed_out

    def list_entries(self, base: str, max_depth: int, kind: str) -> tuple[list[tuple[str, bool]], bool, str]:
        if not self._test("-d", base):
            return [], False, "path does not exist or is not a directory"
        prune = " -o ".join(f"-name {shlex.quote(name)}" for name in sorted(JUNK_DIRS))
        depth = f" -maxdepth {max_depth}" if max_depth > 0 else ""
        entries: list[tuple[str, bool]] = []
        truncated = False
        for is_dir in ([True] if kind == "dir" else [False] if kind == "file" else [True, False]):
            # junk directories print but are not entered (-prune), as the host's walker does
            select_ = " -print -o -type d -print" if is_dir else " -o -type f -print"
            script = f'cd "$1" && find . -mindepth 1{depth} \\( {prune} \\) -prune{select_}'
            result = self._exec(["sh", "-c", script, "_", self.resolve(base)], LIST_MAX_OUTPUT, combine_stderr=False)
            truncated = truncated or result.timed_out
            entries += [(line.removeprefix("./"), is_dir) for line in result.output.splitlines() if line]
        return entries, truncated, ""

    def run(self, argv: list[str], max_output: int, timeout: float,
            on_chunk: Callable[[str], None] | None = None) -> ExecResult:
        inner = ["timeout", f"{int(timeout)}s", *argv]
        if self.cwd:
            inner = ["sh", "-c", 'cd "$1" && shift && exec "$@"', "_", self.cwd, *inner]
        # the isolate's own `timeout` ends the command; ours, a little later, ends a client that hangs
        return run_process(self.prefix(inner, False), max_output, timeout + 5, on_chunk)


def _container_prefix(engine: str, container: str) -> Callable[[list[str], bool], list[str]]:
    def prefix(inner: list[str], needs_stdin: bool) -> list[str]:
        return [engine, "exec", *(["-i"] if needs_stdin else []), container, *inner]
    return prefix


def _ssh_prefix(target: str) -> Callable[[list[str], bool], list[str]]:
    def prefix(inner: list[str], needs_stdin: bool) -> list[str]:
        # no console here, so a password prompt would hang the call: keys only, and a host key already trusted
        return ["ssh", "-o", "BatchMode=yes", "-o", "PasswordAuthentication=no", "-o",
                "KbdInteractiveAuthentication=no", "-o", "StrictHostKeyChecking=yes",
                *([] if needs_stdin else ["-n"]), target, shlex.join(inner)]  # the remote shell re-parses it
    return prefix


def tool_io(runtime: str, cwd: str) -> HostIO:
    """The IO a call runs through: its runtime (already checked by check_runtime) and its working directory."""
    if not runtime:
        return HostIO(cwd)
    check_runtime(runtime)
    container = parse_container_spec(runtime)
    if container is not None:
        return IsolateIO(_container_prefix(container.engine, container.target), cwd)
    return IsolateIO(_ssh_prefix(runtime[4:]), cwd)
