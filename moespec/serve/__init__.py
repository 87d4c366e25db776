"""An OpenAI-compatible HTTP server over the generator loop, speculating per request.

engine.py (bounded queue, one worker at batch size 1, cancellation between steps),
speculation.py (drafter and draft-length policy, as `moespec generate` builds them),
text.py (chat templates, stop strings), protocol.py (the OpenAI wire format), metrics.py
(Prometheus text), app.py (FastAPI routes), server.py (loading, uvicorn). FastAPI and uvicorn
are the optional extra `moespec[serve]`; only app.py and server.py's `serve` import them.
"""

from moespec.serve.engine import Engine, Job, QueueFull
from moespec.serve.server import load_engine, serve

__all__ = ["Engine", "Job", "QueueFull", "load_engine", "serve"]
