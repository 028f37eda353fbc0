"""llama-server's tool flags on a real `dormouse serve`: --tools, --mcp-servers-json, --mcp-servers-config and
--tools-runtime reach the daemon unchanged, its /tools works, a bad value stops it at start with a message that
names it, and stopping it leaves no MCP server behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import DaemonProcess

FAKE_MCP = str(Path(__file__).parents[1] / "fixtures" / "mcp_servers" / "fake_mcp_server.py")


def test_llama_server_tool_flags_serve_tools_and_mcp_and_stop_cleanly(tmp_path):
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"files": {"command": sys.executable, "args": [FAKE_MCP]}}}))
    servers = json.dumps({"mcpServers": {"echo": {"command": sys.executable, "args": [FAKE_MCP]}}})
    daemon = DaemonProcess("--tools", "read_file,exec_shell_command", "--mcp-servers-json", servers,
                           log_path=tmp_path / "d.log")
    try:
        daemon.wait_state("ready", "sleeping")
        names = [t["tool"] for t in daemon.http.get("/tools").json()]
        assert names[:2] == ["read_file", "exec_shell_command"] and "echo_echo" in names
        answer = daemon.http.post("/tools", json={"tool": "echo_pid", "params": {}}).json()
        mcp_pid = int(answer["plain_text_response"])
        shell = daemon.http.post("/tools", json={"tool": "exec_shell_command", "params": {"command": "echo $PPID"}})
        assert "[exit code: 0]" in shell.json()["plain_text_response"]
        assert daemon.stop() == 0
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
    for _ in range(100):  # the daemon closed its MCP clients on the way out; bounded by count
        if not Path(f"/proc/{mcp_pid}").exists() or open(f"/proc/{mcp_pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.05)
    else:
        os.kill(mcp_pid, signal.SIGKILL)
        pytest.fail("an MCP server outlived the daemon")
    # --mcp-servers-config: the same from a file, beside Dormouse's own flags
    daemon = DaemonProcess("--mcp-servers-config", str(config), "--sleep-idle-seconds", "300",
                           log_path=tmp_path / "d2.log")
    try:
        daemon.wait_state("ready", "sleeping")
        assert "files_echo" in [t["tool"] for t in daemon.http.get("/tools").json()]
    finally:
        daemon.stop()


@pytest.mark.parametrize("args, words", [
    (["--tools", "rm_rf"], "unknown tool 'rm_rf'"),
    (["--tools-runtime", "ssh:-oProxyCommand=x"], "is not a tool runtime"),
    (["--mcp-servers-config", "/nonexistent/mcp.json"], "--mcp-servers-config /nonexistent/mcp.json: cannot read it"),
    (["--mcp-servers-json", "not valid json"], "--mcp-servers-json: not JSON"),
    (["--tools", "all", "--tools-runtime", "podman:no-such-image-here"], "could not start a container"),
])
def test_a_bad_tool_flag_stops_the_daemon_at_start_naming_it(tmp_path, args, words):
    result = subprocess.run([sys.executable, "-m", "daemon", "serve", "--port", "0", *args], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "DORMOUSE_STATE_DIR": str(tmp_path / "s")})
    assert result.returncode != 0 and words in result.stdout + result.stderr, result.stdout + result.stderr
