"""MCP servers as stdio children: llama-server's `--mcp-servers-json` / `--mcp-servers-config`.

The servers come from the `mcp_servers` setting (config/host_tools.py checks each entry).

Each configured server is a child process speaking newline-delimited JSON-RPC 2.0 on its stdin/stdout
(the MCP stdio transport). At start-up warm_up() runs every server once to learn its tools and shuts it
down again; afterwards call() keeps one live instance per server, spawned on first use and respawned
when it dies. Like llama-server (tools/server/server-mcp.cpp), a tool call answers
{"plain_text_response": text} or {"error": message} and never raises.

The children are not trusted to behave: they may print notifications or junk between responses, answer
out of order, never answer, die mid-call, flood stderr, or leave a grandchild holding their pipes. So
every wait is bounded, every child gets its own process group (killed whole), and teardown never waits
for an EOF on a pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
from dataclasses import dataclass

from daemon import __version__
from daemon.host_tools.runtime import kill_group

PROTOCOL_VERSION = "2024-11-05"
MAX_LINE = 16 * 2**20           # one JSON-RPC message; longer kills the instance
WARM_UP_CAP_MS = 10_000         # a server that will not list its tools must not hold up start-up
MAX_PAGES = 100                 # tools/list pages followed; a cursor loop must end
SPAWN_COOLDOWN_S = 5.0          # after a failed start, calls fail fast instead of spawning per call
STOP_GRACE_S = 0.25             # EOF on stdin is MCP's polite "please exit"; then SIGKILL
REAP_WAIT_S = 0.5
EXIT_SETTLE_S = 0.5             # a response written just before exit may still be in the pipe
STDERR_LOG_BYTES = 8192         # per instance: enough to see why a server failed, not a log flood
STDERR_TAIL_BYTES = 2048
MAX_CALLS_PER_SERVER = 64       # under way at once; more answer an error at once


@dataclass(frozen=True)
class McpServerConfig:
    name: str
    command: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()    # added to the daemon's environment
    timeout_ms: int = 30000                  # per tool call


@dataclass(frozen=True)
class McpToolDef:
    server: str
    name: str
    description: str
    input_schema: dict      # {} when the server gave none or not an object


class _Failure(Exception):
    """A step failed; str() is the message the caller gets as {"error": ...}."""


class _RpcError(_Failure):
    """The server answered with a JSON-RPC error; str() is its message, passed on as llama-server does."""


class _NotSent(_Failure):
    """The request never reached the server (its stdin was already closed), so re-sending it is safe."""


def _rpc_error_message(error: object) -> str:
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    if isinstance(error, str):
        return error
    return "unknown error"


class _Instance:
    """One child process and its JSON-RPC session; requests are multiplexed by id, so one slow call does
    not hold up the others."""

    def __init__(self, cfg: McpServerConfig, log, proc: asyncio.subprocess.Process) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self._log = log
        self._proc = proc
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._transports: list[asyncio.BaseTransport] = []
        self._stdin: asyncio.WriteTransport | None = None
        self._tasks: list[asyncio.Task] = []
        self._watcher: asyncio.Task | None = None
        self._exited = asyncio.Event()
        self._eof = False
        self._dead = False
        self._stopping = False
        self._reason = ""
        self._stderr_tail = b""
        self._junk_logged = False

    @classmethod
    async def spawn(cls, cfg: McpServerConfig, log) -> _Instance:
        env = {**os.environ, **dict(cfg.env)} if cfg.env else None
        # Plain pipes of our own rather than asyncio's PIPE: asyncio's Process.wait() also waits for EOF on
        # its pipes, which never comes while a grandchild holds them; this way the exit is seen when it
        # happens, and closing our ends is ours to do.
        child_in, parent_in = os.pipe()
        parent_out, child_out = os.pipe()
        parent_err, child_err = os.pipe()
        parent_fds = [parent_in, parent_out, parent_err]
        try:
            try:
                proc = await asyncio.create_subprocess_exec(
                    cfg.command, *cfg.args, stdin=child_in, stdout=child_out, stderr=child_err, env=env,
                    start_new_session=True)  # its own process group, so a kill reaches what it spawned too
            finally:
                for fd in (child_in, child_out, child_err):
                    os.close(fd)
        except BaseException as e:
            for fd in parent_fds:
                os.close(fd)
            if isinstance(e, (OSError, ValueError)):
                raise _Failure(f"MCP server '{cfg.name}': cannot start {cfg.command!r}: "
                               f"{getattr(e, 'strerror', None) or e}") from None
            raise
        inst = cls(cfg, log, proc)
        loop = asyncio.get_running_loop()
        files = [os.fdopen(fd, mode, buffering=0) for fd, mode in zip(parent_fds, ("wb", "rb", "rb"))]
        try:
            inst._stdin, _ = await loop.connect_write_pipe(asyncio.Protocol, files[0])
            inst._transports.append(inst._stdin)
            stdout = asyncio.StreamReader(limit=MAX_LINE)
            stderr = asyncio.StreamReader()
            for file, reader in ((files[1], stdout), (files[2], stderr)):
                transport, _ = await loop.connect_read_pipe(
                    lambda reader=reader: asyncio.StreamReaderProtocol(reader), file)
                inst._transports.append(transport)
        except BaseException:
            inst._die("could not attach to its pipes", quiet=True)
            for file in files:  # the ones no transport took over yet; closing twice is harmless
                file.close()
            raise
        inst._tasks = [asyncio.create_task(inst._read_stdout(stdout)),
                       asyncio.create_task(inst._drain_stderr(stderr))]
        # not in _tasks: it must outlive the kill to see the exit and set _exited
        inst._watcher = asyncio.create_task(inst._watch_exit())
        log.debug("mcp.spawned", server=cfg.name, pid=proc.pid)
        return inst

    @property
    def exited(self) -> bool:
        return self._exited.is_set()

    @property
    def alive(self) -> bool:
        return (not self._dead and not self._stopping and not self._eof and self._proc.returncode is None
                and self._stdin is not None and not self._stdin.is_closing())

    # JSON-RPC

    def _send(self, message: dict) -> None:
        try:
            data = json.dumps(message, allow_nan=False, separators=(",", ":")).encode() + b"\n"
        except (TypeError, ValueError) as e:
            raise _Failure(f"MCP server '{self.name}': arguments are not JSON: {e}") from None
        stdin = self._stdin
        if not self.alive or stdin is None:
            raise _NotSent(self._reason or f"MCP server '{self.name}' is not running")
        stdin.write(data)
        # a write to a pipe nobody reads fails at once and closes the transport: nothing was delivered
        if stdin.is_closing():
            raise _NotSent(f"MCP server '{self.name}' is not reading its input")
        # a server that stopped reading: what waits for it is the daemon's memory, so past a bound it goes
        if stdin.get_write_buffer_size() > MAX_LINE:
            self._die(f"MCP server '{self.name}' is not reading its input")
            raise _Failure(f"MCP server '{self.name}' is not reading its input")

    async def request(self, method: str, params: dict) -> object:
        """The result of one request; raises _Failure with the server's error message or ours."""
        rid = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        try:
            self._send({"jsonrpc": "2.0", "id": rid, "method": method, "params": params})
            reply = await future
        finally:
            self._pending.pop(rid, None)
        if "error" in reply:
            raise _RpcError(_rpc_error_message(reply["error"]))
        if "result" not in reply:
            raise _Failure(f"MCP server '{self.name}': invalid response to {method}")
        return reply["result"]

    async def initialize(self) -> None:
        try:
            result = await self.request("initialize", {
                "protocolVersion": PROTOCOL_VERSION, "capabilities": {},
                "clientInfo": {"name": "dormouse", "version": __version__}})
        except _RpcError as e:
            raise _Failure(f"MCP server '{self.name}': initialize failed: {e}") from None
        if not isinstance(result, dict):
            raise _Failure(f"MCP server '{self.name}': initialize failed: invalid result")
        self._send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    async def list_tools(self) -> list[McpToolDef]:
        tools: dict[str, McpToolDef] = {}
        skipped = 0
        cursor = None
        for _ in range(MAX_PAGES):
            result = await self.request("tools/list", {} if cursor is None else {"cursor": cursor})
            if not isinstance(result, dict) or not isinstance(result.get("tools", []), list):
                raise _Failure(f"MCP server '{self.name}': invalid tools/list result")
            for tool in result.get("tools", []):
                name = tool.get("name") if isinstance(tool, dict) else None
                if not isinstance(name, str) or not name or name in tools:
                    skipped += 1
                    continue
                description, schema = tool.get("description"), tool.get("inputSchema")
                tools[name] = McpToolDef(self.name, name, description if isinstance(description, str) else "",
                                         schema if isinstance(schema, dict) else {})
            cursor = result.get("nextCursor")
            if not isinstance(cursor, str) or not cursor:
                break
        else:
            self._log.warning("mcp.tools_list_truncated", server=self.name, pages=MAX_PAGES)
        if skipped:
            self._log.warning("mcp.tools_skipped", server=self.name, count=skipped, reason="no name or a duplicate")
        return list(tools.values())

    def _dispatch(self, line: bytes) -> None:
        try:
            message = json.loads(line)
        except ValueError:  # not JSON (or not UTF-8): servers do print banners on stdout
            if not self._junk_logged:
                self._junk_logged = True
                self._log.warning("mcp.non_json_line", server=self.name, line=line[:200].decode(errors="replace"))
            return
        if not isinstance(message, dict):
            return
        if "method" in message:
            # A request from the server (ping, sampling, ...): answer it so the server is not left waiting.
            # Notifications (no id) need nothing.
            if "id" in message:
                reply = {"jsonrpc": "2.0", "id": message["id"]}
                if message["method"] == "ping":
                    reply["result"] = {}
                else:
                    reply["error"] = {"code": -32601, "message": "Method not found"}
                with contextlib.suppress(_Failure):
                    self._send(reply)
            return
        rid = message.get("id")
        # ids are ints we chose; anything else (or a late answer to a timed-out call) is not ours
        future = self._pending.pop(rid, None) if type(rid) is int else None
        if future is not None and not future.done():
            future.set_result(message)

    # the three tasks

    async def _read_stdout(self, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                line = await reader.readline()
            except ValueError:  # asyncio's "line over the limit"; the buffer stays bounded
                self._die(f"MCP server '{self.name}' sent a message longer than {MAX_LINE // 2**20} MiB")
                return
            if not line:
                self._eof = True
                # usually the process is exiting: wait a moment so the error can say how it ended
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._exited.wait(), EXIT_SETTLE_S)
                self._die(f"MCP server '{self.name}' {self._exit_reason()}")
                return
            self._dispatch(line)

    async def _drain_stderr(self, reader: asyncio.StreamReader) -> None:
        # always read, so the child never blocks on a full stderr pipe; log only the first few KiB
        budget = STDERR_LOG_BYTES
        while chunk := await reader.read(4096):
            self._stderr_tail = (self._stderr_tail + chunk)[-STDERR_TAIL_BYTES:]
            if budget > 0:
                self._log.info("mcp.stderr", server=self.name, text=chunk[:budget].decode(errors="replace").rstrip())
                budget -= len(chunk)
                if budget <= 0:
                    self._log.info("mcp.stderr_muted", server=self.name, after_bytes=STDERR_LOG_BYTES)

    async def _watch_exit(self) -> None:
        await self._proc.wait()
        self._exited.set()
        # let the reader deliver what the child wrote before it went (it dies itself at EOF); a grandchild
        # holding stdout open means no EOF, hence the bound
        await asyncio.wait(self._tasks[:1], timeout=EXIT_SETTLE_S)  # _tasks[0] reads stdout
        self._die(f"MCP server '{self.name}' {self._exit_reason()}")

    def _exit_reason(self) -> str:
        code = self._proc.returncode
        if code is None:
            return "closed its output"
        return f"exited with status {code}" if code >= 0 else f"was killed by signal {-code}"

    # ending

    def _fail_pending(self, reason: str) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(_Failure(reason))
        self._pending.clear()

    def _die(self, reason: str, *, quiet: bool = False) -> None:
        """Fail every pending call with `reason` and kill the process group now. Idempotent, never waits."""
        if self._dead:
            return
        self._dead = True
        self._reason = reason
        if not (quiet or self._stopping):
            self._log.warning("mcp.server_died", server=self.name, reason=reason,
                              stderr_tail=self._stderr_tail.decode(errors="replace")[-500:])
        self._fail_pending(reason)
        kill_group(self._proc.pid)
        # close our pipe ends rather than wait for EOF: a grandchild outside the group may hold the others.
        # stdin with unwritten data is aborted: a plain close would wait to flush to a reader that may never read
        for transport in self._transports:
            if isinstance(transport, asyncio.WriteTransport) and transport.get_write_buffer_size():
                transport.abort()
            else:
                transport.close()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()

    async def stop(self, reason: str) -> None:
        """Pending calls fail at once; the child gets EOF on stdin and a short grace, then SIGKILL."""
        self._stopping = True
        self._fail_pending(reason)
        try:
            if not self._dead and self._stdin is not None:
                self._stdin.close()
                await asyncio.wait_for(self._exited.wait(), STOP_GRACE_S)
        except TimeoutError:
            pass
        finally:
            self._die(reason, quiet=True)
        # reap, so no zombie outlives us; bounded in case the kernel is slow to deliver the kill
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._exited.wait(), REAP_WAIT_S)


# --- all servers ---------------------------------------------------------------------------------------

def _to_response(result: object) -> dict:
    """llama-server's mcp_result_to_response: the text parts of result.content joined by newlines;
    isError makes that text the error. Other content (images, resources) is dropped, as there."""
    if not isinstance(result, dict):
        return {"error": "invalid response from MCP server"}
    text = ""
    content = result.get("content")
    for part in content if isinstance(content, list) else []:
        if isinstance(part, dict) and part.get("type") == "text":
            if text:
                text += "\n"
            text += part["text"] if isinstance(part.get("text"), str) else ""
    if result.get("isError") is True:
        return {"error": text or "MCP tool returned an error"}
    return {"plain_text_response": text}


class McpClients:
    def __init__(self, servers: list[McpServerConfig], log) -> None:
        self._log = log
        self._configs: dict[str, McpServerConfig] = {}
        for cfg in servers:
            if cfg.name in self._configs:  # the same name from the file and the flag: the first wins
                log.warning("mcp.duplicate_server", server=cfg.name)
                continue
            self._configs[cfg.name] = cfg
        self._live: dict[str, _Instance] = {}
        self._spawned: set[_Instance] = set()  # every instance not yet seen to exit, warm-up's included
        self._locks = {name: asyncio.Lock() for name in self._configs}  # one spawn at a time per server
        self._waiting = dict.fromkeys(self._configs, 0)  # calls under way per server (each holds its arguments)
        self._retry_at: dict[str, tuple[float, str]] = {}
        self._closed = False

    async def warm_up(self) -> list[McpToolDef]:
        """Every server at once: spawn, initialize, list its tools, stop. A server that fails is logged and
        left out; this never raises. The tools come in config order."""
        found = await asyncio.gather(*(self._discover(cfg) for cfg in self._configs.values()))
        return [tool for tools in found for tool in tools]

    async def _discover(self, cfg: McpServerConfig) -> list[McpToolDef]:
        bound_ms = min(cfg.timeout_ms, WARM_UP_CAP_MS)
        instance = None
        try:
            async with asyncio.timeout(bound_ms / 1000):
                instance = await self._spawn(cfg)
                await instance.initialize()
                tools = await instance.list_tools()
        except TimeoutError:
            self._log.warning("mcp.warm_up_failed", server=cfg.name, error=f"no tool list within {bound_ms} ms")
            return []
        except Exception as e:  # _Failure, or a surprise: either way this server is left out, start-up goes on
            self._log.warning("mcp.warm_up_failed", server=cfg.name, error=str(e) or repr(e))
            return []
        finally:
            if instance is not None:
                await instance.stop(f"MCP server '{cfg.name}': warm-up over")
        self._log.info("mcp.warm_up", server=cfg.name, tools=len(tools))
        return tools

    async def call(self, server: str, tool: str, arguments: dict) -> dict:
        """{"plain_text_response": text} or {"error": message}; raises only CancelledError."""
        cfg = self._configs.get(server)
        if cfg is None:
            return {"error": f"MCP server unavailable: {server}"}
        if self._waiting[server] >= MAX_CALLS_PER_SERVER:
            return {"error": f"MCP server '{server}': {MAX_CALLS_PER_SERVER} calls are already under way"}
        try:
            self._waiting[server] += 1
            async with asyncio.timeout(cfg.timeout_ms / 1000):  # spawning and initializing count too
                result = await self._call(cfg, tool, arguments)
        except TimeoutError:
            self._log.warning("mcp.call_timed_out", server=server, tool=tool, timeout_ms=cfg.timeout_ms)
            return {"error": f"MCP server '{server}': tool {tool!r} timed out after {cfg.timeout_ms} ms"}
        except _Failure as e:
            return {"error": str(e)}
        except Exception as e:  # a bug here must not become a 500 or take the daemon down
            self._log.warning("mcp.call_failed", server=server, tool=tool, error=repr(e))
            return {"error": f"MCP server '{server}': {e!r}"}
        finally:
            self._waiting[server] -= 1
        return _to_response(result)

    async def _call(self, cfg: McpServerConfig, tool: str, arguments: dict) -> object:
        for attempt in range(2):
            instance = await self._instance_for(cfg)
            try:
                return await instance.request("tools/call", {"name": tool, "arguments": arguments})
            except _NotSent:
                # the instance had just gone (its stdin closed) and the server never saw the request:
                # one retry on a fresh instance cannot run the tool twice
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def _instance_for(self, cfg: McpServerConfig) -> _Instance:
        async with self._locks[cfg.name]:
            if self._closed:
                raise _Failure(f"MCP server unavailable: {cfg.name}")
            instance = self._live.pop(cfg.name, None)
            if instance is not None:
                if instance.alive:
                    self._live[cfg.name] = instance
                    return instance
                instance._die(f"MCP server '{cfg.name}' stopped", quiet=True)  # usually dying already
            now = asyncio.get_running_loop().time()
            retry_at, why = self._retry_at.get(cfg.name, (0.0, ""))
            if now < retry_at:
                raise _Failure(f"MCP server unavailable: {cfg.name} ({why})")
            try:
                instance = await self._spawn(cfg)
            except _Failure as e:
                if not self._closed:
                    self._retry_at[cfg.name] = (now + SPAWN_COOLDOWN_S, str(e))
                    self._log.warning("mcp.start_failed", server=cfg.name, error=str(e))
                raise
            self._live[cfg.name] = instance
            try:
                await instance.initialize()
            except BaseException as e:
                self._live.pop(cfg.name, None)
                instance._die(str(e) or "cancelled", quiet=True)
                if isinstance(e, _Failure) and not self._closed:
                    self._retry_at[cfg.name] = (now + SPAWN_COOLDOWN_S, str(e))
                    self._log.warning("mcp.start_failed", server=cfg.name, error=str(e))
                raise
            self._retry_at.pop(cfg.name, None)
            return instance

    async def _spawn(self, cfg: McpServerConfig) -> _Instance:
        instance = await _Instance.spawn(cfg, self._log)
        if self._closed:  # close() ran while this one was starting, so it could not see it
            await instance.stop("closed")
            raise _Failure(f"MCP server unavailable: {cfg.name}")
        # registered before the handshake, so close() stops it even mid-handshake; and kept until it is seen
        # to exit, so close() also reaps the ones that died or were replaced
        self._spawned = {i for i in self._spawned if not i.exited} | {instance}
        return instance

    async def close(self) -> None:
        """In-flight calls get {"error": ...} at once; every child and its process group is killed.
        Idempotent; bounded (it never waits on a pipe)."""
        if self._closed:
            return
        self._closed = True
        self._live.clear()
        await asyncio.gather(*(i.stop(f"MCP server '{i.name}': shutting down") for i in self._spawned),
                             return_exceptions=True)
