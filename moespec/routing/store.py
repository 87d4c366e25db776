"""Routing traces on disk: one Parquet file per trace, written atomically, read with checks.

Schema (version 1), one row per (document, position, MoE layer), rows ordered by document
(in trace order), then position, then layer:

    document  string                          document id, unique within the trace
    position  int32                           token position within the document, from 0
    layer     int16                           decoder layer index of the MoE layer
    experts   fixed_size_list<int16>[m]       the m experts the token selects (int32 if N > 32768)
    weights   fixed_size_list<float32>[m]     their gate weights (present when recorded)

File metadata (key-value pairs of the Parquet schema, values JSON-encoded):

    moespec.format          "moespec-routing-trace"
    moespec.schema_version  1
    moespec.model           model name
    moespec.num_layers      L, MoE layers
    moespec.num_experts     N, routed experts per layer
    moespec.top_k           m
    moespec.expert_bytes    [w_l], bytes of one expert of each MoE layer
    moespec.layer_indices   the decoder layer of each MoE layer
    moespec.dtype           weight dtype of the model that routed ("" for synthetic traces)
    moespec.version         moespec version that wrote the file
    moespec.metadata        anything else (corpus, chunking, synthetic process, ...)

Every data page carries a CRC32 checksum, verified on reading, so a corrupt page is refused
instead of read as wrong experts.
"""

import contextlib
import json
from pathlib import Path

import numpy as np

from moespec.routing.trace import RoutingTrace

FORMAT = "moespec-routing-trace"
SCHEMA_VERSION = 1
ROW_GROUP_ROWS = 1 << 20
_PREFIX = "moespec."
_HEADER_KEYS = ("model", "num_layers", "num_experts", "top_k", "expert_bytes", "layer_indices")


class TraceFormatError(ValueError):
    """A file is not a readable routing trace of the supported schema."""


def _id_type(num_experts: int):
    import pyarrow as pa

    return pa.int16() if num_experts <= 32768 else pa.int32()


def trace_schema(header: dict, *, with_weights: bool):
    """The Arrow schema of a trace file, its metadata made from `header` (see module doc)."""
    import pyarrow as pa

    from moespec import __version__

    m = header["top_k"]
    fields = [
        pa.field("document", pa.string(), nullable=False),
        pa.field("position", pa.int32(), nullable=False),
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("experts", pa.list_(_id_type(header["num_experts"]), m), nullable=False),
    ]
    if with_weights:
        fields.append(pa.field("weights", pa.list_(pa.float32(), m), nullable=False))
    values = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "version": __version__}
    values.update(header)
    try:
        metadata = {_PREFIX + key: json.dumps(value) for key, value in values.items()}
    except TypeError as error:
        raise ValueError(f"trace metadata must be JSON-serialisable: {error}") from None
    return pa.schema(fields, metadata=metadata)


def trace_header(trace: RoutingTrace) -> dict:
    return {
        "model": trace.model,
        "num_layers": trace.num_layers,
        "num_experts": int(trace.num_experts),
        "top_k": trace.top_k,
        "expert_bytes": [int(w) for w in trace.expert_bytes],
        "layer_indices": [int(i) for i in trace.layer_indices],
        "dtype": trace.dtype,
        "metadata": trace.metadata,
    }


class TraceWriter:
    """Stream documents into a trace file: a temporary file, renamed into place on success.

    On an exception the temporary file is removed and nothing is written, except on
    KeyboardInterrupt: then the documents added so far (each complete) are kept, if any.

        with TraceWriter(path, header, with_weights=True, force=False) as writer:
            writer.add(name, expert_ids, gate_weights)   # [T_d, L, m] each
    """

    def __init__(self, path, header: dict, *, with_weights: bool, force: bool = False):
        self.path = Path(path)
        self.header = header
        self.schema = trace_schema(header, with_weights=with_weights)
        self.with_weights = with_weights
        self.force = force
        self.names: set[str] = set()
        self.num_tokens = 0
        self._pending: list = []
        self._pending_rows = 0

    def __enter__(self) -> "TraceWriter":
        import pyarrow.parquet as pq

        from moespec.files import atomic_path

        self._stack = contextlib.ExitStack()
        tmp = self._stack.enter_context(atomic_path(self.path, force=self.force))
        try:
            self._writer = pq.ParquetWriter(tmp, self.schema, write_page_checksum=True)
        except BaseException:
            self._stack.close()  # removes the temporary file
            raise
        return self

    def add(self, name: str, expert_ids: np.ndarray, gate_weights: np.ndarray | None = None):
        """Append one complete document: expert_ids (and gate_weights) [T_d, L, m]."""
        import pyarrow as pa

        name = str(name)
        layers, m = self.header["num_layers"], self.header["top_k"]
        tokens = expert_ids.shape[0]
        if name in self.names:
            raise ValueError(f"document {name!r} appears twice")
        if expert_ids.shape[1:] != (layers, m) or tokens < 1:
            raise ValueError(f"document {name!r}: expert ids of shape {expert_ids.shape}")
        if expert_ids.min() < 0 or expert_ids.max() >= self.header["num_experts"]:
            raise ValueError(
                f"document {name!r}: expert ids must lie in 0..{self.header['num_experts'] - 1}"
            )
        if (gate_weights is not None) != self.with_weights:
            raise ValueError(f"document {name!r}: gate weights must be given for every document")
        rows = tokens * layers
        id_type = self.schema.field("experts").type.value_type
        columns = [
            pa.DictionaryArray.from_arrays(np.zeros(rows, np.int32), [name]).cast(pa.string()),
            pa.array(np.repeat(np.arange(tokens, dtype=np.int32), layers)),
            pa.array(np.tile(np.asarray(self.header["layer_indices"], np.int16), tokens)),
            _fixed_list(expert_ids.reshape(-1), m, id_type.to_pandas_dtype()),
        ]
        if self.with_weights:
            columns.append(_fixed_list(gate_weights.reshape(-1), m, np.float32))
        self._pending.append(pa.RecordBatch.from_arrays(columns, schema=self.schema))
        self._pending_rows += rows
        self.names.add(name)
        self.num_tokens += tokens
        if self._pending_rows >= ROW_GROUP_ROWS:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self._pending:
            table = pa.Table.from_batches(self._pending, schema=self.schema)
            self._writer.write_table(table, row_group_size=ROW_GROUP_ROWS)
        self._pending, self._pending_rows = [], 0

    def __exit__(self, kind, error, traceback) -> bool:
        keep = kind is None or (issubclass(kind, KeyboardInterrupt) and bool(self.names))
        try:
            if keep:
                self._flush()
            self._writer.close()
        except BaseException as failure:
            self._stack.__exit__(type(failure), failure, failure.__traceback__)
            raise
        if keep:
            self._stack.__exit__(None, None, None)  # rename into place
            return False
        return bool(self._stack.__exit__(kind, error, traceback))  # remove the temporary file


def _fixed_list(values: np.ndarray, size: int, dtype):
    import pyarrow as pa

    return pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(values, dtype)), size)


def write_trace(trace: RoutingTrace, path, *, force: bool = False) -> Path:
    """Write an in-memory trace to `path` atomically."""
    weights = trace.gate_weights
    with TraceWriter(path, trace_header(trace), with_weights=weights is not None, force=force) as w:
        for d, (name, ids) in enumerate(trace.documents()):
            a, b = trace.doc_starts[d], trace.doc_starts[d + 1]
            w.add(name, ids, None if weights is None else weights[a:b])
    return Path(path)


def read_header(path) -> dict:
    """The metadata of a trace file, checked against the supported format and version."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such trace file")
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as error:
        raise _format_error(path, f"not a readable Parquet file ({error})") from None
    raw = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
    if raw.get(_PREFIX + "format") != json.dumps(FORMAT):
        raise _format_error(path, "not a moespec routing trace (no moespec.format metadata)")
    header = {}
    try:
        for key, value in raw.items():
            if key.startswith(_PREFIX):
                header[key[len(_PREFIX) :]] = json.loads(value)
    except json.JSONDecodeError:
        raise _format_error(path, f"metadata {key} is not valid JSON") from None
    if header.get("schema_version") != SCHEMA_VERSION:
        raise _format_error(
            path,
            f"schema version {header.get('schema_version')} is not supported "
            f"(this moespec reads version {SCHEMA_VERSION})",
        )
    missing = [k for k in _HEADER_KEYS if k not in header]
    if missing:
        raise _format_error(path, f"metadata lacks {', '.join(_PREFIX + k for k in missing)}")
    problem = _header_problem(header)
    if problem:
        raise _format_error(path, problem)
    _check_columns(path, schema, header)
    return header


def _header_problem(header: dict) -> str | None:
    def whole(value, minimum):
        return isinstance(value, int) and not isinstance(value, bool) and value >= minimum

    layers = header["num_layers"]
    for key in ("num_layers", "num_experts", "top_k"):
        if not whole(header[key], 1):
            return f"metadata {_PREFIX}{key} = {header[key]!r} is not a positive integer"
    for key, minimum in (("expert_bytes", 1), ("layer_indices", 0)):
        values = header[key]
        if not isinstance(values, list) or len(values) != layers:
            return f"metadata {_PREFIX}{key} must list one value per layer ({layers})"
        if not all(whole(v, minimum) for v in values):
            return f"metadata {_PREFIX}{key} holds a value that is not an integer >= {minimum}"
    if not isinstance(header.get("metadata", {}), dict):
        return f"metadata {_PREFIX}metadata is not an object"
    return None


def _check_columns(path: Path, schema, header: dict) -> None:
    import pyarrow as pa

    m = header["top_k"]
    expected = {
        "document": [pa.string(), pa.dictionary(pa.int32(), pa.string())],
        "position": [pa.int32()],
        "layer": [pa.int16()],
        "experts": [pa.list_(pa.int16(), m), pa.list_(pa.int32(), m)],
        "weights": [pa.list_(pa.float32(), m)],
    }
    names = schema.names
    for name, types in expected.items():
        if name not in names:
            if name == "weights":
                continue
            raise _format_error(path, f"has no column {name!r}")
        found = schema.field(name).type
        if not any(found.equals(t) for t in types):
            raise _format_error(path, f"column {name!r} has type {found}, expected {types[0]}")


def read_trace(path) -> RoutingTrace:
    """Read a trace file written by `write_trace` or `TraceWriter`; refuse anything else
    (another schema or version, a truncated or corrupt file) with one line naming the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    header = read_header(path)
    try:
        table = pq.read_table(path, read_dictionary=["document"], page_checksum_verification=True)
        table = table.unify_dictionaries().combine_chunks()
    except (pa.ArrowException, OSError) as error:
        raise _format_error(path, f"corrupt or truncated ({error})") from None
    try:
        return _trace_from_table(table, header)
    except ValueError as error:
        raise _format_error(path, str(error)) from None


def _trace_from_table(table, header: dict) -> RoutingTrace:
    layers, m = header["num_layers"], header["top_k"]
    layer_indices = np.asarray(header["layer_indices"], np.int64)
    rows = table.num_rows
    if rows % layers:
        raise ValueError(f"{rows} rows is not a whole number of tokens of {layers} layers")
    tokens = rows // layers
    if tokens == 0:
        return _empty_trace(header)
    document = table.column("document").chunk(0)
    codes = document.indices.to_numpy()  # [T * L]
    token_codes = codes[::layers]  # [T]
    if np.any(codes.reshape(tokens, layers) != token_codes[:, None]):
        raise ValueError("the layers of a token belong to different documents")
    starts = np.flatnonzero(np.diff(token_codes) != 0) + 1
    doc_starts = np.concatenate([[0], starts, [tokens]]).astype(np.int64)
    dictionary = document.dictionary.to_pylist()
    names = [dictionary[c] for c in token_codes[doc_starts[:-1]]]
    if len(set(names)) != len(names):
        raise ValueError("a document's rows are not contiguous")
    _check_positions(table, tokens, doc_starts, layer_indices)
    ids = _column_values(table, "experts").reshape(tokens, layers, m)  # [T, L, m]
    weights = None
    if "weights" in table.column_names:
        weights = _column_values(table, "weights").reshape(tokens, layers, m)
    _check_distinct(ids)
    return _trace(header, ids, doc_starts, names, weights)


def _empty_trace(header: dict) -> RoutingTrace:
    ids = np.zeros((0, header["num_layers"], header["top_k"]), np.int16)
    return _trace(header, ids, np.zeros(1, np.int64), [], None)


def _trace(header: dict, ids, doc_starts, names, weights) -> RoutingTrace:
    return RoutingTrace(
        expert_ids=ids,
        doc_starts=doc_starts,
        doc_names=names,
        num_experts=header["num_experts"],
        expert_bytes=list(header["expert_bytes"]),
        layer_indices=[int(i) for i in header["layer_indices"]],
        model=header["model"],
        dtype=header.get("dtype", ""),
        gate_weights=weights,
        metadata=header.get("metadata", {}),
    )


def _column_values(table, name: str) -> np.ndarray:
    chunk = table.column(name).chunk(0)
    if chunk.null_count or chunk.flatten().null_count:
        raise ValueError(f"column {name!r} has missing values")
    return chunk.flatten().to_numpy()


def _check_positions(table, tokens: int, doc_starts: np.ndarray, layer_indices) -> None:
    layers = len(layer_indices)
    layer = table.column("layer").to_numpy().reshape(tokens, layers)
    if np.any(layer != layer_indices[None, :]):
        indices = [int(i) for i in layer_indices]
        raise ValueError(f"layer column does not repeat the layer indices {indices}")
    lengths = np.diff(doc_starts)
    expected = np.arange(tokens) - np.repeat(doc_starts[:-1], lengths)  # [T]
    position = table.column("position").to_numpy().reshape(tokens, layers)
    if np.any(position != expected[:, None]):
        raise ValueError("positions do not run 0, 1, 2, ... within each document")


def _check_distinct(ids: np.ndarray) -> None:
    if ids.size and np.any(np.diff(np.sort(ids, axis=-1), axis=-1) == 0):
        raise ValueError("a token selects the same expert twice in one layer")


def _format_error(path: Path, message: str) -> TraceFormatError:
    return TraceFormatError(f"{path}: {' '.join(message.split())}")
