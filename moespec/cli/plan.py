"""Calibrate and plan: benchmark one layer's expert operation, fit, predict, write plan.json.

With --model (default: the embedded demo model): benchmarks the model's MoE layers (both
kernels, chosen ids and recorded windows of a routing trace — given by --trace, else recorded
on the embedded corpus), fits each kernel's time as a fixed time plus a cost per byte read,
scores the fits on the windows they did not see (the bandwidth error epsilon), measures
whole-model verify times, predicts the whole model's verify time per pass size from the fits,
and writes DIR/plan.json and a report (report.md; bandwidth.png: each kernel's effective
bandwidth; ratio.png: where deduplication pays; saving.png: the time it saves per pass;
staircase.png: the best draft length per acceptance rate). `moespec generate --plan
DIR/plan.json` then switches kernels at the crossover and drafts k*(a) on the plan's verify
times.

With --shape NAME: one full-size layer of random weights of that model's expert shapes, on a
synthetic trace fitted to its published reuse.

With --engine llamacpp --gguf TARGET.gguf [--draft-gguf DRAFT.gguf]: a plan for llama.cpp
from its own timings (moespec.calibrate.llamacpp_plan): its verify time per pass size on a
cache of fixed depth, the draft's cost h(k) and acceptance, a fit by the cost model (U(n)
from moespec's trace of --model, from --trace, or uniform routing), k*(a) over the
acceptance grid, and the llama.cpp flags for the measured (or --acceptance) acceptance.

With --export vllm|sglang|llamacpp [--plan FILE]: no planning; an existing plan's k*(a) as that
engine's own speculative settings (vLLM's speculative_config, SGLang's server flags, llama.cpp's
draft flags) with the predicted saving beside them, written to --out FILE (default: the plan's
folder, TARGET.json) (moespec.export.speculative). --drafter lookup|model (default: the draft
model when the plan measured one), --acceptance (default: the draft's, where the plan measured
it), --draft (the draft as the engine loads it; default: the plan's). A plan of another machine
or engine version, or (with --model, --weights) of another model or weights kind, is refused.
"""

import argparse
import json

from moespec.cli.options import (
    add_batch_invariant,
    add_dtype,
    add_weights,
    at_least,
    batch_sizes,
    checkpoint_dir,
    device_name,
    existing_file,
    non_negative_int,
    non_negative_number,
    number_in,
    positive_int,
    require_device,
    resolve_weights,
)

HELP = "calibrate the expert kernels and write plan.json (crossover, V(k), staircase)"
OUT = "moespec-plan"  # the plan's folder by default
TARGETS = ("vllm", "sglang", "llamacpp")  # moespec.export.speculative.TARGETS
DRAFTERS = ("lookup", "model")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from moespec.calibrate.texts import (
        TRACE_TOKENS,
        VERIFY_MIN_REPEATS,
        VERIFY_REPEATS,
        VERIFY_SECONDS,
        VERIFY_TEXTS,
    )

    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--model", metavar="DIR", type=checkpoint_dir, help="checkpoint (default: the demo model)"
    )
    source.add_argument(
        "--shape",
        metavar="NAME",
        help="random weights of a named shape (qwen3-30b-a3b, olmoe-1b-7b, ...)",
    )
    parser.add_argument(
        "--draft",
        metavar="DIR",
        help="draft checkpoint: measure its h(k); with --export: the draft as the engine loads "
        "it (default: the plan's)",
    )
    parser.add_argument(
        "--trace", metavar="FILE", type=existing_file, help="routing trace (Parquet) of the model"
    )
    parser.add_argument("--reuse2", type=float, help="with --shape: target layer-mean rho(2)")
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="the plan's folder (default moespec-plan); with --export: the file to write",
    )
    add_dtype(parser)
    add_weights(parser)
    parser.add_argument("--kernels", default="slot,dedup", help="per-slot and a dedup kernel")
    parser.add_argument(
        "--max-n", type=at_least(2), default=9, help="largest pass size (default 9)"
    )
    parser.add_argument("--repeats", type=positive_int, default=7, help="timed runs per case")
    parser.add_argument("--windows", type=positive_int, default=12, help="recorded windows per n")
    parser.add_argument(
        "--flush-mib",
        type=non_negative_int,
        default=None,
        help="cache flush buffer before each timed run (MiB; 0: none); default: 256, or none"
        " where the model's weights fit in this CPU's last-level cache (the engine then reads"
        " them warm)",
    )
    parser.add_argument(
        "--verify-repeats",
        type=positive_int,
        default=VERIFY_REPEATS,
        help=f"the most rounds of whole-model verify passes to time (default {VERIFY_REPEATS})",
    )
    parser.add_argument(
        "--verify-seconds",
        type=non_negative_number,
        default=VERIFY_SECONDS,
        help=f"add no more verify rounds once they have run this long and "
        f"{VERIFY_MIN_REPEATS} are timed (default {VERIFY_SECONDS:.0f}; 0: every round)",
    )
    parser.add_argument(
        "--verify-text",
        choices=VERIFY_TEXTS,
        default=VERIFY_TEXTS[0],
        help="what the whole-model verify passes run on: the target's greedy continuation of "
        "a fit document's start, as decoding verifies (default), or the test documents",
    )
    parser.add_argument(
        "--trace-tokens",
        type=non_negative_int,
        default=TRACE_TOKENS,
        help=f"without --trace: tokens of routing to record on the embedded corpus, spread "
        f"over its documents (default {TRACE_TOKENS}; 0: all of it)",
    )
    parser.add_argument(
        "--batch-sizes",
        type=batch_sizes,
        default=(1, 2, 4, 8),
        help="batch sizes of the plan's draft-length table k*(a, B) (default 1,2,4,8; 1: none)",
    )
    add_batch_invariant(
        parser,
        "time the expert operation and whole-model passes batch-invariant, as `moespec "
        "generate` verifies by default (off: plan for a run with --batch-invariant off)",
    )
    parser.add_argument(
        "--pooled-fits",
        action="store_true",
        help="one fit over all benchmarked layers (default: each layer its own, as seed 000)",
    )
    parser.add_argument(
        "--device",
        type=device_name,
        default="cpu",
        metavar="cpu|cuda[:N]",
        help="where to benchmark: with --shape, cuda runs the same benchmark and fits on the "
        "GPU's kernels (timed by CUDA events); whole-model plans run on the CPU",
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing plan")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--engine",
        choices=("moespec", "llamacpp"),
        default="moespec",
        help="the engine to plan for (llamacpp: pip install -e '.[llamacpp]')",
    )
    parser.add_argument("--gguf", metavar="FILE", type=existing_file, help="llamacpp: target")
    parser.add_argument(
        "--draft-gguf", metavar="FILE", type=existing_file, help="llamacpp: draft model"
    )
    parser.add_argument("--threads", type=positive_int, default=1, help="llamacpp: threads")
    parser.add_argument(
        "--verify-times",
        choices=("measured", "fitted"),
        default="measured",
        help="llamacpp: the verify times k* follows: as measured at each pass size (default; "
        "llama.cpp switches kernels with the batch) or the cost model's fit of them",
    )
    parser.add_argument(
        "--acceptance",
        type=number_in(0, 1, high_open=True),
        help="llamacpp, --export: the acceptance to decide k* at (default: the draft's, measured)",
    )
    parser.add_argument(
        "--export",
        choices=TARGETS,
        help="write this engine's speculative settings from an existing plan (--plan FILE) "
        "instead of planning",
    )
    parser.add_argument(
        "--plan",
        metavar="FILE",
        default=f"{OUT}/plan.json",
        help=f"with --export: the plan to read (default {OUT}/plan.json)",
    )
    parser.add_argument(
        "--drafter",
        choices=DRAFTERS,
        help="with --export: prompt lookup or the draft model (default: the draft model when "
        "the plan measured one)",
    )


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    if args.export:
        return run_export(args)
    args.out = args.out or OUT
    if args.device != "cpu" and (args.engine != "moespec" or not args.shape):
        raise ValueError(
            f"--device {args.device} plans a --shape (one layer of the expert operation); "
            "moespec's whole-model engine and the llama.cpp plan run on the CPU"
        )
    if args.engine == "llamacpp":
        return run_llamacpp(args)

    weights = resolve_weights(args)
    kernels = tuple(k.strip() for k in args.kernels.split(","))
    if "slot" not in kernels or len(kernels) != 2:
        raise ValueError(
            f"--kernels must name slot and one deduplicating kernel, got {args.kernels}"
        )
    from moespec.calibrate.bench import BenchSettings
    from moespec.calibrate.plan import make_plan, make_shape_plan

    settings = BenchSettings(
        kernels=kernels,
        pass_sizes=tuple(range(1, args.max_n + 1)),
        repeats=args.repeats,
        flush_bytes=None if args.flush_mib is None else args.flush_mib * 2**20,
        batch_invariant=args.batch_invariant == "on",
    )
    out = Path(args.out)
    if args.shape:
        plan = make_shape_plan(
            out,
            shape_name=args.shape,
            reuse2=args.reuse2,
            dtype=args.dtype,
            weights=weights,
            settings=settings,
            windows=args.windows,
            device=require_device(args.device),
            force=args.force,
            progress=not args.json,
        )
    else:
        model = Path(args.model) if args.model else default_model()
        plan = make_plan(
            out,
            model_dir=model,
            draft_dir=Path(args.draft) if args.draft else None,
            trace_path=Path(args.trace) if args.trace else None,
            dtype=args.dtype,
            weights=weights,
            settings=settings,
            windows=args.windows,
            verify_repeats=args.verify_repeats,
            verify_seconds=args.verify_seconds or None,
            verify_text_kind=args.verify_text,
            per_layer_fits=not args.pooled_fits,
            batch_sizes=args.batch_sizes,
            trace_tokens=args.trace_tokens or None,
            force=args.force,
            progress=not args.json,
        )
        from moespec.report.plan import write_report

        write_report(plan, out)
    if args.json:
        print(json.dumps(plan.to_dict()))
    else:
        print(summary(plan, out))
    return 0


def default_model():
    from moespec.demo import demo_paths

    return demo_paths()[0]


def summary(plan, out) -> str:
    """A Plan's or ShapePlan's summary lines."""
    from moespec.plan import Plan

    crossover = plan.kernel.crossover
    lines = [
        f"wrote {out}/plan.json in {plan.seconds:.0f} s",
        f"bandwidth error epsilon = {plan.bandwidth_error:.3f}",
        f"crossover: {crossover if crossover else 'none (per-slot at every n)'}",
    ]
    if isinstance(plan, Plan):
        lines.append("V(k) ms: " + " ".join(f"{v * 1e3:.2f}" for v in plan.step_times))
        stair = plan.predictions["calibrated"].staircase.by_acceptance
        lines.append("k*(a): " + " ".join(f"{a}:{e.best_draft_length}" for a, e in stair.items()))
    return "\n".join(lines)


def run_llamacpp(args: argparse.Namespace) -> int:
    from pathlib import Path

    from moespec.calibrate.llamacpp_plan import llamacpp_plan

    if not args.gguf:
        raise ValueError("--engine llamacpp needs --gguf TARGET.gguf")
    plan = llamacpp_plan(
        Path(args.out),
        gguf=Path(args.gguf),
        draft_gguf=Path(args.draft_gguf) if args.draft_gguf else None,
        model_dir=Path(args.model) if args.model else None,
        trace_path=Path(args.trace) if args.trace else None,
        threads=args.threads,
        max_n=args.max_n,
        verify_repeats=args.verify_repeats,
        acceptance=args.acceptance,
        verify_times=args.verify_times,
        force=args.force,
    )
    if args.json:
        print(json.dumps(plan))
        return 0
    print(llamacpp_summary(plan, args.out))
    return 0


def llamacpp_summary(plan: dict, out) -> str:
    stair = plan["staircase"]
    lines = [
        f"wrote {out}/plan.json in {plan['seconds']:.0f} s (engine llamacpp, "
        f"{plan['threads']} threads; routing: {plan['routing']['source']})",
        "tau(n) ms measured: "
        + " ".join(f"{t * 1e3:.2f}" for t in plan["measured_verify"]["llamacpp"]),
        "tau(n) ms fitted:   "
        + " ".join(f"{t * 1e3:.2f}" for t in plan["tau_versions"]["fitted"]["verify_time"]),
        f"k* follows the {plan['verify_times']} verify times; "
        f"bandwidth error epsilon = {plan['bandwidth_error']:.3f}",
        "V(k) ms: " + " ".join(f"{v * 1e3:.2f}" for v in plan["step_times"]),
        f"first-draft threshold a0 = {stair['first_draft_threshold']:.3f}",
        f"{'a':>6} {'k*':>3} {'speedup':>8}",
    ]
    for a, entry in stair["by_acceptance"].items():
        sure = "" if entry["certain"] else "  (epsilon can move it)"
        lines.append(f"{a:>6} {entry['best_draft_length']:>3} {entry['speedup']:>8.3f}{sure}")
    decision = plan["decision"]
    if decision is None:
        lines.append("llama.cpp flags: give --draft-gguf or --acceptance for a decision")
    elif not decision["speculate"]:
        lines.append(
            f"llama.cpp flags at a = {decision['acceptance']:.3f}: none - do not speculate "
            "(plain decoding is fastest)"
        )
    else:
        lines.append(
            f"llama.cpp flags at a = {decision['acceptance']:.3f}: " + " ".join(decision["args"])
        )
    return "\n".join(lines)


def run_export(args: argparse.Namespace) -> int:
    """--export: read the plan, check it is of this machine (and model, weights), decide k*
    and write the engine's settings."""
    from pathlib import Path

    from moespec.export import speculative

    ignored = [f for f in ("shape", "gguf", "trace") if getattr(args, f)]
    if ignored or args.engine != "moespec":
        raise ValueError(
            f"--export reads an existing plan; it takes no --{(ignored or ['engine'])[0]}"
        )
    timing = speculative.read_timing(args.plan)
    speculative.check_fits(timing, export_here(args, timing.engine))
    out = Path(args.out) if args.out else Path(args.plan).parent / f"{args.export}.json"
    document = speculative.export_settings(
        timing,
        args.export,
        drafter=args.drafter,
        acceptance=args.acceptance,
        draft=args.draft,
    )
    speculative.write_export(document, out, force=args.force)
    print(json.dumps(document) if args.json else export_summary(document, out))
    return 0


def export_here(args: argparse.Namespace, engine: str) -> dict:
    """What is known here to check the plan against: machine and engine, and the model and
    weights kind when given."""
    from moespec.export.speculative import facts_here

    here = facts_here(engine)
    if args.model:
        from moespec.models import load_config

        config = load_config(args.model)
        here["model"] = {
            k: getattr(config, k)
            for k in (
                "model_type", "num_layers", "hidden_size", "num_experts", "top_k",
                "moe_intermediate_size",
            )
        }  # fmt: skip
    if args.weights:
        here["weights"] = args.weights
    return here


def export_summary(document: dict, out) -> str:
    """The written file, the decision with its predicted saving, and how to pass it."""
    p = document["predicted"]
    engine = document["engine"]
    lines = [f"wrote {out} ({engine} settings from {document['plan']})"]
    head = f"at a = {p['acceptance']:.3f} with {p['drafter']} drafting: k* = {p['draft_length']}"
    if not p["speculate"]:
        lines.append(f"{head}, do not speculate (plain decoding is fastest)")
        return "\n".join(lines)
    lines.append(
        f"{head}, {p['speedup']:.3f}x: {p['ms_per_token']:.3f} ms a token against "
        f"{p['ms_per_token_plain']:.3f} plain (saving {p['saving']:.1%}; as timed by "
        f"{p['timed_by']}{'' if p['certain'] else ', epsilon can move k*'})"
    )
    if engine == "vllm":
        config = json.dumps(document["speculative_config"])
        lines.append(f"vllm serve MODEL --speculative-config '{config}'")
    elif engine == "sglang":
        lines.append(
            "python -m sglang.launch_server --model-path MODEL " + " ".join(document["args"])
        )
    else:
        lines.append("llama-server -m MODEL.gguf " + " ".join(document["args"]))
        lines.append("older builds: " + " ".join(document["older_builds"]))
    return "\n".join(lines)
