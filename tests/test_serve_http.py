"""A real server (uvicorn on a free loopback port) spoken to over HTTP: the official `openai`
client, a full queue, disconnecting clients, a bounded load test, and the command itself."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from moespec.cli import main  # noqa: E402
from tests.serving import prometheus_samples, running_server, sse_events, tiny_engine  # noqa: E402

WAIT = 60  # seconds any one wait may take before the test fails (never reached when it works)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tests.checkpoints import hf_model, save_checkpoint

    return save_checkpoint(hf_model("qwen3_moe"), tmp_path_factory.mktemp("http-target"))


def client_for(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=WAIT)


def expected_text(capsys, target, prompt: str, max_tokens: int) -> str:
    """What `moespec generate` decodes greedily for the prompt."""
    args = ["generate", "--model", str(target), prompt, "--max-tokens", str(max_tokens)]
    assert main([*args, "--dtype", "fp32", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["text"]


def test_openai_client_both_endpoints_streamed_and_not(target, capsys):
    expected = expected_text(capsys, target, "w4 w5 w6", 8)
    with running_server(tiny_engine(target)) as url:
        client = client_for(url)
        model = client.models.list().data[0].id
        done = client.completions.create(
            model=model, prompt="w4 w5 w6", max_tokens=8, temperature=0
        )
        assert done.choices[0].text == expected
        assert done.usage.prompt_tokens == 3 and done.usage.completion_tokens == 8
        chunks = list(
            client.completions.create(
                model=model, prompt="w4 w5 w6", max_tokens=8, temperature=0, stream=True
            )
        )
        assert "".join(c.choices[0].text for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == 8

        messages = [{"role": "user", "content": "w9 w8"}]
        chat = client.chat.completions.create(
            model=model, messages=messages, max_tokens=5, temperature=0, seed=3
        )
        assert chat.choices[0].message.role == "assistant"
        streamed = list(
            client.chat.completions.create(
                model=model, messages=messages, max_tokens=5, temperature=0, seed=3, stream=True
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == chat.choices[0].message.content
        assert streamed[-1].usage.total_tokens == chat.usage.total_tokens

        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=model, prompt="w1", max_tokens=10_000)


def test_full_queue_answers_429_with_retry_after_and_loses_no_queued_request(target):
    engine = tiny_engine(target, max_queue=2)
    engine.pause()  # hold the worker: both queued requests wait, deterministically
    body = {"prompt": "w1 w2", "max_tokens": 4, "temperature": 0, "stream": True}
    with running_server(engine) as url, httpx.Client(base_url=url, timeout=WAIT) as http:
        with http.stream("POST", "/v1/completions", json=body) as first:
            assert first.status_code == 200  # headers come once the job is queued
            with http.stream("POST", "/v1/completions", json=body) as second:
                assert second.status_code == 200
                assert engine.queue_length() == 2
                refused = http.post("/v1/completions", json={**body, "stream": False})
                assert refused.status_code == 429
                assert int(refused.headers["Retry-After"]) >= 1
                assert refused.json()["error"]["code"] == "queue_full"
                engine.resume()
                texts = [
                    "".join(e["choices"][0]["text"] for e in sse_events(r.iter_lines())[:-1])
                    for r in (first, second)
                ]
        assert texts[0] == texts[1] and len(texts[0].split()) == 4
        samples = prometheus_samples(http.get("/metrics").text)
        assert samples['moespec_requests_total{status="429"}'] == 1
        assert samples['moespec_generations_total{finish_reason="length"}'] == 2


class HeldWorker:
    """Holds the worker at the end of its first step (the prefill) until released, so a test
    can act while a generation is known to be running and can not yet have finished."""

    def __init__(self, engine):
        self.engine, self.reached, self.release = engine, threading.Event(), threading.Event()
        self.observe = engine.metrics.observe
        engine.metrics.observe = self._observe

    def _observe(self, record):
        self.observe(record)
        if not self.reached.is_set():
            self.reached.set()
            assert self.release.wait(WAIT), "never released"

    def running_job(self):
        assert self.reached.wait(WAIT), "the generation never started"
        (job,) = self.engine.active  # the one job of the running batch
        return job


def assert_cancelled_early(engine, held: HeldWorker, job, max_tokens: int) -> None:
    assert job.cancelled.wait(WAIT), "the disconnect did not cancel the job"
    held.release.set()
    assert job.finished.wait(WAIT)
    generations = engine.metrics.generations
    assert generations["cancelled"] == 1 and sum(generations.values()) == 1
    assert engine.metrics.generated_tokens == 1 < max_tokens  # the prefill's token, no more


def test_a_streaming_client_that_disconnects_cancels_its_generation(target):
    engine = tiny_engine(target, max_tokens_limit=400)
    held = HeldWorker(engine)
    body = {
        "messages": [{"role": "user", "content": "w1 w2"}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    with running_server(engine) as url:
        with (
            httpx.Client(base_url=url, timeout=WAIT) as http,
            http.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            lines = response.iter_lines()
            first = json.loads(next(lines)[len("data: ") :])  # the stream has begun
            assert first["choices"][0]["delta"]["role"] == "assistant"
            job = held.running_job()
        # leaving both blocks closed the connection mid-stream
        assert_cancelled_early(engine, held, job, 400)


def test_a_waiting_client_that_disconnects_cancels_its_generation(target):
    engine = tiny_engine(target, max_tokens_limit=400)
    held = HeldWorker(engine)
    body = json.dumps({"prompt": "w1 w2", "max_tokens": 400, "temperature": 0}).encode()
    with running_server(engine) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as raw:
            raw.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            job = held.running_job()
        assert_cancelled_early(engine, held, job, 400)


def test_load_every_request_is_answered_once_or_refused(target, capsys):
    """16 concurrent clients, 64 greedy requests, a queue of 4: each request gets exactly one
    answer, the right text or a 429, and the server's counts agree."""
    prompts = [f"w{i} w{i + 1} w{i + 2}" for i in range(1, 9)]
    expected = {p: expected_text(capsys, target, p, 6) for p in prompts}
    requests = [prompts[i % len(prompts)] for i in range(64)]
    engine = tiny_engine(target, max_queue=4)
    with running_server(engine) as url:
        client = client_for(url)

        def ask(prompt):
            try:
                done = client.completions.create(
                    model=engine.model_name, prompt=prompt, max_tokens=6, temperature=0
                )
                return prompt, done.id, done.choices[0].text
            except openai.RateLimitError as refusal:
                assert int(refusal.response.headers["Retry-After"]) >= 1
                return prompt, None, 429

        with ThreadPoolExecutor(max_workers=16) as pool:
            answers = list(pool.map(ask, requests, timeout=10 * WAIT))
        samples = prometheus_samples(httpx.get(f"{url}/metrics", timeout=WAIT).text)
    assert len(answers) == 64
    served = [a for a in answers if a[1] is not None]
    assert served, "every request was refused"
    assert all(text == expected[prompt] for prompt, _, text in served)
    assert len({rid for _, rid, _ in served}) == len(served)  # no answer given twice
    refused = sum(a[2] == 429 for a in answers)
    assert len(served) + refused == 64
    assert samples['moespec_requests_total{status="200"}'] == len(served)
    assert samples.get('moespec_requests_total{status="429"}', 0) == refused
    assert samples['moespec_generations_total{finish_reason="length"}'] == len(served)


def test_the_command_serves_the_demo_pair_on_a_free_port():
    root = str(Path(__file__).resolve().parent.parent)  # this tree's moespec, not another
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "moespec", "serve", "--port", "0", "--max-queue", "2"]
    server = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        line = read_line(server)
        assert "moespec/demo/target (draft auto:moespec/demo/draft)" in line, line
        url = line.rsplit(" ", 1)[1].strip()
        assert url.startswith("http://127.0.0.1:")
        done = client_for(url).completions.create(
            model="moespec/demo/target", prompt="def fibonacci(n):", max_tokens=16, temperature=0
        )
        assert done.usage.completion_tokens >= 1 and done.choices[0].text
        assert httpx.get(f"{url}/health", timeout=WAIT).json()["status"] == "ok"
    finally:
        server.send_signal(signal.SIGINT)  # Ctrl-C: a graceful stop
        _, err = server.communicate(timeout=WAIT)
    assert server.returncode == 0 and "Traceback" not in err, err


def read_line(process) -> str:
    """The first stdout line, within WAIT seconds (a reader thread: pipes have no timeout)."""
    lines = []
    reader = threading.Thread(target=lambda: lines.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(WAIT)
    assert lines and lines[0], (
        f"no listening line; stderr: {process.stderr.read() if process.poll() is not None else ''}"
    )
    return lines[0]


def test_without_fastapi_the_command_says_what_to_install(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a)
    )
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'moespec[serve]'" in err and err.count("\n") == 1


def test_bad_flags_exit_2_before_loading(capsys):
    assert main(["serve", "--port", "0", "--max-queue", "-1"]) == 2
    assert "--max-queue" in capsys.readouterr().err
    assert main(["serve", "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err
    assert main(["serve", "--port", "0", "--draft", "oracle:2"]) == 2
    assert "in [0, 1]" in capsys.readouterr().err
    assert main(["serve", "--port", "0", "--kernel", "auto", "--crossover", "0"]) == 2


def test_a_port_in_use_is_one_line_and_exit_2(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--draft", "none"]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
