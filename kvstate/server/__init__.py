"""`kvstate serve`: an OpenAI-compatible HTTP server over the engine core, and the explorer's API.

- `app.create_app(...)`: the FastAPI application (OpenAI routes, /health, /metrics, extra routers
  such as the explorer's, the static explorer at `/`).
- `engine_loop.EngineLoop`: the one background thread that owns the engine and steps it.
- `openai_routes`, `schemas`, `protocol`: the OpenAI endpoints, their request bodies, their replies.
- `metrics`: Prometheus text from the engine's counters and pool occupancy.

FastAPI, uvicorn and prometheus-client come with the `serve` extra: `pip install kvstate[serve]`.
"""
