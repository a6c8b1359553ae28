"""`dgemma serve`: an OpenAI-compatible HTTP server over the engine: protocol.py (the wire format), worker.py
(the thread that owns the engine), metrics.py, app.py (the routes), run.py (uvicorn and a clean stop).
Only cli imports it.
"""
