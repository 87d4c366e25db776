"""The server's API through FastAPI's TestClient, on a tiny fp32 checkpoint drafted by itself."""

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from moespec.cli import main  # noqa: E402
from moespec.serve.app import create_app  # noqa: E402
from tests.serving import prometheus_samples, sse_events, tiny_engine  # noqa: E402

PROMPT = "w1 w2 w3 w1 w2"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tests.checkpoints import hf_model, save_checkpoint

    return save_checkpoint(hf_model("qwen3_moe"), tmp_path_factory.mktemp("serve-target"))


@pytest.fixture(scope="module")
def engine(target):
    engine = tiny_engine(target, max_queue=4, max_tokens_limit=64)
    yield engine
    engine.close()


@pytest.fixture
def client(engine):
    return TestClient(create_app(engine))


def complete(client, **body):
    return client.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, **body})


def generate_json(capsys, directory, *flags) -> dict:
    args = ["generate", "--model", str(directory), PROMPT, "--dtype", "fp32", "--json"]
    code = main([*args, *flags])
    assert code == 0
    return json.loads(capsys.readouterr().out)


def test_greedy_completion_equals_moespec_generate(client, target, capsys):
    response = complete(client, max_tokens=12)
    assert response.status_code == 200
    body = response.json()
    speculative = generate_json(capsys, target, "--max-tokens", "12", "--draft", str(target))
    plain = generate_json(capsys, target, "--max-tokens", "12", "--draft", "none")
    assert body["choices"][0]["text"] == speculative["text"] == plain["text"]
    assert body["usage"] == {
        "prompt_tokens": len(speculative["prompt_tokens"]),
        "completion_tokens": len(speculative["tokens"]),
        "total_tokens": len(speculative["prompt_tokens"]) + len(speculative["tokens"]),
    }
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["moespec"]["drafted"] > 0  # it did speculate


def test_completion_body_has_the_openai_shape(client):
    body = complete(client, max_tokens=3).json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == str(client.get("/v1/models").json()["data"][0]["id"])
    assert set(body["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}
    assert body["usage"]["completion_tokens"] == 3


def test_token_id_prompt_is_the_same_as_its_text(client, engine):
    ids = engine.tokenizer.encode(PROMPT)
    by_ids = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 4, "temperature": 0})
    assert (
        by_ids.json()["choices"][0]["text"]
        == complete(client, max_tokens=4).json()["choices"][0]["text"]
    )


def test_chat_uses_the_plain_template_and_counts_its_tokens(client, engine):
    messages = [{"role": "system", "content": "w5"}, {"role": "user", "content": "w6 w7"}]
    body = client.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "temperature": 0}
    ).json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    rendered = engine.chat_template.render(messages)
    assert rendered == "System: w5\nUser: w6 w7\nAssistant:"
    assert body["usage"]["prompt_tokens"] == len(engine.tokenizer.encode(rendered))
    assert body["usage"]["completion_tokens"] <= 5


def test_streamed_completion_is_the_non_streamed_text_in_openai_chunks(client):
    whole = complete(client, max_tokens=10).json()
    response = complete(client, max_tokens=10, stream=True)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text.split("\n"))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["usage"] == whole["usage"]


def test_streamed_chat_opens_with_the_role_and_closes_with_usage(client):
    request = {
        "messages": [{"role": "user", "content": "w3"}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
    }
    events = sse_events(client.post("/v1/chat/completions", json=request).text.split("\n"))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["usage"]["completion_tokens"] <= 6
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert len(text.split()) == chunks[-1]["usage"]["completion_tokens"] > 0


def test_stop_string_ends_the_text_before_it(client):
    full = complete(client, max_tokens=12).json()["choices"][0]["text"]
    words = full.split()
    stop = " " + words[3]  # the text stops before the first occurrence of this word
    cut = full[: full.index(stop)]
    body = complete(client, max_tokens=12, stop=[stop]).json()
    assert body["choices"][0]["text"] == cut
    assert body["choices"][0]["finish_reason"] == "stop"
    streamed = sse_events(complete(client, max_tokens=12, stop=stop, stream=True).text.split("\n"))
    assert "".join(c["choices"][0]["text"] for c in streamed[:-1]) == cut


@pytest.mark.parametrize("draft", ["suffix", "auto"])
def test_suffix_and_auto_drafting_engines_answer_as_plain(client, target, draft):
    engine = tiny_engine(target, draft=draft)
    try:
        answer = complete(TestClient(create_app(engine)), max_tokens=16).json()
    finally:
        engine.close()
    plain = complete(client, max_tokens=16).json()
    assert answer["choices"][0]["text"] == plain["choices"][0]["text"]


def test_same_seed_same_sample_on_a_plain_engine(target):
    engine = tiny_engine(target, draft="none")
    try:
        client = TestClient(create_app(engine))
        texts = [
            complete(client, max_tokens=10, temperature=1.0, seed=seed).json()["choices"][0]["text"]
            for seed in (7, 7, 8)
        ]
    finally:
        engine.close()
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]  # another seed, another sample (this model's 96 tokens)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": PROMPT, "max_tokens": 65}, "max_tokens"),  # over --max-tokens-limit
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"prompt": PROMPT, "temperature": -1}, "temperature"),
        ({"prompt": PROMPT, "top_p": 0}, "top_p"),
        ({"prompt": PROMPT, "n": 2}, "n"),
        ({"prompt": PROMPT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": PROMPT, "logprobs": 6}, "logprobs"),  # over the API's 5
        ({"prompt": PROMPT, "echo": True}, "echo"),
        ({"prompt": [1, 2, 10_000]}, "prompt"),
        ({"prompt": ["w1", "w2"]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"max_tokens": 3}, "prompt"),  # missing
        ({"prompt": PROMPT, "max_tokens": "many"}, "max_tokens"),
    ],
)
def test_bad_completion_request_is_400_with_an_openai_error(client, body, param):
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param or error["param"].startswith(param), error
    assert error["message"]


def test_over_the_context_is_400_context_length_exceeded(target):
    engine = tiny_engine(target, max_tokens_limit=4096)  # the checkpoint's context: 512
    try:
        client = TestClient(create_app(engine))
        long_prompt = " ".join(["w4"] * 500)
        response = client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 13})
        fits = client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 12})
    finally:
        engine.close()
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert "512" in response.json()["error"]["message"]
    assert fits.status_code == 200 and fits.json()["usage"]["total_tokens"] == 512


def test_malformed_json_and_wrong_shapes_are_400_and_the_server_goes_on(client):
    headers = {"content-type": "application/json"}
    for content in (b"{not json", b"[1, 2]", b'{"prompt": {"a": 1}}', b""):
        response = client.post("/v1/completions", content=content, headers=headers)
        assert response.status_code == 400, content
        assert response.json()["error"]["type"] == "invalid_request_error"
    bad_chat = client.post("/v1/chat/completions", json={"messages": [{"role": "robot"}]})
    assert bad_chat.status_code == 400
    assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 400
    assert complete(client, max_tokens=2).status_code == 200


def test_unknown_route_is_an_openai_404(client):
    response = client.get("/v1/nothing")
    assert response.status_code == 404 and "error" in response.json()


def test_full_queue_is_429_with_retry_after(target):
    engine = tiny_engine(target, max_queue=0)
    engine.pause()  # the worker takes nothing: a queue of 0 cannot hold this request
    try:
        client = TestClient(create_app(engine))
        response = complete(client, max_tokens=2)
    finally:
        engine.close()
    assert response.status_code == 429
    assert int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["type"] == "rate_limit_error"


def test_health_and_models(client, engine):
    assert client.get("/health").json() == {
        "status": "ok",
        "model": engine.model_name,
        "queue_length": 0,
    }
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [engine.model_name]


def test_metrics_are_prometheus_text_counting_steps_and_answers(target):
    engine = tiny_engine(target, draft_length=2)
    try:
        client = TestClient(create_app(engine))
        complete(client, max_tokens=9)
        client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
        response = client.get("/metrics")
    finally:
        engine.close()
    assert response.headers["content-type"].startswith("text/plain")
    samples = prometheus_samples(response.text)
    assert samples['moespec_requests_total{status="200"}'] == 1
    assert samples['moespec_requests_total{status="400"}'] == 1
    assert samples['moespec_generations_total{finish_reason="length"}'] == 1
    assert samples["moespec_generated_tokens_total"] == 9
    # self-drafted greedy: every draft is accepted; k = 2 until the budget caps it
    assert samples["moespec_accepted_tokens_total"] == samples["moespec_drafted_tokens_total"] > 0
    assert samples["moespec_acceptance_rate"] == 1.0
    assert samples['moespec_draft_length_steps_total{k="2"}'] >= 1
    assert samples["moespec_tokens_per_second"] > 0
    assert samples['moespec_kernel_passes_total{kernel="slot"}'] >= 1
    assert samples["moespec_queue_length"] == 0 and samples["moespec_running"] == 0
