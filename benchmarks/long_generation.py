"""Does anything grow with the generation? Per-token time from token 64 to token 2,048.

    python benchmarks/long_generation.py --out benchmarks/results/long_generation_demo.json

Decodes `--tokens` tokens greedily from a held-out prompt of the demo corpus, plainly and with
`--draft auto` (cold: no remembered measurements) in alternating rounds in one process, each
record streamed through the detokenizer as `moespec generate` streams it. Per window of
`--window` tokens it reports the median over rounds of: wall time per emitted token (the whole
step: choosing and drafting, the target pass, verification, detokenizing), the target pass's own
time per emitted token, and their difference (the work around the pass, which is what must not
grow). The pass itself grows with the context by its attention over more keys, a cost of the
model, not of the engine: `pass_per_token` shows how much.

The demo target was trained on 1,024 positions; past them its text is noise, but its steps
cost what they cost (rotary positions are computed for any position), which is what is measured.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_draft_eval import greedy_speculation, prompts_from_held_out  # noqa: E402

from moespec.decoding import generate  # noqa: E402
from moespec.demo import demo_paths, describe  # noqa: E402
from moespec.files import check_writable, write_json  # noqa: E402
from moespec.models import StreamingDetokenizer, load_model  # noqa: E402
from moespec.provenance import provenance  # noqa: E402


def run_arm(target, tokenizer, prompt, tokens, make) -> list[tuple[int, float, float]]:
    """[(tokens emitted, wall seconds, pass seconds)] per decode step, detokenized as the CLI
    does."""
    stream = StreamingDetokenizer(tokenizer)
    steps = []
    last = time.perf_counter()
    records = generate(
        target, prompt, max_tokens=tokens, drafter=make() if make else None, stop_tokens=()
    )
    for record in records:
        stream.add(record.tokens)
        now = time.perf_counter()
        if record.phase == "decode":
            steps.append((len(record.tokens), now - last, record.verify_seconds))
        last = time.perf_counter()
    return steps


def windows(steps, size: int) -> list[dict]:
    """Per window of `size` emitted tokens: wall, pass and other seconds per token."""
    out, emitted, at = [], 1, 0  # the prefill emitted the first token
    while at < len(steps):
        start, wall, passes, count = emitted, 0.0, 0.0, 0
        while at < len(steps) and emitted < start + size:
            n, w, p = steps[at]
            wall, passes, count, emitted, at = wall + w, passes + p, count + n, emitted + n, at + 1
        out.append({"from": start, "tokens": count, "wall": wall, "pass": passes})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="target checkpoint (default: the demo target)")
    parser.add_argument("--draft", help="draft checkpoint of auto (default: the demo draft)")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--out", required=True)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    check_writable(args.out, force=args.force)
    if args.threads:
        torch.set_num_threads(args.threads)
    target_dir, draft_dir = demo_paths()
    target_dir, draft_dir = args.model or target_dir, args.draft or draft_dir
    target, tokenizer = load_model(target_dir)
    prompt = prompts_from_held_out(tokenizer, 1, 64, 0)[0]["ids"]

    def make():
        return greedy_speculation(f"auto:{draft_dir}", target, tokenizer, prompt, args.tokens)

    arms = {"plain": None, "auto": make}
    for maker in arms.values():  # the same warm-up
        run_arm(target, tokenizer, prompt, 64, maker)
    per_round = {name: [] for name in arms}
    for r in range(args.rounds):
        for name in arms if r % 2 == 0 else reversed(list(arms)):
            steps = run_arm(target, tokenizer, prompt, args.tokens, arms[name])
            per_round[name].append(windows(steps, args.window))
            print(f"round {r + 1}/{args.rounds} {name}", file=sys.stderr, flush=True)
    result = {"arms": {}}
    for name, rounds in per_round.items():
        rows = []
        for i in range(min(len(w) for w in rounds)):
            cells = [w[i] for w in rounds]
            wall = statistics.median(c["wall"] / c["tokens"] for c in cells)
            passes = statistics.median(c["pass"] / c["tokens"] for c in cells)
            other = statistics.median((c["wall"] - c["pass"]) / c["tokens"] for c in cells)
            rows.append(
                {
                    "from_token": cells[0]["from"],
                    "wall_per_token_ms": wall * 1e3,
                    "pass_per_token_ms": passes * 1e3,
                    "other_per_token_ms": other * 1e3,
                }
            )
        first = next((r for r in rows if r["from_token"] >= 64), rows[0])  # past the warm-up
        last = rows[-1]
        result["arms"][name] = {
            "windows": rows,
            "last_over_first_from_token_64": {
                key: last[key] / first[key]
                for key in ("wall_per_token_ms", "pass_per_token_ms", "other_per_token_ms")
            },
        }
    write_json(
        args.out,
        {
            "title": f"{describe(target_dir)}: per-token time over {args.tokens} tokens",
            "provenance": provenance(
                settings={k: v for k, v in vars(args).items() if k not in ("out", "force")}
            ),
            **result,
        },
        force=args.force,
    )
    for name, arm in result["arms"].items():
        print(name, {k: round(v, 3) for k, v in arm["last_over_first_from_token_64"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
