"""How to time a verify pass so it costs what decoding pays: the two readings of
`moespec.calibrate.verify.time_pass` against the passes inside `generate()`'s own loop.

    python benchmarks/verify_modes.py --out benchmarks/results/verify_modes_demo.json

For each held-out prompt the target's greedy continuation is the text; around its middle
(prompt + tokens // 2) each (kernel, n) is timed three ways, in one process:

- "decode": `generate()` decoding a window of the continuation with an oracle whose every draft
  is right at a draft length of n - 1 (plain decoding at n = 1) and the kernel fixed, so each
  step verifies n tokens; the median of the steps' verify passes (`StepRecord.verify_seconds`).
  This is the cost the sweep of `moespec evaluate` and a user's decoding pay.
- "isolated": one pass at the depth, rolled back (the plan's and the evaluation's reading
  before this benchmark).
- "stream": a run of consecutive passes through the text centred on the depth, the first
  untimed, the median of the rest (`--stream-passes`; the reading they take now).

Each round times every (prompt, kernel, n, reading) once in a seeded random order; a reading's
ratio to "decode" is paired within the round and prompt. Written after every round; Ctrl-C
keeps the rounds done.
"""

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moespec.bench.stats import ratio_range  # noqa: E402
from moespec.calibrate.evaluate import evaluation_prompts  # noqa: E402
from moespec.calibrate.verify import STREAM_PASSES, pass_span, time_pass  # noqa: E402
from moespec.cli.options import checkpoint_dir, positive_int  # noqa: E402
from moespec.decoding import DraftLengthPolicy, KernelPolicy, OracleDrafter, generate  # noqa: E402
from moespec.decoding.setup import greedy_reference  # noqa: E402
from moespec.demo import demo_paths, describe  # noqa: E402
from moespec.files import check_writable, write_json  # noqa: E402
from moespec.kernels.cpu import weight_paths  # noqa: E402
from moespec.models import load_model  # noqa: E402
from moespec.provenance import provenance  # noqa: E402

READINGS = ("decode", "isolated", "stream")


def sizes(text: str) -> list[int]:
    """--sizes: comma-separated pass sizes >= 1."""
    return [positive_int(x) for x in text.split(",")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=checkpoint_dir, help="checkpoint (default: the demo target)"
    )
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--sizes", type=sizes, default=[1, 2, 5, 9], help="pass sizes n")
    parser.add_argument("--prompts", type=positive_int, default=2)
    parser.add_argument("--prompt-tokens", type=positive_int, default=64)
    parser.add_argument("--tokens", type=positive_int, default=256, help="continuation length")
    parser.add_argument(
        "--window", type=positive_int, default=64, help="tokens `generate()` decodes a round"
    )
    parser.add_argument("--stream-passes", type=positive_int, default=STREAM_PASSES)
    parser.add_argument("--rounds", type=positive_int, default=30)
    parser.add_argument("--warmup", type=int, default=2, help="rounds run and not kept")
    parser.add_argument("--threads", type=positive_int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    largest = max(args.sizes)
    if args.window < 4 * largest:
        parser.error(f"--window {args.window}: at least four passes of the largest n ({largest})")
    try:
        check_writable(args.out, force=args.force)
    except FileExistsError:
        raise SystemExit(
            f"verify_modes.py: {args.out} exists: pass --force to overwrite it"
        ) from None
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else demo_paths()[0]
    model, tokenizer = load_model(model_dir, dtype=args.dtype)
    model.batch_invariant = True  # as `moespec evaluate` runs it
    try:
        prompts = evaluation_prompts(tokenizer, args.prompts, args.prompt_tokens)
    except ValueError as e:
        parser.error(f"--prompts {args.prompts}, --prompt-tokens {args.prompt_tokens}: {e}")
    depth = args.prompt_tokens + args.tokens // 2
    first, end = pass_span(depth, largest, "stream", args.stream_passes)
    start = depth - args.window // 2  # where the decode window begins
    if min(first, start) < 0 or max(end, start + args.window + largest) > depth + args.tokens // 2:
        parser.error(
            f"--tokens {args.tokens}: too short for --window {args.window} and "
            f"--stream-passes {args.stream_passes} at n = {largest} around depth {depth}"
        )
    streams = []
    for prompt in prompts:
        stream = prompt + greedy_reference(model, prompt, args.tokens, KernelPolicy("auto", 2))
        cache = model.new_cache(capacity=len(stream) + 1)
        model(torch.tensor(stream[:depth]), cache, kernel="dedup")
        streams.append((stream, cache))

    def decode(stream, n, kernel) -> float:
        """The median verify pass of `generate()` decoding the window, every draft right."""
        oracle = OracleDrafter(stream[start:], start, 1.0, model.config.vocab_size)
        records = generate(
            model,
            stream[:start],
            max_tokens=args.window,
            kernels=KernelPolicy(kernel),
            drafter=oracle,
            draft_policy=DraftLengthPolicy(n - 1),
        )
        steps = [r.verify_seconds for r in records if r.phase == "decode" and r.drafted == n - 1]
        return statistics.median(steps[2:])  # the window's first steps settle the loop

    def one(reading, index, n, kernel) -> float:
        stream, cache = streams[index]
        if reading == "decode":
            return decode(stream, n, kernel)
        return time_pass(
            model, cache, stream, depth, n, kernel, mode=reading, passes=args.stream_passes
        )

    cells = [(i, n, k) for i in range(len(streams)) for n in args.sizes for k in ("slot", "dedup")]
    rng = random.Random(args.seed)
    times = {(r, n, k): [] for r in READINGS for n in args.sizes for k in ("slot", "dedup")}
    kept = 0
    try:
        for round_index in range(args.warmup + args.rounds):
            order = [(reading, *cell) for cell in cells for reading in READINGS]
            got = {item: one(*item) for item in rng.sample(order, len(order))}
            if round_index < args.warmup:
                continue
            kept += 1
            for (reading, _, n, kernel), seconds in sorted(got.items()):
                times[reading, n, kernel].append(seconds)
            summary = {}
            for n in args.sizes:
                for kernel in ("slot", "dedup"):
                    truth = times["decode", n, kernel]

                    def over(reading, n=n, kernel=kernel, truth=truth):
                        pairs = zip(times[reading, n, kernel], truth, strict=True)
                        return ratio_range([x / y for x, y in pairs])

                    summary[f"{kernel} n={n}"] = {
                        "decode_ms": statistics.median(truth) * 1e3,
                        **{
                            f"{reading}_over_decode": ratio_range(
                                [
                                    x / y
                                    for x, y in zip(times[reading, n, kernel], truth, strict=True)
                                ]
                            )
                            for reading in READINGS[1:]
                        },
                    }
            result = {
                "benchmark": "verify_modes",
                "provenance": provenance(model.embed.device),
                "settings": {**vars(args), "model": describe(model_dir), "depth": depth},
                "weights": weight_paths(model.expert_format, model.dense_format, model.dtype),
                "rounds_done": kept,
                "seconds": {f"{r} {k} n={n}": v for (r, n, k), v in times.items()},
                "summary": summary,
            }
            result["settings"].pop("out")
            write_json(args.out, result, force=True if kept > 1 else args.force)
    except KeyboardInterrupt:
        print(f"interrupted: {kept} rounds kept in {args.out}", file=sys.stderr)
        return 130
    print(f"{'pass':12s} {'decode (ms)':>11s}   isolated / decode     stream / decode")
    for name, row in summary.items():
        parts = [
            f"{row[f'{r}_over_decode']['median']:.3f} ({row[f'{r}_over_decode']['min']:.2f}-"
            f"{row[f'{r}_over_decode']['max']:.2f})"
            for r in READINGS[1:]
        ]
        print(f"{name:12s} {row['decode_ms']:11.3f}   {parts[0]:18s}  {parts[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
