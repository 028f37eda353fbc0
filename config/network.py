"""The addresses the daemon serves and the origins it allows: how they are read and compared.

`host` may name several addresses, separated by commas (llama-server's `--host 127.0.0.1,::1`):
the daemon serves each. Off loopback (any one of them) the admin routes need admin_key.
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from config.settings import Settings

MAX_HOSTS = 16


def host_list(host: str) -> list[str]:
    """The addresses in `host` ("127.0.0.1,::1" -> two), in order, without repeats; an empty
    `host` is [""]: every interface (asyncio's create_server), which is not loopback."""
    hosts: list[str] = []
    for part in host.split(","):
        part = part.strip()
        if part and part not in hosts:
            hosts.append(part)
    return hosts or [""]


def normalize_host(name: str, strict: bool = False) -> str:
    """A host name as compared with allowed_hosts: lower case, no trailing dot,
    IPv6 without brackets and in its short form. `strict` refuses what is not
    a host name (a port, a scheme, a wildcard); lenient returns "" for it."""
    host = name.strip().lower().rstrip(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if ":" in host:
        try:
            return ipaddress.IPv6Address(host).compressed
        except ValueError:
            if strict:
                raise ValueError(f"{name!r} is not a host name (give names without port or scheme)") from None
            return ""
    if not host or len(host) > 253 or not all(ch.isascii() and (ch.isalnum() or ch in "-._") for ch in host):
        if strict:
            raise ValueError(f"{name!r} is not a host name (letters, digits, '-', '.'; no port, scheme or wildcard)")
        return ""
    return host


def normalize_origin(origin: str) -> str:
    """'https://ui.example:8443' as browsers send it in Origin (no path, the
    default port left out), or '*', or 'localhost' (llama-server's keyword:
    every origin on a loopback host, any port); anything else is refused."""
    from yarl import URL

    origin = origin.strip()
    if origin in ("*", "localhost"):
        return origin
    try:
        url = URL(origin)
    except (ValueError, TypeError):
        url = None
    if url is None or url.scheme not in ("http", "https") or not url.host or url.path not in ("", "/") \
            or url.query_string or url.fragment or url.user:
        raise ValueError(f"{origin[:100]!r} is not an origin (scheme://host[:port], e.g. https://ui.example:8443, or *)")
    host = normalize_host(url.host, strict=True)
    shown = f"[{host}]" if ":" in host else host
    return f"{url.scheme}://{shown}" + ("" if url.is_default_port() else f":{url.port}")


def is_loopback_host(host: str) -> bool:
    """An address literal in 127.0.0.0/8 or ::1 (also ::ffff:127.x), or "localhost": nothing
    beyond this machine can reach it. A host name is not resolved (it may resolve elsewhere tomorrow)."""
    host = host.strip().strip("[]").rstrip(".").lower()
    try:
        address = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return host == "localhost"
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def admin_key_problem(host: str, port: int, settings: "Settings") -> str | None:
    """Why the daemon may not serve on host:port with these settings (no admin_key off loopback), or None.
    `host` may name several addresses: every one must be loopback, or admin_key set."""
    if settings.admin_key is not None and settings.admin_key.get_secret_value():
        return None
    host = next((h for h in host_list(host) if not is_loopback_host(h)), None)
    if host is None:
        return None
    return (f"admin_key is required when host is {host!r}, not a loopback address: without it anyone who can reach "
            f"port {port} can put the models to sleep, wake and load them. Set admin_key (DORMOUSE_ADMIN_KEY, or "
            f"--admin-key), or bind 127.0.0.1")
