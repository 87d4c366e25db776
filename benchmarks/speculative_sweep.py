"""The measured staircase: oracle draft, k = 0..8 x the 11 acceptances, tokens/s and speedup.

    python benchmarks/speculative_sweep.py --out benchmarks/results/sweep_olmoe.json

On the OLMoE-shaped random-weight model (the oracle makes acceptance independent of the
weights). For each acceptance a and draft length k, greedy decoding with the oracle draft
(proposing the target's own greedy token, corrupted with probability 1 - a) runs N tokens;
its decode tokens/s and the speedup over k = 0 measured in the same repeat are recorded.
Beside the measured best k, the predicted best k from the measured step times
V(k) = tau(k + 1) (the oracle costs nothing, h = 0), and the k the `auto` policy settles on.
Writes JSON and a figure (measured and predicted staircase).
"""

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moespec.bench.checkpoints import SHAPES, random_checkpoint  # noqa: E402
from moespec.calibrate.plan import verify_documents  # noqa: E402
from moespec.costmodel import best_draft_length  # noqa: E402
from moespec.decoding import (  # noqa: E402
    DraftLengthPolicy,
    KernelPolicy,
    OracleDrafter,
    generate,
    summarize,
)
from moespec.decoding.setup import greedy_reference  # noqa: E402
from moespec.files import atomic_path, write_json  # noqa: E402
from moespec.models import load_model  # noqa: E402
from moespec.provenance import provenance  # noqa: E402
from moespec.routing.record import tokenize_documents  # noqa: E402

ACCEPTANCES = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98)


def run_once(model, prompt, reference, acceptance, policy, tokens, kernels, seed):
    """One oracle-drafted run; its tokens/s count the steps' time without the oracle's (the
    oracle stands for a draft that costs nothing, h = 0; its resyncs are not a draft's work)."""
    drafter = OracleDrafter(
        reference,
        len(prompt),
        acceptance,
        model.config.vocab_size,
        seed,
        resync=lambda context, n: greedy_reference(model, context, n, kernels),
    )
    records = list(
        generate(
            model, prompt, max_tokens=tokens, kernels=kernels, drafter=drafter, draft_policy=policy
        )
    )
    summary = summarize(records)
    decode = [r for r in records if r.phase == "decode"]
    seconds = sum(r.seconds - r.draft_seconds for r in decode)
    summary["tokens_per_second"] = sum(len(r.tokens) for r in decode) / seconds
    summary["oracle_resyncs"] = drafter.resyncs
    return records, summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="olmoe")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--model", type=Path, help="a checkpoint instead of a random shape")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--max-draft-length", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kernel", default="slot")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--crossover", type=int)
    parser.add_argument("--cache-dir", type=Path, default=Path("benchmarks/checkpoints"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.force:
        parser.error(f"{args.out} exists (use --force)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        args.cache_dir.mkdir(parents=True, exist_ok=True)
        args.model = random_checkpoint(args.shape, args.cache_dir, args.layers)
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    kernels = KernelPolicy(args.kernel, args.crossover)
    # A text prompt (held-out, test part): the sweep runs the workload the plan's trace saw.
    text = tokenize_documents(tokenizer, verify_documents(1))
    prompt = next(ids for _, ids in text)[:16]
    reference = greedy_reference(model, prompt, args.tokens, kernels)
    k_max = args.max_draft_length

    # Warm up, then measure the step time V(k) = tau(k + 1) from the fixed-k runs themselves.
    run_once(model, prompt, reference, 0.9, DraftLengthPolicy(2), 8, kernels, 0)
    rates = {a: {k: [] for k in range(k_max + 1)} for a in ACCEPTANCES}
    verify = {k: [] for k in range(k_max + 1)}
    auto_choices = {a: Counter() for a in ACCEPTANCES}
    diverged = 0  # runs whose output left the plain greedy reference (bf16 batch variance)
    for repeat in range(args.repeats):
        for a in ACCEPTANCES:
            for k in range(k_max + 1):
                records, summary = run_once(
                    model,
                    prompt,
                    reference,
                    a,
                    DraftLengthPolicy(k),
                    args.tokens,
                    kernels,
                    seed=repeat,
                )
                rates[a][k].append(summary["tokens_per_second"])
                diverged += summary["oracle_resyncs"] > 0
                verify[k] += [r.verify_seconds for r in records[1:] if r.drafted == k]
            records, _ = run_once(
                model,
                prompt,
                reference,
                a,
                DraftLengthPolicy("auto", max_draft_length=k_max),
                args.tokens,
                kernels,
                seed=repeat,
            )
            auto_choices[a].update(r.draft_length for r in records[len(records) // 2 :])
            print(
                f"repeat {repeat} a={a}: "
                + " ".join(f"{k}:{rates[a][k][-1]:.1f}" for k in range(k_max + 1)),
                flush=True,
            )

    step_times = [statistics.median(verify[k]) for k in range(k_max + 1)]
    table = {}
    within = 0
    for a in ACCEPTANCES:
        medians = {k: statistics.median(v) for k, v in rates[a].items()}
        best = max(medians, key=lambda k: (medians[k], -k))
        predicted = best_draft_length(step_times, a)
        auto = auto_choices[a].most_common(1)[0][0]
        within += abs(auto - best) <= 1
        table[str(a)] = {
            "tokens_per_second": medians,
            "speedup": {k: medians[k] / medians[0] for k in medians},
            "measured_best": best,
            "measured_best_speedup": medians[best] / medians[0],
            "predicted_best_from_measured_V": predicted,
            "auto_choice": auto,
            "auto_choices": dict(auto_choices[a]),
            "loss_at_predicted": 1 - medians[predicted] / medians[best],
        }
    report = {
        "benchmark": "speculative_sweep",
        "provenance": provenance(),
        "settings": {
            "model": str(args.model),
            "tokens": args.tokens,
            "k_max": k_max,
            "repeats": args.repeats,
            "kernel": args.kernel,
            "crossover": args.crossover,
            "acceptances": ACCEPTANCES,
            "dtype": args.dtype,
            "draft": "oracle",
        },
        "step_times": step_times,
        "by_acceptance": table,
        "auto_within_one_of_measured_best": within,
        "runs_where_the_oracle_resynced": diverged,
        "runs": args.repeats * len(ACCEPTANCES) * (k_max + 1),
    }
    write_json(args.out, report, force=args.force)
    plot(report, args.out.with_suffix(".png"))
    for a, row in table.items():
        print(
            f"a={a:>5}: measured best k={row['measured_best']} "
            f"(x{row['measured_best_speedup']:.2f}), "
            f"predicted {row['predicted_best_from_measured_V']}, auto {row['auto_choice']}"
        )
    print(f"auto within one of the measured best at {within} of {len(ACCEPTANCES)} acceptances")
    return 0


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["by_acceptance"]
    a = [float(x) for x in rows]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    ax.plot(a, [r["measured_best"] for r in rows.values()], "ko-", label="measured best k")
    ax.plot(
        a,
        [r["predicted_best_from_measured_V"] for r in rows.values()],
        "r^--",
        label="k*(a) from measured V(k)",
    )
    ax.plot(a, [r["auto_choice"] for r in rows.values()], "bs:", label="auto policy")
    ax.set(xlabel="acceptance a", ylabel="draft length k", title="Staircase, oracle draft")
    ax.legend()
    fig.tight_layout()
    with atomic_path(path, force=True) as tmp:
        fig.savefig(tmp, format="png", dpi=120)


if __name__ == "__main__":
    sys.exit(main())
