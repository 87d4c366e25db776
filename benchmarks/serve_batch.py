"""Concurrent clients on `moespec serve`: the one-at-a-time server against continuous batching.

    python benchmarks/serve_batch.py --out benchmarks/results/serve_batch_demo.json

For each --max-batch setting (default 1, 4, 8) a server is started (`python -m moespec serve
--port 0 --max-batch B --max-queue 64`, the demo target, --draft as given, default none), and
--clients concurrent clients each send greedy completions of --tokens tokens, one after
another, on held-out prompts, for --seconds. Reported per setting: completed requests,
generated tokens per second over the window (aggregate throughput), the median request
latency, and answers by HTTP status (any 5xx fails the run). The settings run in --rounds
rounds, their order rotated each round; ratios to --max-batch 1 are taken within a round.
Every answer's text is checked against the one-at-a-time server's for its prompt.
"""

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from real_draft_eval import prompts_from_held_out  # noqa: E402

from moespec.files import check_writable, write_json  # noqa: E402
from moespec.provenance import provenance  # noqa: E402


def start_server(batch: int, draft: str) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "moespec", "serve", "--port", "0", "--max-queue", "64"]
    command += ["--max-batch", str(batch), "--draft", draft, "--no-cache"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    line = server.stdout.readline()
    if " on http" not in line:
        server.kill()
        raise RuntimeError(f"the server did not start: {line!r}")
    return server, line.rsplit(" ", 1)[1].strip()


async def load(url: str, prompts: list[str], clients: int, seconds: float, tokens: int):
    """(answers [(prompt index, text, completion tokens, latency)], statuses, window)."""
    answers, statuses = [], Counter()
    end = time.perf_counter() + seconds

    async def client(c: int, http: httpx.AsyncClient):
        i = c
        while time.perf_counter() < end:
            body = {"prompt": prompts[i % len(prompts)], "max_tokens": tokens, "temperature": 0}
            start = time.perf_counter()
            response = await http.post(f"{url}/v1/completions", json=body)
            statuses[response.status_code] += 1
            if response.status_code == 200:
                done = response.json()
                text, count = done["choices"][0]["text"], done["usage"]["completion_tokens"]
                answers.append((i % len(prompts), text, count, time.perf_counter() - start))
            i += clients

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        begin = time.perf_counter()
        await asyncio.gather(*(client(c, http) for c in range(clients)))
        window = time.perf_counter() - begin
    return answers, statuses, window


def run_setting(batch: int, args, prompts) -> dict:
    server, url = start_server(batch, args.draft)
    try:
        asyncio.run(load(url, prompts, args.clients, 3.0, args.tokens))  # warm-up
        answers, statuses, window = asyncio.run(
            load(url, prompts, args.clients, args.seconds, args.tokens)
        )
    finally:
        server.send_signal(2)
        server.wait(timeout=60)
    return {
        "batch": batch,
        "completed": len(answers),
        "tokens_per_second": sum(a[2] for a in answers) / window,
        "median_latency_seconds": statistics.median(a[3] for a in answers) if answers else None,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "server_exit_code": server.returncode,
        "texts": {str(i): text for i, text, _, _ in answers},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--draft", default="none")
    parser.add_argument("--out", required=True)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    out = check_writable(args.out, force=args.force)
    from moespec.demo import demo_paths
    from moespec.models import Tokenizer

    tokenizer = Tokenizer(Path(demo_paths()[0]) / "tokenizer.json")
    windows = prompts_from_held_out(tokenizer, 16, 48, seed=0)
    prompts = [tokenizer.decode(p["ids"]) for p in windows]
    batches = [int(b) for b in args.batches.split(",")]
    rounds = []
    for r in range(args.rounds):
        order = batches[r % len(batches) :] + batches[: r % len(batches)]
        rounds.append({b: run_setting(b, args, prompts) for b in order})
        for b in batches:
            row = rounds[-1][b]
            print(
                f"round {r + 1}: max-batch {b}: {row['tokens_per_second']:.1f} tok/s, "
                f"{row['completed']} requests, {row['statuses']}",
                flush=True,
            )
    summary, failures = [], 0
    reference = {}
    for rnd in rounds:
        reference.update(rnd[batches[0]]["texts"])
    same = all(
        reference.get(i, text) == text
        for rnd in rounds
        for row in rnd.values()
        for i, text in row["texts"].items()
    )
    for b in batches:
        ratios = [
            rnd[b]["tokens_per_second"] / rnd[batches[0]]["tokens_per_second"] for rnd in rounds
        ]
        failures += sum(int(s) >= 500 for rnd in rounds for s in rnd[b]["statuses"])
        summary.append(
            {
                "batch": b,
                "tokens_per_second": statistics.median(
                    rnd[b]["tokens_per_second"] for rnd in rounds
                ),
                "throughput_vs_one_at_a_time": statistics.median(ratios),
                "throughput_ratio_range": [min(ratios), max(ratios)],
                "median_latency_seconds": statistics.median(
                    rnd[b]["median_latency_seconds"] for rnd in rounds
                ),
            }
        )
    for rnd in rounds:
        for row in rnd.values():
            del row["texts"]
    result = {
        "benchmark": "serve_batch",
        "provenance": provenance(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "force")},
        "same_text_as_one_at_a_time": same,
        "responses_5xx": failures,
        "summary": summary,
        "rounds": [{str(b): row for b, row in rnd.items()} for rnd in rounds],
    }
    write_json(out, result, force=args.force)
    print(f"wrote {out}")
    return 1 if failures or not same else 0


if __name__ == "__main__":
    sys.exit(main())
