"""Routing traces and reuse: record, store (Parquet), estimate rho(n), U(n), u(n), simulate.

trace.py      RoutingTrace, the in-memory trace [T, L, m]
corpus.py     documents from text files and JSONL
record.py     teacher-forced recording through the model's routing sink
store.py      the Parquet file format (schema in its docstring), atomic writes, checked reads
reuse.py      rho_hat(n), U(n), u(n) (seed 000 App. D.2), bootstrap, fit/test split
synthetic.py  stationary routing processes with tunable locality, fitted to a target rho(2)
shapes.py     the routing shapes and expert bytes of full-size models
"""

from moespec.routing.reuse import (
    ReuseEstimate,
    ReuseReport,
    document_part,
    document_statistics,
    estimate,
    reuse_report,
    split_trace,
    static_coverage,
    uniform_curves,
)
from moespec.routing.shapes import SHAPES, ModelShape, get_shape
from moespec.routing.store import TraceFormatError, TraceWriter, read_trace, write_trace
from moespec.routing.synthetic import LocalityProcess, synthetic_trace, uniform_process
from moespec.routing.trace import RoutingTrace

__all__ = [
    "SHAPES",
    "LocalityProcess",
    "ModelShape",
    "ReuseEstimate",
    "ReuseReport",
    "RoutingTrace",
    "TraceFormatError",
    "TraceWriter",
    "document_part",
    "document_statistics",
    "estimate",
    "get_shape",
    "read_trace",
    "reuse_report",
    "split_trace",
    "static_coverage",
    "synthetic_trace",
    "uniform_curves",
    "uniform_process",
    "write_trace",
]
