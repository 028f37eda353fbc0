"""MCP stdio clients (daemon/host_tools/mcp.py): the mcp_servers setting, then real child processes, the fixture
server in tests/fixtures/mcp_servers/ run with this interpreter and switched into each way a server can
misbehave."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import structlog

from daemon.host_tools.mcp import McpClients, McpServerConfig, McpToolDef

SERVER = Path(__file__).parents[1] / "fixtures" / "mcp_servers" / "fake_mcp_server.py"
FAKE_TOOLS = ["echo", "add", "multi", "tool_error", "fail_once", "sleep", "crash", "big", "pid", "env", "bare", "args",
              "odd_schema"]


# The daemon's logger writes to the stream another test configured (pytest may have closed it): a logger of
# our own, that writes nothing.
QUIET = structlog.wrap_logger(structlog.ReturnLogger(), processors=[])


def fake(name: str, *flags: str, timeout_ms: int = 30000, env: dict[str, str] | None = None) -> McpServerConfig:
    return McpServerConfig(name, sys.executable, (str(SERVER), *flags), tuple((env or {}).items()), timeout_ms)


@pytest.fixture
async def make_clients():
    made: list[McpClients] = []

    def make(*servers: McpServerConfig) -> McpClients:
        made.append(McpClients(list(servers), QUIET))
        return made[-1]

    yield make
    for clients in made:
        await asyncio.wait_for(clients.close(), 5)


def gone(pid: int) -> bool:
    """True once pid is dead (a zombie counts: its parent was killed and no one need reap it here)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def pid_of(clients: McpClients, server: str) -> int:
    result = await clients.call(server, "pid", {})
    return int(result["plain_text_response"])


# --- config (the mcp_servers setting, from llama-server's flags) ---------------------------------------

def servers_from(text: str) -> dict:
    """--mcp-servers-json TEXT through the translation and the settings, as `dormouse serve` reads it."""
    from config import Settings
    from daemon.llama_server_args import translate

    return Settings(**translate(["--mcp-servers-json", text], {}, {}).settings).mcp_servers


def test_a_full_config_becomes_the_setting():
    text = json.dumps({"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "server-files"], "env": {"ROOT": "/srv"}, "timeout_ms": 5000},
        "web_search-2": {"command": "/usr/bin/search"},
        "remote": {"url": "https://example.com/mcp"},  # no command: an HTTP server, skipped as llama-server does
    }})
    servers = servers_from(text)
    assert list(servers) == ["files", "web_search-2"]
    assert servers["files"].args == ["-y", "server-files"] and servers["files"].env == {"ROOT": "/srv"}
    assert servers["files"].timeout_ms == 5000 and servers["web_search-2"].timeout_ms == 30000
    assert servers_from("{}") == {} and servers_from('{"mcpServers": {}}') == {}


@pytest.mark.parametrize("text, complaint", [
    ("not json", "not JSON"),
    ("[]", "must be {"),
    ('{"mcpServers": []}', "must be {"),
    ('{"mcpServers": {"a": "cmd"}}', "valid dictionary"),
    ('{"mcpServers": {"a": {"command": 5}}}', "valid string"),
    ('{"mcpServers": {"a": {"command": "c", "args": "x"}}}', "valid list"),
    ('{"mcpServers": {"a": {"command": "c", "args": [1]}}}', "valid string"),
    ('{"mcpServers": {"a": {"command": "c", "args": ["a\\u0000b"]}}}', "NUL"),
    ('{"mcpServers": {"a": {"command": "c", "env": ["X=1"]}}}', "valid dictionary"),
    ('{"mcpServers": {"a": {"command": "c", "env": {"X": 1}}}}', "valid string"),
    ('{"mcpServers": {"a": {"command": "c", "env": {"X=Y": "1"}}}}', "environment variable name"),
    ('{"mcpServers": {"a": {"command": "c", "timeout_ms": 0}}}', "greater than or equal to 1"),
    ('{"mcpServers": {"a": {"command": "c", "timeout_ms": 600001}}}', "less than or equal to 600000"),
    ('{"mcpServers": {"a": {"command": "c", "timeout_ms": "5x"}}}', "valid integer"),
    ('{"mcpServers": {"a": {"command": "c", "timeout_ms": true}}}', "valid integer"),
    ('{"mcpServers": {"bad name": {"command": "c"}}}', "server name"),
    ('{"mcpServers": {"_x": {"command": "c"}}}', "server name"),
    ('{"mcpServers": {"my.srv": {"command": "c"}}}', "server name"),
    ('{"mcpServers": {"%s": {"command": "c"}}}' % ("a" * 65), "server name"),
    ('{"mcpServers": {"a": {"command": "c"}, "a": {"command": "d"}}}', '"a" is given twice'),
    (json.dumps({"mcpServers": {f"s{i}": {"command": "c"} for i in range(65)}}), "at most 64"),
])
def test_a_bad_config_names_the_problem(text, complaint):
    from pydantic import ValidationError

    from daemon.llama_server_handling import LlamaServerArgsError

    with pytest.raises((ValidationError, LlamaServerArgsError)) as caught:
        servers_from(text)
    assert complaint in str(caught.value), str(caught.value)


def test_a_config_file_is_read_and_a_missing_or_broken_one_is_an_error(tmp_path):
    from daemon.llama_server_args import translate
    from daemon.llama_server_handling import LlamaServerArgsError

    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {"a": {"command": "c"}}}))
    assert translate(["--mcp-servers-config", str(path)], {}, {}).settings["mcp_servers"] == {"a": {"command": "c"}}
    with pytest.raises(LlamaServerArgsError, match="missing.json: cannot read it"):
        translate(["--mcp-servers-config", str(tmp_path / "missing.json")], {}, {})
    path.write_text("{oops")
    with pytest.raises(LlamaServerArgsError, match="not JSON"):
        translate(["--mcp-servers-config", str(path)], {}, {})


# --- warm-up -------------------------------------------------------------------------------------------

async def test_warm_up_lists_the_working_servers_tools_in_config_order_and_skips_the_rest(make_clients):
    clients = make_clients(
        fake("one"),
        McpServerConfig("missing", "/nonexistent/mcp-server-binary"),
        fake("mute", "--silent", timeout_ms=1000),   # never answers: bounded by its timeout
        fake("junk", "--garbage", timeout_ms=1000),  # answers, but nothing that parses
        fake("refuses", "--bad-init"),
        fake("two", "--notify"),
    )
    tools = await asyncio.wait_for(clients.warm_up(), 15)
    assert [(t.server, t.name) for t in tools] == [("one", n) for n in FAKE_TOOLS] + [("two", n) for n in FAKE_TOOLS]
    echo = tools[0]
    assert echo == McpToolDef("one", "echo", "Echo the message", {
        "type": "object", "properties": {"message": {"type": "string"}, "delay": {"type": "number"}},
        "required": ["message"]})
    by_name = {t.name: t for t in tools if t.server == "one"}
    assert by_name["bare"].input_schema == {} and by_name["odd_schema"].input_schema == {}
    assert by_name["odd_schema"].description == ""


async def test_warm_up_follows_the_cursor_through_every_page(make_clients):
    clients = make_clients(fake("paged", "--page-size", "5"))
    assert [t.name for t in await clients.warm_up()] == FAKE_TOOLS


async def test_warm_up_stops_its_instances_and_calls_spawn_a_fresh_one(make_clients):
    clients = make_clients(fake("one"))
    await clients.warm_up()
    # fail_once is per process: the warm-up instance never called it, and the call's instance is new
    assert await clients.call("one", "fail_once", {}) == {"error": "transient failure"}
    assert await clients.call("one", "fail_once", {}) == {"plain_text_response": "ok now"}


async def test_a_stderr_flood_is_drained(make_clients):
    # 1 MiB is many pipe buffers: undrained, the server would block before it ever read a request
    clients = make_clients(fake("loud", "--stderr-flood", str(2**20)))
    assert len(await asyncio.wait_for(clients.warm_up(), 10)) == len(FAKE_TOOLS)
    assert await clients.call("loud", "echo", {"message": "hi"}) == {"plain_text_response": "echo: hi"}


# --- calls ---------------------------------------------------------------------------------------------

async def test_call_results_in_llama_servers_shape(make_clients):
    clients = make_clients(fake("one"), fake("env", env={"MCP_TEST_VALUE": "from config"}))
    assert await clients.call("one", "echo", {"message": "hello"}) == {"plain_text_response": "echo: hello"}
    assert await clients.call("one", "add", {"a": 3, "b": 5}) == {"plain_text_response": "8"}
    # text parts joined by newlines; the image is dropped
    assert await clients.call("one", "multi", {}) == {"plain_text_response": "first\nsecond"}
    assert await clients.call("one", "tool_error", {}) == {"error": "the tool says no"}  # isError
    assert await clients.call("one", "nope", {}) == {"error": "Unknown tool: nope"}      # a JSON-RPC error
    assert await clients.call("nobody", "echo", {}) == {"error": "MCP server unavailable: nobody"}
    assert await clients.call("env", "env", {"name": "MCP_TEST_VALUE"}) == {"plain_text_response": "from config"}
    assert await clients.call("env", "env", {"name": "PATH"}) == {"plain_text_response": os.environ["PATH"]}
    assert "not JSON" in (await clients.call("one", "echo", {"message": object()}))["error"]


async def test_one_instance_serves_every_call(make_clients):
    clients = make_clients(fake("one"))
    pids = {await pid_of(clients, "one") for _ in range(5)}
    assert len(pids) == 1


async def test_notifications_junk_and_stray_answers_around_a_response_are_skipped(make_clients):
    clients = make_clients(fake("noisy", "--notify"), fake("burst", "--burst"))
    for _ in range(3):
        assert await clients.call("noisy", "echo", {"message": "n"}) == {"plain_text_response": "echo: n"}
        assert await clients.call("burst", "echo", {"message": "b"}) == {"plain_text_response": "echo: b"}


async def test_a_ping_from_the_server_is_answered(make_clients):
    clients = make_clients(fake("pinger", "--ping-first"))
    assert await clients.call("pinger", "echo", {"message": "p"}) == {"plain_text_response": "echo: p"}


async def test_ten_concurrent_calls_each_get_their_own_answer(make_clients):
    clients = make_clients(fake("one"))
    # later calls answer first, so a client that matched answers to calls by order would mix them up
    results = await asyncio.gather(*(clients.call("one", "echo", {"message": str(i), "delay": (10 - i) / 50})
                                     for i in range(10)))
    assert results == [{"plain_text_response": f"echo: {i}"} for i in range(10)]
    assert len({await pid_of(clients, "one") for _ in range(2)}) == 1  # and they all shared one instance


async def test_a_call_times_out_without_holding_up_the_others(make_clients):
    clients = make_clients(fake("slow", timeout_ms=1500))
    await pid_of(clients, "slow")  # started, so the timeout below is all the tool's
    slow = asyncio.create_task(clients.call("slow", "sleep", {"seconds": 30}))
    assert await clients.call("slow", "echo", {"message": "quick"}) == {"plain_text_response": "echo: quick"}
    result = await asyncio.wait_for(slow, 10)
    assert result == {"error": "MCP server 'slow': tool 'sleep' timed out after 1500 ms"}
    # the late answer to the timed-out call, if it ever came, would be ignored; the instance lives on
    assert await clients.call("slow", "echo", {"message": "again"}) == {"plain_text_response": "echo: again"}


async def test_a_server_that_crashes_mid_call_fails_that_call_and_is_respawned(make_clients):
    clients = make_clients(fake("fragile"))
    first = await pid_of(clients, "fragile")
    result = await asyncio.wait_for(clients.call("fragile", "crash", {}), 10)
    assert result == {"error": "MCP server 'fragile' exited with status 3"}
    assert await pid_of(clients, "fragile") != first


async def test_a_server_that_exits_after_every_call_is_respawned_for_each(make_clients):
    clients = make_clients(fake("oneshot", "--exit-after-call"))
    pids = [await pid_of(clients, "oneshot") for _ in range(3)]
    assert len(set(pids)) == 3


async def test_a_server_that_cannot_start_fails_its_calls_fast(make_clients):
    clients = make_clients(McpServerConfig("missing", "/nonexistent/mcp-server-binary"),
                           fake("refuses", "--bad-init"))
    result = await clients.call("missing", "echo", {})
    assert result["error"].startswith("MCP server 'missing': cannot start '/nonexistent/mcp-server-binary'")
    result = await clients.call("missing", "echo", {})  # within the cool-down: no new spawn
    assert result["error"].startswith("MCP server unavailable: missing (")
    result = await clients.call("refuses", "echo", {})
    assert result == {"error": "MCP server 'refuses': initialize failed: cannot initialize today"}


async def test_a_line_over_16_mib_kills_the_instance_and_the_next_call_respawns(make_clients):
    clients = make_clients(fake("huge"))
    first = await pid_of(clients, "huge")
    result = await asyncio.wait_for(clients.call("huge", "big", {}), 20)
    assert result == {"error": "MCP server 'huge' sent a message longer than 16 MiB"}
    assert await pid_of(clients, "huge") != first


# --- close ---------------------------------------------------------------------------------------------

async def test_close_during_a_slow_call_fails_it_at_once_and_kills_the_server(make_clients):
    clients = make_clients(fake("slow"))
    pid = await pid_of(clients, "slow")
    call = asyncio.create_task(clients.call("slow", "sleep", {"seconds": 60}))
    await asyncio.sleep(0.2)  # let the request reach the server; the outcome below holds either way
    await asyncio.wait_for(clients.close(), 5)
    result = await asyncio.wait_for(call, 5)
    assert "error" in result
    assert gone(pid)
    await asyncio.wait_for(clients.close(), 5)  # idempotent
    assert await clients.call("slow", "echo", {"message": "late"}) == {"error": "MCP server unavailable: slow"}
    assert await clients.warm_up() == []


async def test_close_during_warm_up_is_bounded(make_clients):
    clients = make_clients(fake("mute", "--silent", timeout_ms=60000))
    warm_up = asyncio.create_task(clients.warm_up())
    await asyncio.sleep(0.3)
    await asyncio.wait_for(clients.close(), 5)
    assert await asyncio.wait_for(warm_up, 5) == []


@pytest.fixture
def grandchild(tmp_path):
    """The pid file --grandchild servers add to; every grandchild is killed after the test whatever happens."""
    pid_file = tmp_path / "grandchild.pid"
    yield pid_file
    for pid in grandchild_pids(pid_file):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def grandchild_pids(pid_file: Path) -> list[int]:
    return [int(line) for line in pid_file.read_text().split()] if pid_file.exists() else []


async def test_a_grandchild_in_the_group_dies_with_the_server(make_clients, grandchild):
    clients = make_clients(fake("parent", "--grandchild", str(grandchild)))
    assert await clients.call("parent", "echo", {"message": "x"}) == {"plain_text_response": "echo: x"}
    await asyncio.wait_for(clients.close(), 5)
    [pid] = grandchild_pids(grandchild)
    for _ in range(100):
        if gone(pid):
            break
        await asyncio.sleep(0.05)
    assert gone(pid)


async def test_a_grandchild_holding_the_pipes_hangs_nothing(make_clients, grandchild):
    # it leaves the process group, so the kill misses it and its copies of the pipes stay open: no EOF ever
    clients = make_clients(fake("parent", "--grandchild", str(grandchild), "--grandchild-escapes"))
    assert len(await asyncio.wait_for(clients.warm_up(), 10)) == len(FAKE_TOOLS)
    assert await clients.call("parent", "echo", {"message": "x"}) == {"plain_text_response": "echo: x"}
    # the server's exit is seen without EOF on its stdout, so the crash is reported, not timed out
    assert await asyncio.wait_for(clients.call("parent", "crash", {}), 10) == {
        "error": "MCP server 'parent' exited with status 3"}
    assert await clients.call("parent", "echo", {"message": "y"}) == {"plain_text_response": "echo: y"}
    await asyncio.wait_for(clients.close(), 5)


async def test_a_server_that_stops_reading_is_dropped_before_its_input_fills_the_daemon(make_clients):
    """Calls of 4 MiB of arguments each to a server that no longer reads: they time out, and once more than 16 MiB
    waits unwritten the instance is killed, so what the daemon holds for it stays bounded."""
    clients = make_clients(fake("stuck", "--stop-reading", timeout_ms=300))
    big = {"message": "x" * (4 * 2**20)}
    answers = [await clients.call("stuck", "echo", big) for _ in range(8)]
    assert all("error" in a for a in answers)
    assert any("not reading its input" in a["error"] for a in answers), answers
    instance = clients._live.get("stuck")
    assert instance is None or instance._stdin is None or instance._stdin.get_write_buffer_size() <= 20 * 2**20
