"""Real-draft evaluation (seed 000, App. D.3 analogue): does speculation with a real draft pay,
prompt by prompt, and does `--draft auto` find the best choice without losing where none pays?

    python benchmarks/real_draft_eval.py --out benchmarks/results/real_draft_demo.json \\
        --plot benchmarks/results/real_draft_demo.png

Prompts are windows of the demo corpus's held-out files (a seeded offset into each file), and
with `--quoting N` also N prompts that quote themselves: a held-out window, a blank line, and
the window's first quarter again (code edited or repeated from the prompt), where the suffix
drafter should pay most. Per prompt, greedy, every arm decodes the same number of tokens from
fresh state: plain; the draft model at each fixed k = 1..8; prompt lookup and the suffix drafter
at fixed k; the suffix drafter alone with its length from its counts (`suffix`); `auto` (per
step among the suffix drafter, the draft model, lookup and none, as `moespec generate --draft
auto:DIR` runs it: starting from the measurements its earlier runs remembered, here those of the
previous auto runs of this benchmark, as `moespec generate` remembers them between runs);
`auto-cold` (the same from nothing, `--no-cache`); with `--plan`, `plan` (the same from
nothing but the plan's clock: `--plan PLAN --no-cache`, its verify times, its draft's h(k)
and its kernel switch, scored against the best fixed choice as auto is); and plain again
(`plain-b`, whose ratio to plain is the noise floor). "Within 5% of the best fixed choice"
is scored twice: against the arm best over all rounds (the best of some 17 noisy arms,
biased upwards), and held out: the best arm chosen on the even rounds, auto scored against
it on the odd ones. Arms run in a seeded random order within each round, one round per
repeat, all in one process; every ratio is paired within a round (arm / plain of the same
prompt and round) and summarised by its median over rounds. Results are written after every
round, so an interrupted run keeps the rounds it finished.
"""

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moespec.decoding import DraftLengthPolicy, KernelPolicy, generate, summarize  # noqa: E402
from moespec.decoding.drafters import ModelDrafter, PromptLookupDrafter  # noqa: E402
from moespec.decoding.remembered import Remembered  # noqa: E402
from moespec.decoding.sampling import Sampler  # noqa: E402
from moespec.decoding.setup import speculation_factory  # noqa: E402
from moespec.decoding.suffix import SuffixDrafter  # noqa: E402
from moespec.demo import demo_paths, describe  # noqa: E402
from moespec.demo.corpus import held_out_documents  # noqa: E402
from moespec.files import check_writable, write_json  # noqa: E402
from moespec.models import load_model  # noqa: E402
from moespec.plan import load_plan  # noqa: E402
from moespec.provenance import provenance  # noqa: E402

LOOKUP_LENGTHS = (2, 4, 8)  # the fixed lengths of lookup and the suffix drafter
AUTO_ARMS = ("auto", "auto-cold", "suffix", "plan")  # arms that choose for themselves
WITHIN = 0.95  # "within 5% of the best fixed choice"
NEVER_LOSES = 0.97  # auto's floor against plain where no fixed choice beats plain


def prompts_from_held_out(tokenizer, count: int, length: int, seed: int) -> list[dict]:
    """`count` windows of `length` tokens, one per held-out file of at least 2 `length`
    tokens, at a seeded offset (so not every prompt is a licence header)."""
    rng = random.Random(seed)
    prompts = []
    for document in held_out_documents():
        ids = tokenizer.encode(document.text)
        if len(ids) < 2 * length:
            continue
        start = rng.randrange(0, len(ids) - 2 * length + 1)
        prompts.append(
            {"source": document.name, "offset": start, "ids": ids[start : start + length]}
        )
        if len(prompts) == count:
            return prompts
    raise ValueError(f"only {len(prompts)} held-out files have {2 * length} tokens")


def quoting_prompts(tokenizer, count: int, length: int, seed: int) -> list[dict]:
    """`count` prompts that quote themselves: a held-out window of `length` tokens, a blank
    line, then the window's first quarter again (other files than `prompts_from_held_out`'s
    first ones: seeded differently)."""
    blank = tokenizer.encode("\n\n")
    out = []
    for p in prompts_from_held_out(tokenizer, count, length, seed + 1):
        ids = p["ids"] + blank + p["ids"][: length // 4]
        out.append({**p, "source": f"quote:{p['source']}", "ids": ids})
    return out


def greedy_speculation(spec, target, tokenizer, prompt, n, plan=None):
    """Fresh greedy speculation of `spec` (`--draft SPEC`) for one bf16 generation."""
    return speculation_factory(
        spec,
        target=target,
        tokenizer=tokenizer,
        sampler=Sampler(),
        prompt=prompt,
        max_tokens=n,
        dtype="bf16",
        plan=plan,
    )()


def make_arms(target, draft_model, draft_dir, tokenizer, plan=None):
    """{arm name: function(prompt ids, n) -> records}, each a fresh generation."""
    vocab = target.config.vocab_size

    def run(prompt, n, drafter=None, policy=None, kernels=None):
        return list(
            generate(
                target,
                prompt,
                max_tokens=n,
                kernels=kernels or KernelPolicy("auto"),
                drafter=drafter,
                draft_policy=policy,
                stop_tokens=(),
            )
        )

    arms = {"plain": lambda p, n: run(p, n), "plain-b": lambda p, n: run(p, n)}
    for k in range(1, 9):
        arms[f"model:{k}"] = lambda p, n, k=k: run(
            p, n, ModelDrafter(draft_model, Sampler(), vocab), DraftLengthPolicy(k)
        )
    for k in LOOKUP_LENGTHS:
        arms[f"lookup:{k}"] = lambda p, n, k=k: run(
            p, n, PromptLookupDrafter(), DraftLengthPolicy(k)
        )

    for k in LOOKUP_LENGTHS:
        arms[f"suffix:{k}"] = lambda p, n, k=k: run(p, n, SuffixDrafter(), DraftLengthPolicy(k))
    memory = Remembered(None, "benchmark")  # in memory: what generate keeps in its file

    def speculating(spec, remember, plan=None):
        def arm(prompt, n):
            speculation = greedy_speculation(spec, target, tokenizer, prompt, n, plan)
            if remember:
                memory.seed(speculation)
            kernels = plan.kernel_policy() if plan is not None else None
            records = run(prompt, n, speculation, kernels=kernels)
            if remember:
                memory.take(speculation)
            return records

        return arm

    arms["suffix"] = speculating("suffix", remember=False)
    arms["auto"] = speculating(f"auto:{draft_dir}", remember=True)
    arms["auto-cold"] = speculating(f"auto:{draft_dir}", remember=False)
    if plan is not None:  # `generate --draft auto:DIR --plan PLAN --no-cache`: the plan's clock
        arms["plan"] = speculating(f"auto:{draft_dir}", remember=False, plan=plan)
    return arms


def summarise(prompts, arms, rounds) -> dict:
    """Paired ratios per prompt and the scores of the issue (see the module docstring)."""
    fixed = [a for a in arms if a not in (*AUTO_ARMS, "plain-b")]
    per_prompt = []
    for i, prompt in enumerate(prompts):
        runs = [r[i] for r in rounds]
        ratio = {
            arm: statistics.median(run[arm]["tps"] / run["plain"]["tps"] for run in runs)
            for arm in arms
        }
        best = max(fixed, key=lambda arm: ratio[arm])
        auto_vs_best = statistics.median(run["auto"]["tps"] / run[best]["tps"] for run in runs)
        # The best of some 17 noisy arms is biased upwards (the winner's curse): chosen on
        # the even rounds, it is scored on the odd ones (with at least two rounds)
        held_out = None
        if len(runs) >= 2:
            chooser, scorer = runs[0::2], runs[1::2]
            pick = max(
                fixed,
                key=lambda arm: statistics.median(
                    r[arm]["tps"] / r["plain"]["tps"] for r in chooser
                ),
            )
            held_out = {
                "best_fixed": pick,
                "auto_over_best_fixed": statistics.median(
                    r["auto"]["tps"] / r[pick]["tps"] for r in scorer
                ),
            }
        per_prompt.append(
            {
                "source": prompt["source"],
                "offset": prompt["offset"],
                "plain_tokens_per_second": statistics.median(run["plain"]["tps"] for run in runs),
                "speedup": ratio,
                "best_fixed": best,
                "auto_over_best_fixed": auto_vs_best,
                "held_out": held_out,
                "tokens_per_second_by_round": {
                    arm: [run[arm]["tps"] for run in runs] for arm in arms
                },
                "auto_drafters": runs[0]["auto"]["drafters"],
                "auto_exploring_share": statistics.median(run["auto"]["exploring"] for run in runs),
                "same_tokens_as_plain": {
                    arm: all(run[arm]["same"] for run in runs) for arm in arms
                },
            }
        )
    if "plan" in arms:  # `generate --plan` against the best fixed setting, as auto is
        for p, i in zip(per_prompt, range(len(prompts)), strict=True):
            runs = [r[i] for r in rounds]
            p["plan_over_best_fixed"] = statistics.median(
                run["plan"]["tps"] / run[p["best_fixed"]]["tps"] for run in runs
            )
            if p["held_out"]:
                pick = p["held_out"]["best_fixed"]
                p["held_out"]["plan_over_best_fixed"] = statistics.median(
                    r["plan"]["tps"] / r[pick]["tps"] for r in runs[1::2]
                )
    no_gain = [p for p in per_prompt if p["best_fixed"] == "plain"]
    auto = [p["speedup"]["auto"] for p in per_prompt]
    noise = [p["speedup"]["plain-b"] for p in per_prompt]
    quoting = [p for p in per_prompt if p["source"].startswith("quote:")]
    return {
        "prompts": per_prompt,
        "scores": {
            "auto_at_least_0.97x_plain_everywhere": all(a >= NEVER_LOSES for a in auto),
            "auto_exploring_share_median_max": [
                statistics.median(p["auto_exploring_share"] for p in per_prompt),
                max(p["auto_exploring_share"] for p in per_prompt),
            ],
            "auto_cold_median_speedup": statistics.median(
                p["speedup"]["auto-cold"] for p in per_prompt
            ),
            "suffix_on_quoting_prompts": sorted(p["speedup"]["suffix"] for p in quoting),
            "auto_on_quoting_prompts": sorted(p["speedup"]["auto"] for p in quoting),
            "auto_within_5pct_of_best_fixed_held_out": (
                sum(p["held_out"]["auto_over_best_fixed"] >= WITHIN for p in per_prompt)
                / len(per_prompt)
                if all(p["held_out"] for p in per_prompt)
                else None
            ),
            "auto_within_5pct_of_best_fixed": sum(
                p["auto_over_best_fixed"] >= WITHIN for p in per_prompt
            )
            / len(per_prompt),
            "prompts_where_no_fixed_choice_beats_plain": len(no_gain),
            "auto_worst_on_those": min((p["speedup"]["auto"] for p in no_gain), default=None),
            "auto_at_least_0.97x_plain_on_those": all(
                p["speedup"]["auto"] >= NEVER_LOSES for p in no_gain
            ),
            "auto_worst_against_plain": min(auto),
            "auto_median_speedup": statistics.median(auto),
            "share_of_prompts_where_speculation_beats_plain": sum(
                p["best_fixed"] != "plain" for p in per_prompt
            )
            / len(per_prompt),
            "share_of_prompts_where_auto_beats_plain": sum(a > 1 for a in auto) / len(auto),
            "noise_floor_plain_b_over_plain": [min(noise), statistics.median(noise), max(noise)],
            "held_out_noise_ceiling": held_out_noise_ceiling(per_prompt),
            **(plan_scores(per_prompt) if "plan" in arms else {}),
        },
    }


def held_out_noise_ceiling(per_prompt) -> float | None:
    """The share of prompts on which plain-b, the very arm plain is, comes within 5% of plain
    on the scoring (odd) rounds: what an arm making the held-out pick's own choice would
    score against it at this many rounds, the ceiling of the held-out "within 5%" scores."""
    ratios = []
    for p in per_prompt:
        tps = p["tokens_per_second_by_round"]
        scoring = list(zip(tps["plain-b"][1::2], tps["plain"][1::2], strict=True))
        if not scoring:
            return None
        ratios.append(statistics.median(again / first for again, first in scoring))
    return sum(r >= WITHIN for r in ratios) / len(ratios)


def rescore(path: Path) -> dict:
    """The result at `path` with the scores computed from its stored rounds added (those
    added since it was run); written in place."""
    result = json.loads(path.read_text())
    result["scores"]["held_out_noise_ceiling"] = held_out_noise_ceiling(result["prompts"])
    write_json(path, result, force=True)
    return result["scores"]


def plan_scores(per_prompt) -> dict:
    plan = [p["speedup"]["plan"] for p in per_prompt]
    held_out = [p["held_out"] for p in per_prompt]
    return {
        "plan_within_5pct_of_best_fixed": sum(
            p["plan_over_best_fixed"] >= WITHIN for p in per_prompt
        )
        / len(per_prompt),
        "plan_within_5pct_of_best_fixed_held_out": (
            sum(h["plan_over_best_fixed"] >= WITHIN for h in held_out) / len(held_out)
            if all(held_out)
            else None
        ),
        "plan_median_speedup": statistics.median(plan),
        "plan_worst_against_plain": min(plan),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prompts = sorted(result["prompts"], key=lambda p: p["speedup"][p["best_fixed"]])
    x = range(len(prompts))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    for arm, style in (("model:", "tab:blue"), ("lookup:", "tab:green"), ("suffix:", "tab:orange")):
        for i, p in enumerate(prompts):
            values = [v for a, v in p["speedup"].items() if a.startswith(arm)]
            left.scatter([i] * len(values), values, s=8, color=style, alpha=0.35)
    left.plot(x, [p["speedup"][p["best_fixed"]] for p in prompts], "k_", ms=14, label="best fixed")
    left.plot(x, [p["speedup"]["auto"] for p in prompts], "o", color="tab:red", label="auto")
    noise = result["scores"]["noise_floor_plain_b_over_plain"]
    left.axhspan(noise[0], noise[2], color="0.85", label="plain vs plain (noise)")
    left.axhline(1.0, color="0.4", lw=0.8)
    left.scatter([], [], s=8, color="tab:blue", label="draft model, k = 1..8")
    left.scatter([], [], s=8, color="tab:green", label="lookup, fixed k")
    left.scatter([], [], s=8, color="tab:orange", label="suffix, fixed k")
    left.set_xlabel("prompt (sorted by the best fixed choice's speedup)")
    left.set_ylabel("tokens/s over plain (median of paired rounds)")
    left.legend(fontsize=8)
    right.hist([p["speedup"]["auto"] for p in prompts], bins=12, color="tab:red", alpha=0.7)
    right.axvline(1.0, color="0.4", lw=0.8)
    right.set_xlabel("auto's speedup over plain")
    right.set_ylabel("prompts")
    fig.suptitle(result["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="target checkpoint (default: the demo target)")
    parser.add_argument("--draft", help="draft checkpoint (default: the demo draft)")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--quoting", type=int, default=0, help="prompts that quote themselves")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-invariant", default="on", choices=["on", "off"])
    parser.add_argument(
        "--plan", help="a plan of the target made with --draft: adds its arm (auto on the plan)"
    )
    parser.add_argument("--out")
    parser.add_argument("--plot")
    parser.add_argument("--force", action="store_true")
    parser.add_argument(
        "--rescore", metavar="FILE", help="add the newer scores to a result from its rounds"
    )
    args = parser.parse_args(argv)
    if args.rescore:
        if not Path(args.rescore).is_file():
            parser.error(f"--rescore {args.rescore}: no such file")
        print(rescore(Path(args.rescore)))
        return 0
    if not args.out:
        parser.error("--out FILE is required (or --rescore FILE)")
    for path in filter(None, (args.out, args.plot)):
        check_writable(path, force=args.force)
    if args.threads:
        torch.set_num_threads(args.threads)
    target_dir, draft_dir = demo_paths()
    target_dir, draft_dir = args.model or target_dir, args.draft or draft_dir
    target, tokenizer = load_model(target_dir, dtype="bf16")
    target.batch_invariant = args.batch_invariant == "on"
    draft, _ = load_model(draft_dir, dtype="bf16")
    prompts = prompts_from_held_out(tokenizer, args.prompts, args.prompt_tokens, args.seed)
    if args.quoting:
        prompts += quoting_prompts(tokenizer, args.quoting, args.prompt_tokens, args.seed)
    plan = load_plan(args.plan, model=target) if args.plan else None
    arms = make_arms(target, draft, draft_dir, tokenizer, plan)
    for run in arms.values():  # the same warm-up for every arm
        run(prompts[0]["ids"], 16)
    rng = random.Random(args.seed)
    rounds = []
    settings = {
        "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens,
        "repeats": args.repeats,
        "dtype": "bf16",
        "greedy": True,
        "kernel": "auto",
        "batch_invariant": args.batch_invariant,
        "arms": list(arms),
        "seed": args.seed,
        "quoting_prompts": args.quoting,
        "plan": args.plan,
        "threads": torch.get_num_threads(),
    }
    started = time.time()
    for repeat in range(args.repeats):
        round_ = []
        for i, prompt in enumerate(prompts):
            order = list(arms)
            rng.shuffle(order)
            runs = {}
            for arm in order:
                records = arms[arm](prompt["ids"], args.tokens)
                runs[arm] = {
                    "tps": summarize(records)["tokens_per_second"],
                    "tokens": [t for r in records for t in r.tokens],
                    "exploring": summarize(records)["exploring_steps"]
                    / max(summarize(records)["decode_steps"], 1),
                    "drafters": {
                        str(name): sum(r.drafter == name for r in records[1:])
                        for name in ("suffix", "model", "lookup", None)
                    },
                }
            plain_tokens = runs["plain"]["tokens"]
            for run in runs.values():
                run["same"] = run["tokens"] == plain_tokens
            for run in runs.values():
                del run["tokens"]
            round_.append(runs)
            print(
                f"round {repeat + 1}/{args.repeats} prompt {i + 1}/{len(prompts)}: auto "
                f"{runs['auto']['tps'] / runs['plain']['tps']:.2f}x plain "
                f"({time.time() - started:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
        rounds.append(round_)
        result = {
            "title": f"{describe(target_dir)} drafted by {describe(draft_dir)}: "
            f"{len(prompts)} held-out prompts ({args.quoting} quoting themselves), "
            f"{args.tokens} tokens, {repeat + 1} rounds",
            "provenance": provenance(),
            "settings": settings,
            "rounds_done": repeat + 1,
            **summarise(prompts, arms, rounds),
        }
        write_json(args.out, result, force=True if repeat else args.force)
    if args.plot:
        plot(result, Path(args.plot))
    print(result["scores"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
