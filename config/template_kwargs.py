"""The server's chat template variables (`chat_template_kwargs`): checked once, at load.

llama-server's --chat-template-kwargs and --reasoning off set template variables for every chat
prompt (enable_thinking = false turns thinking off in the templates that read it); a request's own
chat_template_kwargs win over them. The bounds are a request's (daemon/http/core/conversation.py):
a config file is trusted no more than a body, and every prompt carries these values.
"""

from __future__ import annotations

import json
from typing import Any

MAX_ENTRIES = 64
MAX_BYTES = 64 * 1024  # all of them, as JSON
# Variables the server sets itself: a setting may not replace them (as worker/chat.py's RESERVED_VARIABLES).
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def check_template_kwargs(value: Any) -> dict[str, Any]:
    """`value` as a table of template variables, or ValueError that names what is wrong."""
    if isinstance(value, str):  # an environment variable or a command line gives JSON text
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"must be a JSON object: {str(exc)[:80]}") from None
    if not isinstance(value, dict):
        raise ValueError(f"must be a table of template variables, got {type(value).__name__}")
    if len(value) > MAX_ENTRIES:
        raise ValueError(f"at most {MAX_ENTRIES} variables, got {len(value)}")
    for key, item in value.items():
        if not isinstance(key, str) or not 0 < len(key) <= 128 or key in RESERVED:
            raise ValueError(f"{str(key)[:32]!r} is not a template variable the server may set (1 to 128 "
                             f"characters; not one of {', '.join(sorted(RESERVED))})")
        if key == "enable_thinking" and not isinstance(item, bool):
            raise ValueError(f"enable_thinking must be true or false, got {type(item).__name__}")
    try:
        size = len(json.dumps(value))
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"must hold JSON values only: {str(exc)[:80]}") from None
    if size > MAX_BYTES:
        raise ValueError(f"at most {MAX_BYTES} bytes of JSON, got {size}")
    return value
