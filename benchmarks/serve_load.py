"""Load and fault test of `moespec serve`: many clients, bad input and overload at once.

    python benchmarks/serve_load.py --out benchmarks/results/serve_load_demo.json

Starts the real server as a subprocess (`python -m moespec serve --port 0 --max-queue Q`, the
demo pair unless --model; `--max-request-bytes B` passed when the server has that option),
then for --seconds runs --clients concurrent clients (httpx, one event loop), each sending one
request after another, mixed: /v1/completions and /v1/chat/completions, streaming and not,
short varied prompts, max_tokens 16-64, temperature 0 or above; clients that read a few chunks
of a stream and close it; clients that abandon a non-streaming request after a few hundred ms;
bad input (invalid JSON, invalid UTF-8, 100,000-deep nesting, strings or booleans for numbers,
negative or huge max_tokens, n = 2, an unknown model, ...: each expected to be refused with a
4xx and an OpenAI error body {"error": {"message", "type", "param", "code"}}, or served where
issue 56 says it must be, e.g. null fields); after the warm-up, --oversized bodies of
--oversized-mb MB (expected: 413, fast), each sent on a plain socket that reads while it sends
(the refusal time: first byte sent to status line) and then with httpx as ordinary clients send
(does the 413 reach them?), and one burst of --burst simultaneous requests past the queue
(expected: some 429 with Retry-After). A client answered 429 waits Retry-After
(capped at --retry-cap s) before its next request.

Throughout, a process of its own polls GET /health every 50 ms on its own connections;
each probe is sent when due, whether or not earlier ones have answered, and its latency counts
from when it was due (a stall of S seconds shows as S / 0.05 slow probes, not one). Another
thread reads the server's RSS (/proc/PID/status VmRSS) every second. After the load: the
queue must drain, /metrics is read, and the server is stopped with SIGINT and must exit 0.

Reports (JSON, and a table on stdout) requests by kind and outcome, latency and time to first
token p50/p99 per kind, /health p50/p99/max (overall and per 10 s window), the 413 refusal
times, RSS over time and its growth from the end of the warm-up to the end, and the targets of
issue 56 each as met or missed. Exits 1 when any answer was a 5xx (or an error inside a
streamed 200), any request failed on the connection or timed out, or the server died or did
not exit cleanly; the JSON is written either way.
"""

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing
import os
import random
import re
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from moespec.files import check_writable, write_json  # noqa: E402
from moespec.provenance import provenance  # noqa: E402

PROMPTS = [
    "def fibonacci(n):",
    "class LRUCache:\n    def __init__(self, capacity):",
    "import os\n\ndef walk_files(root):",
    "def parse_args(argv=None):",
    "# Sort a list of dicts by a key\n",
    "async def fetch(session, url):",
    "for i in range(10):",
    "def is_prime(n: int) -> bool:",
    "with open(path) as f:",
    "The quick brown fox",
    "Once upon a time, in a small town,",
    "SELECT name, count(*) FROM users",
    "def merge_sorted(a, b):",
    "try:\n    import numpy as np\nexcept ImportError:",
    "if __name__ == '__main__':",
    "Dear team, the release",
]
QUESTIONS = [
    "Write a function that reverses a string.",
    "What is a hash map?",
    "hello",
    "Explain recursion in one sentence.",
    "List three prime numbers.",
    "How do I read a file in Python?",
    "Say something short.",
    "What does HTTP 429 mean?",
]
SYSTEMS = ["You are a helpful assistant.", "Answer briefly.", None, None]

# kind -> (weight, path, streaming)
KINDS = {
    "completion": (3.0, "/v1/completions", False),
    "completion_stream": (3.0, "/v1/completions", True),
    "chat": (2.0, "/v1/chat/completions", False),
    "chat_stream": (2.0, "/v1/chat/completions", True),
    "disconnect_stream": (1.5, None, True),  # read 1-3 chunks, then close
    "abandon": (0.5, None, False),  # non-streaming, given up after 50-300 ms
    "bad_input": (1.0, None, False),
}

REFUSE, SERVE, EITHER = "refuse", "serve", "refuse_or_serve"
OK_BODY = {"prompt": "def f(x):", "max_tokens": 8, "temperature": 0}
CHAT_OK = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}


def bad_inputs() -> list[dict]:
    """Bodies a careless client or an attacker sends, and what issue 56 expects of each."""
    cases = [
        ("invalid_json", "/v1/completions", b'{"prompt": "def f(x):", "max_tokens": 8', REFUSE),
        (
            "invalid_utf8",
            "/v1/completions",
            b'{"prompt": "caf\xe9 \xff\xfe \xc3\x28", "max_tokens": 8}',
            REFUSE,
        ),
        (
            "deep_nesting",
            "/v1/completions",
            b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b', "max_tokens": 8}',
            REFUSE,
        ),
        ("deep_nesting_unclosed", "/v1/completions", b"[" * 100_000, REFUSE),
        ("not_an_object", "/v1/completions", b'["prompt", "max_tokens"]', REFUSE),
        ("empty_body", "/v1/completions", b"", REFUSE),
        ("missing_prompt", "/v1/completions", {"max_tokens": 8}, REFUSE),
        ("string_max_tokens", "/v1/completions", {**OK_BODY, "max_tokens": "12"}, REFUSE),
        ("bool_max_tokens", "/v1/completions", {**OK_BODY, "max_tokens": True}, REFUSE),
        ("string_temperature", "/v1/completions", {**OK_BODY, "temperature": "0.5"}, REFUSE),
        ("float_max_tokens", "/v1/completions", {**OK_BODY, "max_tokens": 8.5}, REFUSE),
        ("negative_max_tokens", "/v1/completions", {**OK_BODY, "max_tokens": -5}, REFUSE),
        ("huge_max_tokens", "/v1/completions", {**OK_BODY, "max_tokens": 10**12}, REFUSE),
        ("huge_int_max_tokens", "/v1/completions", {**OK_BODY, "max_tokens": 10**30}, REFUSE),
        ("n_2", "/v1/completions", {**OK_BODY, "n": 2}, EITHER),  # implement or refuse
        ("unknown_model", "/v1/completions", {**OK_BODY, "model": "no-such-model"}, REFUSE),
        ("out_of_vocab_ids", "/v1/completions", {**OK_BODY, "prompt": [10**9]}, REFUSE),
        ("long_stop", "/v1/completions", {**OK_BODY, "stop": ["x" * 20_000] * 4}, REFUSE),
        ("chat_no_messages", "/v1/chat/completions", {**CHAT_OK, "messages": []}, REFUSE),
        (
            "chat_bad_role",
            "/v1/chat/completions",
            {**CHAT_OK, "messages": [{"role": "wizard", "content": "hi"}]},
            REFUSE,
        ),
        (
            "chat_tools",
            "/v1/chat/completions",
            {**CHAT_OK, "tools": [{"type": "function", "function": {"name": "f"}}]},
            REFUSE,
        ),
        (
            "null_fields",
            "/v1/completions",
            {
                **OK_BODY,
                "temperature": None,
                "top_p": None,
                "stream": None,
                "n": None,
                "stop": None,
                "seed": None,
                "echo": None,
                "logprobs": None,
            },
            SERVE,
        ),
        ("tiny_temperature", "/v1/completions", {**OK_BODY, "temperature": 1e-40}, SERVE),
    ]
    return [{"case": c, "path": p, "body": b, "expect": e} for c, p, b, e in cases]


# -- helpers ----------------------------------------------------------------------------------
def percentile(values, q: float):
    """Nearest-rank percentile (q in [0, 1]); None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(-(-q * len(ordered) // 1)) - 1))]


def ms_stats(seconds) -> dict:
    values = [s for s in seconds if s is not None]
    rnd = lambda v: None if v is None else round(v * 1e3, 2)  # noqa: E731
    return {
        "count": len(values),
        "p50_ms": rnd(percentile(values, 0.5)),
        "p99_ms": rnd(percentile(values, 0.99)),
        "max_ms": rnd(max(values) if values else None),
    }


def scrub(text: str) -> str:
    """Text for the results: no paths of this machine."""
    text = str(text).replace(str(REPO), ".")
    for prefix in sorted({sys.prefix, sys.base_prefix, str(Path.home())}, key=len, reverse=True):
        text = text.replace(prefix, "<python>" if "python" in prefix.lower() else "~")
    return text


def error_shape_ok(data: bytes) -> bool:
    """An OpenAI error body: {"error": {"message": str, "type": str, "param", "code"}}."""
    try:
        error = json.loads(data)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (
        isinstance(error, dict)
        and isinstance(error.get("message"), str)
        and isinstance(error.get("type"), str)
        and "param" in error
        and "code" in error
    )


def error_message(data: bytes) -> str:
    try:
        return str(json.loads(data)["error"]["message"])[:200]
    except (ValueError, KeyError, TypeError):
        return data[:200].decode("utf-8", "replace")


def parse_retry_after(value):
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return seconds if seconds >= 0 else None


# -- the server -------------------------------------------------------------------------------
class Server:
    """`python -m moespec serve` as a subprocess: its URL from the first stdout line, its
    stderr kept (the last lines and every exception line), stopped with SIGINT."""

    LISTENING = re.compile(r"^moespec serve: (?P<name>.*) on (?P<url>https?://\S+)\s*$")

    def __init__(self, command: list[str]):
        self.command = command
        self.proc = subprocess.Popen(
            command,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
        )
        self.pid = self.proc.pid
        self.first_line: deque[str] = deque()
        self.line_ready = threading.Event()
        self.stderr_tail: deque[str] = deque(maxlen=200)
        self.stderr_lines = 0
        self.exceptions: Counter = Counter()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self):
        for line in self.proc.stdout:
            if not self.line_ready.is_set():
                self.first_line.append(line.rstrip("\n"))
                self.line_ready.set()
        self.line_ready.set()

    def _read_stderr(self):
        for line in self.proc.stderr:
            self.stderr_lines += 1
            self.stderr_tail.append(line.rstrip("\n"))
            if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b", line):
                self.exceptions[scrub(line.strip())[:200]] += 1

    def wait_listening(self, timeout: float) -> tuple[str, str]:
        if not self.line_ready.wait(timeout) or not self.first_line:
            tail = "\n".join(self.stderr_tail)
            raise RuntimeError(f"the server did not start (exit {self.proc.poll()}):\n{tail}")
        line = self.first_line[0]
        match = self.LISTENING.match(line)
        if match is None:
            raise RuntimeError(f"unexpected first line from the server: {line!r}")
        return match["name"], match["url"]

    def stop(self, timeout: float = 60.0) -> dict:
        """SIGINT, then wait; SIGKILL if it does not go within `timeout`."""
        if self.proc.poll() is not None:
            return {"signalled": False, "exit_code": self.proc.returncode, "stop_seconds": None}
        start = time.perf_counter()
        self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(timeout)
            killed = False
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code, killed = self.proc.wait(), True
        return {
            "signalled": True,
            "exit_code": code,
            "killed_after_timeout": killed,
            "stop_seconds": round(time.perf_counter() - start, 3),
        }


def server_options() -> str:
    """The server's --help text (to see which options this version has)."""
    return subprocess.run(
        [sys.executable, "-m", "moespec", "serve", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


# -- probes (threads) -------------------------------------------------------------------------
class Sampler(threading.Thread):
    """Every `interval` s: the server's RSS (MB) and CPU seconds; notices if it has died."""

    def __init__(self, server: Server, interval: float = 1.0):
        super().__init__(daemon=True)
        self.server, self.interval = server, interval
        self.samples: list[tuple[float, float, float]] = []  # (time, rss MB, cpu s)
        self.stopping = threading.Event()
        self.died = threading.Event()
        self.died_at = None
        self.ticks = os.sysconf("SC_CLK_TCK")

    def sample(self):
        pid = self.server.pid
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        rss = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        fields = stat.rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / self.ticks  # utime, stime
        return (time.perf_counter(), int(rss[1]) / 1024 if rss else float("nan"), cpu)

    def run(self):
        while not self.stopping.is_set():
            if self.server.proc.poll() is not None:
                self.died_at = time.perf_counter()
                self.died.set()
                return
            reading = self.sample()
            if reading is not None:
                self.samples.append(reading)
            self.stopping.wait(self.interval)


class HealthProbe:
    """GET /health every `period` s from a process of its own (the clients' work cannot delay
    it), each probe sent when due whether or not earlier ones have answered (as independent
    clients would); latency from when it was due, so a stall weighs as long as it lasts."""

    def __init__(self, url: str, period: float = 0.05, timeout: float = 30.0):
        self.url, self.period, self.timeout = url, period, timeout
        self.probes: list[tuple[float, float, float, int | None]] = []  # due, sent, done, status
        self.errors: Counter = Counter()
        context = multiprocessing.get_context("spawn")
        self.stopping = context.Event()
        self.results, child = context.Pipe(duplex=False)
        self.process = context.Process(
            target=probe_health, args=(url, period, timeout, self.stopping, child), daemon=True
        )

    def start(self):
        self.process.start()

    def stop(self):
        """Stop probing and take the probes (time.perf_counter is system-wide on Linux)."""
        self.stopping.set()
        if self.results.poll(self.timeout + 10):
            self.probes, errors = self.results.recv()
            self.errors.update(errors)
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()


def probe_health(url, period, timeout, stopping, results):
    probes, errors = [], Counter()

    async def probe(http, due):
        sent = time.perf_counter()
        try:
            status = (await http.get("/health")).status_code
        except httpx.HTTPError as error:
            errors[type(error).__name__] += 1
            status = None
        probes.append((due, sent, time.perf_counter(), status))

    async def probe_all():
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=8)
        async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
            pending = set()
            start = time.perf_counter()
            for i in itertools.count():
                due = start + i * period
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                if stopping.is_set():
                    break
                task = asyncio.ensure_future(probe(http, due))
                pending.add(task)
                task.add_done_callback(pending.discard)
            if pending:
                await asyncio.wait(pending, timeout=timeout)

    asyncio.run(probe_all())
    results.send((probes, dict(errors)))


# -- requests ---------------------------------------------------------------------------------
class Load:
    """Makes the requests and keeps one record per request."""

    def __init__(self, args, t0: float, rng: random.Random):
        self.args, self.t0, self.rng = args, t0, rng
        self.records: list[dict] = []
        self.cases = bad_inputs()
        self.case_cycle = itertools.cycle(range(len(self.cases)))
        names = list(KINDS)
        self.kind_names, self.kind_weights = names, [KINDS[k][0] for k in names]
        self.loop_lag: list[float] = []

    # what to send
    def sampling(self) -> dict:
        rng = self.rng
        body = {"max_tokens": rng.randint(16, 64)}
        body["temperature"] = rng.choice([0, 0, 0.7, 1.0])
        if body["temperature"] and rng.random() < 0.5:
            body["seed"] = rng.randrange(2**31)
        return body

    def completion_body(self) -> dict:
        prompt = self.rng.choice(PROMPTS)
        if self.rng.random() < 0.3:
            prompt = f"# {self.rng.randrange(1000)}\n{prompt}"
        return {"prompt": prompt, **self.sampling()}

    def chat_body(self) -> dict:
        messages = []
        system = self.rng.choice(SYSTEMS)
        if system:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": self.rng.choice(QUESTIONS)})
        return {"messages": messages, **self.sampling()}

    def next_request(self) -> dict:
        kind = self.rng.choices(self.kind_names, self.kind_weights)[0]
        if kind == "bad_input":
            case = self.cases[next(self.case_cycle)]
            return {"kind": kind, "stream": False, **case}
        if kind in ("disconnect_stream", "abandon"):
            chat = self.rng.random() < 0.5
            body = self.chat_body() if chat else self.completion_body()
            body["max_tokens"] = 64
            body["stream"] = kind == "disconnect_stream"
            request = {
                "kind": kind,
                "path": "/v1/chat/completions" if chat else "/v1/completions",
                "body": body,
                "stream": kind == "disconnect_stream",
            }
            if kind == "disconnect_stream":
                request["close_after"] = self.rng.randint(1, 3)
            else:
                request["abandon_after"] = self.rng.uniform(0.05, 0.3)
            return request
        _, path, streaming = KINDS[kind]
        body = self.chat_body() if "chat" in path else self.completion_body()
        if streaming:
            body["stream"] = True
        return {"kind": kind, "path": path, "body": body, "stream": streaming}

    # how it went
    async def send(self, http: httpx.AsyncClient, request: dict) -> dict:
        start = time.perf_counter()
        record = {
            "kind": request["kind"],
            "case": request.get("case"),
            "t": start - self.t0,
            "status": None,
            "outcome": None,
            "latency": None,
            "ttft": None,
        }
        try:
            if "abandon_after" in request:
                try:
                    await asyncio.wait_for(
                        self._exchange(http, request, record, start), request["abandon_after"]
                    )
                except TimeoutError:
                    record["outcome"] = "cancelled_by_client"
            else:
                await self._exchange(http, request, record, start)
        except httpx.TimeoutException as error:
            record["outcome"], record["detail"] = "timeout", type(error).__name__
        except httpx.HTTPError as error:
            record["outcome"] = "connection_error"
            record["detail"] = f"{type(error).__name__}: {error}"[:200]
        record["latency"] = time.perf_counter() - start
        if record["outcome"] is None:
            record["outcome"] = "unclassified"
        if "body" in request and not isinstance(request["body"], bytes):
            record["request"] = request_summary(request)
        self.records.append(record)
        return record

    async def _exchange(self, http, request, record, start):
        body = request["body"]
        if isinstance(body, bytes):
            kwargs = {"content": body, "headers": {"content-type": "application/json"}}
        else:
            kwargs = {"json": body}
        response = await http.send(
            http.build_request("POST", request["path"], **kwargs), stream=True
        )
        try:
            record["status"] = status = response.status_code
            if status == 200 and request["stream"]:
                await self._read_stream(response, request, record, start)
                return
            data = await response.aread()
            if status == 200:
                record["outcome"] = check_answer(data, request)
                if record["outcome"] == "completed":
                    record["tokens"] = completion_tokens(data)
                else:
                    record["detail"] = data[:200].decode("utf-8", "replace")
            elif status == 429:
                record["outcome"] = "rate_limited"
                record["retry_after"] = parse_retry_after(response.headers.get("retry-after"))
                record["error_shape_ok"] = error_shape_ok(data)
            elif 400 <= status < 500:
                record["outcome"] = "refused"
                record["error_shape_ok"] = error_shape_ok(data)
                record["detail"] = error_message(data)
            elif status >= 500:
                record["outcome"] = "server_error"
                record["error_shape_ok"] = error_shape_ok(data)
                record["detail"] = error_message(data)
            else:
                record["outcome"] = "unexpected_status"
        finally:
            await response.aclose()

    async def _read_stream(self, response, request, record, start):
        chunks, finished, done = 0, False, False
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            record["outcome"] = "bad_response"
            record["detail"] = f"not an event stream: {response.headers.get('content-type')}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                done = True
                break
            try:
                chunk = json.loads(payload)
            except ValueError:
                record["outcome"], record["detail"] = "bad_response", payload[:200]
                return
            if "error" in chunk:
                record["outcome"] = "stream_error"
                record["detail"] = str(chunk["error"].get("message"))[:200]
                return
            try:
                choice = chunk["choices"][0]
            except (KeyError, IndexError, TypeError):
                record["outcome"], record["detail"] = "bad_response", payload[:200]
                return
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if text:
                chunks += 1
                if record["ttft"] is None:
                    record["ttft"] = time.perf_counter() - start
            if choice.get("finish_reason"):
                finished = True
                usage = chunk.get("usage") or {}
                record["tokens"] = usage.get("completion_tokens")
            close_after = request.get("close_after")
            if close_after and chunks >= close_after and not finished:
                record["outcome"] = "cancelled_by_client"
                return  # closing the unread response closes the connection
        if done and finished:
            record["outcome"] = "completed"
        else:
            record["outcome"] = "truncated_stream"
            record["detail"] = f"[DONE] {'seen' if done else 'missing'}, finish {finished}"


def request_summary(request: dict) -> dict:
    body = request["body"]
    summary = {"path": request["path"], "stream": request["stream"]}
    if isinstance(body, dict):
        for key in ("max_tokens", "temperature", "seed", "model", "n"):
            if key in body:
                summary[key] = body[key]
        if isinstance(body.get("prompt"), str):
            summary["prompt"] = body["prompt"][:60]
        if isinstance(body.get("messages"), list) and body["messages"]:
            last = body["messages"][-1]
            if isinstance(last, dict) and isinstance(last.get("content"), str):
                summary["message"] = last["content"][:60]
    return summary


def check_answer(data: bytes, request: dict) -> str:
    """A 200 non-streaming body: choices with text and a finish reason."""
    try:
        answer = json.loads(data)
        choices = answer["choices"]
        for choice in choices:
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            if not isinstance(text, str) or choice.get("finish_reason") not in ("stop", "length"):
                return "bad_response"
    except (ValueError, KeyError, TypeError, IndexError):
        return "bad_response"
    return "completed" if choices else "bad_response"


def completion_tokens(data: bytes):
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return json.loads(data)["usage"]["completion_tokens"]
    return None


# -- the run ----------------------------------------------------------------------------------
async def client_loop(load: Load, http, stop_at: float, died: threading.Event, jitter: float):
    await asyncio.sleep(jitter)
    while time.perf_counter() < stop_at and not died.is_set():
        record = await load.send(http, load.next_request())
        if record["outcome"] == "rate_limited":
            wait = record.get("retry_after")
            wait = 1.0 if wait is None else wait
            await asyncio.sleep(min(wait, load.args.retry_cap) + load.rng.uniform(0, 0.25))
        elif record["outcome"] in ("connection_error", "timeout"):
            await asyncio.sleep(0.5)


async def burst(load: Load, url: str, at: float, count: int, timeout: float) -> dict:
    """`count` non-streaming requests sent at once on as many connections."""
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
        requests = []
        for _ in range(count):
            body = {"prompt": load.rng.choice(PROMPTS), "max_tokens": 16, "temperature": 0}
            requests.append({"kind": "burst", "path": "/v1/completions", "body": body})
            requests[-1]["stream"] = False
        start = time.perf_counter()
        records = await asyncio.gather(*(load.send(http, r) for r in requests))
        seconds = time.perf_counter() - start
    statuses = Counter(str(r["status"]) for r in records)
    limited = [r for r in records if r["outcome"] == "rate_limited"]
    accepted = [r for r in records if r["status"] == 200]
    return {
        "at_s": round(start - load.t0, 2),
        "requests": count,
        "statuses": dict(statuses),
        "outcomes": dict(Counter(r["outcome"] for r in records)),
        "rate_limited": len(limited),
        "rate_limited_with_retry_after": sum(r.get("retry_after") is not None for r in limited),
        "retry_after_s": dict(Counter(str(r.get("retry_after")) for r in limited)),
        "accepted": len(accepted),
        "accepted_completed": sum(r["outcome"] == "completed" for r in accepted),
        "accepted_latency": ms_stats([r["latency"] for r in accepted]),
        "refusal_latency_429": ms_stats([r["latency"] for r in limited]),
        "seconds": round(seconds, 3),
    }


def oversized_body(megabytes: float) -> bytes:
    """A valid completion request whose prompt makes the body `megabytes` MB (10**6 bytes)."""
    head, tail = b'{"prompt": "', b'", "max_tokens": 16}'
    sentence = b"The quick brown fox jumps over the lazy dog. "
    size = int(megabytes * 1e6) - len(head) - len(tail)
    return head + (sentence * (size // len(sentence) + 1))[:size] + tail


def raw_send(url: str, body: bytes, timeout: float) -> dict:
    """POST `body` on a plain socket, reading while sending (as a careful client does), so an
    early answer is seen even when the server stops reading: the time to its status line,
    and how much of the body had gone by then."""
    parts = httpx.URL(url)
    entry: dict = {}
    start = time.perf_counter()
    try:
        sock = socket.create_connection((parts.host, parts.port), timeout=10)
    except OSError as error:
        return {"error": f"connect: {type(error).__name__}: {error}"}
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {parts.host}:{parts.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        start = time.perf_counter()
        sock.sendall(head)
        sock.setblocking(False)
        view, sent, answer, writing = memoryview(body), 0, b"", True
        deadline = start + timeout
        while (left := deadline - time.perf_counter()) > 0:
            readable, writable, _ = select.select([sock], [sock] if writing else [], [], left)
            if readable:
                try:
                    data = sock.recv(1 << 16)
                except OSError as error:
                    entry["error"] = f"{type(error).__name__} while reading"
                    break
                if not data:
                    break
                if not answer:
                    entry["status_ms"] = round((time.perf_counter() - start) * 1e3, 2)
                    entry["body_bytes_sent_before_answer"] = sent
                answer += data
                head_end = answer.find(b"\r\n\r\n")
                if head_end >= 0:
                    length = re.search(rb"(?im)^content-length:\s*(\d+)", answer[:head_end])
                    if length and len(answer) >= head_end + 4 + int(length[1]):
                        break
            elif writable:
                try:
                    sent += sock.send(view[sent : sent + (1 << 18)])
                except OSError as error:  # the server closed its side: read what it said
                    entry["send_stopped"] = type(error).__name__
                    writing = False
                writing = writing and sent < len(body)
        else:
            entry["error"] = "timeout"
    entry["total_ms"] = round((time.perf_counter() - start) * 1e3, 2)
    entry["body_bytes_sent"] = sent
    status = re.match(rb"HTTP/1\.[01] (\d{3})", answer)
    entry["status"] = int(status[1]) if status else None
    if status:
        payload = answer.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in answer else b""
        entry["error_shape_ok"] = error_shape_ok(payload)
        entry["message"] = error_message(payload)
    return entry


async def httpx_send(url: str, body: bytes, timeout: float) -> dict:
    """POST `body` as ordinary clients do (httpx: the whole body, then the answer)."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=0)
    timeout_ = httpx.Timeout(timeout, connect=10)
    entry: dict = {}
    async with httpx.AsyncClient(base_url=url, timeout=timeout_, limits=limits) as http:
        start = time.perf_counter()
        try:
            request = http.build_request(
                "POST",
                "/v1/completions",
                content=body,
                headers={"content-type": "application/json"},
            )
            response = await http.send(request, stream=True)
            entry["status"] = response.status_code
            entry["status_ms"] = round((time.perf_counter() - start) * 1e3, 2)
            data = await response.aread()
            await response.aclose()
            entry["error_shape_ok"] = error_shape_ok(data)
            entry["message"] = error_message(data)
        except httpx.HTTPError as error:
            entry["status"] = None
            entry["error"] = f"{type(error).__name__}: {error}"[:200]
        entry["total_ms"] = round((time.perf_counter() - start) * 1e3, 2)
    return entry


async def oversized(load: Load, url: str, times: list[float], stop_at: float, body: bytes):
    """At each of `times` (one after another) send the oversized body twice: on a plain socket
    that reads while it sends (the server's refusal time: first byte sent to status line),
    then with httpx as ordinary clients do (does the 413 reach them?)."""
    sends = []
    timeout = load.args.oversized_timeout
    for at in times:
        if at >= stop_at:
            sends.append({"skipped": "the load had ended before its turn"})
            continue
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        entry = {"at_s": round(time.perf_counter() - load.t0, 2)}
        entry["raw_socket"] = await asyncio.to_thread(raw_send, url, body, timeout)
        entry["httpx"] = await httpx_send(url, body, timeout)
        sends.append(entry)
        for client in ("raw_socket", "httpx"):
            result = entry[client]
            status = result.get("status")
            if status is None:
                error = result.get("error", "")
                outcome = "timeout" if "imeout" in error else "connection_error"
            elif status >= 500:
                outcome = "server_error"
            elif status == 429:
                outcome = "rate_limited"
            elif 400 <= status < 500:
                outcome = "refused"
            else:
                outcome = "completed" if status == 200 else "unexpected_status"
            record = {
                "kind": f"oversized_{client}",
                "case": None,
                "t": entry["at_s"],
                "status": status,
                "outcome": outcome,
                "latency": result["total_ms"] / 1e3,
                "ttft": None,
                "error_shape_ok": result.get("error_shape_ok"),
            }
            if result.get("error"):
                record["detail"] = result["error"]
            load.records.append(record)
    return sends


async def loop_lag(load: Load, stop: asyncio.Event, period: float = 0.05):
    """How late the client's own event loop wakes (is the client the bottleneck?)."""
    while not stop.is_set():
        due = time.perf_counter() + period
        await asyncio.sleep(period)
        load.loop_lag.append(time.perf_counter() - due)


async def drain(url: str, timeout: float) -> tuple[bool, float, dict | None]:
    """Wait until nothing waits or runs; then the server's counters."""
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        idle = False
        while time.perf_counter() - start < timeout:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                metrics = parse_metrics((await http.get("/metrics")).text)
                if metrics.get("queue_length") == 0 and metrics.get("running") == 0:
                    idle = True
                    break
            await asyncio.sleep(0.2)
        seconds = time.perf_counter() - start
        metrics = None
        with contextlib.suppress(httpx.HTTPError):
            metrics = parse_metrics((await http.get("/metrics")).text)
    return idle, seconds, metrics


def parse_metrics(text: str) -> dict:
    """moespec_* samples: plain ones as numbers, labelled ones as {label value: number}."""
    out: dict = {}
    for line in text.splitlines():
        match = re.match(r'^moespec_(\w+?)(?:\{\w+="([^"]*)"\})?\s+(\S+)$', line)
        if not match:
            continue
        name, label, value = match[1], match[2], float(match[3])
        if label is None:
            out[name] = value
        else:
            out.setdefault(name, {})[label] = value
    return out


async def run_load(args, url: str, sampler: Sampler, t0: float) -> dict:
    rng = random.Random(args.seed)
    load = Load(args, t0, rng)
    stop_at = t0 + args.seconds
    load_from = t0 + args.warmup
    span = max(args.seconds - args.warmup, 1.0)
    oversize_times = [load_from + (k + 0.25) * span / args.oversized for k in range(args.oversized)]
    burst_at = load_from + 0.5 * span
    lag_stop = asyncio.Event()
    timeout = httpx.Timeout(args.request_timeout, connect=10)
    limits = httpx.Limits(
        max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4
    )
    body = oversized_body(args.oversized_mb) if args.oversized else b""
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
        lag = asyncio.ensure_future(loop_lag(load, lag_stop))
        tasks = [
            asyncio.ensure_future(
                client_loop(load, http, stop_at, sampler.died, i * 1.0 / args.clients)
            )
            for i in range(args.clients)
        ]
        burst_task = (
            asyncio.ensure_future(burst(load, url, burst_at, args.burst, args.request_timeout))
            if args.burst
            else None
        )
        oversized_task = asyncio.ensure_future(oversized(load, url, oversize_times, stop_at, body))
        await asyncio.gather(*tasks)
        load_ended = time.perf_counter()
        burst_report = await burst_task if burst_task else None
        oversized_sends = await oversized_task
        lag_stop.set()
        await lag
    return {
        "load": load,
        "load_seconds": load_ended - t0,
        "burst": burst_report,
        "oversized": oversized_sends,
    }


# -- the report -------------------------------------------------------------------------------
OUTCOMES = (
    "completed",
    "cancelled_by_client",
    "rate_limited",
    "refused",
    "server_error",
    "stream_error",
    "truncated_stream",
    "bad_response",
    "connection_error",
    "timeout",
    "unexpected_status",
    "unclassified",
)
SERVER_FAULTS = ("server_error", "stream_error", "truncated_stream", "bad_response")
CONNECTION_FAULTS = ("connection_error", "timeout")


def by_kind(records) -> dict:
    kinds = {}
    for kind in [*KINDS, "burst", "oversized_raw_socket", "oversized_httpx"]:
        rows = [r for r in records if r["kind"] == kind]
        if not rows:
            continue
        completed = [r for r in rows if r["outcome"] == "completed"]
        entry = {
            "count": len(rows),
            "outcomes": {o: n for o in OUTCOMES if (n := sum(r["outcome"] == o for r in rows))},
            "statuses": dict(sorted(Counter(str(r["status"]) for r in rows).items())),
            "latency_completed": ms_stats([r["latency"] for r in completed]),
            "latency_refused_429": ms_stats(
                [r["latency"] for r in rows if r["outcome"] == "rate_limited"]
            ),
            "latency_refused_4xx": ms_stats(
                [r["latency"] for r in rows if r["outcome"] == "refused"]
            ),
        }
        if any(r["ttft"] is not None for r in rows):
            entry["time_to_first_token"] = ms_stats(
                [r["ttft"] for r in rows if r["ttft"] is not None]
            )
        tokens = [r.get("tokens") for r in completed if r.get("tokens") is not None]
        if tokens:
            entry["completion_tokens"] = sum(tokens)
        kinds[kind] = entry
    return kinds


def bad_input_report(records, cases) -> dict:
    out = {}
    for case in cases:
        rows = [r for r in records if r["kind"] == "bad_input" and r["case"] == case["case"]]
        decided = [r for r in rows if r["outcome"] != "rate_limited"]

        def as_expected(r, expect=case["expect"]):
            refused = r["outcome"] == "refused" and r.get("error_shape_ok")
            served = r["outcome"] == "completed"
            return {REFUSE: refused, SERVE: served, EITHER: refused or served}[expect]

        messages = Counter(r.get("detail") for r in rows if r.get("detail"))
        out[case["case"]] = {
            "path": case["path"],
            "expect": case["expect"],
            "sent": len(rows),
            "statuses": dict(sorted(Counter(str(r["status"]) for r in rows).items())),
            "as_expected": sum(as_expected(r) for r in decided),
            "not_as_expected": sum(not as_expected(r) for r in decided),
            "error_shape_ok": all(r.get("error_shape_ok", True) for r in decided),
            "latency": ms_stats([r["latency"] for r in rows]),
            "messages": [scrub(m) for m, _ in messages.most_common(2)],
        }
    return out


def health_report(probe: HealthProbe, t0: float, until: float, window: float = 10.0) -> dict:
    probes = [p for p in probe.probes if t0 <= p[0] <= until]
    answered = [p for p in probes if p[3] is not None]
    due = [p[2] - p[0] for p in answered]  # from when it was due
    raw = [p[2] - p[1] for p in answered]  # from when it was sent
    windows = []
    start = t0
    while start < until:
        rows = [p[2] - p[0] for p in answered if start <= p[0] < start + window]
        if rows:
            windows.append(
                {"from_s": round(start - t0, 1), **ms_stats(rows)} | {"count": len(rows)}
            )
        start += window
    slow = [p for p in answered if p[2] - p[0] >= 0.1]
    return {
        "period_ms": probe.period * 1e3,
        "probes": len(probes),
        "failed": len(probes) - len(answered),
        "errors": dict(probe.errors),
        "non_200": sum(p[3] != 200 for p in answered),
        "latency_from_due": ms_stats(due),
        "latency_from_sent": ms_stats(raw),
        "slow_probes_100ms": len(slow),
        "slow_at_s": [round(p[0] - t0, 2) for p in slow[:50]],
        "windows_10s": windows,
    }


def rss_report(sampler: Sampler, t0: float, warm_at: float, until: float) -> dict:
    samples = [s for s in sampler.samples if s[0] <= until]
    series = [[round(t - t0, 1), round(mb, 1)] for t, mb, _ in samples]
    after = [s for s in samples if s[0] >= warm_at]
    start_mb = after[0][1] if after else None
    end_mb = samples[-1][1] if samples else None
    growth = (end_mb - start_mb) / start_mb * 100 if start_mb and end_mb else None
    at_load = [s for s in samples if s[0] >= t0]
    return {
        "interval_s": sampler.interval,
        "at_load_start_mb": round(at_load[0][1], 1) if at_load else None,
        "after_warmup_mb": None if start_mb is None else round(start_mb, 1),
        "at_end_mb": None if end_mb is None else round(end_mb, 1),
        "peak_mb": round(max(s[1] for s in samples), 1) if samples else None,
        "growth_pct": None if growth is None else round(growth, 2),
        "series_s_mb": series,
    }


def cross_check(records, metrics) -> dict | None:
    """What the clients saw against what the server counted (its /metrics after the drain;
    the server's counts include the two unmeasured warm-up requests)."""
    if metrics is None:
        return None
    seen = Counter(str(r["status"]) for r in records if r["status"] is not None)
    counted = {k: int(v) for k, v in (metrics.get("requests_total") or {}).items()}
    generations = {k: int(v) for k, v in (metrics.get("generations_total") or {}).items()}
    return {
        "client_statuses": dict(sorted(seen.items())),
        "server_statuses": dict(sorted(counted.items())),
        "client_cancelled": sum(r["outcome"] == "cancelled_by_client" for r in records),
        "server_generations": generations,
    }


def anomalies(records, cases, limit: int = 40) -> list[dict]:
    expect = {c["case"]: c["expect"] for c in cases}
    out = []
    for r in records:
        odd = r["outcome"] in (*SERVER_FAULTS, *CONNECTION_FAULTS, "unexpected_status")
        odd = odd or (r["outcome"] == "rate_limited" and r.get("retry_after") is None)
        odd = odd or (r["outcome"] in ("refused", "rate_limited") and not r.get("error_shape_ok"))
        if r["kind"] == "bad_input" and r["outcome"] != "rate_limited":
            want = expect[r["case"]]
            if want == REFUSE and r["outcome"] != "refused":
                odd = True
            if want == SERVE and r["outcome"] != "completed":
                odd = True
        if odd:
            row = {k: r.get(k) for k in ("kind", "case", "status", "outcome")}
            row["t_s"] = round(r["t"], 2)
            row["latency_ms"] = round(r["latency"] * 1e3, 1) if r["latency"] else None
            if r.get("detail"):
                row["detail"] = scrub(r["detail"])
            if r.get("request"):
                row["request"] = r["request"]
            out.append(row)
    seen, unique = Counter(), []  # keep a few of each (kind, case, status, outcome)
    for row in out:
        key = (row["kind"], row["case"], row["status"], row["outcome"])
        seen[key] += 1
        if seen[key] <= 3:
            unique.append(row)
    return [*unique[:limit], *([{"more": len(unique) - limit}] if len(unique) > limit else [])]


def targets(records, report) -> dict:
    statuses = Counter(r["status"] for r in records)
    fives = sum(n for s, n in statuses.items() if s is not None and s >= 500)
    stream_errors = sum(r["outcome"] == "stream_error" for r in records)
    accepted = [r for r in records if r["status"] == 200]
    clean = Counter(r["outcome"] for r in accepted)
    not_clean = sum(n for o, n in clean.items() if o not in ("completed", "cancelled_by_client"))
    lost = sum(  # accepted or not, unknown; the oversized bodies have their own target
        r["outcome"] in CONNECTION_FAULTS for r in records if not r["kind"].startswith("oversized")
    )
    server = report["server"]
    generation_errors = ((server.get("metrics_end") or {}).get("generations_total") or {}).get(
        "error", 0
    )
    limited = [r for r in records if r["outcome"] == "rate_limited"]
    health = report["health"]["latency_from_due"]["p99_ms"]
    rss = report["rss"]["growth_pct"]
    sends = [s for s in report["oversized"]["sends"] if "skipped" not in s]

    def target(goal, value, met):
        return {"target": goal, "value": value, "met": met}

    return {
        "zero_5xx": target(
            "no 5xx answer, no error inside a streamed 200",
            {"5xx": fives, "stream_errors": stream_errors},
            fives == 0 and stream_errors == 0,
        ),
        "accepted_complete_or_cancel_cleanly": target(
            "every accepted (200) request completes or is cancelled by its client; no request "
            "lost to a connection error or timeout; no failed generation; the queue drains",
            {
                "accepted": len(accepted),
                "outcomes": dict(clean),
                "connection_errors_or_timeouts": lost,
                "server_generation_errors": generation_errors,
                "drained": server["drained"],
            },
            not_clean == 0 and lost == 0 and not generation_errors and server["drained"],
        ),
        "overload_429_retry_after": target(
            "overload answers 429 with Retry-After (and an OpenAI error body)",
            {
                "429": len(limited),
                "with_retry_after": sum(r.get("retry_after") is not None for r in limited),
                "error_body_ok": sum(bool(r.get("error_shape_ok")) for r in limited),
            },
            bool(limited)
            and all(r.get("retry_after") is not None and r.get("error_shape_ok") for r in limited),
        ),
        "health_p99_under_100ms": target(
            "/health p99 < 100 ms throughout (latency from when each probe was due)",
            {"p99_ms": health, "failed_probes": report["health"]["failed"]},
            health is not None and health < 100 and report["health"]["failed"] == 0,
        ),
        "rss_growth_at_most_5pct": target(
            "RSS growth <= 5% from the end of the warm-up to the end",
            rss,
            rss is not None and rss <= 5,
        ),
        "oversized_413_under_100ms": target(
            f"a {report['oversized']['megabytes']:g} MB body is refused with 413 in < 100 ms "
            "(status line on a socket that reads while sending), and the 413 reaches an "
            "ordinary client (httpx) too",
            [
                {
                    "raw_socket_status": s["raw_socket"].get("status"),
                    "raw_socket_status_ms": s["raw_socket"].get("status_ms"),
                    "httpx_status": s["httpx"].get("status"),
                    "httpx_ms": s["httpx"].get("total_ms"),
                    "httpx_error": s["httpx"].get("error"),
                }
                for s in sends
            ],
            all(
                s["raw_socket"].get("status") == 413
                and s["raw_socket"].get("status_ms", 1e9) < 100
                and s["httpx"].get("status") == 413
                for s in sends
            )
            if sends
            else None,
        ),
        "bad_input_answered_as_expected": target(
            "each bad input refused with a 4xx and an OpenAI error body (or served where "
            "issue 56 says so); the server keeps serving",
            {
                case: row["not_as_expected"]
                for case, row in report["bad_input"].items()
                if row["not_as_expected"]
            },
            all(
                row["not_as_expected"] == 0 and row["error_shape_ok"]
                for row in report["bad_input"].values()
            ),
        ),
        "server_up_and_clean_exit": target(
            "the server stays up and exits 0 on SIGINT",
            {"stayed_up": server["stayed_up"], "exit_code": server["exit_code"]},
            server["stayed_up"] and server["exit_code"] == 0,
        ),
    }


def print_summary(report: dict) -> None:
    kinds = report["requests"]["by_kind"]
    head = (
        f"{'kind':20s} {'n':>5s} {'done':>5s} {'cancel':>6s} {'429':>5s} {'4xx':>5s} "
        f"{'5xx':>4s} {'conn':>4s} {'p50 ms':>8s} {'p99 ms':>8s} {'ttft50':>7s} {'ttft99':>7s}"
    )
    print(head)
    for kind, row in kinds.items():
        o = row["outcomes"]
        lat, ttft = row["latency_completed"], row.get("time_to_first_token") or {}
        fives = sum(n for s, n in row["statuses"].items() if s != "None" and int(s) >= 500)
        fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
        print(
            f"{kind:20s} {row['count']:5d} {o.get('completed', 0):5d} "
            f"{o.get('cancelled_by_client', 0):6d} {o.get('rate_limited', 0):5d} "
            f"{o.get('refused', 0):5d} {fives:4d} "
            f"{o.get('connection_error', 0) + o.get('timeout', 0):4d} "
            f"{fmt(lat['p50_ms']):>8s} {fmt(lat['p99_ms']):>8s} "
            f"{fmt(ttft.get('p50_ms')):>7s} {fmt(ttft.get('p99_ms')):>7s}"
        )
    h = report["health"]["latency_from_due"]
    print(
        f"/health: {report['health']['probes']} probes, p50 {h['p50_ms']} ms, p99 {h['p99_ms']} "
        f"ms, max {h['max_ms']} ms, failed {report['health']['failed']}"
    )
    rss = report["rss"]
    print(
        f"RSS: {rss['after_warmup_mb']} MB after warm-up -> {rss['at_end_mb']} MB at the end "
        f"({rss['growth_pct']}%), peak {rss['peak_mb']} MB"
    )
    for send in report["oversized"]["sends"]:
        if "skipped" in send:
            print(f"oversized body: skipped ({send['skipped']})")
            continue
        raw, plain = send["raw_socket"], send["httpx"]
        print(
            f"oversized body at {send['at_s']} s: socket {raw.get('status')} after "
            f"{raw.get('status_ms')} ms ({raw.get('body_bytes_sent_before_answer')} body bytes "
            f"sent){' ' + raw['error'] if raw.get('error') else ''}; httpx "
            f"{plain.get('status') or plain.get('error')} after {plain.get('total_ms')} ms"
        )
    bad = {c: r["not_as_expected"] for c, r in report["bad_input"].items() if r["not_as_expected"]}
    print(f"bad input not answered as expected: {bad or 'none'}")
    server = report["server"]
    print(
        f"server: stayed up {server['stayed_up']}, drained {server['drained']}, "
        f"exit code {server['exit_code']}"
    )
    for name, row in report["targets"].items():
        verdict = {True: "met", False: "MISSED", None: "not measured"}[row["met"]]
        print(f"  {verdict:12s} {name}: {json.dumps(row['value'])[:110]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", metavar="DIR", help="checkpoint (default: the demo pair)")
    parser.add_argument("--clients", type=int, default=48, help="concurrent clients (48)")
    parser.add_argument("--seconds", type=float, default=150, help="load duration (150)")
    parser.add_argument(
        "--warmup",
        type=float,
        help="seconds of load before RSS is taken as the start and the "
        "faults begin (default: 10%% of --seconds, at least 5, at most half)",
    )
    parser.add_argument("--max-queue", type=int, default=16, help="the server's --max-queue")
    parser.add_argument(
        "--max-request-bytes", type=int, help="the server's --max-request-bytes (when it has it)"
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="another argument for `moespec serve` (repeatable, e.g. --server-arg=--no-cache)",
    )
    parser.add_argument("--burst", type=int, default=100, help="simultaneous requests (100)")
    parser.add_argument("--oversized", type=int, default=3, help="oversized bodies sent (3)")
    parser.add_argument("--oversized-mb", type=float, default=50.0)
    parser.add_argument("--oversized-timeout", type=float, default=120.0)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--retry-cap", type=float, default=5.0, help="most s to honour (5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    if args.warmup is None:
        args.warmup = min(max(5.0, 0.1 * args.seconds), 0.5 * args.seconds)
    if not 0 <= args.warmup < args.seconds:
        parser.error("--warmup must be in [0, --seconds)")
    if args.clients < 1:
        parser.error("--clients must be >= 1")
    check_writable(args.out, force=args.force)

    command = [sys.executable, "-m", "moespec", "serve", "--port", "0"]
    command += ["--max-queue", str(args.max_queue)]
    if args.model:
        command += ["--model", args.model]
    has_byte_limit = "--max-request-bytes" in server_options()
    if args.max_request_bytes is not None:
        if has_byte_limit:
            command += ["--max-request-bytes", str(args.max_request_bytes)]
        else:
            print("this server has no --max-request-bytes: not passed", file=sys.stderr)
    command += args.server_arg
    shown = ["moespec", "serve", *command[4:]]
    if args.model:
        shown[shown.index("--model") + 1] = "<model>"

    settings = {
        "clients": args.clients,
        "seconds": args.seconds,
        "warmup_seconds": args.warmup,
        "max_queue": args.max_queue,
        "max_request_bytes": args.max_request_bytes if has_byte_limit else None,
        "server_has_max_request_bytes": has_byte_limit,
        "burst": args.burst,
        "oversized": args.oversized,
        "oversized_mb": args.oversized_mb,
        "request_timeout_s": args.request_timeout,
        "retry_cap_s": args.retry_cap,
        "seed": args.seed,
        "kinds": {k: {"weight": w, "path": p, "stream": s} for k, (w, p, s) in KINDS.items()},
        "bad_inputs": {c["case"]: c["expect"] for c in bad_inputs()},
        "server_command": " ".join(shown),
        "health_period_ms": 50,
        "rss_interval_s": 1,
        "transport": "HTTP/1.1 on loopback; clients: httpx.AsyncClient in one event loop",
    }
    record = provenance(settings=settings)
    load_before = os.getloadavg()
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)

    server = Server(command)
    sampler = probe = None
    try:
        name, url = server.wait_listening(timeout=600)
        print(f"server {name} on {url}, pid {server.pid}", flush=True)
        sampler, probe = Sampler(server), HealthProbe(url)
        sampler.start()
        probe.start()
        with httpx.Client(base_url=url, timeout=60) as http:  # one of each, unmeasured
            http.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 8})
            http.post("/v1/chat/completions", json=CHAT_OK | {"stream": True})
        t0 = time.perf_counter()
        print(f"load: {args.clients} clients for {args.seconds:g} s", flush=True)
        result = asyncio.run(run_load(args, url, sampler, t0))
        stayed_up = not sampler.died.is_set() and server.proc.poll() is None
        drained, drain_seconds, metrics = (
            asyncio.run(drain(url, 60.0)) if stayed_up else (False, None, None)
        )
        end = time.perf_counter()
        probe.stop()
        last = sampler.sample()
        if last is not None:
            sampler.samples.append(last)
        sampler.stopping.set()
        sampler.join(5)
        stayed_up = stayed_up and server.proc.poll() is None
        died_at = None if sampler.died_at is None else round(sampler.died_at - t0, 2)
        stop = server.stop()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
        if sampler is not None:
            sampler.stopping.set()
        if probe is not None and probe.process.is_alive():
            probe.process.kill()

    load = result["load"]
    records = load.records
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    server_cpu = sampler.samples[-1][2] if sampler.samples else None
    report = {
        "benchmark": "serve_load",
        "provenance": record,
        "settings": settings,
        "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
        "server": {
            "model": name,
            "stayed_up": stayed_up,
            "died_at_s": died_at,
            "drained": drained,
            "drain_seconds": None if drain_seconds is None else round(drain_seconds, 3),
            "exit_code": stop["exit_code"],
            "stop": stop,
            "cpu_seconds": server_cpu,
            "stderr_lines": server.stderr_lines,
            "stderr_exceptions": dict(server.exceptions),
            "metrics_end": None
            if metrics is None
            else {
                k: metrics.get(k)
                for k in ("requests_total", "generations_total", "generated_tokens_total")
            },
        },
        "client": {
            "cpu_seconds": round(
                cpu_after.ru_utime + cpu_after.ru_stime - cpu_before.ru_utime - cpu_before.ru_stime,
                2,
            ),
            "event_loop_lag": ms_stats(load.loop_lag),
        },
        "load_seconds": round(result["load_seconds"], 2),
        "requests": {
            "total": len(records),
            "by_outcome": {
                o: n for o in OUTCOMES if (n := sum(r["outcome"] == o for r in records))
            },
            "by_status": dict(sorted(Counter(str(r["status"]) for r in records).items())),
            "by_kind": by_kind(records),
            "retry_after_s": dict(
                Counter(str(r.get("retry_after")) for r in records if r["status"] == 429)
            ),
            "completion_tokens": sum(r.get("tokens") or 0 for r in records),
        },
        "cross_check": cross_check(records, metrics),
        "bad_input": bad_input_report(records, load.cases),
        "burst": result["burst"],
        "oversized": {"megabytes": args.oversized_mb, "sends": result["oversized"]},
        "health": health_report(probe, t0, end),
        "rss": rss_report(sampler, t0, t0 + args.warmup, end),
        "anomalies": anomalies(records, load.cases),
    }
    report["targets"] = targets(records, report)
    faults = sum(r["outcome"] in (*SERVER_FAULTS, *CONNECTION_FAULTS) for r in records)
    fives = sum(r["status"] is not None and r["status"] >= 500 for r in records)
    report["check_passed"] = faults == 0 and fives == 0 and stayed_up and stop["exit_code"] == 0
    write_json(args.out, report, force=args.force)
    print_summary(report)
    print(f"check {'passed' if report['check_passed'] else 'FAILED'}; wrote {args.out}")
    return 0 if report["check_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
