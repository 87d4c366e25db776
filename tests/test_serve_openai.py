"""The server's OpenAI semantics and input limits: null fields, strict types, logit_bias,
penalties, seeds, logprobs, refused fields, body and prompt limits, bad bytes, and the event
loop kept free while a request is read. In fp32 and bf16."""

import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from fastapi.testclient import TestClient  # noqa: E402

from moespec.serve import load_engine  # noqa: E402
from moespec.serve.app import create_app  # noqa: E402
from tests.serving import running_server, sse_events  # noqa: E402

PROMPT = "w1 w2 w3 w1 w2"
WAIT = 60


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tests.checkpoints import hf_model, save_checkpoint

    return save_checkpoint(hf_model("qwen3_moe"), tmp_path_factory.mktemp("openai-target"))


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def engines(target, request):
    """(speculating engine, plain engine) in one dtype: the target drafting 4 tokens a step for
    itself (auto would find a draft as dear as the target not worth it)."""
    speculative = load_engine(str(target), dtype=request.param, draft=str(target), draft_length=4)
    plain = load_engine(str(target), dtype=request.param, draft="none")
    yield speculative, plain
    speculative.close()
    plain.close()


@pytest.fixture(scope="module")
def engine(engines):
    return engines[0]


@pytest.fixture
def client(engine):
    return TestClient(create_app(engine))


def post(client, body, path="/v1/completions"):
    return client.post(path, json=body)


def text_of(response) -> str:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def both(engines, body, path="/v1/completions"):
    """The answers of the speculating engine and the plain one to the same body."""
    return [post(TestClient(create_app(e)), body, path) for e in engines]


NULLS = {
    "model": None,
    "max_tokens": None,
    "temperature": None,
    "top_p": None,
    "seed": None,
    "stop": None,
    "stream": None,
    "stream_options": None,
    "n": None,
    "logit_bias": None,
    "presence_penalty": None,
    "frequency_penalty": None,
    "user": None,
}


def test_null_means_the_default_for_every_optional_field(client):
    completion = post(client, {"prompt": PROMPT, **NULLS, "seed": 4, "max_tokens": 6})
    default = post(client, {"prompt": PROMPT, "seed": 4, "max_tokens": 6})
    assert text_of(completion) == text_of(default)
    chat_nulls = {**NULLS, "logprobs": None, "top_logprobs": None, "response_format": None}
    chat_nulls |= {"tools": None, "tool_choice": None, "max_completion_tokens": None}
    messages = [{"role": "user", "content": "w3 w4"}]
    chat = post(client, {"messages": messages, **chat_nulls}, "/v1/chat/completions")
    assert chat.status_code == 200, chat.text


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", "12"),
        ("max_tokens", True),
        ("max_tokens", 12.0),
        ("temperature", "0.5"),
        ("temperature", True),
        ("stream", 1),
        ("seed", "3"),
        ("stop", 5),
        ("logit_bias", {"5": "10"}),
    ],
)
def test_types_are_strict(client, field, value):
    response = post(client, {"prompt": PROMPT, field: value})
    assert response.status_code == 400
    assert response.json()["error"]["param"].startswith(field)


@pytest.mark.parametrize(
    "path, field, value",
    [
        ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
        ("/v1/chat/completions", "tool_choice", "required"),
        ("/v1/chat/completions", "response_format", {"type": "json_object"}),
        ("/v1/chat/completions", "functions", [{"name": "f"}]),
        ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
        ("/v1/chat/completions", "modalities", ["text", "audio"]),
        ("/v1/completions", "suffix", " w9"),
        ("/v1/completions", "echo", True),
        ("/v1/completions", "best_of", 2),
        ("/v1/completions", "n", 2),
    ],
)
def test_fields_that_would_change_the_answer_are_refused_by_name(client, path, field, value):
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user"}]}
    response = post(client, {**body, field: value}, path)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_harmless_forms_of_those_fields_are_served(client):
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "w3 w4"}]}],
        "response_format": {"type": "text"},
        "tool_choice": "none",
        "modalities": ["text"],
        "max_tokens": 3,
    }
    assert post(client, body, "/v1/chat/completions").status_code == 200


def test_an_image_part_is_refused_naming_the_message(client):
    content = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    body = {"messages": [{"role": "user", "content": content}]}
    response = post(client, body, "/v1/chat/completions")
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages.0.content"


def test_a_seed_gives_the_same_sample_with_and_without_speculation(engines):
    body = {"prompt": PROMPT, "temperature": 1.0, "top_p": 0.9, "max_tokens": 16}
    for seed in (1, 2, -5):
        speculative, plain = both(engines, {**body, "seed": seed})
        assert text_of(speculative) == text_of(plain)
        assert speculative.json()["moespec"]["drafted"] > 0


def test_a_tiny_temperature_is_greedy(engines):
    plain = TestClient(create_app(engines[1]))
    greedy = text_of(post(plain, {"prompt": PROMPT, "temperature": 0}))
    for answer in both(engines, {"prompt": PROMPT, "temperature": 1e-40}):
        assert text_of(answer) == greedy


def test_logit_bias_and_penalties_answer_as_plain_decoding_does(engines):
    plain = TestClient(create_app(engines[1]))
    greedy = text_of(post(plain, {"prompt": PROMPT, "temperature": 0, "max_tokens": 12}))
    favoured = engines[0].tokenizer.encode("w7")[0]
    body = {
        "prompt": PROMPT,
        "temperature": 0,
        "max_tokens": 12,
        "logit_bias": {str(favoured): 100},
    }
    speculative, plain = both(engines, body)
    assert text_of(speculative) == text_of(plain) == " ".join(["w7"] * 12)
    penalised = {**body, "logit_bias": None, "presence_penalty": 2, "frequency_penalty": 2}
    speculative, plain = both(engines, penalised)
    assert text_of(speculative) == text_of(plain) != greedy[: len(text_of(plain))]
    words = text_of(plain).split()
    assert len(set(words)) == len(words)  # penalised this hard, no token repeats here


@pytest.mark.parametrize("bias", [{"96": 1}, {"-1": 1}, {"w1": 1}, {"5": 101}, {"5": -100.5}])
def test_bad_logit_bias_is_400(client, bias):
    response = post(client, {"prompt": PROMPT, "logit_bias": bias})
    assert response.status_code == 400 and response.json()["error"]["param"] == "logit_bias"


def test_completion_logprobs_have_the_openai_shape_and_match_plain_decoding(engines):
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 8, "logprobs": 3}
    speculative, plain = both(engines, body)
    logprobs = speculative.json()["choices"][0]["logprobs"]
    assert logprobs == plain.json()["choices"][0]["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert "".join(logprobs["tokens"]) == text_of(speculative).replace(" ", "")
    assert len(logprobs["token_logprobs"]) == 8
    assert all(lp <= 0 for lp in logprobs["token_logprobs"])
    for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True):
        assert len(top) == 3 and max(top, key=top.get) == token  # greedy: the best token


def test_chat_logprobs_streamed_cover_every_token(client):
    body = {
        "messages": [{"role": "user", "content": "w3 w4"}],
        "temperature": 0,
        "max_tokens": 6,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = post(client, body, "/v1/chat/completions").json()["choices"][0]["logprobs"]
    assert len(whole["content"]) == 6 and whole["refusal"] is None
    entry = whole["content"][0]
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
    assert entry["bytes"] == list(entry["token"].encode()) and len(entry["top_logprobs"]) == 2
    response = post(client, {**body, "stream": True}, "/v1/chat/completions")
    chunks = [c["choices"][0]["logprobs"] for c in sse_events(response.text.split("\n"))[:-1]]
    assert [e for c in chunks if c for e in c["content"]] == whole["content"]


def test_top_logprobs_without_logprobs_is_400(client):
    body = {"messages": [{"role": "user", "content": "w3"}], "top_logprobs": 2}
    response = post(client, body, "/v1/chat/completions")
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"


def test_an_unknown_model_is_404_model_not_found(client):
    response = post(client, {"prompt": PROMPT, "model": "gpt-4o"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_stop_strings_are_bounded(client):
    assert post(client, {"prompt": PROMPT, "stop": "w" * 257}).status_code == 400
    assert post(client, {"prompt": PROMPT, "stop": "w" * 256, "max_tokens": 2}).status_code == 200


def test_invalid_utf8_and_deep_nesting_are_400_and_the_server_goes_on(client):
    headers = {"content-type": "application/json"}
    bad_bytes = b'{"prompt": "w1 \xff\xfe"}'
    response = client.post("/v1/completions", content=bad_bytes, headers=headers)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_utf8"
    nested = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = client.post("/v1/completions", content=nested, headers=headers)
    assert response.status_code == 400 and "nested" in response.json()["error"]["message"]
    assert post(client, {"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_a_token_the_tokenizer_adds_past_the_vocabulary_is_400(target, tmp_path):
    import shutil

    from tokenizers import Tokenizer

    shutil.copytree(target, tmp_path / "added")
    tokenizer = Tokenizer.from_file(str(tmp_path / "added" / "tokenizer.json"))
    tokenizer.add_tokens(["<extra>"])  # id 96: the model embeds 96 ids
    tokenizer.save(str(tmp_path / "added" / "tokenizer.json"))
    engine = load_engine(str(tmp_path / "added"), dtype="fp32", draft="none")
    try:
        response = post(TestClient(create_app(engine)), {"prompt": "w1 <extra>"})
    finally:
        engine.close()
    assert response.status_code == 400
    assert "token 96 at position 1" in response.json()["error"]["message"]


def test_prompt_limits_refuse_long_prompts_before_and_after_tokenizing(target):
    engine = load_engine(str(target), dtype="fp32", draft="none", max_prompt_tokens=8)
    try:
        client = TestClient(create_app(engine))
        nine = post(client, {"prompt": " ".join(["w1"] * 9)})
        eight = post(client, {"prompt": " ".join(["w1"] * 8), "max_tokens": 2})
        calls = []
        engine.tokenizer.encode = lambda text: calls.append(text) or [1]
        huge = post(client, {"prompt": "w" * (engine.prompt_characters + 1)})
    finally:
        engine.close()
    assert nine.status_code == 400 and nine.json()["error"]["code"] == "context_length_exceeded"
    assert eight.status_code == 200
    assert huge.status_code == 400 and calls == []  # the tokenizer never saw it


def test_an_oversized_body_is_413_before_it_is_read(target):
    engine = load_engine(str(target), dtype="fp32", draft="none", max_request_bytes=4096)
    with running_server(engine) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as raw:
            raw.sendall(  # 50 MB announced, none of it sent: an answer proves it was not awaited
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 50000000\r\n\r\n"
            )
            answer = b""
            while b"}}" not in answer:  # the error body's end
                answer += raw.recv(4096)
        assert answer.startswith(b"HTTP/1.1 413"), answer
        assert b'"request_too_large"' in answer
        sent = httpx.post(f"{url}/v1/completions", content=b" " * 5_000_000, timeout=WAIT)
        assert sent.status_code == 413  # a client that reads once it has sent gets it too
        chunked = httpx.post(  # no Content-Length: refused once the bytes pass the limit
            f"{url}/v1/completions", content=iter([b"{" + b" " * 3000] * 3), timeout=WAIT
        )
        assert chunked.status_code == 413
        small = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert small.status_code == 200


def test_health_answers_while_a_prompt_is_being_tokenized(target):
    """Reading, templating and tokenizing run off the event loop: /health answers while the
    tokenizer is held mid-encode."""
    engine = load_engine(str(target), dtype="fp32", draft="none")
    inside, release = threading.Event(), threading.Event()
    encode = engine.tokenizer.encode

    def held_encode(text):
        inside.set()
        assert release.wait(WAIT)
        return encode(text)

    engine.tokenizer.encode = held_encode
    with running_server(engine) as url:
        answer = {}
        body = {"prompt": PROMPT, "max_tokens": 2}

        def ask():
            answer["r"] = httpx.post(f"{url}/v1/completions", json=body, timeout=WAIT)

        request = threading.Thread(target=ask)
        request.start()
        assert inside.wait(WAIT)
        health = httpx.get(f"{url}/health", timeout=WAIT)
        release.set()
        request.join(WAIT)
    assert health.status_code == 200
    assert answer["r"].status_code == 200


def test_the_openai_client_with_its_optional_fields(target):
    engine = load_engine(str(target), dtype="fp32", draft=str(target))
    with running_server(engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=WAIT)
        model = client.models.list().data[0].id
        options = {
            "model": model,
            "max_tokens": 6,
            "temperature": 0.7,
            "top_p": 0.95,
            "seed": 9,
            "stop": ["w90"],
            "logit_bias": {"7": 3},
            "presence_penalty": 0.5,
            "frequency_penalty": 0.5,
            "user": "someone",
        }
        messages = [{"role": "user", "content": "w3 w4"}]
        chat = client.chat.completions.create(
            messages=messages,
            logprobs=True,
            top_logprobs=2,
            response_format={"type": "text"},
            **options,
        )
        streamed = client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **options
        )
        pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
        completion = client.completions.create(prompt=PROMPT, logprobs=2, **options)
        with pytest.raises(openai.BadRequestError, match="tools"):
            client.chat.completions.create(
                messages=messages,
                tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
                **options,
            )
    assert chat.choices[0].message.content == "".join(pieces)  # same seed, same text
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    assert len(completion.choices[0].logprobs.tokens) == completion.usage.completion_tokens


def test_a_full_queue_refuses_before_the_body_is_parsed(target):
    engine = load_engine(
        str(target), dtype="fp32", draft="none", max_queue=0, max_request_bytes=4096
    )
    engine.pause()  # the worker takes nothing: a queue of 0 holds no request
    try:
        client = TestClient(create_app(engine))
        headers = {"content-type": "application/json"}
        response = client.post("/v1/completions", content=b"{not json", headers=headers)
        oversized = client.post("/v1/completions", content=b" " * 5000, headers=headers)
    finally:
        engine.close()
    assert oversized.status_code == 413  # too large whatever the load
    assert response.status_code == 429  # not 400: the body was never parsed
    assert int(response.headers["retry-after"]) >= 1


def test_concurrent_requests_decode_in_one_batch_each_as_it_would_alone(target):
    """Four requests queued while the worker is held all join one batch; each answer (greedy,
    or sampled with its seed) is the one a batch-1 engine gives."""
    engine = load_engine(str(target), dtype="bf16", draft="none", max_batch=4)
    alone = load_engine(str(target), dtype="bf16", draft="none")
    bodies = [
        {"prompt": "w1 w2 w3", "max_tokens": 9, "temperature": 0},
        {"prompt": "w7", "max_tokens": 5, "temperature": 0},
        {"prompt": "w4 w4 w5 w6", "max_tokens": 12, "temperature": 0.8, "seed": 3},
        {"prompt": "w9 w8", "max_tokens": 7, "temperature": 1.0, "seed": 4},
    ]
    sizes, observe = [], engine.metrics.observe
    engine.metrics.observe = lambda record: (sizes.append(len(engine.active)), observe(record))
    engine.pause()
    answers = {}
    try:
        with running_server(engine) as url:

            def ask(i):
                answers[i] = httpx.post(f"{url}/v1/completions", json=bodies[i], timeout=WAIT)

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + WAIT
            while engine.queue_length() < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            engine.resume()
            for thread in threads:
                thread.join(WAIT)
        client = TestClient(create_app(alone))
        expected = [text_of(post(client, body)) for body in bodies]
    finally:
        alone.close()
    assert [text_of(answers[i]) for i in range(4)] == expected
    assert max(sizes) == 4  # all four ran in one batch
