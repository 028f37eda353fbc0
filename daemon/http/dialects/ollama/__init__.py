"""Ollama: /api/chat, /api/generate, /api/embed and the model routes (/api/tags, /api/show...)."""
