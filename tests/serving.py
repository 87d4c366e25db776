"""Helpers for the server's tests: an engine on a tiny checkpoint, a real uvicorn server on a
free loopback port, and parsers for server-sent events and the Prometheus text format."""

import json
import re
import threading
from contextlib import contextmanager

PROMETHEUS_SAMPLE = re.compile(
    r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?P<labels>[a-zA-Z_][a-zA-Z0-9_]*="[^"]*"'
    r'(,[a-zA-Z_][a-zA-Z0-9_]*="[^"]*")*)\})? (?P<value>NaN|[-+]?[0-9.e+-]+)$'
)


def tiny_engine(directory, **settings):
    """An fp32 engine on a test checkpoint, drafted by itself unless told otherwise."""
    from moespec.serve import load_engine

    settings.setdefault("draft", str(directory))
    return load_engine(str(directory), dtype="fp32", **settings)


@contextmanager
def running_server(engine):
    """uvicorn in a thread on a socket bound to 127.0.0.1:0; yields the base URL. The socket
    listens before the thread starts, so a client may connect at once."""
    import uvicorn

    from moespec.serve.app import create_app
    from moespec.serve.server import bind

    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(engine), log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        engine.resume()
        server.should_exit = True
        thread.join(timeout=30)
        engine.close()
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


def sse_events(lines) -> list:
    """The data payloads of a server-sent event stream: JSON objects, and "[DONE]" as is."""
    events = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        payload = line[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def prometheus_samples(text: str) -> dict[str, float]:
    """{'name{labels}': value} of an exposition text; every line must be well formed and every
    sample's family declared by a TYPE line before it."""
    declared, samples = set(), {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge"), line
            declared.add(name)
            continue
        match = PROMETHEUS_SAMPLE.match(line)
        assert match, f"not a Prometheus sample line: {line!r}"
        assert match["name"] in declared, f"{match['name']} has no TYPE line"
        key = match["name"] + (f"{{{match['labels']}}}" if match["labels"] else "")
        samples[key] = float(match["value"])
    return samples
