"""HTTP: the aiohttp app, the OpenAI routes, the admin routes, request schemas, OpenAPI."""
