"""Generate text with an MoE model, streaming it as it is decoded, optionally speculating.

Loads a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json) and
decodes at batch size 1 (default: the embedded demo MoE, drafted by its demo draft). The
expert kernel of each pass is chosen by --kernel: "slot" (per-slot), "dedup" (deduplicating),
or "auto": per-slot below the crossover pass size (from --crossover or --plan), else the
kernel measured faster at each pass size as decoding goes. With --draft, each step drafts k
tokens and verifies them in one pass of k + 1: --draft-length K fixes k; "auto" takes k*(a)
from the cost model, with the acceptance a estimated online and the step times V(k) measured
online (or read from --plan). Temperature 0 is greedy.

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
    checkpoint_dir,
    existing_file,
    non_negative_int,
    non_negative_number,
    number_in,
    positive_int,
    positive_number,
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
        metavar="DIR|oracle:A|lookup",
        help="draft: a checkpoint sharing the tokenizer, the oracle at acceptance A, prompt "
        "lookup, or none (default: the demo draft with the demo model, else none)",
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
        help="also decode without speculation and report the speedup",
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
    import torch

    from moespec.decoding import KernelPolicy, Sampler, generate, summarize
    from moespec.decoding.repetition import stop_repetition
    from moespec.decoding.setup import build_drafter
    from moespec.demo import describe
    from moespec.models import StreamingDetokenizer, load_model
    from moespec.models.context import fit_context

    draft_length = parse_draft_length(args.draft_length)
    KernelPolicy(args.kernel, args.crossover)  # bad flags fail before the model loads
    check_offload_flags(args)
    sampler = Sampler(args.temperature, args.top_p, args.seed)
    torch.manual_seed(args.seed)
    if args.model is None:
        from moespec.demo import demo_paths

        args.model, demo_draft = map(str, demo_paths())
        if args.draft is None:
            args.draft = demo_draft
    if args.draft == "none":
        args.draft = None
    model, tokenizer = load_model(args.model, dtype=args.dtype, pack=args.offload is None)
    plan = None
    if args.plan:
        from moespec.calibrate.plan import load_plan

        plan = load_plan(args.plan, model.config)
    crossover = args.crossover
    if crossover is None and plan is not None:
        crossover = plan["kernel"]["crossover"]
    kernels = KernelPolicy(args.kernel, crossover)
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise ValueError("the prompt encodes to no tokens")
    given = len(prompt)
    prompt = fit_context(prompt, model.config, new_tokens=args.max_tokens, truncate=args.truncate)
    stops = model.config.eos_token_ids

    plain = None
    if args.compare_plain or (args.draft or "").startswith("oracle"):
        list(generate(model, prompt, max_tokens=2, kernels=kernels))  # warm-up, untimed
        # Compared with speculation, plain decoding offloads too (a fresh cache); as the
        # oracle's reference only, it runs in memory.
        plain_offload = (
            open_offload(args, model, False, 0, note=False) if args.compare_plain else None
        )
        plain = list(
            generate(
                model,
                prompt,
                max_tokens=args.max_tokens,
                sampler=Sampler(args.temperature, args.top_p, args.seed),
                kernels=kernels,
                stop_tokens=stops,
                offload=plain_offload,
            )
        )
        plain = list(stop_repetition(iter(plain), args.stop_repeats))  # stops where we will
        if plain_offload is not None:
            plain_offload.close()
    drafter = policy = None
    if args.draft:
        reference = [t for r in plain for t in r.tokens] if plain and sampler.greedy else None
        drafter = build_drafter(
            args.draft,
            target=model,
            tokenizer=tokenizer,
            sampler=sampler,
            prompt=prompt,
            max_tokens=args.max_tokens,
            dtype=args.dtype,
            reference=reference,
            seed=args.seed,
        )
        policy = make_policy(draft_length, args.max_draft_length, plan, args.draft)

    offload = open_offload(args, model, drafter is not None, draft_length)
    stream = StreamingDetokenizer(tokenizer)
    records = []
    if not args.json:
        echo_prompt(args.prompt if len(prompt) == given else tokenizer.decode(prompt))
    for record in stop_repetition(
        generate(
            model,
            prompt,
            max_tokens=args.max_tokens,
            sampler=sampler,
            kernels=kernels,
            drafter=drafter,
            draft_policy=policy,
            stop_tokens=stops,
            offload=offload,
        ),
        args.stop_repeats,
    ):
        records.append(record)
        piece = stream.add(record.tokens)
        if not args.json:
            print(piece, end="", flush=True)
    if offload is not None:
        offload.close()
    tokens = [t for r in records for t in r.tokens]
    summary = summarize(records)
    if offload is not None:
        summary["offload"] = offload.summary()
    if plain is not None and args.compare_plain:
        plain_summary = summarize(plain)
        summary["plain_tokens_per_second"] = plain_summary["tokens_per_second"]
        if summary["tokens_per_second"] and plain_summary["tokens_per_second"]:
            summary["speedup"] = summary["tokens_per_second"] / plain_summary["tokens_per_second"]
        summary["same_tokens_as_plain"] = tokens == [t for r in plain for t in r.tokens]
    if args.json:
        print(
            json.dumps(
                {
                    "model": describe(args.model),
                    "draft": describe(args.draft) if args.draft else None,
                    "prompt": args.prompt,
                    "prompt_tokens": prompt,
                    "tokens": tokens,
                    "text": tokenizer.decode(tokens),
                    **summary,
                    "steps": [r.to_dict() for r in records],
                }
            )
        )
    else:
        print(stream.flush())
        print(format_summary(summary, len(tokens), len(prompt), bool(args.draft)), file=sys.stderr)
        print(format_notes(summary, len(prompt), given, args.stop_repeats), file=sys.stderr, end="")
        if offload is not None:
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
    from moespec.offload.executor import (
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


def make_policy(draft_length, max_draft_length, plan, draft_spec):
    """The draft-length policy: V(k) from the plan's verify times (and its draft's h(k) when
    the plan measured this very draft), else measured online."""
    from moespec.decoding import DraftLengthPolicy

    if plan is None:
        return DraftLengthPolicy(draft_length, max_draft_length=max_draft_length)
    from pathlib import Path

    from moespec.demo import describe

    planned = plan.get("draft_dir")
    same_draft = (
        planned is not None
        and draft_spec is not None
        and (
            describe(draft_spec) == planned or Path(draft_spec).resolve() == Path(planned).resolve()
        )
    )
    return DraftLengthPolicy(
        draft_length,
        max_draft_length=max_draft_length,
        verify_times=plan["verify_time"],
        draft_times=plan["draft_time"] if same_draft else None,
    )


def format_summary(summary: dict, generated: int, prompt: int, speculative: bool) -> str:
    rate = summary["tokens_per_second"]
    parts = [f"{generated} tokens", f"{rate:.1f} tokens/s" if rate else "n/a tokens/s"]
    if speculative and summary["mean_accepted_per_step"] is not None:
        parts.append(f"{summary['mean_accepted_per_step']:.2f} accepted drafts/step")
    if "speedup" in summary:
        parts.append(
            f"{summary['speedup']:.2f}x plain ({summary['plain_tokens_per_second']:.1f} tokens/s)"
        )
    parts.append(f"prompt {prompt} tokens in {summary['prefill_seconds']:.2f} s")
    return "[" + ", ".join(parts) + "]"
