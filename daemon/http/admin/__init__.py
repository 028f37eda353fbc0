"""The admin routes (/health, /props, /slots, /metrics, /sleep, /wake, /models/load and unload) and /openapi.json."""
