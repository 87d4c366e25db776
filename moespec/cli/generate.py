"""Generate text with an MoE model, streaming it as it is decoded, optionally speculating.

Loads a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json) and
decodes at batch size 1 (default: the embedded demo MoE, drafted by its demo draft). The
expert kernel of each pass is chosen by --kernel: "slot" (per-slot), "dedup" (deduplicating),
or "auto": per-slot below the crossover pass size (from --crossover or --plan), else the
kernel measured faster at each pass size as decoding goes. With --draft, each step drafts k
tokens and verifies them in one pass of k + 1: --draft-length K fixes k; "auto" takes k*(a)
from the cost model, with the acceptance a estimated online and the step times V(k) measured
online (or read from --plan). --draft auto (the default on the demo model) chooses per step
among the draft model, prompt lookup and no draft, each drafter with its own acceptance and
draft cost; a step without a draft is a plain step. Temperature 0 is greedy.

--compare-plain decodes without speculation too, in --rounds paired rounds of alternating
order after an equal warm-up, and reports the median of the rounds' speedups with its range.

With --offload POLICY (spac, lru, static, hybrid, spac-ar, ...) the target's experts live in
host memory and an expert cache of --expert-cache-ratio R of their bytes (or
--expert-cache-bytes B) on the compute device; the policy decides per layer which experts run
from the cache, are copied in, or run on the CPU. The prompt runs on the host and is the fit
split of the policy (or --offload-fit TRACE). A budget holding every expert runs in memory.
"""

import argparse
import json
import sys

from moespec.cli.options import (
    add_dtype,
    add_weights,
    checkpoint_dir,
    existing_file,
    non_negative_int,
    non_negative_number,
    number_in,
    positive_int,
    positive_number,
    resolve_weights,
)

HELP = "generate text (streamed), speculating with a draft, the kernel chosen per pass"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument(
        "--model",
        metavar="DIR",
        type=checkpoint_dir,
        help="checkpoint directory (default: the embedded demo MoE, drafted by its demo draft)",
    )
    parser.add_argument("--max-tokens", type=positive_int, default=128, metavar="N")
    parser.add_argument(
        "--draft",
        metavar="auto|auto:DIR|DIR|lookup|oracle:A|none",
        help="draft: auto chooses per step among prompt lookup, the draft model DIR of "
        "auto:DIR, and none; or one drafter: a checkpoint sharing the tokenizer, prompt "
        "lookup, the oracle at acceptance A; or none (default: auto with the demo draft for "
        "the demo model, else none)",
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
    parser.add_argument(
        "--batch-invariant",
        default="on",
        choices=["on", "off"],
        help="verification passes give every token the bits it gets alone, so greedy "
        "speculation equals plain greedy decoding in bf16 too (default: on)",
    )
    parser.add_argument(
        "--truncate",
        default="none",
        choices=["none", "left"],
        help="a prompt beyond the model's context (with --max-tokens): refuse it (none, the "
        "default) or keep its last tokens that fit (left)",
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
    offload = parser.add_argument_group("offloaded experts")
    offload.add_argument(
        "--offload",
        metavar="POLICY",
        help="keep experts in host memory behind a device cache run by POLICY: spac, lru, "
        "static, hybrid, spac-ar (spac without speculation), or a SpAc ablation",
    )
    budget = offload.add_mutually_exclusive_group()
    budget.add_argument(
        "--expert-cache-ratio",
        type=positive_number,
        metavar="R",
        help="expert cache budget: this share of all expert bytes (default 0.25)",
    )
    budget.add_argument(
        "--expert-cache-bytes",
        type=non_negative_int,
        metavar="B",
        help="expert cache budget in bytes",
    )
    offload.add_argument(
        "--offload-device",
        default="auto",
        metavar="cpu|cuda[:N]|auto",
        help="the expert cache's device (default: cuda when available, else cpu)",
    )
    offload.add_argument(
        "--offload-fit",
        metavar="TRACE",
        type=existing_file,
        help="a routing trace (moespec trace) to fit the policy on (default: the prompt)",
    )


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
    weights = resolve_weights(args)
    if weights is not None and args.offload is not None:
        raise ValueError(f"--weights {weights} runs in memory: it does not take --offload")
    import torch

    from moespec.decoding import KernelPolicy, Sampler, generate, summarize
    from moespec.decoding.compare import compare_plain
    from moespec.decoding.repetition import stop_repetition
    from moespec.decoding.setup import draft_name, greedy_reference, speculation_factory
    from moespec.demo import describe
    from moespec.kernels.cpu import weight_paths
    from moespec.models import StreamingDetokenizer, load_model
    from moespec.models.context import fit_context

    draft_length = parse_draft_length(args.draft_length)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    KernelPolicy(args.kernel, args.crossover)  # bad flags fail before the model loads
    check_offload_flags(args)
    sampler = Sampler(args.temperature, args.top_p, args.seed)
    torch.manual_seed(args.seed)
    if args.model is None:
        from moespec.demo import demo_paths

        args.model, demo_draft = map(str, demo_paths())
        if args.draft is None:
            args.draft = f"auto:{demo_draft}"
    if args.draft == "none":
        args.draft = None
    model, tokenizer = load_model(
        args.model, dtype=args.dtype, pack=args.offload is None, weights=weights
    )
    model.batch_invariant = args.batch_invariant == "on"
    plan = None
    if args.plan:
        from moespec.calibrate.plan import load_plan

        plan = load_plan(args.plan, model.config)
    crossover = args.crossover
    if crossover is None and plan is not None:
        crossover = plan["kernel"]["crossover"]
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise ValueError("the prompt encodes to no tokens")
    given = len(prompt)
    prompt = fit_context(prompt, model.config, new_tokens=args.max_tokens, truncate=args.truncate)
    stops = model.config.eos_token_ids

    make_speculation = None
    if args.draft:
        reference = None
        if args.draft.startswith("oracle") and sampler.greedy:  # in memory, untimed
            kernels = KernelPolicy(args.kernel, crossover)
            reference = greedy_reference(model, prompt, args.max_tokens, kernels, stops)
        make_speculation = speculation_factory(
            args.draft,
            draft_length=draft_length,
            max_draft_length=args.max_draft_length,
            plan=plan,
            target=model,
            tokenizer=tokenizer,
            sampler=sampler,
            prompt=prompt,
            max_tokens=args.max_tokens,
            dtype=args.dtype,
            reference=reference,
            seed=args.seed,
        )
    notes = {"offload": True}
    offload_runs = {True: [], False: []}  # each generation's offload summary, by arm

    def arm(speculative: bool):
        """One fresh generation per call: sampler, kernel policy, drafters, offload cache."""

        def decode(max_tokens: int):
            note = notes.pop("offload", False)
            offload = open_offload(args, model, speculative, draft_length, note=note)
            try:  # both arms stop alike at a loop (moespec.decoding.repetition)
                records = generate(
                    model,
                    prompt,
                    max_tokens=max_tokens,
                    sampler=Sampler(args.temperature, args.top_p, args.seed),
                    kernels=KernelPolicy(args.kernel, crossover),
                    drafter=make_speculation() if speculative else None,
                    stop_tokens=stops,
                    offload=offload,
                )
                yield from stop_repetition(records, args.stop_repeats)
            finally:
                if offload is not None:
                    offload_runs[speculative].append(offload.summary())
                    offload.close()

        return decode

    stream = StreamingDetokenizer(tokenizer)

    def show(record) -> None:
        piece = stream.add(record.tokens)
        if not args.json:
            print(piece, end="", flush=True)

    comparison = None
    speculative = make_speculation is not None
    if not args.json:
        echo_prompt(args.prompt if len(prompt) == given else tokenizer.decode(prompt))
    if args.compare_plain:
        comparison, records = compare_plain(
            arm(speculative), arm(False), args.max_tokens, rounds=args.rounds, on_speculative=show
        )
    else:
        records = []
        for record in arm(speculative)(args.max_tokens):
            records.append(record)
            show(record)
    tokens = [t for r in records for t in r.tokens]
    summary = summarize(records)
    if offload_runs[speculative]:  # the shown run's: after the warm-up when comparing
        summary["offload"] = offload_runs[speculative][1 if comparison else 0]
    if comparison is not None:
        compared = comparison.to_dict()
        summary["speedup"] = compared.pop("speedup")
        summary["plain_tokens_per_second"] = compared["plain_tokens_per_second"]
        summary["same_tokens_as_plain"] = compared["same_tokens_as_plain"]
        summary["compare"] = compared
    if args.json:
        print(
            json.dumps(
                {
                    "model": describe(args.model),
                    "draft": draft_name(args.draft),
                    "prompt": args.prompt,
                    "prompt_tokens": prompt,
                    "tokens": tokens,
                    "text": tokenizer.decode(tokens),
                    "threads": model.thread_plan(),
                    "weights": weight_paths(model.expert_format, model.dense_format),
                    "batch_invariant": model.batch_invariant,
                    **summary,
                    "steps": [r.to_dict() for r in records],
                }
            )
        )
    else:
        print(stream.flush())
        print(format_summary(summary, len(tokens), len(prompt), speculative), file=sys.stderr)
        print(format_notes(summary, len(prompt), given, args.stop_repeats), file=sys.stderr, end="")
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


def check_offload_flags(args) -> None:
    """Offload flags that are wrong whatever the model: fail before it loads."""
    if args.offload is None:
        if args.expert_cache_ratio is not None or args.expert_cache_bytes is not None:
            raise ValueError("--expert-cache-ratio/--expert-cache-bytes need --offload POLICY")
        return
    from moespec.offload import make_policy as make_offload_policy

    make_offload_policy(args.offload)  # an unknown name fails here
    if args.expert_cache_ratio is None and args.expert_cache_bytes is None:
        args.expert_cache_ratio = 0.25
    if args.expert_cache_ratio is not None and not args.expert_cache_ratio > 0:
        raise ValueError(f"--expert-cache-ratio must be > 0, got {args.expert_cache_ratio}")
    if args.expert_cache_bytes is not None and args.expert_cache_bytes < 0:
        raise ValueError(f"--expert-cache-bytes must be >= 0, got {args.expert_cache_bytes}")


def open_offload(args, model, speculative: bool, draft_length, note: bool = True):
    """The offload engine of --offload (None without it, or when the budget holds every
    expert: then the model runs in memory, and a note says so)."""
    if args.offload is None:
        return None
    from moespec.offload import make_policy as make_offload_policy
    from moespec.offload.engine.executor import (
        OffloadEngine,
        expert_cache_budget,
        fits_in_memory,
        model_expert_bytes,
    )

    policy = make_offload_policy(args.offload)
    if speculative and not policy.speculative:
        raise ValueError(
            f"--offload {args.offload} plans for decoding without a draft: add --draft none"
        )
    total, one = model_expert_bytes(model)
    budget = expert_cache_budget(
        total, one, ratio=args.expert_cache_ratio, nbytes=args.expert_cache_bytes
    )
    if fits_in_memory(budget, total):
        if note:
            print(
                f"note: the expert cache ({budget} bytes) holds all {total} bytes of experts: "
                "running in memory",
                file=sys.stderr,
            )
        return None
    k = args.max_draft_length if draft_length == "auto" else draft_length
    engine = OffloadEngine.for_model(
        model, policy, budget, draft_length=k if speculative else 0, device=args.offload_device
    )
    if args.offload_fit:
        from moespec.routing import read_trace

        try:
            engine.start(read_trace(args.offload_fit))
        except BaseException:
            engine.close()
            raise
    return engine


def format_offload(s: dict) -> str:
    rate = "n/a" if s["hit_rate"] is None else f"{s['hit_rate']:.2f}"
    return (
        f"[offload {s['policy']} on {s['device']}: cache {s['budget_bytes'] / 2**20:.1f} MiB "
        f"({s['slots']} experts of {s['total_expert_bytes'] // s['expert_bytes']}), hit rate "
        f"{rate}, {s['bytes_copied'] / 2**20:.1f} MiB copied, {s['cpu_experts']} experts on CPU]"
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
