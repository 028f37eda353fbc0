"""The settings of the tools that run on the daemon's host (daemon/host_tools): which built-in tools, where
they run, and which MCP servers. All off by default: each lets an HTTP client act on this machine."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

BUILTIN_TOOLS = ("read_file", "file_glob_search", "grep_search", "exec_shell_command", "write_file", "edit_file",
                 "get_info")
MAX_MCP_SERVERS = 64
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")  # the start of its tools' function names: no "."
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")
_RUNTIME = re.compile(r"^((docker|podman)(-container)?:[A-Za-z0-9][A-Za-z0-9._:/@-]*|ssh:[A-Za-z0-9._@][A-Za-z0-9._@-]*)$")


TOOLS_DOC = ("llama-server's built-in tools that POST /tools runs on this host for a client (--tools): "
             f"{', '.join(BUILTIN_TOOLS)}, or all; empty: none (/tools answers 403). They read and write files and "
             "run commands as the daemon's user: the admin key opens /tools when one is set, and with tools on and "
             "cors_origins unset only localhost pages are allowed. A list, or names separated by commas")
TOOLS_RUNTIME_DOC = ("where the built-in tools run (--tools-runtime): empty, this host; docker:IMAGE or podman:IMAGE, a "
                     "container the daemon starts and removes; docker-container:ID, podman-container:ID, a running "
                     "container; ssh:[user@]host, over ssh with keys only. A call's x-tool-runtime header may name "
                     "another running container or ssh host")
MCP_SERVERS_DOC = ("stdio MCP servers whose tools GET /tools lists as SERVER_TOOL and POST /tools calls "
                   "(--mcp-servers-json, --mcp-servers-config): [mcp_servers.NAME] tables of command, args, env and "
                   "timeout_ms. In the environment: a JSON object")

CORS_PROXY_DOC = ("llama-server's /cors-proxy?url=URL (--ui-mcp-proxy; -ag turns it on): the daemon fetches an http(s) "
                  "URL for a client, forwarding only the x-llama-server-proxy-header-* headers, so a web UI reaches "
                  "MCP servers that send no CORS headers; false: 403. Opened by the admin key when one is set")


class McpServer(BaseModel):
    """One [mcp_servers.NAME] table: a stdio MCP server, as an `mcpServers` entry of Claude Desktop's config."""
    model_config = ConfigDict(extra="forbid")
    command: str = Field(min_length=1, max_length=4096, description="the program to run")
    args: list[str] = Field(default_factory=list, max_length=256)
    env: dict[str, str] = Field(default_factory=dict, max_length=256, description="added to the daemon's environment")
    timeout_ms: int = Field(30_000, ge=1, le=600_000, strict=True, description="bound on each tool call")

    @field_validator("command", "args", "env")
    @classmethod
    def _no_nul(cls, value: Any) -> Any:
        texts = [value] if isinstance(value, str) else list(value) + (list(value.values()) if isinstance(value, dict) else [])
        if any("\x00" in text for text in texts):
            raise ValueError("holds a NUL character")
        if isinstance(value, dict) and (bad := next((k for k in value if not _ENV_NAME.match(k)), None)) is not None:
            raise ValueError(f"{bad[:80]!r} is not an environment variable name")
        return value


def check_tools(value: list[str]) -> list[str]:
    unknown = [name for name in value if name != "all" and name not in BUILTIN_TOOLS]
    if unknown:
        raise ValueError(f"unknown tool {unknown[0]!r}: the built-in tools are {', '.join(BUILTIN_TOOLS)} (or all)")
    return list(dict.fromkeys(value))


def check_tools_runtime(value: str) -> str:
    # An id or target that starts with "-" would be read as an option by docker or ssh.
    if value and not _RUNTIME.match(value):
        raise ValueError(f"{value!r} is not a tool runtime: docker:IMAGE, podman:IMAGE (started with the daemon), "
                         "docker-container:ID, podman-container:ID or ssh:[user@]host")
    return value


def check_mcp_names(value: dict[str, McpServer]) -> dict[str, McpServer]:
    if len(value) > MAX_MCP_SERVERS:
        raise ValueError(f"at most {MAX_MCP_SERVERS} MCP servers, got {len(value)}")
    for name in value:
        if not _NAME.match(name):
            raise ValueError(f"MCP server name {name[:80]!r}: letters, digits, '_' and '-', up to 64, starting "
                             "with a letter or digit (its tools are named NAME_TOOL, a function name)")
    return value


def mcp_servers_json(value: Any) -> Any:
    """The environment gives JSON text: {"NAME": {...}}, or Claude Desktop's {"mcpServers": {...}}."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"must be a JSON object: {str(exc)[:80]}") from None
    if isinstance(value, dict) and set(value) == {"mcpServers"}:
        value = value["mcpServers"]
    return value


def check_host_tools(settings: Any) -> Any:
    """Settings' after-validator for tools, tools_runtime and mcp_servers; and llama-server's rule: with tools or MCP
    servers on and no cors_origins given, pages on localhost only."""
    for key, check in (("tools", check_tools), ("tools_runtime", check_tools_runtime), ("mcp_servers", check_mcp_names)):
        try:
            setattr(settings, key, check(getattr(settings, key)))
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from None
    if (settings.tools or settings.mcp_servers) and "cors_origins" not in settings.model_fields_set:
        settings.cors_origins = ["localhost"]
    return settings
