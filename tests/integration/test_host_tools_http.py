"""GET/POST /tools through the real middleware on a fake worker: llama-server's answers, its hostile inputs, and
the model left alone (a call never wakes it)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from config import Settings
from tests.conftest import fake_daemon
from tests.integration.test_http_hardening import daemon

ALL = {"tools": ["all"]}


def alive(pid: int) -> bool:
    """Running, not a zombie (a killed command whose parent was the tool's child waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def events(response) -> list[dict]:
    text = (await response.read()).decode()
    return [json.loads(block[len("data: "):]) for block in text.split("\n\n") if block.startswith("data: ")]


async def test_tools_off_answer_403_as_llama_server_and_so_does_the_cors_proxy():
    async with fake_daemon() as (_, client):
        for method, path in (("GET", "/tools"), ("POST", "/tools"), ("GET", "/cors-proxy"), ("POST", "/cors-proxy")):
            response = await client.request(method, path, json={"tool": "read_file", "params": {"path": "/etc/hosts"}})
            body = await response.json()
            assert response.status == 403 and body["error"]["type"] == "feature_disabled", (method, path, body)
            assert body["error"]["message"] == "this feature is disabled"


async def test_the_listing_shows_the_enabled_tools_in_llama_server_s_shape():
    async with fake_daemon(tools=["read_file", "exec_shell_command"]) as (_, client):
        listing = await (await client.get("/tools")).json()
        assert [t["tool"] for t in listing] == ["read_file", "exec_shell_command"]
        shell = listing[1]
        assert shell["permissions"] == {"write": True} and shell["type"] == "server" and shell["uses_cwd"] is True
        assert shell["definition"]["function"]["parameters"]["required"] == ["command"]
        refused = await client.post("/tools", json={"tool": "write_file", "params": {"path": "x", "content": ""}})
        assert refused.status == 404 and "unknown tool" in (await refused.json())["error"]["message"]


async def test_a_call_reads_files_relative_to_x_tool_cwd_whatever_the_params_say(tmp_path):
    (tmp_path / "marker.txt").write_text("marker")
    async with fake_daemon(**ALL) as (_, client):
        response = await client.post("/tools", json={"tool": "read_file", "params": {
            "path": "marker.txt", "cwd": "/definitely/not/here"}}, headers={"x-tool-cwd": str(tmp_path)})
        assert response.status == 200 and await response.json() == {"plain_text_response": "marker\n"}
        written = await client.post("/tools", json={"tool": "write_file", "params": {"path": "sub/out", "content": "w"}},
                                    headers={"x-tool-cwd": str(tmp_path)})
        assert (await written.json())["result"] == "file written successfully"
        assert (tmp_path / "sub" / "out").read_text() == "w"
        # a model's "runtime" in params is dropped: only the header names one
        response = await client.post("/tools", json={"tool": "exec_shell_command", "params": {
            "command": "pwd", "runtime": "ssh:elsewhere"}}, headers={"x-tool-cwd": str(tmp_path)})
        assert (await response.json())["plain_text_response"].startswith(str(tmp_path))


@pytest.mark.parametrize("runtime, words", [
    ("fake:does-not-exist", "unknown tool runtime"),
    ("ssh:-oProxyCommand=touch /tmp/pwned", "invalid ssh target"),
    ("docker-container:--privileged", "invalid container id"),
    ("podman-container:--privileged", "invalid container id"),
    ("docker:busybox", "must name a running container"),
])
async def test_a_runtime_header_that_would_inject_an_option_is_a_500_and_runs_nothing(tmp_path, runtime, words):
    marker = tmp_path / "ran"
    async with fake_daemon(**ALL) as (_, client):
        response = await client.post("/tools", json={"tool": "exec_shell_command",
                                                      "params": {"command": f"touch {marker}"}},
                                     headers={"x-tool-runtime": runtime})
        assert response.status == 500 and words in (await response.json())["error"]["message"]
    assert not marker.exists()


async def test_a_streamed_command_arrives_as_events_and_ends_with_done():
    async with fake_daemon(**ALL) as (_, client):
        response = await client.post("/tools", json={"tool": "exec_shell_command", "stream": True,
                                                      "params": {"command": "echo hello"}})
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
        got = await events(response)
        assert got[-1] == {"done": True} and len(got) >= 2
        assert "hello" in "".join(e["chunk"] for e in got[:-1]) and "[exit code: 0]" in got[-2]["chunk"]
        refused = await client.post("/tools", json={"tool": "read_file", "stream": True, "params": {"path": "x"}})
        assert refused.status == 404 and "does not support stream" in (await refused.json())["error"]["message"]


@pytest.mark.parametrize("body, status, words", [
    (b"not json", 400, "not JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"params": {}}', 400, '"tool" must be'),
    (b'{"tool": 5}', 400, '"tool" must be'),
    (b'{"tool": "read_file", "params": [1]}', 400, '"params" must be a JSON object'),
    (b'{"tool": "read_file", "params": {"path": 5}}', 400, "params.path must be str"),
    (b'{"tool": "read_file", "params": {"path": "x", "end_line": 1.5}}', 400, "params.end_line must be an integer"),
    (b'{"tool": "exec_shell_command", "params": {"command": "true"}, "stream": "yes"}', 400, '"stream" must be'),
    (b'{"tool": "' + b"x" * 5000 + b'"}', 404, "unknown tool"),
])
async def test_hostile_bodies_are_refused_by_name(body, status, words):
    async with fake_daemon(**ALL) as (_, client):
        response = await client.post("/tools", data=body, headers={"Content-Type": "application/json"})
        message = (await response.json())["error"]["message"]
        assert response.status == status and words in message and len(message) < 600, message


async def test_wrong_content_type_and_huge_bodies_are_refused_before_any_tool_runs(tmp_path):
    async with fake_daemon(max_body_bytes=4096, **ALL) as (_, client):
        wrong = await client.post("/tools", data=b'{"tool": "get_info"}', headers={"Content-Type": "text/plain"})
        assert wrong.status == 415
        huge = await client.post("/tools", json={"tool": "write_file", "params": {
            "path": str(tmp_path / "big"), "content": "x" * 10000}})
        assert huge.status == 413 and not (tmp_path / "big").exists()


async def test_tool_calls_never_wake_a_sleeping_model(tmp_path):
    async with daemon(**ALL) as (controller, client):
        assert (await client.post("/sleep")).status == 200
        for _ in range(50):
            if str(controller.state) == "sleeping":
                break
            await asyncio.sleep(0.05)
        assert str(controller.state) == "sleeping"
        for body in ({"tool": "get_info"}, {"tool": "file_glob_search", "params": {"path": str(tmp_path)}}):
            assert (await client.post("/tools", json=body)).status == 200
        assert (await client.get("/tools")).status == 200
        assert str(controller.state) == "sleeping"


async def test_the_admin_key_opens_tools_when_one_is_set_and_an_api_key_does_not():
    async with fake_daemon(api_key="api", admin_key="admin", **ALL) as (_, client):
        for key, status in ((None, 401), ("api", 401), ("admin", 200)):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            assert (await client.get("/tools", headers=headers)).status == status, key
            assert (await client.post("/tools", json={"tool": "get_info"}, headers=headers)).status == status, key
    async with fake_daemon(api_key="api", **ALL) as (_, client):  # no admin key: the API key, as /sleep
        assert (await client.get("/tools")).status == 401
        assert (await client.get("/tools", headers={"Authorization": "Bearer api"})).status == 200


async def test_with_tools_on_and_no_cors_origins_only_localhost_pages_are_allowed():
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"}
    async with fake_daemon(**ALL) as (_, client):
        ok = await client.options("/completions", headers={"Origin": "http://localhost:8080", **preflight})
        assert ok.status == 200 and ok.headers["Access-Control-Allow-Origin"] == "http://localhost:8080"
        evil = await client.options("/completions", headers={"Origin": "http://evil.com", **preflight})
        assert evil.status == 200 and "Access-Control-Allow-Origin" not in evil.headers
        post = await client.post("/tools", json={"tool": "get_info"}, headers={"Origin": "http://evil.com"})
        assert post.status == 403
    assert Settings(tools=["all"], cors_origins=["http://ui.example"]).cors_origins == ["http://ui.example"]
    assert Settings().cors_origins == []


def test_settings_refuse_unknown_tools_and_runtimes_that_would_be_options():
    for bad in ({"tools": ["rm_rf"]}, {"tools_runtime": "ssh:-oProxyCommand=x"},
                {"tools_runtime": "docker-container:--privileged"}, {"tools_runtime": "lxc:x"},
                {"mcp_servers": {"bad name": {"command": "x"}}}, {"mcp_servers": {"a": {"command": ""}}},
                {"mcp_servers": {"a": {"command": "x", "timeout_ms": 0}}}, {"mcp_servers": "not json"},
                {"mcp_servers": {"a": {"command": "x", "shell": True}}}):
        with pytest.raises(ValidationError):
            Settings(**bad)
    assert Settings(tools="read_file,get_info").tools == ["read_file", "get_info"]
    assert list(Settings(mcp_servers='{"mcpServers": {"e": {"command": "x"}}}').mcp_servers) == ["e"]


async def test_a_crowd_of_calls_is_answered_and_a_client_that_leaves_ends_its_command(tmp_path):
    """40 calls at once (more than run at once: the rest wait their turn), then a streamed command whose client
    goes away: its process group is killed, bounded by count, never by time."""
    async with fake_daemon(handler_cancellation=True, **ALL) as (_, client):
        answers = await asyncio.gather(*(client.post("/tools", json={"tool": "exec_shell_command", "params": {
            "command": f"echo {n}"}}) for n in range(40)))
        bodies = [await a.json() for a in answers]
        assert [b["plain_text_response"].split("\n")[0] for b in bodies] == [str(n) for n in range(40)]
        pid_file = tmp_path / "pid"
        response = await client.post("/tools", json={"tool": "exec_shell_command", "stream": True, "params": {
            "command": f"echo $$ > {pid_file}; echo started; sleep 50", "timeout": 60}})
        await response.content.readuntil(b"started")
        response.close()
        pid = int(pid_file.read_text())
        for _ in range(200):
            if not alive(pid):
                break
            await asyncio.sleep(0.05)
        else:
            subprocess.run(["kill", "-9", str(pid)])
            pytest.fail("the command outlived its client")


FAKE_MCP = str(Path(__file__).parents[1] / "fixtures" / "mcp_servers" / "fake_mcp_server.py")


def mcp(*flags: str, **more) -> dict:
    return {"command": sys.executable, "args": [FAKE_MCP, *flags], **more}


async def test_mcp_tools_are_listed_as_server_tool_and_called_beside_the_built_in_ones():
    servers = {"echo": mcp(), "echo2": mcp("--notify"), "broken": {"command": "/nonexistent/mcp-binary"},
               "read": mcp()}  # read + file = read_file: taken by the built-in tool, so skipped
    async with fake_daemon(tools=["read_file"], mcp_servers=servers) as (_, client):
        listing = await (await client.get("/tools")).json()
        names = [t["tool"] for t in listing]
        assert names[0] == "read_file" and names.count("read_file") == 1
        assert {"echo_echo", "echo_add", "echo2_echo"} <= set(names) and not any(n.startswith("broken_") for n in names)
        echo = next(t for t in listing if t["tool"] == "echo_echo")
        assert echo["type"] == "mcp" and echo["definition"]["type"] == "function"
        assert echo["definition"]["function"]["parameters"]["type"] == "object"
        answers = await asyncio.gather(*(client.post("/tools", json={"tool": "echo2_echo", "params": {
            "message": f"m{n}"}}) for n in range(10)))
        assert [(await a.json())["plain_text_response"] for a in answers] == [f"echo: m{n}" for n in range(10)]
        added = await client.post("/tools", json={"tool": "echo_add", "params": {"a": 3, "b": 5}})
        assert added.status == 200 and "error" not in await added.json()
        # an MCP tool takes no x-tool-cwd / runtime and does not stream
        streamed = await client.post("/tools", json={"tool": "echo_echo", "stream": True, "params": {}})
        assert streamed.status == 404


async def test_mcp_servers_alone_turn_tools_on_with_no_built_in_tool():
    async with fake_daemon(mcp_servers={"echo": mcp()}) as (_, client):
        names = [t["tool"] for t in await (await client.get("/tools")).json()]
        assert names and all(n.startswith("echo_") for n in names)
        refused = await client.post("/tools", json={"tool": "exec_shell_command", "params": {"command": "id"}})
        assert refused.status == 404


async def test_a_slow_mcp_call_ends_at_its_timeout_and_the_daemon_closes_promptly():
    async with fake_daemon(mcp_servers={"slow": mcp(timeout_ms=500)}) as (_, client):
        answer = await (await client.post("/tools", json={"tool": "slow_sleep", "params": {"seconds": 5}})).json()
        assert "timed out" in answer["error"]
        pending = asyncio.ensure_future(client.post("/tools", json={"tool": "slow_sleep", "params": {"seconds": 30}}))
        await asyncio.sleep(0.3)
    # leaving the block closed the app (its cleanup closes the MCP clients): the slow call got an answer or
    # its connection closed, and no wait of 30 s happened (the test would time out)
    await asyncio.wait_for(asyncio.gather(pending, return_exceptions=True), 10)


async def test_stopping_ends_the_calls_under_way_at_once_and_refuses_new_ones(tmp_path):
    """The daemon closes the tools first when it stops (daemon/server.py): a command of 50 s and an MCP call of
    30 s end then, not when they would, and a call after that is a 503."""
    from daemon.http.tool_routes import HOST_TOOLS

    async with fake_daemon(mcp_servers={"slow": mcp()}, **ALL) as (_, client):
        pid_file = tmp_path / "pid"
        command = asyncio.ensure_future(client.post("/tools", json={"tool": "exec_shell_command", "params": {
            "command": f"echo $$ > {pid_file}; sleep 50", "timeout": 60}}))
        slow = asyncio.ensure_future(client.post("/tools", json={"tool": "slow_sleep", "params": {"seconds": 30}}))
        for _ in range(200):
            if pid_file.exists() and pid_file.read_text().strip():
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # the MCP call reaches its server
        await asyncio.wait_for(client.server.app[HOST_TOOLS].close(), 10)
        answered, mcp_answer = await asyncio.wait_for(asyncio.gather(command, slow), 10)
        assert answered.status == 500 and "ended without an answer" in (await answered.json())["error"]["message"]
        assert "error" in await mcp_answer.json()
        assert not alive(int(pid_file.read_text()))
        late = await client.post("/tools", json={"tool": "get_info"})
        assert late.status == 503 and "stopping" in (await late.json())["error"]["message"]


# -- the web UI's CORS proxy (cors_proxy, llama-server's --ui-mcp-proxy) --

async def _target_server(seen: list):
    """An upstream that records what reached it: GET /capture, POST / answers 204, GET /stream trickles."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    async def capture(request):
        seen.append(dict(request.headers))
        return web.Response(text="ok", content_type="text/plain")

    async def no_content(request):
        seen.append(await request.read())
        return web.Response(status=204)

    async def stream(request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for n in range(3):
            await response.write(f"data: {n}\n\n".encode())
            await asyncio.sleep(0.01)
        return response

    async def slow(request):
        await asyncio.sleep(30)
        return web.Response(text="late")

    async def moved(request):
        raise web.HTTPTemporaryRedirect("/capture")

    async def cookie(request):
        seen.append(dict(request.headers))
        response = web.Response(text="<script>alert(1)</script>", content_type="text/html")
        response.set_cookie("upstream", "secret")
        return response

    app = web.Application()
    app.router.add_get("/capture", capture)
    app.router.add_post("/", no_content)
    app.router.add_get("/stream", stream)
    app.router.add_get("/slow", slow)
    app.router.add_get("/moved", moved)
    app.router.add_get("/cookie", cookie)
    server = TestServer(app)
    await server.start_server()
    return server


async def test_the_proxy_forwards_only_the_headers_the_client_names_and_streams_the_answer():
    seen: list = []
    target = await _target_server(seen)
    try:
        async with fake_daemon(cors_proxy=True, api_key="k") as (_, client):
            base = f"http://127.0.0.1:{target.port}"
            response = await client.get(f"/cors-proxy?url={base}/capture", headers={
                "Authorization": "Bearer k", "Cookie": "session=secret", "Proxy-Authorization": "Basic x",
                "x-llama-server-proxy-header-accept": "application/json",
                "x-llama-server-proxy-header-authorization": "Bearer explicit"})
            assert response.status == 200 and await response.text() == "ok"
            captured = {k.lower(): v for k, v in seen[-1].items()}
            assert captured["accept"] == "application/json" and captured["authorization"] == "Bearer explicit"
            assert not {"cookie", "proxy-authorization", "x-api-key"} & set(captured)
            empty = await client.post(f"/cors-proxy?url={base}/", json={"jsonrpc": "2.0"},
                                      headers={"Authorization": "Bearer k"})
            assert empty.status == 204 and await empty.read() == b"" and seen[-1] == b'{"jsonrpc": "2.0"}'
            events = await client.get(f"/cors-proxy?url={base}/stream", headers={"Authorization": "Bearer k"})
            assert events.headers["Content-Type"] == "text/event-stream"
            assert await events.text() == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
            assert (await client.get(f"/cors-proxy?url={base}/capture")).status == 401  # the key applies
    finally:
        await target.close()


@pytest.mark.parametrize("url, status, words", [
    ("", 400, "invalid target URL"),
    ("ftp://example.com/x", 400, "unsupported URL scheme"),
    ("file:///etc/passwd", 400, "invalid target URL"),
    ("http://user:pw@127.0.0.1:1/", 400, "authentication in target URL"),
    ("http://127.0.0.1:1/", 502, "the proxied request failed"),
])
async def test_the_proxy_refuses_what_it_cannot_fetch_by_name(url, status, words):
    async with fake_daemon(cors_proxy=True) as (_, client):
        response = await client.get("/cors-proxy", params={"url": url})
        assert response.status == status and words in (await response.json())["error"]["message"]


async def test_the_proxy_is_off_by_default_and_bounded_when_on(monkeypatch):
    from daemon.http import tool_routes

    async with fake_daemon() as (_, client):
        assert (await client.get("/cors-proxy", params={"url": "http://127.0.0.1:1/"})).status == 403
    monkeypatch.setattr(tool_routes, "PROXY_MAX_RUNNING", 2)
    target = await _target_server([])
    try:
        async with fake_daemon(cors_proxy=True, handler_cancellation=True) as (_, client):
            url = {"url": f"http://127.0.0.1:{target.port}/slow"}
            held = [asyncio.ensure_future(client.get("/cors-proxy", params=url)) for _ in range(2)]
            for _ in range(400):  # both under way (bounded by count: a busy machine is slow, never wrong)
                if client.server.app[tool_routes.PROXY].running == 2:
                    break
                await asyncio.sleep(0.025)
            busy = await client.get("/cors-proxy", params=url)
            assert busy.status == 503 and busy.headers["Retry-After"] == "1"
            for request in held:
                request.cancel()
            await asyncio.gather(*held, return_exceptions=True)
    finally:
        await target.close()


async def test_review_findings_stay_fixed(tmp_path, monkeypatch):
    """From the adversarial review: a repository's git config runs nothing; a bad glob or line range is an error
    the model reads; grep's answer is bounded; an MCP tool keeps arguments named cwd; answers held for clients
    that do not read are bounded."""
    from daemon.host_tools import registry

    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    marker = tmp_path / "pwned"
    subprocess.run(["git", "-C", str(repo), "config", "core.fsmonitor", f"touch {marker}; false"], check=True)
    (repo / "a.txt").write_text("m" * 20000 + "\n")
    async with fake_daemon(tools=["file_glob_search", "grep_search", "read_file"],
                           mcp_servers={"echo": mcp()}) as (_, client):
        async def call(tool: str, **params) -> dict:
            response = await client.post("/tools", json={"tool": tool, "params": params})
            assert response.status == 200, await response.text()
            return await response.json()

        assert "a.txt" in (await call("file_glob_search", path=str(repo)))["plain_text_response"]
        await call("grep_search", path=str(repo), pattern="m")
        assert not marker.exists()
        bad_glob = await client.post("/tools", json={"tool": "file_glob_search", "params": {
            "path": str(repo), "include": "[z-a]"}})
        assert bad_glob.status == 400 and "invalid glob" in (await bad_glob.json())["error"]["message"]
        for start, end in ((0, -1), (1, 0), (1, -2), (5, 3)):
            answer = await call("read_file", path=str(repo / "a.txt"), start_line=start, end_line=end)
            assert "invalid line range" in answer["error"], (start, end)
        (repo / "wide.txt").write_text(("m" * 20000 + "\n") * 60)
        text = (await call("grep_search", path=str(repo / "wide.txt"), pattern="m", context_lines=100))
        assert len(text["plain_text_response"]) < 200_000 and "[output truncated]" in text["plain_text_response"]
        echoed = await call("echo_args", cwd="/x", runtime="r", resp_type="t", keep=1)
        assert json.loads(echoed["plain_text_response"]) == {"cwd": "/x", "runtime": "r", "resp_type": "t", "keep": 1}
        monkeypatch.setattr(registry, "MAX_HELD_BYTES", 10)
        held = await client.post("/tools", json={"tool": "read_file", "params": {"path": str(repo / "a.txt"),
                                                                                 "start_line": 1, "end_line": 1}})
        assert held.status == 503 and "waiting for their clients" in (await held.json())["error"]["message"]


async def test_the_proxy_keeps_the_hop_s_headers_cookies_and_pages_to_itself():
    """From the proxy's review: the web UI's text POST with its content type named; Host and framing headers of
    the client never forwarded; no cookie kept across requests; a redirect followed; what comes back sandboxed,
    and a page load refused."""
    seen: list = []
    target = await _target_server(seen)
    try:
        async with fake_daemon(cors_proxy=True) as (_, client):
            base = f"http://127.0.0.1:{target.port}"
            posted = await client.post(f"/cors-proxy?url={base}/", data='{"jsonrpc": "2.0"}', headers={
                "Content-Type": "text/plain;charset=UTF-8",
                "x-llama-server-proxy-header-content-type": "application/json"})
            assert posted.status == 204 and seen[-1] == b'{"jsonrpc": "2.0"}'
            answer = await client.get(f"/cors-proxy?url={base}/capture", headers={
                "x-llama-server-proxy-header-host": "evil.example", "x-llama-server-proxy-header-content-length": "99",
                "x-llama-server-proxy-header-x-kept": "yes"})
            assert answer.status == 200
            captured = {k.lower(): v for k, v in seen[-1].items()}
            assert captured["host"] == f"127.0.0.1:{target.port}" and captured["x-kept"] == "yes"
            assert "content-length" not in captured
            page = await client.get(f"/cors-proxy?url={base}/cookie")
            assert page.headers["Content-Security-Policy"] == "sandbox" and "Set-Cookie" not in page.headers
            await client.get(f"/cors-proxy?url={base}/cookie")
            assert "cookie" not in {k.lower() for k in seen[-1]}
            moved = await client.get(f"/cors-proxy?url={base}/moved")
            assert moved.status == 200 and await moved.text() == "ok"
            navigated = await client.get(f"/cors-proxy?url={base}/cookie", headers={"Sec-Fetch-Mode": "navigate"})
            assert navigated.status == 403
    finally:
        await target.close()
