"""The server's counters, rendered in the Prometheus text exposition format (version 0.0.4).

Fed by the worker with every StepRecord of the generator loop (tokens, drafted, accepted,
draft length, kernel, seconds) and by the app with every answer's HTTP status; with offloaded
experts, the offload engine's totals are read as the text is rendered (`offload_families`).
"""

import threading
from collections import Counter

from moespec.decoding import StepRecord

PREFIX = "moespec_"


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests = Counter()  # HTTP status code -> answers
        self.generations = Counter()  # finish reason (stop, length, cancelled, error) -> count
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.decode_tokens = 0
        self.decode_seconds = 0.0
        self.prefill_seconds = 0.0
        self.drafted = 0
        self.accepted = 0
        self.draft_lengths = Counter()  # chosen k -> decode steps
        self.kernel_passes = Counter()  # expert kernel -> target passes
        self.last_draft_length = 0
        self.last_acceptance_estimate = None
        self.last_tokens_per_second = None

    def count_request(self, status: int) -> None:
        with self.lock:
            self.requests[str(status)] += 1

    def count_generation(self, finish_reason: str, prompt_tokens: int, records) -> None:
        """One finished (or cancelled) generation: its prompt and its decode throughput."""
        decode = [r for r in records if r.phase == "decode"]
        tokens, seconds = sum(len(r.tokens) for r in decode), sum(r.seconds for r in decode)
        with self.lock:
            self.generations[finish_reason] += 1
            self.prompt_tokens += prompt_tokens
            if seconds > 0:
                self.last_tokens_per_second = tokens / seconds

    def observe(self, record: StepRecord) -> None:
        """One step of the generator loop."""
        with self.lock:
            self.generated_tokens += len(record.tokens)
            self.kernel_passes[record.kernel] += 1
            if record.phase == "prefill":
                self.prefill_seconds += record.seconds
                return
            self.decode_tokens += len(record.tokens)
            self.decode_seconds += record.seconds
            self.drafted += record.drafted
            self.accepted += record.accepted
            self.draft_lengths[record.draft_length] += 1
            self.last_draft_length = record.draft_length
            if record.acceptance_estimate is not None:
                self.last_acceptance_estimate = record.acceptance_estimate

    def render(
        self, queue_length: int, queue_capacity: int, running: int, offload: dict | None = None
    ) -> str:
        """The exposition text: HELP and TYPE lines, then samples; offload: the offload
        engine's summary (moespec.offload.engine.executor.OffloadEngine.summary), if any."""
        with self.lock:
            rate = self.decode_tokens / self.decode_seconds if self.decode_seconds else None
            acceptance = self.accepted / self.drafted if self.drafted else None
            families = [
                ("requests_total", "counter", "answers by HTTP status", "status", self.requests),
                (
                    "generations_total",
                    "counter",
                    "generations by finish reason",
                    "finish_reason",
                    self.generations,
                ),
                (
                    "prompt_tokens_total",
                    "counter",
                    "prompt tokens of finished generations",
                    None,
                    self.prompt_tokens,
                ),
                (
                    "generated_tokens_total",
                    "counter",
                    "tokens generated",
                    None,
                    self.generated_tokens,
                ),
                (
                    "decode_seconds_total",
                    "counter",
                    "seconds spent in decode steps",
                    None,
                    self.decode_seconds,
                ),
                (
                    "prefill_seconds_total",
                    "counter",
                    "seconds spent in prefill",
                    None,
                    self.prefill_seconds,
                ),
                (
                    "tokens_per_second",
                    "gauge",
                    "decode tokens per second over the server's life",
                    None,
                    rate,
                ),
                (
                    "last_tokens_per_second",
                    "gauge",
                    "decode tokens per second of the last generation",
                    None,
                    self.last_tokens_per_second,
                ),
                ("drafted_tokens_total", "counter", "draft tokens verified", None, self.drafted),
                ("accepted_tokens_total", "counter", "draft tokens accepted", None, self.accepted),
                (
                    "acceptance_rate",
                    "gauge",
                    "accepted / drafted over the server's life",
                    None,
                    acceptance,
                ),
                (
                    "acceptance_estimate",
                    "gauge",
                    "the draft-length policy's latest estimate of the geometric acceptance a",
                    None,
                    self.last_acceptance_estimate,
                ),
                (
                    "draft_length",
                    "gauge",
                    "draft length k chosen for the latest step",
                    None,
                    self.last_draft_length,
                ),
                (
                    "draft_length_steps_total",
                    "counter",
                    "decode steps by chosen draft length",
                    "k",
                    self.draft_lengths,
                ),
                (
                    "kernel_passes_total",
                    "counter",
                    "target passes by expert kernel",
                    "kernel",
                    self.kernel_passes,
                ),
                ("queue_length", "gauge", "requests waiting", None, queue_length),
                ("queue_capacity", "gauge", "requests that may wait", None, queue_capacity),
                ("running", "gauge", "requests generating (batch size 1)", None, running),
            ]
        if offload is not None:
            families += offload_families(offload)
        lines = []
        for name, kind, text, label, value in families:
            lines += [f"# HELP {PREFIX}{name} {text}", f"# TYPE {PREFIX}{name} {kind}"]
            if label is None:
                lines.append(f"{PREFIX}{name} {_number(value)}")
            else:  # a label's name and values, or a tuple of names and tuples of values
                names = label if isinstance(label, tuple) else (label,)
                for key, count in sorted(value.items(), key=lambda kv: str(kv[0])):
                    keys = key if isinstance(key, tuple) else (key,)
                    labels = ",".join(f'{n}="{k}"' for n, k in zip(names, keys, strict=True))
                    lines.append(f"{PREFIX}{name}{{{labels}}} {_number(count)}")
        return "\n".join(lines) + "\n"


def offload_families(summary: dict) -> list[tuple]:
    """The offload engine's totals over the server's life as metric families: its policy and
    tier, the cache, hits and misses, bytes brought in, and the decode loop's stalls on them."""
    disk = summary.get("tier") == "disk"
    # bytes read into the RAM cache and the CPU tier's staging (disk), else copied to the cache
    brought = summary["disk_bytes_read"] if disk else summary["bytes_copied"]
    stalled = summary["stall_seconds"] if disk else summary["copy_wait_seconds"]
    where = (summary["policy"], "disk" if disk else summary["device"])
    return [
        (
            "offload_info",
            "gauge",
            "the offload policy and the tier the expert cache fills from (disk) or lies on",
            ("policy", "tier"),
            {where: 1},
        ),
        ("offload_cache_bytes", "gauge", "the cache's budget", None, summary["budget_bytes"]),
        ("offload_cache_slots", "gauge", "experts the cache holds", None, summary["slots"]),
        (
            "offload_hit_rate",
            "gauge",
            "needed experts found in the cache and arrived, over the server's life",
            None,
            summary["hit_rate"],
        ),
        ("offload_hits_total", "counter", "needed experts found ready", None, summary["hits"]),
        ("offload_misses_total", "counter", "needed experts not ready", None, summary["misses"]),
        (
            "offload_cpu_experts_total",
            "counter",
            "experts computed on the CPU tier",
            None,
            summary["cpu_experts"],
        ),
        (
            "offload_bytes_read_total",
            "counter",
            "bytes read from disk (the disk tier) or copied into the expert cache",
            None,
            brought,
        ),
        (
            "offload_stall_seconds_total",
            "counter",
            "seconds the decode loop waited for experts to arrive",
            None,
            stalled,
        ),
    ]


def _number(value) -> str:
    if value is None:
        return "NaN"
    return repr(float(value)) if isinstance(value, float) else str(value)
