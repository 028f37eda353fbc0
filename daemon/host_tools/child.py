"""One tool call, in its own process: `python -m daemon.host_tools.child`.

The daemon writes the call as one JSON object on stdin ({"tool", "params"
(cwd, runtime and resp_type already set from the headers), "stream"}) and
reads lines back, each a tag, a space and JSON: `chunk "text"` while a
streamed command runs, then one last line, `result {...}` (passed to the
client as it is, never decoded: it may be 43 MB of base64), `invalid
"message"` (a parameter of the wrong type: 400) or `failure "message"` (a
runtime that cannot be used, or a bug: 500). A process per call keeps the daemon's event loop free of file I/O,
regular expressions (a pattern that backtracks for minutes) and commands: the
daemon bounds the call by its deadline and kills the process group.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

from daemon.host_tools.builtin import RUN, ToolInputError
from daemon.host_tools.runtime import RUNNING_GROUPS, RuntimeSpecError, kill_group, tool_io


def _stop(signum: int, frame: object) -> None:
    """The daemon ends a call (its client left, its deadline passed): the command's own group goes too."""
    for group in list(RUNNING_GROUPS):
        kill_group(group)
    os._exit(1)


def _write(tag: str, payload: Any) -> None:
    sys.stdout.write(f"{tag} {json.dumps(payload, ensure_ascii=False)}\n")
    sys.stdout.flush()


def main() -> int:
    signal.signal(signal.SIGTERM, _stop)
    call = json.loads(sys.stdin.read())
    params = call["params"]
    emit = (lambda chunk: _write("chunk", chunk)) if call.get("stream") else None
    try:
        io = tool_io(params.get("runtime") or "", params.get("cwd") or "")
        result = RUN[call["tool"]](params, io, emit)
    except ToolInputError as exc:
        _write("invalid", str(exc))
        return 0
    except RuntimeSpecError as exc:
        _write("failure", str(exc))
        return 0
    except Exception as exc:  # noqa: BLE001 - a bug, or a path the OS refuses: named, not a bare "no answer"
        _write("failure", f"{call['tool']} failed: {type(exc).__name__}: {str(exc)[:500]}")
        return 0
    _write("result", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
