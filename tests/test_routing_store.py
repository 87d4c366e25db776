"""Trace files: the documented Parquet schema, a lossless round trip, atomic writes that keep
complete documents on Ctrl-C, and clear refusals of files that are not traces of this schema."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moespec.files import OutputExistsError
from moespec.routing import store
from moespec.routing.store import TraceFormatError, TraceWriter, read_trace, write_trace
from moespec.routing.synthetic import LocalityProcess, synthetic_trace
from tests.routing_traces import make_trace


def sample_trace(weights=True, num_experts=16):
    trace = synthetic_trace(
        LocalityProcess(num_experts, 3, keep_probability=0.5),
        num_layers=2,
        tokens=300,
        documents=4,
        expert_bytes=[100, 300],
        layer_indices=[1, 3],
        model="tiny",
    )
    trace.dtype = "bf16"
    trace.metadata = {"corpus": ["wiki.jsonl"], "chunk_tokens": 512}
    if weights:
        trace.gate_weights = np.random.default_rng(0).random(trace.expert_ids.shape, np.float32)
    return trace


def assert_same(read, trace):
    np.testing.assert_array_equal(read.expert_ids, trace.expert_ids)
    np.testing.assert_array_equal(read.doc_starts, trace.doc_starts)
    if trace.gate_weights is None:
        assert read.gate_weights is None
    else:  # bit for bit
        assert read.gate_weights.dtype == np.float32
        np.testing.assert_array_equal(
            read.gate_weights.view(np.uint32), trace.gate_weights.view(np.uint32)
        )
    for key in ("doc_names", "num_experts", "expert_bytes", "layer_indices", "model", "dtype"):
        assert getattr(read, key) == getattr(trace, key), key
    assert read.metadata == trace.metadata


@pytest.mark.parametrize("weights", [True, False])
def test_round_trip_is_lossless(tmp_path, weights):
    trace = sample_trace(weights)
    assert_same(read_trace(write_trace(trace, tmp_path / "t.parquet")), trace)


def test_round_trip_across_row_groups(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "ROW_GROUP_ROWS", 70)  # documents straddle row groups
    trace = sample_trace()
    path = write_trace(trace, tmp_path / "t.parquet")
    assert pq.ParquetFile(path).num_row_groups > 4
    assert_same(read_trace(path), trace)


def test_more_than_32768_experts_are_stored_as_int32(tmp_path):
    trace = make_trace({"d": [[[40_000, 3]], [[3, 7]]]}, num_experts=40_001)
    path = write_trace(trace, tmp_path / "t.parquet")
    assert pq.read_schema(path).field("experts").type == pa.list_(pa.int32(), 2)
    assert_same(read_trace(path), trace)


def test_file_has_the_documented_schema_and_metadata(tmp_path):
    trace = sample_trace()
    path = write_trace(trace, tmp_path / "t.parquet")
    schema = pq.read_schema(path)
    assert schema.names == ["document", "position", "layer", "experts", "weights"]
    assert schema.field("position").type == pa.int32()
    assert schema.field("layer").type == pa.int16()
    assert schema.field("experts").type == pa.list_(pa.int16(), 3)
    assert schema.field("weights").type == pa.list_(pa.float32(), 3)
    meta = {k.decode(): json.loads(v) for k, v in schema.metadata.items() if b"moespec" in k}
    assert meta["moespec.format"] == "moespec-routing-trace"
    assert meta["moespec.schema_version"] == 1
    assert (meta["moespec.num_layers"], meta["moespec.num_experts"], meta["moespec.top_k"]) == (
        2,
        16,
        3,
    )
    assert meta["moespec.expert_bytes"] == [100, 300]
    assert meta["moespec.layer_indices"] == [1, 3]
    assert meta["moespec.model"] == "tiny" and meta["moespec.dtype"] == "bf16"
    assert "moespec.version" in meta
    rows = pq.read_table(path).slice(0, 3).to_pylist()  # one row per (document, position, layer)
    assert [(r["document"], r["position"], r["layer"]) for r in rows] == [
        ("synthetic-0", 0, 1),
        ("synthetic-0", 0, 3),
        ("synthetic-0", 1, 1),
    ]
    assert rows[1]["experts"] == trace.expert_ids[0, 1].tolist()


def test_an_existing_file_is_kept_without_force(tmp_path):
    path = tmp_path / "t.parquet"
    path.write_text("precious")
    with pytest.raises(OutputExistsError, match="pass force=True"):
        write_trace(sample_trace(), path)
    assert path.read_text() == "precious"
    write_trace(sample_trace(), path, force=True)
    assert read_trace(path).num_documents == 4


def documents(trace):
    for d, (name, ids) in enumerate(trace.documents()):
        a, b = trace.doc_starts[d], trace.doc_starts[d + 1]
        yield name, ids, trace.gate_weights[a:b]


def test_an_error_while_writing_leaves_nothing(tmp_path):
    trace = sample_trace()
    header = store.trace_header(trace)
    with (
        pytest.raises(RuntimeError),
        TraceWriter(tmp_path / "t.parquet", header, with_weights=True) as w,
    ):
        for name, ids, weights in documents(trace):
            w.add(name, ids, weights)
        raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_keeps_the_complete_documents(tmp_path):
    trace = sample_trace()
    header = store.trace_header(trace)
    path = tmp_path / "t.parquet"
    with pytest.raises(KeyboardInterrupt), TraceWriter(path, header, with_weights=True) as w:
        for d, (name, ids, weights) in enumerate(documents(trace)):
            if d == 2:
                raise KeyboardInterrupt  # while routing the third document
            w.add(name, ids, weights)
    assert list(tmp_path.iterdir()) == [path]
    assert_same(read_trace(path), trace.select_documents(trace.doc_names[:2]))


def test_ctrl_c_before_any_document_leaves_nothing(tmp_path):
    header = store.trace_header(sample_trace())
    with (
        pytest.raises(KeyboardInterrupt),
        TraceWriter(tmp_path / "t.parquet", header, with_weights=True),
    ):
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_a_repeated_document_name_is_refused(tmp_path):
    trace = sample_trace()
    header = store.trace_header(trace)
    name, ids, weights = next(documents(trace))
    with (
        pytest.raises(ValueError, match="'synthetic-0' appears twice"),
        TraceWriter(tmp_path / "t.parquet", header, with_weights=True) as w,
    ):
        w.add(name, ids, weights)
        w.add(name, ids, weights)


def test_expert_ids_outside_the_experts_are_refused_before_writing(tmp_path):
    trace = sample_trace()
    header = store.trace_header(trace)
    name, ids, weights = next(documents(trace))
    ids = ids.astype(np.int32)
    ids[0, 0, 0] = 16  # N = 16
    with (
        pytest.raises(ValueError, match="expert ids must lie in 0..15"),
        TraceWriter(tmp_path / "t.parquet", header, with_weights=True) as w,
    ):
        w.add(name, ids, weights)
    assert list(tmp_path.iterdir()) == []


def assert_refused(path, message):
    with pytest.raises(TraceFormatError) as error:
        read_trace(path)
    text = str(error.value)
    assert text.startswith(f"{path}: ") and "\n" not in text
    assert message in text


def test_a_file_that_is_not_parquet_is_refused(tmp_path):
    path = tmp_path / "notes.parquet"
    path.write_text("not a trace\n")
    assert_refused(path, "not a readable Parquet file")


def test_a_truncated_file_is_refused(tmp_path):
    path = write_trace(sample_trace(), tmp_path / "t.parquet")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert_refused(path, "not a readable Parquet file")


@pytest.mark.parametrize("where", [1 / 4, 1 / 3, 1 / 2])
def test_a_corrupt_data_page_is_refused(tmp_path, where):
    path = write_trace(sample_trace(), tmp_path / "t.parquet")
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x5A
    path.write_bytes(bytes(data))
    assert_refused(path, "corrupt")


def test_a_parquet_file_of_another_kind_is_refused(tmp_path):
    path = tmp_path / "other.parquet"
    pq.write_table(pa.table({"a": [1, 2, 3]}), path)
    assert_refused(path, "not a moespec routing trace")


def rewrite(path, table, **metadata):
    meta = dict(table.schema.metadata)
    meta.update({f"moespec.{k}".encode(): json.dumps(v).encode() for k, v in metadata.items()})
    pq.write_table(table.replace_schema_metadata(meta), path)


def test_another_schema_version_is_refused(tmp_path):
    path = write_trace(sample_trace(), tmp_path / "t.parquet")
    rewrite(path, pq.read_table(path), schema_version=2)
    assert_refused(path, "schema version 2 is not supported (this moespec reads version 1)")


def test_a_column_of_the_wrong_type_is_refused(tmp_path):
    path = write_trace(sample_trace(), tmp_path / "t.parquet")
    table = pq.read_table(path)
    experts = pa.array([list(x) for x in table.column("experts").to_pylist()], pa.list_(pa.int64()))
    rewrite(path, table.set_column(3, "experts", experts))
    assert_refused(path, "column 'experts' has type list<")
    assert_refused(path, "expected fixed_size_list")


def test_rows_out_of_order_are_refused(tmp_path):
    path = write_trace(sample_trace(), tmp_path / "t.parquet")
    table = pq.read_table(path)
    order = np.arange(table.num_rows)
    order[2:6] = [4, 5, 2, 3]  # the first document's tokens 1 and 2 swapped (L = 2 rows each)
    rewrite(path, table.take(order))
    assert_refused(path, "positions do not run 0, 1, 2, ... within each document")
    rewrite(path, table.take(np.roll(np.arange(table.num_rows), 1)))
    assert_refused(path, "the layers of a token belong to different documents")


def test_metadata_that_contradicts_the_columns_is_refused(tmp_path):
    path = write_trace(sample_trace(), tmp_path / "t.parquet")
    rewrite(path, pq.read_table(path), layer_indices=[1, 2])
    assert_refused(path, "layer column does not repeat the layer indices [1, 2]")


def test_a_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such trace file"):
        read_trace(tmp_path / "absent.parquet")
