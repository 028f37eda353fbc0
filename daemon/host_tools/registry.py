"""The tools GET /tools lists and POST /tools runs: the built-in ones the operator enabled, then the MCP servers'.

A built-in call runs in its own child process (daemon/host_tools/child.py),
bounded by a deadline after which its process group is killed, and at most
MAX_RUNNING at once (MAX_WAITING more wait; past that a 503): a crowd of
calls, a command that never ends or a regular expression that backtracks for
minutes holds a child, never the daemon's event loop. An MCP tool is named
`<server>_<tool>`; one that collides with a built-in tool's name, or with an
earlier one, is skipped with a warning, as llama-server skips it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator, Mapping

from daemon.host_tools.builtin import EXEC_MAX_TIMEOUT, TOOLS, Tool
if TYPE_CHECKING:
    from config.host_tools import McpServer
    from daemon.host_tools.mcp import McpClients, McpToolDef
from daemon.host_tools.runtime import RuntimeSpecError, check_runtime, kill_group, parse_container_spec

MAX_RUNNING = 8
MAX_WAITING = 64
CALL_DEADLINE = 90.0  # seconds for any built-in call but a command (its own timeout, plus this margin)
COMMAND_MARGIN = 15.0
RESULT_LINE_LIMIT = 64 * 1024 * 1024  # read_file's base64 answer: 32 MiB of file
MAX_HELD_BYTES = 256 * 1024 * 1024
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolCallError(Exception):
    """An answer that is not the tool's: 400 (bad parameters), 404 (no such tool), 500 (runtime), 503 (busy)."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass(frozen=True)
class McpTool:
    name: str
    source: McpToolDef

    def listing(self) -> dict[str, Any]:
        schema = self.source.input_schema if isinstance(self.source.input_schema, dict) else {}
        return {"display_name": self.name, "tool": self.name, "type": "mcp", "permissions": {"write": False},
                "uses_cwd": False, "definition": {"type": "function", "function": {
                    "name": self.name, "description": self.source.description, "parameters": schema}}}


class HostTools:
    def __init__(self, enabled: list[str], runtime: str, mcp_servers: Mapping[str, McpServer], log) -> None:
        self.builtin: dict[str, Tool] = {name: tool for name, tool in TOOLS.items()
                                         if name in enabled or "all" in enabled}
        self.runtime = runtime
        self.mcp: McpClients | None = None
        if mcp_servers:
            from daemon.host_tools.mcp import McpClients, McpServerConfig  # only where MCP servers are configured

            self.mcp = McpClients([McpServerConfig(name, server.command, tuple(server.args), tuple(server.env.items()),
                                                   server.timeout_ms) for name, server in mcp_servers.items()], log)
        self.mcp_tools: dict[str, McpTool] = {}
        self.log = log
        self._running = asyncio.Semaphore(MAX_RUNNING)
        self._waiting = 0
        self._container: str | None = None  # the container --tools-runtime docker:IMAGE started
        self._children: set[asyncio.subprocess.Process] = set()
        self._held = 0  # bytes of answers being written to their clients
        self._closed = False

    @property
    def enabled(self) -> bool:
        return bool(self.builtin) or self.mcp is not None

    async def start(self) -> None:
        """Start the --tools-runtime container and list the MCP servers' tools (each server bounded)."""
        if self.runtime:
            check_runtime(self.runtime, startable=True)
            spec = parse_container_spec(self.runtime)
            if spec is not None and not spec.attach:
                self._container = await _start_container(spec.engine, spec.target)
                self.runtime = f"{spec.engine}-container:{self._container}"
        if self.mcp is not None:
            for definition in await self.mcp.warm_up():
                name = f"{definition.server}_{definition.name}"
                if not FUNCTION_NAME.match(name):  # what OpenAI-style clients accept as a function's name
                    self.log.warning("mcp_tool_name_refused", tool=name[:100], server=definition.server,
                                     reason="not 1 to 64 letters, digits, '_' or '-'")
                    continue
                if name in self.builtin or name in self.mcp_tools:
                    self.log.warning("mcp_tool_name_taken", tool=name, server=definition.server)
                    continue
                self.mcp_tools[name] = McpTool(name, definition)
            self.log.info("mcp_tools", count=len(self.mcp_tools))

    async def close(self) -> None:
        """At the start of shutdown (daemon/server.py) and again at the app's cleanup: the calls under way end at
        once (their children killed, MCP calls answered with an error) and new ones get a 503."""
        self._closed = True
        await asyncio.gather(*(_stop(process) for process in list(self._children)))
        if self.mcp is not None:
            await self.mcp.close()
        if self._container is not None:
            engine = self.runtime.split("-container:", 1)[0]
            await _run_quietly([engine, "rm", "-f", self._container], 30)
            self._container = None

    def listing(self) -> list[dict[str, Any]]:
        return [tool.listing() for tool in self.builtin.values()] + [t.listing() for t in self.mcp_tools.values()]

    def prepare(self, body: Any, headers: Mapping[str, str]) -> tuple[str, dict[str, Any], bool]:
        """Check a POST /tools body; the headers, not the model, say where the call runs (x-tool-cwd,
        x-tool-runtime, x-resp-type): those keys in params are dropped."""
        if not isinstance(body, dict):
            raise ToolCallError(400, "the body must be a JSON object: {\"tool\": NAME, \"params\": {...}}",
                                "invalid_request")
        name, params, stream = body.get("tool"), body.get("params", {}), body.get("stream", False)
        if not isinstance(name, str) or not name:
            raise ToolCallError(400, "\"tool\" must be a tool's name (a string): GET /tools lists them",
                                "invalid_request")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ToolCallError(400, f"\"params\" must be a JSON object, not {type(params).__name__}",
                                "invalid_request")
        if not isinstance(stream, bool):
            raise ToolCallError(400, "\"stream\" must be true or false", "invalid_request")
        tool = self.builtin.get(name)
        if tool is None and name not in self.mcp_tools:
            raise ToolCallError(404, f"unknown tool \"{name[:200]}\"", "not_found")
        if stream and (tool is None or not tool.stream):
            raise ToolCallError(404, f"tool \"{name}\" does not support stream = true", "not_found")
        if tool is not None:  # an MCP tool's arguments are its own: none of them is dropped
            params = {key: value for key, value in params.items() if key not in ("cwd", "runtime", "resp_type")}
            for header, key in (("x-tool-cwd", "cwd"), ("x-tool-runtime", "runtime"), ("x-resp-type", "resp_type")):
                value = headers.get(header, "")
                if value:
                    params[key] = value
            if "runtime" not in params and self.runtime:
                params["runtime"] = self.runtime
            try:
                check_runtime(params.get("runtime", ""))
            except RuntimeSpecError as exc:
                raise ToolCallError(500, str(exc), "server_error") from None
        return name, params, stream

    async def call(self, name: str, params: dict[str, Any]) -> bytes:
        """The answer's JSON."""
        if name in self.mcp_tools:
            source = self.mcp_tools[name].source
            return json.dumps(await self.mcp.call(source.server, source.name, params), ensure_ascii=False).encode()
        result = b"{}"
        try:
            async for message in self._run_child(name, params, stream=False):
                result = message
        except ToolCallError as exc:
            if exc.code != "timeout":
                raise
            return json.dumps({"error": str(exc)}).encode()  # as a command's own timeout reads: the model sees it
        return result

    @contextlib.contextmanager
    def holding(self, size: int) -> Iterator[None]:
        """While an answer of `size` bytes is written: a client that does not read holds it in memory, so the
        answers held together are bounded (past MAX_HELD_BYTES, a 503)."""
        if self._held + size > MAX_HELD_BYTES:
            raise ToolCallError(503, "too many large tool answers are waiting for their clients: try again later",
                                "busy")
        self._held += size
        try:
            yield
        finally:
            self._held -= size

    async def stream(self, name: str, params: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """{"chunk": text}... then {"done": true} (with "error" when the call failed)."""
        try:
            async for message in self._run_child(name, params, stream=True):
                if isinstance(message, dict):  # {"chunk"}; the last, the result's bytes, says nothing more
                    yield message
        except ToolCallError as exc:
            yield {"done": True, "error": str(exc)}
            return
        yield {"done": True}

    async def _run_child(self, name: str, params: dict[str, Any], stream: bool) -> AsyncIterator[dict[str, Any]]:
        if self._closed:
            raise ToolCallError(503, "the daemon is stopping", "stopping")
        if self._waiting >= MAX_WAITING:
            raise ToolCallError(503, f"{MAX_RUNNING + MAX_WAITING} tool calls are already under way: try again "
                                     "later", "busy")
        self._waiting += 1
        try:
            await self._running.acquire()
        finally:
            self._waiting -= 1
        try:
            deadline = CALL_DEADLINE
            if name == "exec_shell_command" and isinstance(params.get("timeout"), int):
                deadline = min(max(params["timeout"], 1), EXEC_MAX_TIMEOUT) + COMMAND_MARGIN
            async for message in _child(name, params, stream, deadline, self._children):
                yield message
        finally:
            self._running.release()


async def _child(name: str, params: dict[str, Any], stream: bool, deadline: float,
                 running: set[asyncio.subprocess.Process]) -> AsyncIterator[dict[str, Any]]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "daemon.host_tools.child", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
        limit=RESULT_LINE_LIMIT)
    running.add(process)
    loop = asyncio.get_running_loop()
    ends = loop.time() + deadline
    try:
        process.stdin.write(json.dumps({"tool": name, "params": params, "stream": stream}).encode())
        await process.stdin.drain()
        process.stdin.close()
        while True:
            try:
                line = await asyncio.wait_for(process.stdout.readline(), max(0.0, ends - loop.time()))
            except asyncio.TimeoutError:
                raise ToolCallError(200, f"the tool call ran past its deadline ({deadline:.0f} s) and was stopped",
                                    "timeout") from None
            except ValueError:  # a line past RESULT_LINE_LIMIT
                raise ToolCallError(500, "the tool's answer is too large", "server_error") from None
            if not line:
                raise ToolCallError(500, "the tool's process ended without an answer", "server_error")
            tag, _, payload = line.rstrip(b"\n").partition(b" ")
            if tag == b"chunk":
                yield {"chunk": json.loads(payload)}
            elif tag == b"result":
                yield payload  # the answer's JSON, as the child wrote it
                return
            elif tag == b"invalid":
                raise ToolCallError(400, json.loads(payload), "invalid_request")
            else:
                raise ToolCallError(500, json.loads(payload) if tag == b"failure" else "the tool failed",
                                    "server_error")
    finally:
        running.discard(process)
        if process.returncode is None:
            await _stop(process)


async def _stop(process: asyncio.subprocess.Process) -> None:
    """SIGTERM first: the child kills its command's process group (a group of its own) and exits; then, to be
    sure, SIGKILL to the child's group."""
    try:
        process.terminate()
        await asyncio.wait_for(asyncio.shield(process.wait()), 2)
    except (ProcessLookupError, asyncio.TimeoutError):
        pass
    kill_group(process.pid)
    await process.wait()


async def _run_quietly(argv: list[str], timeout: float) -> tuple[int, str]:
    try:
        process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                       stderr=asyncio.subprocess.STDOUT)
    except OSError as exc:
        return -1, str(exc)
    try:
        out, _ = await asyncio.wait_for(process.communicate(), timeout)
    except asyncio.TimeoutError:
        process.kill()
        await process.wait()
        return -1, "timed out"
    return process.returncode, out.decode(errors="replace")


async def _start_container(engine: str, image: str) -> str:
    """--tools-runtime docker:IMAGE: a container of that image that lives as long as the daemon (closed by
    close(); --rm removes it if the daemon dies first and the engine notices)."""
    code, out = await _run_quietly([engine, "run", "-d", "--rm", "--", image, "sleep", "infinity"], 300)
    container = out.strip().splitlines()[-1] if out.strip() else ""
    if code != 0 or not container:
        raise RuntimeSpecError(f"--tools-runtime {engine}:{image}: could not start a container: {out.strip()[:300]}")
    return container[:64]
