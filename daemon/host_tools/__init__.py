"""Tools that run on the daemon's host for a client: llama-server's `--tools` and `--mcp-servers-*`.

Off unless the operator turns them on (`tools`, `mcp_servers` settings, or
llama-server's flags). They never touch a model: calling one neither wakes a
sleeping model nor takes a slot. builtin.py holds llama-server's seven
built-in tools, runtime.py where their files and commands live (this host, a
container, an ssh host), child.py the process each built-in call runs in,
mcp.py the MCP servers' stdio clients, and registry.py the list that GET /tools
answers and POST /tools dispatches on, with the bounds on calls.
"""
