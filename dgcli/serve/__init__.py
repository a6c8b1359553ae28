"""`dgemma serve`: an OpenAI-compatible HTTP server over the batched engine.

protocol.py (request fields in, reply objects out), output.py (one answer's append-only text), worker.py
(the thread that owns the engine), metrics.py (Prometheus text), app.py (the routes), run.py (uvicorn and
a clean stop). The layer imports runtime, sampling and text; only cli imports it.
"""
