"""Vertex AI's custom-container contract: the AIP_* variables a prediction container is started with.

Vertex AI runs a container with AIP_MODE=PREDICTION and tells it where to listen (AIP_HTTP_PORT), where
predictions are posted (AIP_PREDICT_ROUTE) and where it is probed (AIP_HEALTH_ROUTE):
https://cloud.google.com/vertex-ai/docs/predictions/custom-container-requirements. llama-server reads the
same variables (its GCP compat), so a container built on either serves unchanged. Read by `dormouse serve`
over its command line: the platform decides the port, as it does for llama-server (which warns and obeys).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class VertexAIError(ValueError):
    """An AIP_* variable that cannot be served, named."""


def _route(environ: Mapping[str, str], name: str, default: str | None) -> str | None:
    value = environ.get(name, "").strip()
    if not value:
        return default
    return value if value.startswith("/") else "/" + value  # as llama-server: a leading slash is added


# the setting -> the AIP_* variable it comes from (for an error that names it)
VERTEX_VARIABLES = {"port": "AIP_HTTP_PORT", "predict_route": "AIP_PREDICT_ROUTE", "predict_health_route": "AIP_HEALTH_ROUTE"}


def vertex_settings(environ: Mapping[str, str]) -> tuple[dict[str, Any], list[str]]:
    """The settings AIP_MODE=PREDICTION implies (none without it), and a note for each."""
    if environ.get("AIP_MODE", "") != "PREDICTION":
        return {}, []
    port_text = environ.get("AIP_HTTP_PORT", "").strip() or "8080"
    if not (port_text.isascii() and port_text.isdigit() and 0 < int(port_text) < 65536):
        raise VertexAIError(f"AIP_HTTP_PORT {port_text[:40]!r} is not a TCP port (1-65535)")
    settings: dict[str, Any] = {"port": int(port_text), "predict_route": _route(environ, "AIP_PREDICT_ROUTE", "/predict")}
    health = _route(environ, "AIP_HEALTH_ROUTE", None)
    if health is not None:
        settings["predict_health_route"] = health
    notes = [f"AIP_MODE=PREDICTION (Vertex AI): port {settings['port']} (AIP_HTTP_PORT, over --port), predictions on "
             f"POST {settings['predict_route']}" + (f", /health also on GET {health}" if health else "")]
    return settings, notes
