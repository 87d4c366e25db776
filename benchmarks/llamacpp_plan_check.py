"""Check a llama.cpp plan against llama.cpp speculating: is k̂* within one of the measured best?

    python benchmarks/llamacpp_plan_check.py --shape olmoe --types bf16,q8_0 \\
        --out benchmarks/results/llamacpp_plan_check.json

For each GGUF of the checkpoint (written by moespec's exporter), at --threads threads:

1. the plan (moespec.calibrate.llamacpp_plan): llama.cpp's τ(n) on a cache of --depth tokens
   (by default the sweep's mean depth), the fit with U(n) from moespec's trace of the same
   checkpoint, V̂(k) = τ̂(k + 1) (the oracle drafts for free, h = 0), k̂*(a) on the 11
   acceptances, in both versions of τ̂ (as measured, the plan's default, and fitted), each
   scored below;
2. the sweep: llama.cpp verifying oracle drafts, k = 0..8 at each acceptance a. A step drafts
   the next k tokens of a reference stream, runs one pass of k + 1 tokens with every row's
   logits and their argmax, keeps the accepted drafts and removes the rest from the KV cache.
   The reference stream is held-out text: the plan's test documents, after the tokens its
   passes read (--prompt-tokens of it as the prompt). Not the target's greedy continuation:
   a random-weight target's greedy continuation of the prompt repeats one token (7 distinct
   tokens in 60 on the OLMoE-shaped checkpoint), so the sweep's passes held one token repeated
   while the plan timed passes of text: two workloads. The oracle decides acceptance, so the
   stream need not be what the target would emit; it is refused when degenerate (fewer than
   a fifth of its tokens distinct). Which drafts are accepted is the oracle's (seed 000 [1]):
   each drafted position is the stream's token with probability a, else a wrong one, so the
   accepted count is geometric; the first wrong position and those after it carry another
   token, so the pass routes as a rejected draft would. Tokens/s = emitted tokens / time
   after the prefill; cells (a, k) run in --rounds rounds, each cell once per round in a
   random order, every cell of a round on the same per-position draft flags (common random
   numbers, as moespec's own evaluation: cells differ only in a and k), the median per cell;
3. seed 000's rules (moespec.calibrate.score): k̂* within one of the measured best at >= 9 of
   11 acceptances, throughput lost by following the plan <= 6%, and verify time within 15%
   at n >= 2 against the sweep's own passes (a measurement the plan never saw); beside them the
   noise floor: the k* and loss rules with k* from the sweep's own V(k).

The machine may be shared: the load average is recorded beside the results.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from decode_vs_llamacpp import cpu_flags, gguf_files  # noqa: E402

from moespec.bench.checkpoints import SHAPES, random_checkpoint  # noqa: E402
from moespec.calibrate import llamacpp  # noqa: E402
from moespec.calibrate.llamacpp_plan import ACCEPTANCE_GRID, llamacpp_plan  # noqa: E402
from moespec.calibrate.plan import verify_documents  # noqa: E402
from moespec.calibrate.score import (  # noqa: E402
    noise_floor,
    rule_best_draft_length,
    rule_verify_time,
)
from moespec.files import check_writable, write_json  # noqa: E402
from moespec.provenance import machine  # noqa: E402


def oracle_run(engine, prompt, reference, acceptance, k, tokens, flags, passes) -> float:
    """Seconds per emitted token of speculative decoding with oracle drafts of length k;
    every pass's time goes into passes[n]. flags: the round's common random numbers
    (`llamacpp.round_flags`), read by `llamacpp.oracle_draft`."""
    engine.prefill(prompt)  # its last logits give reference[0], the current token
    emitted, position = 1, 0  # reference[position] is the current token, not yet cached
    start = time.perf_counter()
    while emitted < tokens:
        draft, accepted = llamacpp.oracle_draft(
            reference, position + 1, k, acceptance, flags, engine.vocab_size
        )
        length = engine.length
        begin = time.perf_counter()
        predicted = engine.forward([reference[position], *draft]).argmax(axis=1)
        passes.setdefault(k + 1, []).append(time.perf_counter() - begin)
        del predicted  # greedy verification's argmax; the oracle decided the acceptance
        engine.rollback(length + 1 + accepted)
        emitted += accepted + 1
        position += accepted + 1
    return (time.perf_counter() - start) / (emitted - 1)


def sweep(engine, prompt, reference, args, rng):
    """Every (a, k) cell once per round, in a random order, all on the round's flags: cells
    differ only in a and k (common random numbers), so acceptance sampling moves no
    comparison between them; rounds differ in flags and order."""
    cells = [(a, k) for a in ACCEPTANCE_GRID for k in range(args.max_n)]
    seconds: dict = {}
    passes: dict = {}
    for round_ in range(args.rounds):
        flags = llamacpp.round_flags(rng, len(reference), engine.vocab_size)
        for i in rng.permutation(len(cells)):
            a, k = cells[i]
            value = oracle_run(engine, prompt, reference, a, k, args.tokens, flags, passes)
            seconds.setdefault((a, k), []).append(value)
        print(f"  sweep round {round_ + 1} done", flush=True)
    by_acceptance = {
        str(a): {
            "tokens_per_second": {
                str(k): 1 / statistics.median(seconds[(a, k)]) for k in range(args.max_n)
            },
            "rounds_seconds_per_token": {str(k): seconds[(a, k)] for k in range(args.max_n)},
        }
        for a in ACCEPTANCE_GRID
    }
    verify = [statistics.median(passes[n]) for n in range(1, args.max_n + 1)]
    return {"by_acceptance": by_acceptance, "verify_median": verify}


def reference_stream(engine, args) -> tuple[list[int], list[int]]:
    """(prompt, reference): held-out text after the tokens the plan's passes read (the plan
    tokenizes the same documents with the same GGUF tokenizer); refused when degenerate."""
    text = "".join(d.text for d in verify_documents())
    stream = engine.llm.tokenize(text.encode(), add_bos=False, special=False)
    start = args.depth + args.max_n
    prompt = stream[start : start + args.prompt_tokens]
    end = start + args.prompt_tokens + args.tokens + args.max_n + 1
    reference = stream[start + args.prompt_tokens : end]
    if len(reference) < end - start - args.prompt_tokens:
        raise SystemExit(f"the held-out text has {len(stream)} tokens; the sweep needs {end}")
    if len(set(reference)) * 5 < len(reference):
        raise SystemExit(
            f"the sweep's reference stream is degenerate: {len(set(reference))} distinct "
            f"tokens in {len(reference)}"
        )
    return prompt, reference


def score(version: dict, measured: dict) -> dict:
    """The rules and each acceptance's k̂*, best k and loss for one version of the plan's τ̂."""
    k_rule, loss_rule = rule_best_draft_length(version["step_times"], measured["by_acceptance"])
    verify_rule = rule_verify_time(
        {"llamacpp": version["verify_time"]}, {"llamacpp": measured["verify_median"]}
    )
    rows = {}
    for a, row in measured["by_acceptance"].items():
        rates = {int(k): v for k, v in row["tokens_per_second"].items()}
        best = max(rates, key=lambda k: (rates[k], -k))
        k_hat = version["staircase"]["by_acceptance"][a]["best_draft_length"]
        rows[a] = {"k_hat": k_hat, "k_best": best, "loss": 1 - rates[k_hat] / rates[best]}
    return {
        "by_acceptance": rows,
        "rules": {
            "k* within one at >= 9 of 11": k_rule,
            "throughput lost <= 6%": loss_rule,
            "verify time within 15% (n >= 2)": verify_rule,
        },
    }


def check_one(path: Path, directory: Path, args) -> dict:
    print(f"{path.name}: plan", flush=True)
    plan = llamacpp_plan(
        args.work / path.stem,
        gguf=path,
        model_dir=directory,
        threads=args.threads,
        depth=args.depth,
        max_n=args.max_n,
        verify_repeats=args.verify_repeats,
        trace_documents=args.trace_documents,
        force=True,
    )
    engine = llamacpp.LlamaCpp(path, threads=args.threads)
    prompt, reference = reference_stream(engine, args)
    print(f"{path.name}: sweep", flush=True)
    measured = sweep(engine, prompt, reference, args, np.random.default_rng(args.seed))
    versions = {name: score(v, measured) for name, v in plan["tau_versions"].items()}
    return {
        "gguf": str(path),
        "plan": {k: plan[k] for k in ("verify_time", "measured_verify", "fit", "step_times")}
        | {k: plan[k] for k in ("bandwidth_error", "staircase", "verify_times", "tau_versions")},
        "sweep": measured,
        # the version the plan's decision follows; every version's beside it
        **versions[plan["verify_times"]],
        "tau_versions": versions,
        # the same two rules with k* from the sweep's own V(k) = its median pass of k + 1
        # tokens (the oracle drafts for free): what the sweep's noise lets any plan reach
        "noise_floor": noise_floor(
            {"step_times": measured["verify_median"], "by_acceptance": measured["by_acceptance"]}
        ),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="olmoe")
    parser.add_argument("--model", type=Path, help="a checkpoint directory instead of --shape")
    parser.add_argument("--types", default="bf16,q8_0")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--depth",
        type=int,
        help="cache depth of the plan's passes (default: the sweep's mean depth, "
        "--prompt-tokens + --tokens / 2, so that both time passes over the same cache)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=16, help="the sweep's prompt")
    parser.add_argument("--max-n", type=int, default=9)
    parser.add_argument("--verify-repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace-documents", type=int, default=24, help="files traced for U(n)")
    parser.add_argument("--cache-dir", type=Path, default=Path("benchmarks/checkpoints"))
    parser.add_argument("--work", type=Path, default=Path("benchmarks/checkpoints/plan-check"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    check_writable(args.out, force=args.force)
    if args.depth is None:
        args.depth = args.prompt_tokens + args.tokens // 2
    args.work.mkdir(parents=True, exist_ok=True)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    directory = args.model or random_checkpoint(args.shape, args.cache_dir)
    files = gguf_files(directory, args.cache_dir)
    load = {"start": os.getloadavg()}
    results = {t: check_one(files[t], directory, args) for t in args.types.split(",")}
    load["end"] = os.getloadavg()
    report = {
        "benchmark": "llamacpp_plan_check",
        "machine": {**machine(), "cpu_flags": cpu_flags(), **llamacpp.versions()},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        | {"checkpoint": str(directory), "acceptances": list(ACCEPTANCE_GRID)},
        "load_average_1_5_15_min": load,
        "results": results,
    }
    write_json(args.out, report, force=args.force)
    for kind, r in results.items():
        for name, v in r["tau_versions"].items():
            rules = {rule: f"{'holds' if ok else 'fails'} ({d})" for rule, (ok, d) in
                     v["rules"].items()}  # fmt: skip
            chosen = " (the plan's)" if name == r["plan"]["verify_times"] else ""
            print(kind, f"{name} verify times{chosen}", rules)
        floor = {rule: f"{'holds' if ok else 'fails'} ({d})" for rule, (ok, d) in
                 r["noise_floor"].items()}  # fmt: skip
        print("  noise floor", floor)
        for a, row in r["by_acceptance"].items():
            print(f"  a={a:>5} k_hat={row['k_hat']} best={row['k_best']} loss={row['loss']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
