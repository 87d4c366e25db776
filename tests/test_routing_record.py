"""Recording routing: the documents of a corpus, and every token's experts as the model routes it
(checked against `transformers`' own router logits on tiny checkpoints it writes)."""

import json

import numpy as np
import pytest
import torch

from moespec.models import load_model
from moespec.routing.corpus import Document, read_corpus
from moespec.routing.record import (
    RoutingRecorder,
    model_header,
    record_routing,
    record_trace,
    tokenize_documents,
)

pytest.importorskip("transformers")


def hf_routing(hf, token_ids, top_k, renormalize):
    """(ids [T, L, m], weights [T, L, m]) from transformers' router logits, one long pass."""
    with torch.no_grad():
        logits = hf(torch.tensor([token_ids]), output_router_logits=True).router_logits
    probs = torch.softmax(torch.stack(logits, dim=1).float(), dim=-1)  # [T, L, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids.numpy(), weights.numpy()


def sort_slots(ids, weights):
    order = np.argsort(ids, axis=-1)
    return np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_recorded_experts_are_the_models_own_routing(checkpoint_dir, family):
    directory, hf = checkpoint_dir(family)
    model, _ = load_model(directory, dtype="fp32")
    rng = np.random.default_rng(0)
    documents = [("long", rng.integers(0, 95, 23).tolist()), ("short", [5, 17, 33])]
    # chunks of 5: the KV cache carries each document across its chunks
    recorded = list(record_routing(model, documents, chunk_tokens=5))
    assert [r.name for r in recorded] == ["long", "short"]
    for (_, token_ids), r in zip(documents, recorded, strict=True):
        assert r.expert_ids.shape == (len(token_ids), len(model.moe_blocks), model.config.top_k)
        expected_ids, expected_weights = hf_routing(
            hf, token_ids, model.config.top_k, model.config.norm_topk_prob
        )
        ids, weights = sort_slots(r.expert_ids.astype(np.int64), r.gate_weights)
        want_ids, want_weights = sort_slots(expected_ids, expected_weights)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(weights, want_weights, atol=1e-5)


def test_the_trace_covers_every_token_of_every_document_and_names_its_layers(checkpoint_dir):
    directory, _ = checkpoint_dir("qwen3_moe")  # decoder layer 1 is a dense MLP
    model, tokenizer = load_model(directory, dtype="fp32")
    documents = [Document("a", "w1 w2 w3 w4 w5 w6 w7"), Document("b", "w9 w8"), Document("c", "")]
    trace = record_trace(model, tokenizer, documents, chunk_tokens=3)
    assert trace.doc_names == ["a", "b"]  # "c" has no tokens
    assert np.diff(trace.doc_starts).tolist() == [7, 2]
    assert trace.layer_indices == [0, 2]
    assert trace.expert_bytes == [model.moe_blocks[i].experts.bytes_per_expert for i in (0, 2)]
    assert (trace.num_experts, trace.top_k, trace.dtype) == (8, 2, "fp32")


def test_max_tokens_cuts_the_last_document_and_stops(checkpoint_dir):
    _, tokenizer = load_model(checkpoint_dir("olmoe")[0], dtype="fp32")
    documents = [Document(n, "w1 w2 w3 w4") for n in ("a", "b", "c")]
    taken = tokenize_documents(tokenizer, documents, max_tokens=6)
    assert [(name, len(ids)) for name, ids in taken] == [("a", 4), ("b", 2)]


def test_a_dense_model_has_nothing_to_trace(checkpoint_dir):
    model, _ = load_model(checkpoint_dir("qwen3")[0], dtype="fp32")
    with pytest.raises(ValueError, match="has no MoE layers"):
        model_header(model)


def test_the_recorder_refuses_routing_from_an_unknown_layer():
    recorder = RoutingRecorder([0, 2], num_experts=8)
    with pytest.raises(ValueError, match="layer 1, which is not an MoE layer"):
        recorder(1, torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2))


def test_a_folder_gives_one_document_per_file_named_by_its_path(tmp_path):
    corpus = tmp_path / "wiki"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "b.txt").write_text("second")
    (corpus / "a.txt").write_text("first")
    (corpus / "sub" / "c.txt").write_text("third")
    (corpus / ".hidden").write_text("skipped")
    documents = list(read_corpus([corpus]))
    assert [(d.name, d.text) for d in documents] == [
        ("wiki/a.txt", "first"),
        ("wiki/b.txt", "second"),
        ("wiki/sub/c.txt", "third"),
    ]


def test_jsonl_gives_one_document_per_line(tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [{"id": "x", "body": "one"}, {"body": "two"}]
    path.write_text(json.dumps(lines[0]) + "\n\n" + json.dumps(lines[1]) + "\n")
    documents = list(read_corpus([path], text_field="body"))
    assert [(d.name, d.text) for d in documents] == [("x", "one"), ("data.jsonl:3", "two")]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "a"}\n{oops\n', "data.jsonl:2: not valid JSON"),
        ('{"body": "a"}\n', "data.jsonl:1: no string field 'text'"),
        ('{"id": 1, "text": "a"}\n{"id": 1, "text": "b"}\n', "document name '1' appears twice"),
    ],
)
def test_bad_jsonl_is_refused_naming_the_line(tmp_path, content, message):
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        list(read_corpus([path]))


def test_missing_and_binary_corpus_files_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such corpus file or folder"):
        list(read_corpus([tmp_path / "absent"]))
    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="blob.txt: not UTF-8 text"):
        list(read_corpus([binary]))


def test_per_document_cuts_every_document_to_its_first_tokens(checkpoint_dir):
    _, tokenizer = load_model(checkpoint_dir("olmoe")[0], dtype="fp32")
    documents = [Document("a", "w1 w2 w3 w4"), Document("b", "w5 w6"), Document("c", "w7")]
    taken = tokenize_documents(tokenizer, documents, per_document=3)
    whole = tokenize_documents(tokenizer, documents)
    assert [(name, ids) for name, ids in taken] == [(name, ids[:3]) for name, ids in whole]
    assert [len(ids) for _, ids in taken] == [3, 2, 1]
