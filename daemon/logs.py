"""Structured logging with structlog.

On a terminal: human-readable lines. Under systemd (stderr is journald's
stream, which $JOURNAL_STREAM names): the same lines, each prefixed with the
syslog priority "<N>" that journald reads as the line's level
(`journalctl -p warning` filters on it). Otherwise (Docker, pipes, files): one
JSON object per line and nothing else, so jq, Fluent Bit and Vector parse each
line whole; the level is the object's "level".

log_format = "json" under journald: the same JSON lines behind the "<N>"
prefix. journald reads the prefix as the entry's PRIORITY and strips it before
storing (SyslogLevelPrefix=yes, systemd's default), so `journalctl -o cat | jq`
reads whole JSON and `journalctl -p warning` still filters. Anywhere else JSON
lines carry nothing in front.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_SYSLOG_PRIORITY = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2}


def writes_to_journald(stream) -> bool:
    """stream is the socket systemd connected as the unit's stdout/stderr: $JOURNAL_STREAM
    ("device:inode") names it. A stream redirected elsewhere (a pipe under systemd-run, a
    file) has another inode, so the prefix follows the stream, not the environment."""
    expected = os.environ.get("JOURNAL_STREAM", "")
    device, colon, inode = expected.partition(":")
    if not colon:
        return False
    try:
        info = os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):  # an in-memory stream (tests) has no descriptor
        return False
    return f"{info.st_dev}:{info.st_ino}" == f"{device}:{inode}"


class _JournaldPrefix:
    """Wraps a renderer: "<6>" before the line, from the method that logged it."""

    def __init__(self, renderer) -> None:
        self._renderer = renderer

    def __call__(self, logger, method_name: str, event_dict: dict) -> str:
        priority = _SYSLOG_PRIORITY.get(method_name, 6)
        return f"<{priority}>" + self._renderer(logger, method_name, event_dict)


def configure_logging(log_format: str = "auto", level: str = "info", stream=None) -> None:
    stream = stream or sys.stderr
    journald = writes_to_journald(stream)
    tty = stream.isatty()
    if log_format == "auto":
        log_format = "console" if tty or journald else "json"
    processors: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if log_format == "json":
        renderer = structlog.processors.JSONRenderer()
        processors.append(structlog.processors.format_exc_info)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=tty and not journald)
    processors.append(_JournaldPrefix(renderer) if journald else renderer)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str = "dormouse"):
    return structlog.get_logger(name)
