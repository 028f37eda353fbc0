"""The HTTP layer: one request pipeline, the dialects as translators around it.

    app.py, keys.py, errors.py, cold_start.py, agent.py
        the aiohttp app and its access middleware, the app's keys and the model a
        request names, error bodies in each dialect's shape, the cold-start
        headers, the HAProxy agent check (its own TCP port).
    core/
        knows no dialect: a body becomes the internal job (job.py: validated and
        bounded once), the job runs (run.py), and what the worker sends back
        (Tokens, then Done or a JobFailure) is read per choice into typed
        events (events.py): Start, ReasoningDelta, TextDelta, ToolCallDelta
        (thinking, tool calls and held-back text read out as it streams), End
        (its reason, the calls, the counts) or Failure.
    dialects/<name>/
        one package per dialect, each of the same two halves: its request to the
        job, and the job's events to its answer (one body, or a stream).
        openai (chat and completions), responses, anthropic (Messages), ollama,
        llama_server (llama-server's native routes).
    admin/
        the admin routes and the OpenAPI document.
    status/
        the status page at / and /ui, and its static files.
    vertex_predict.py
        Vertex AI's prediction route: each instance sent to this daemon again as
        the request of the route it names (so it knows the routes, not the job).

Arrows point down only: app -> admin, status, vertex_predict, dialects -> core -> keys, errors.
tests/unit/test_layout.py holds the tree to it (no import circle, the core
names no dialect, no file over 600 lines).
"""
