"""Measurement code of the benchmark scripts (benchmarks/), kept in the package so that the
scripts are thin callers and the tests import only the package: the GPU expert-kernel
benchmark's passes, bytes, summary and timing, and random checkpoints of real shapes."""
