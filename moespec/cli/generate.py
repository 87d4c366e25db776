"""Generate text with an MoE model, streaming it as it is decoded, optionally speculating.

Loads a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json) and
decodes at batch size 1 (default: the embedded demo MoE, drafted by its demo draft). The
expert kernel of each pass is chosen by --kernel: "slot" (per-slot), "dedup" (deduplicating),
or "auto": per-slot below the crossover pass size (from --crossover or --plan), else the
kernel measured faster at each pass size as decoding goes. With --draft, each step drafts k
tokens and verifies them in one pass of k + 1: --draft-length K fixes k; "auto" takes k*(a)
from the cost model, with the acceptance a estimated online and the step times V(k) measured
online (or read from --plan), starting from what earlier runs measured on this machine
(--no-cache: from nothing). --draft auto (the default on the demo model) chooses per step
among the suffix drafter (the continuation of the longest earlier match of the text's end),
the draft model, prompt lookup and no draft, each drafter with its own acceptance and draft
cost; a step without a draft is a plain step. Temperature 0 is greedy.

--compare-plain decodes without speculation too, in --rounds paired rounds of alternating
order after an equal warm-up, and reports the median of the rounds' speedups with its range.

With --offload POLICY (spac, lru, static, static-layers, hybrid, spac-ar, ...) the target's
experts live in host memory and an expert cache of --expert-cache-ratio R of their bytes (or
--expert-cache-bytes B) on the compute device; the policy decides per layer which experts run
from the cache, are copied in, or run on the CPU. The prompt runs on the host and is the fit
split of the policy (or --offload-fit TRACE). A budget holding every expert runs in memory.
With --memory-budget SIZE (a converted model) the experts stay in its file on disk and are read
with direct I/O into a RAM cache of SIZE (auto: available memory less the dense weights and a
margin), run by the same policies.
"""

import argparse
import json
import sys
from dataclasses import asdict

from moespec.cli.options import (
    add_batch_invariant,
    add_dtype,
    add_offload,
    add_weights,
    checkpoint_dir,
    existing_file,
    non_negative_int,
    non_negative_number,
    number_in,
    offload_settings,
    positive_int,
    resolve_weights,
)
from moespec.errors import cli_text

HELP = "generate text (streamed), speculating with a draft, the kernel chosen per pass"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", help="the prompt text (or --batch FILE)")
    parser.add_argument(
        "--model",
        metavar="DIR",
        type=checkpoint_dir,
        help="checkpoint directory (default: the embedded demo MoE, drafted by its demo draft)",
    )
    parser.add_argument("--max-tokens", type=positive_int, default=128, metavar="N")
    parser.add_argument(
        "--draft",
        metavar="auto|auto:DIR|DIR|suffix[:CORPUS]|lookup|oracle:A|none",
        help="draft: auto chooses per step among the suffix drafter, prompt lookup, the "
        "draft model DIR of auto:DIR, and none; or one drafter: a checkpoint sharing the "
        "tokenizer, the suffix drafter (over the prompt, the output and the CORPUS files or "
        "directories, separated by ':'), prompt lookup, the oracle at acceptance A; or none "
        "(default: auto with the demo draft for the demo model, else none)",
    )
    parser.add_argument(
        "--draft-length",
        default="auto",
        metavar="K|auto",
        help="tokens drafted per step (default: auto, from the cost model)",
    )
    parser.add_argument(
        "--max-draft-length",
        type=non_negative_int,
        default=8,
        metavar="K",
        help="k_max for --draft-length auto (default 8)",
    )
    parser.add_argument(
        "--compare-plain",
        action="store_true",
        help="also decode without speculation, in paired rounds of alternating order, and "
        "report the median speedup with its range",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        metavar="N",
        help="paired rounds of --compare-plain (default 3)",
    )
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="neither read nor write the measurements earlier runs remembered (verify and "
        "draft times, acceptances: kept per machine, model, weights and threads in the user "
        "cache directory, or $MOESPEC_MEASUREMENTS)",
    )
    parser.add_argument(
        "--kernel",
        default="auto",
        choices=["auto", "slot", "dedup", "dedup-linear", "reference"],
        help="expert kernel of each pass (default: auto)",
    )
    parser.add_argument(
        "--crossover",
        type=positive_int,
        metavar="N",
        help="with --kernel auto: deduplicate from n = N",
    )
    parser.add_argument(
        "--plan",
        metavar="FILE",
        type=existing_file,
        help="plan.json from `moespec plan`: its crossover sets --kernel auto's switch and "
        "its verify times the draft-length policy's V(k)",
    )
    add_dtype(parser)
    add_weights(parser)
    add_batch_invariant(
        parser,
        "verification passes give every token the bits it gets alone, so greedy "
        "speculation equals plain greedy decoding in bf16 too (default: on)",
    )
    parser.add_argument(
        "--compile",
        default="off",
        choices=["auto", "on", "off"],
        help="one-token decode steps compiled by torch.compile (a C++ compiler needed; a "
        "failure decodes eagerly with a note): auto for small models, on for any; the "
        "draft's always, the target's only with --batch-invariant off (default: off, as "
        "compiling takes tens of seconds)",
    )
    parser.add_argument(
        "--truncate",
        default="none",
        choices=["none", "left"],
        help="a prompt beyond the model's context (with --max-tokens): refuse it (none, the "
        "default) or keep its last tokens that fit (left)",
    )
    parser.add_argument(
        "--context",
        type=positive_int,
        metavar="N",
        help="positions of context (prompt + generated): the KV cache it needs must fit in "
        "memory beside the weights, or the run is refused before loading (default: the "
        "model's own, capped to what the available memory holds)",
    )
    parser.add_argument(
        "--stop-repeats",
        type=non_negative_int,
        default=8,
        metavar="R",
        help="stop when the output ends in R copies in a row of one n-gram (1-32 tokens, 24 "
        "tokens at least): finish reason 'repetition' (default 8; 0: never)",
    )
    parser.add_argument(
        "--temperature", type=non_negative_number, default=0.0, help="0 = greedy (default)"
    )
    parser.add_argument("--top-p", type=number_in(0, 1, low_open=True), default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=positive_int,
        metavar="N",
        help="intra-op threads at most (default: the library's); small products and small "
        "models' passes run on one thread whatever N (moespec.kernels.threads)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    batch = parser.add_argument_group("many prompts, decoded together")
    batch.add_argument(
        "--batch",
        metavar="FILE.jsonl",
        type=existing_file,
        help='one JSON object per line: {"prompt": ..., optional "id", "max_tokens", '
        '"temperature", "top_p", "seed"}; decoded up to --max-batch at a time, one pass per '
        "step for all of them, each result written to --out as it finishes (a rerun resumes)",
    )
    batch.add_argument("--out", metavar="FILE.jsonl", help="--batch's results")
    batch.add_argument(
        "--max-batch",
        type=positive_int,
        default=8,
        metavar="N",
        help="sequences decoded together (default 8)",
    )
    batch.add_argument(
        "--force", action="store_true", help="--batch: start the results afresh (overwrite)"
    )
    add_offload(parser)


def parse_draft_length(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise ValueError(
            f"--draft-length must be an integer >= 0 or 'auto', got {text!r}"
        ) from None
    if value < 0:
        raise ValueError(f"--draft-length must be >= 0, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    from moespec.session import GenerateSettings, generate_text

    if args.batch is not None or args.out is not None:
        return run_batch(args)
    if args.prompt is None:
        raise ValueError("give a prompt, or --batch FILE.jsonl with --out FILE.jsonl")

    settings = GenerateSettings(
        prompt=args.prompt,
        model=args.model,
        max_tokens=args.max_tokens,
        draft=args.draft,
        draft_length=parse_draft_length(args.draft_length),
        max_draft_length=args.max_draft_length,
        compare_plain=args.compare_plain,
        rounds=args.rounds,
        kernel=args.kernel,
        crossover=args.crossover,
        plan=args.plan,
        dtype=args.dtype,
        weights=resolve_weights(args),
        batch_invariant=args.batch_invariant == "on",
        compile=args.compile,
        truncate=args.truncate,
        context=args.context,
        stop_repeats=args.stop_repeats,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        threads=args.threads,
        remember=not args.no_cache,
        **asdict(offload_settings(args)),
    )
    result = generate_text(
        settings,
        on_prompt=None if args.json else echo_prompt,
        on_text=None if args.json else (lambda piece: print(piece, end="", flush=True)),
        on_note=lambda line: print(cli_text(line), file=sys.stderr),
    )
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    print()
    summary, kept = result.summary, len(result.prompt_tokens)
    print(format_summary(summary, len(result.tokens), kept, result.speculative), file=sys.stderr)
    if args.compile != "off":
        for name, report in result.compile.items():
            if report.get("note"):
                print(f"note: {name}: {report['note']}", file=sys.stderr)
    notes = format_notes(summary, kept, result.given_prompt_tokens, args.stop_repeats)
    print(notes, file=sys.stderr, end="")
    if summary.get("offload"):
        print(format_offload(summary["offload"]), file=sys.stderr)
    return 0


def format_notes(summary: dict, kept: int, given: int, repeats: int) -> str:
    """Lines on what changed the run: a truncated prompt, a loop that stopped it."""
    notes = ""
    if kept < given:
        notes += f"note: kept the last {kept} of the prompt's {given} tokens (--truncate left)\n"
    if summary["finish_reason"] == "repetition":
        notes += (
            f"note: stopped: the output repeated one n-gram {repeats} times in a row "
            "(--stop-repeats 0 decodes on)\n"
        )
    return notes


def echo_prompt(prompt: str) -> None:
    """On a terminal, the prompt (dimmed) before its continuation; piped output is the
    continuation alone."""
    if sys.stdout.isatty():
        print(f"\x1b[2m{prompt}\x1b[0m", end="", flush=True)


def format_offload(s: dict) -> str:
    rate = "n/a" if s["hit_rate"] is None else f"{s['hit_rate']:.2f}"
    return (
        f"[offload {s['policy']} on {s['device']}: cache {s['budget_bytes'] / 2**20:.1f} MiB "
        f"({s['slots']} experts of {s['total_expert_bytes'] // s['expert_bytes']}), hit rate "
        f"{rate}, {s['bytes_copied'] / 2**20:.1f} MiB copied, {s['cpu_experts']} experts on CPU"
        + format_disk(s)
        + "]"
    )


def format_disk(s: dict) -> str:
    """The disk tier's reads, where the experts came from disk."""
    if s.get("tier") != "disk":
        return ""
    rate = s["disk_bytes_read"] / s["read_seconds"] / 1e9 if s["read_seconds"] else 0.0
    how = "O_DIRECT" if s["o_direct"] else "buffered"
    return (
        f"; read {s['disk_bytes_read'] / 2**20:.1f} MiB in {s['disk_reads']} reads "
        f"({how}, {rate:.2f} GB/s while reading), stalled {s['stall_seconds']:.3f} s"
    )


def format_summary(summary: dict, generated: int, prompt: int, speculative: bool) -> str:
    rate = summary["tokens_per_second"]
    parts = [f"{generated} tokens", f"{rate:.1f} tokens/s" if rate else "n/a tokens/s"]
    if speculative and summary["mean_accepted_per_step"] is not None:
        parts.append(f"{summary['mean_accepted_per_step']:.2f} accepted drafts/step")
    if "compare" in summary:
        c = summary["compare"]
        low, high = c["speedup_range"]
        parts.append(
            f"{summary['speedup']:.2f}x plain (median of {len(c['rounds'])} paired rounds, "
            f"{low:.2f}-{high:.2f}; plain {c['plain_tokens_per_second']:.1f} tokens/s"
            + ("" if c["same_tokens_as_plain"] else "; tokens differ from plain")
            + ")"
        )
    parts.append(f"prompt {prompt} tokens in {summary['prefill_seconds']:.2f} s")
    return "[" + ", ".join(parts) + "]"


BATCH_ALONE = {  # settings of one generation that a batch file does not take
    "prompt": None,
    "compare_plain": False,
    "offload": None,
    "plan": None,
    "compile": "off",
    "truncate": "none",
    "context": None,
    "json": False,
}


def run_batch(args: argparse.Namespace) -> int:
    """generate --batch: the file's prompts decoded together (moespec.batchfile)."""
    from moespec.batchfile import BatchSettings, run_batch_file
    from moespec.progress import Progress, show_progress

    if args.batch is None or args.out is None:
        raise ValueError("--batch FILE.jsonl and --out FILE.jsonl go together")
    for name, default in BATCH_ALONE.items():
        if getattr(args, name) != default:
            flag = "a prompt" if name == "prompt" else "--" + name.replace("_", "-")
            raise ValueError(f"{flag} does not go with --batch")
    settings = BatchSettings(
        model=args.model,
        draft=args.draft or "none",
        max_batch=args.max_batch,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        dtype=args.dtype,
        kernel=args.kernel,
        draft_length=parse_draft_length(args.draft_length),
    )
    with Progress(show_progress()) as progress:
        progress.start("decoding the batch", unit="requests")

        def done(row):
            progress.advance(1)
            if "error" in row:
                print(f"note: {row['error']}", file=sys.stderr)

        counts = run_batch_file(
            args.batch,
            args.out,
            settings,
            force=args.force,
            on_note=lambda line: print(f"note: {line}", file=sys.stderr),
            on_result=done,
        )
    print(
        f"[{counts['finished']} requests finished, {counts['errors']} refused, "
        f"{counts['resumed']} already in {args.out}]",
        file=sys.stderr,
    )
    return 0
