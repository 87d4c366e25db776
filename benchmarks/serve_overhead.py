"""What the server adds to a request: `moespec serve` over loopback HTTP against the same
generator loop called directly, same engine, same inputs, in one process.

    python benchmarks/serve_overhead.py --out benchmarks/results/serve_demo.json

Defaults to the embedded demo pair, bf16, greedy, a fixed draft length (so both arms do the same
work: a chosen-online k would differ between them). Both arms are warmed alike, then run in
interleaved rounds (the order alternating per round) on every prompt; each request's wall time
is end to end (HTTP: request sent to body received, through uvicorn, the queue and the worker).
Reports per arm the median latency and completion tokens/s, and the paired ratio server/direct
with its range; checks that both arms produced the same tokens.
"""

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moespec.bench.stats import ratio_range  # noqa: E402
from moespec.decoding import Sampler, generate  # noqa: E402
from moespec.files import write_json  # noqa: E402
from moespec.provenance import provenance  # noqa: E402

PROMPTS = [
    "def fibonacci(n):",
    "class LRUCache:\n    def __init__(self, capacity):",
    "import os\n\ndef walk_files(root):",
]


def direct_runner(engine, text, tokens):
    prompt = engine.tokenizer.encode(text)

    def run():
        sampler = Sampler(0.0)
        drafter = engine.speculation.drafter(sampler, prompt, tokens, 0)
        start = time.perf_counter()
        records = list(
            generate(
                engine.model,
                prompt,
                max_tokens=tokens,
                sampler=sampler,
                kernels=engine.kernels,
                drafter=drafter,
                draft_policy=engine.speculation.policy,
                stop_tokens=engine.model.config.eos_token_ids,
            )
        )
        seconds = time.perf_counter() - start
        tokens_out = [t for r in records for t in r.tokens]
        return seconds, engine.tokenizer.decode(tokens_out), len(tokens_out)

    return run


def server_runner(http, text, tokens):
    body = {"prompt": text, "max_tokens": tokens, "temperature": 0}

    def run():
        start = time.perf_counter()
        response = http.post("/v1/completions", json=body)
        seconds = time.perf_counter() - start
        response.raise_for_status()
        answer = response.json()
        return seconds, answer["choices"][0]["text"], answer["usage"]["completion_tokens"]

    return run


def start_server(engine):
    import uvicorn

    from moespec.serve.app import create_app
    from moespec.serve.server import bind

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(engine), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: the demo pair)")
    parser.add_argument("--draft", help="draft spec (default: the demo draft with the demo)")
    parser.add_argument("--draft-length", type=int, default=4)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.force:
        parser.error(f"{args.out} exists (use --force)")
    import httpx

    from moespec.serve import load_engine

    engine = load_engine(
        args.model, draft=args.draft, draft_length=args.draft_length, dtype=args.dtype
    )
    server, thread, url = start_server(engine)
    load_before = os.getloadavg()
    results = {}
    try:
        with httpx.Client(base_url=url, timeout=600) as http:
            arms = {
                text: {
                    "direct": direct_runner(engine, text, args.tokens),
                    "server": server_runner(http, text, args.tokens),
                }
                for text in PROMPTS
            }
            for runs in arms.values():  # warm up alike
                for run in runs.values():
                    run()
            for text, runs in arms.items():
                samples = {"direct": [], "server": []}
                texts, counts = {}, {}
                for round_ in range(args.rounds):
                    order = ["direct", "server"] if round_ % 2 == 0 else ["server", "direct"]
                    for name in order:
                        seconds, produced, count = runs[name]()
                        samples[name].append(seconds)
                        texts.setdefault(name, set()).add(produced)
                        counts.setdefault(name, set()).add(count)
                ratios = [s / d for s, d in zip(samples["server"], samples["direct"], strict=True)]
                (tokens,) = counts["direct"] | counts["server"]  # one count, or this fails
                results[text] = {
                    "seconds": samples,
                    "median_seconds": {n: statistics.median(v) for n, v in samples.items()},
                    "server_over_direct": ratio_range(ratios),
                    "completion_tokens": tokens,
                    "median_tokens_per_second": {
                        n: tokens / statistics.median(v) for n, v in samples.items()
                    },
                    "same_text": texts["direct"] == texts["server"] and len(texts["direct"]) == 1,
                }
                row = results[text]
                print(
                    f"{text[:30]!r:34s} direct {row['median_seconds']['direct'] * 1e3:7.1f} ms  "
                    f"server {row['median_seconds']['server'] * 1e3:7.1f} ms  "
                    f"ratio {row['server_over_direct']['median']:.3f} "
                    f"[{row['server_over_direct']['min']:.3f}, "
                    f"{row['server_over_direct']['max']:.3f}]  same text {row['same_text']}",
                    flush=True,
                )
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.close()
    all_ratios = [
        s / d
        for row in results.values()
        for s, d in zip(row["seconds"]["server"], row["seconds"]["direct"], strict=True)
    ]
    extra_ms = [
        (s - d) * 1e3
        for row in results.values()
        for s, d in zip(row["seconds"]["server"], row["seconds"]["direct"], strict=True)
    ]
    summary = {
        "server_over_direct_median": statistics.median(all_ratios),
        "server_over_direct_range": [min(all_ratios), max(all_ratios)],
        "server_extra_ms_median": statistics.median(extra_ms),
        "same_text_everywhere": all(r["same_text"] for r in results.values()),
    }
    report = {
        "benchmark": "serve_overhead",
        "provenance": provenance(),
        "settings": {
            "model": engine.model_name,
            "draft": engine.speculation.name,
            "draft_length": args.draft_length,
            "dtype": args.dtype,
            "tokens": args.tokens,
            "rounds": args.rounds,
            "greedy": True,
            "prompts": PROMPTS,
            "transport": "HTTP/1.1 on loopback, uvicorn in a thread of the same process, httpx",
        },
        "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
        "results": results,
        "summary": summary,
    }
    write_json(args.out, report, force=args.force)
    for name, value in summary.items():
        print(f"{name:28s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
