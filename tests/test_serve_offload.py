"""`moespec serve --offload POLICY --memory-budget SIZE` on a tiny converted checkpoint: greedy
answers through offloaded experts equal the in-memory server's, over HTTP; /metrics reports
the offload engine's figures; a cancelled or failed generation leaves the engine usable; the
engine is closed at shutdown; bad settings are generate's one-line errors, exit status 2."""

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from moespec.cli import main  # noqa: E402
from moespec.decoding import Sampler  # noqa: E402
from moespec.errors import SettingError  # noqa: E402
from moespec.serve import Job, load_engine  # noqa: E402
from moespec.serve.app import create_app  # noqa: E402
from moespec.session import OffloadSettings  # noqa: E402
from tests.serving import prometheus_samples, running_server, sse_events  # noqa: E402
from tests.test_serve_http import read_line  # noqa: E402

PROMPTS = ["w1 w2 w3 w1 w2", "w7 w8 w9", "w4 w4 w5 w6 w4 w4"]
WAIT = 60  # seconds any one wait may take before the test fails (never reached when it works)
# the disk tier's RAM cache: 5 of the tiny model's 16 experts (of 32 KiB), read from its file
DISK = {"offload": "spac", "memory_budget": "170K"}
# the host tier: a cache of a quarter of the expert bytes, copied from memory
HOST = {"offload": "lru", "expert_cache_ratio": 0.25}


@pytest.fixture(scope="module")
def converted(converted):
    """This module's converted directory: the session's fp32 one (conftest's `converted`)."""
    return converted("fp32")


def engine_for(directory, offload: dict | None = None, **settings):
    """An fp32 engine drafting 3 tokens a step with the model itself, offloaded as told."""
    settings = {"draft": str(directory), "draft_length": 3, **settings}
    offloaded = OffloadSettings(**offload) if offload is not None else None
    return load_engine(str(directory), dtype="fp32", offload_settings=offloaded, **settings)


@pytest.fixture(scope="module")
def in_memory_answers(converted):
    """{prompt: (text, moespec stats)} of the in-memory server, greedy, 12 tokens."""
    engine = engine_for(converted)
    try:
        return {prompt: ask(TestClient(create_app(engine)), prompt) for prompt in PROMPTS}
    finally:
        engine.close()


def ask(client, prompt: str, max_tokens: int = 12) -> tuple[str, dict]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    return answer["choices"][0]["text"], answer["moespec"]


@pytest.mark.parametrize("offload", [DISK, HOST], ids=["disk", "host"])
def test_greedy_answers_through_offloaded_experts_equal_the_in_memory_servers(
    converted, in_memory_answers, offload
):
    engine = engine_for(converted, offload)
    try:
        client = TestClient(create_app(engine))
        for prompt in PROMPTS:  # one offload engine, request after request
            text, stats = ask(client, prompt)
            assert text == in_memory_answers[prompt][0], prompt
            assert stats["drafted"] > 0  # it did speculate
        summary = engine.offload.summary()
    finally:
        engine.close()
    assert summary["slots"] < summary["total_expert_bytes"] // summary["expert_bytes"]
    assert summary["hits"] + summary["misses"] > 0
    if offload is DISK:
        assert summary["tier"] == "disk" and summary["disk_bytes_read"] > 0


def test_metrics_report_the_offload_hit_rate_bytes_read_and_stalls(converted):
    engine = engine_for(converted, DISK)
    try:
        client = TestClient(create_app(engine))
        ask(client, PROMPTS[0])
        samples = prometheus_samples(client.get("/metrics").text)
        summary = engine.offload.summary()
    finally:
        engine.close()
    assert samples['moespec_offload_info{policy="spac",tier="disk"}'] == 1
    assert samples["moespec_offload_cache_bytes"] == 170 << 10
    hits, misses = samples["moespec_offload_hits_total"], samples["moespec_offload_misses_total"]
    assert hits + misses > 0
    assert samples["moespec_offload_hit_rate"] == pytest.approx(hits / (hits + misses))
    assert samples["moespec_offload_bytes_read_total"] == summary["disk_bytes_read"] > 0
    assert samples["moespec_offload_stall_seconds_total"] == pytest.approx(summary["stall_seconds"])
    assert samples["moespec_offload_cpu_experts_total"] == summary["cpu_experts"]


def test_an_in_memory_server_reports_no_offload_figures(converted):
    engine = engine_for(converted, draft="none")
    try:
        text = TestClient(create_app(engine)).get("/metrics").text
    finally:
        engine.close()
    assert "moespec_tokens_per_second" in text and "offload" not in text


class HeldAtSecondStep:
    """Holds the worker as it observes a generation's second record (its first decode step:
    the offload engine has started, the prefill's text is sent) until released, so a test acts
    while that generation runs and cannot yet have finished."""

    def __init__(self, engine):
        self.engine, self.reached, self.release = engine, threading.Event(), threading.Event()
        self.observe, self.seen = engine.metrics.observe, 0
        engine.metrics.observe = self._observe

    def _observe(self, record):
        self.observe(record)
        self.seen += 1
        if self.seen == 2:
            self.reached.set()
            assert self.release.wait(WAIT), "never released"


def test_a_client_that_disconnects_mid_generation_leaves_the_engine_usable(
    converted, in_memory_answers
):
    engine = engine_for(converted, DISK, max_tokens_limit=400)
    held = HeldAtSecondStep(engine)
    body = {"prompt": "w1 w2", "max_tokens": 400, "temperature": 0, "stream": True}
    with running_server(engine) as url, httpx.Client(base_url=url, timeout=WAIT) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert sse_events([next(lines)])[0]["choices"][0]["text"]  # it has begun
            assert held.reached.wait(WAIT)
            (job,) = engine.active
        # leaving the stream closed the connection mid-generation
        assert job.cancelled.wait(WAIT), "the disconnect did not cancel the job"
        held.release.set()
        assert job.finished.wait(WAIT)
        assert engine.metrics.generations["cancelled"] == 1
        assert engine.metrics.generated_tokens < 400
        for prompt in PROMPTS:
            answer = http.post(
                "/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0}
            )
            assert answer.json()["choices"][0]["text"] == in_memory_answers[prompt][0]


def test_a_generation_that_fails_midway_leaves_the_engine_usable(converted, in_memory_answers):
    """A prompt id outside the vocabulary (the app refuses it; the engine is given it here)
    fails inside the prefill's pass, with the offload engine's step begun: the next request
    still decodes the in-memory tokens."""
    engine = engine_for(converted, DISK)
    loop = asyncio.new_event_loop()
    try:
        bad = Job([1, engine.vocab_size + 5], 4, Sampler(), 0, [], loop)
        engine.submit(bad)
        kind, message = loop.run_until_complete(asyncio.wait_for(bad.events.get(), WAIT))
        assert kind == "error" and "generation failed" in message
        text, _ = ask(TestClient(create_app(engine)), PROMPTS[0])
    finally:
        loop.close()
        engine.close()
    assert text == in_memory_answers[PROMPTS[0]][0]


def offload_threads() -> list[threading.Thread]:
    names = ("moespec-offload-", "moespec-disk-io")
    return [t for t in threading.enumerate() if t.name.startswith(names)]


def test_shutdown_closes_the_offload_engine(converted):
    engine = engine_for(converted, DISK)
    with running_server(engine) as url:  # it closes the engine as `serve` does at shutdown
        body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=WAIT).status_code == 200
        store = engine.offload.engine.store
        assert store.fd is not None and offload_threads()  # its file and threads, in use
    assert store.fd is None  # the file is closed
    assert offload_threads() == []  # the link's and the reads' threads have ended


def test_the_command_serves_offloaded_experts_and_stops_cleanly(converted):
    root = str(Path(__file__).resolve().parent.parent)  # this tree's moespec, not another
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "moespec", "serve", "--model", str(converted), "--port", "0"]
    command += ["--dtype", "fp32", "--draft", "none", "--offload", "lru", "--memory-budget", "auto"]
    server = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        line = read_line(server)
        assert "experts offloaded by lru (disk, cache " in line, line
        url = line.rsplit(" ", 1)[1].strip()
        body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
        done = httpx.post(f"{url}/v1/completions", json=body, timeout=WAIT).json()
        assert done["usage"]["completion_tokens"] == 4
        assert "moespec_offload_hit_rate" in httpx.get(f"{url}/metrics", timeout=WAIT).text
    finally:
        server.send_signal(signal.SIGINT)  # Ctrl-C: a graceful stop
        _, err = server.communicate(timeout=WAIT)
    assert server.returncode == 0 and "Traceback" not in err, err
    assert "note: memory budget" in err  # auto: sized from the available memory, and said so


def error_line(capsys, command: str, directory, *flags) -> str:
    args = [command, "--model", str(directory), "--dtype", "fp32", "--draft", "none"]
    if command == "serve":
        args += ["--port", "0"]
    else:
        args += ["w1 w2", "--max-tokens", "2"]
    assert main([*args, *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.split(": error: ", 1)[1]


@pytest.mark.parametrize(
    "flags",
    [
        ["--offload", "lru", "--memory-budget", "1K"],
        ["--offload", "lru", "--memory-budget", "lots"],
        ["--offload", "lru", "--memory-budget", "1G", "--offload-device", "cuda"],
        ["--offload", "nosuch", "--memory-budget", "1G"],
        ["--memory-budget", "1G"],
    ],
    ids=["too-small", "not-a-size", "disk-on-cuda", "unknown-policy", "no-policy"],
)
def test_bad_offload_settings_are_generates_one_line_errors(converted, capsys, flags):
    assert error_line(capsys, "serve", converted, *flags) == error_line(
        capsys, "generate", converted, *flags
    )


def test_a_policy_without_speculation_is_refused_with_a_draft(converted, capsys):
    flags = ["--offload", "spac-ar", "--memory-budget", "170K", "--draft", str(converted)]
    assert "--offload spac-ar plans for decoding without a draft" in error_line(
        capsys, "serve", converted, *flags
    )


def test_offload_with_continuous_batching_is_refused_naming_both(converted, capsys):
    flags = ["--offload", "lru", "--memory-budget", "170K", "--max-batch", "4"]
    line = error_line(capsys, "serve", converted, *flags)
    assert line.startswith("--offload decodes one request at a time") and "--max-batch 4" in line
    with pytest.raises(SettingError, match=r"^offload decodes .* max_batch='2'"):
        engine_for(converted, DISK, max_batch=2)


def test_offloaded_step_times_are_not_remembered_as_the_models(converted, remembered_measurements):
    """Verify times measured through offloaded experts are not the model's in memory: as
    `generate` does, the server neither seeds from nor writes the remembered measurements."""
    engine = engine_for(converted, DISK, remember=True)
    try:
        ask(TestClient(create_app(engine)), PROMPTS[0])
    finally:
        engine.close()
    assert engine.speculation.remembered is None
    assert not remembered_measurements.exists()
