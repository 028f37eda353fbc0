"""Structured logging with structlog.

On a terminal: human-readable lines. Otherwise (systemd, pipes): one JSON
object per line, prefixed with the syslog priority "<N>" that journald reads
as the line's level.
"""

from __future__ import annotations

import logging
import sys

import structlog

_SYSLOG_PRIORITY = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2}


def _journald_prefix(logger, method_name: str, event_dict: dict) -> dict:
    event_dict["_priority"] = _SYSLOG_PRIORITY.get(method_name, 6)
    return event_dict


class _PriorityJSONRenderer:
    def __init__(self) -> None:
        self._json = structlog.processors.JSONRenderer()

    def __call__(self, logger, method_name: str, event_dict: dict) -> str:
        priority = event_dict.pop("_priority", 6)
        return f"<{priority}>" + self._json(logger, method_name, event_dict)


def configure_logging(log_format: str = "auto", level: str = "info", stream=None) -> None:
    stream = stream or sys.stderr
    if log_format == "auto":
        log_format = "console" if stream.isatty() else "json"
    processors: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if log_format == "json":
        processors += [_journald_prefix, structlog.processors.format_exc_info, _PriorityJSONRenderer()]
    else:
        processors += [structlog.dev.ConsoleRenderer(colors=stream.isatty())]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str = "dormouse"):
    return structlog.get_logger(name)
