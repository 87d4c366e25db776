"""Batched decoding: aggregate throughput and latency per batch size, and k*(a, B).

    python benchmarks/batch_decode.py --out benchmarks/results/batch_decode_demo.json
    python benchmarks/batch_decode.py --shape olmoe-1b-7b --tokens 24 --rounds 1 \\
        --prompts 8 --out benchmarks/results/batch_decode_olmoe-1b-7b.json

The same --prompts held-out prompts (--prompt-length tokens each) are decoded greedily, in bf16,
by `moespec.decoding.batch.decode_batch` at each batch size B (1, 2, 4, 8): at B = 1 one after
another, at B = 8 all together, each finished request replaced by the next. Per B: aggregate
tokens/s (all tokens over the wall time of the whole set, prefills included), the decode
steps' own tokens/s (without the prefill passes, which are the same at every B), and the mean
per-request latency (start of its prefill to its last token), both also as ratios to B = 1
in the same round. Arms run in --rounds rounds, their order rotated each round, in one
process; every arm's tokens are checked equal to B = 1's.

Speculation per batch size (the suffix drafter, which costs no target time to draft): each B
also decodes with a fixed draft length k = 1..--max-k and with `auto` (the policy's k*(a, B),
which prices a draft of k at tau(B (k + 1)) / B). Measured: tokens/s per (B, k), the best
fixed k per B, whether speculation (auto) is ever slower than plain at the same B. Predicted:
k*(a, B) = argmax_k E(a, k) / tau(B (k + 1)) (seed 000's rule with V(k) = tau(k + 1) for a
drafter whose proposal is spent anyway), from tau(n) measured here as batched passes of n
tokens (n = B (k + 1)) and the acceptance a measured in the fixed-k runs.

--plan PLAN (a plan of this model, made here): its arm decodes with `auto` reading the plan
(its tau(n), its batch table's tau_hat_B(k), its kernel switch: `generate --plan`), and the
table is scored: tau_hat_B(k) against batched passes of B sequences of k + 1 text tokens
measured here (both kernels, interleaved), and k*(a, B) on the plan's V_B against k* on the
measured V_B, at the acceptance of the fixed-k arms. Beside each B's throughput, the bound a
pass limited by its weight bytes would give, from the plan's union of B sequences' experts.

--shape NAME builds a random-weight checkpoint of that model's real shape (streamed, bf16,
with a real-text tokenizer) in --checkpoints, and deletes it at the end unless
--keep-checkpoints; peak RSS is reported beside every figure.
"""

import argparse
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from real_draft_eval import prompts_from_held_out  # noqa: E402

from moespec.costmodel import best_draft_length, expected_tokens  # noqa: E402
from moespec.decoding import DraftLengthPolicy, KernelPolicy  # noqa: E402
from moespec.decoding.batch import BatchRequest, decode_batch  # noqa: E402
from moespec.decoding.speculation import Speculation  # noqa: E402
from moespec.decoding.suffix import SuffixDrafter  # noqa: E402
from moespec.files import check_writable, write_json  # noqa: E402
from moespec.models import load_model  # noqa: E402
from moespec.models.batch import batch_pass  # noqa: E402
from moespec.plan import load_plan  # noqa: E402
from moespec.provenance import provenance  # noqa: E402


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_arm(model, prompts, tokens: int, batch: int, k, plan=None, max_k: int = 8) -> dict:
    """Decode every prompt at batch size `batch`; k: None (plain), an int, "auto" (measured
    online) or "plan" (auto on the plan's tau(n) and batch table, its kernel switch)."""

    def drafter():
        if k is None:
            return None
        if k == "plan":
            return Speculation.single(SuffixDrafter(), plan.draft_policy(max_draft_length=max_k))
        return Speculation.single(SuffixDrafter(), DraftLengthPolicy(k, max_draft_length=8))

    kernels = plan.kernel_policy() if k == "plan" else KernelPolicy()
    requests = [BatchRequest(i, p, tokens, drafter=drafter()) for i, p in enumerate(prompts)]
    out, started, ended, prefill = {}, {}, {}, 0.0
    drafted = accepted = rejected = 0
    begin = time.perf_counter()
    for key, record in decode_batch(model, requests, max_batch=batch, kernels=kernels):
        now = time.perf_counter()
        if record.phase == "prefill":
            started[key] = now - record.seconds
            prefill += record.seconds
        out.setdefault(key, []).extend(record.tokens)
        drafted, accepted = drafted + record.drafted, accepted + record.accepted
        rejected += record.accepted < record.drafted  # a step's run ends at its rejection
        ended[key] = now
    wall = time.perf_counter() - begin
    generated = sum(map(len, out.values()))
    return {
        "tokens": [out[i] for i in range(len(prompts))],
        "wall_seconds": wall,
        "tokens_per_second": generated / wall,
        # the decode steps alone: a prefill is a pass of its own, holding the batch meanwhile
        "decode_tokens_per_second": (generated - len(out)) / (wall - prefill),
        "mean_latency_seconds": statistics.mean(ended[i] - started[i] for i in out),
        "drafted": drafted,
        "accepted": accepted,
        "rejected": rejected,
    }


def pass_times(model, prompts, sizes: list[int], rounds: int) -> dict[int, float]:
    """tau(n): median seconds of a batched pass of n tokens of text spread over min(n, 8)
    sequences at the prompts' ends (the caches rolled back after each)."""
    caches = []
    for p in prompts[:8]:
        cache = model.new_cache(capacity=len(p) + 80)
        batch_pass(model, [p], [cache], kernel="dedup")
        caches.append(cache)
    times = {n: [] for n in sizes}
    for _ in range(rounds):
        for n in sizes:
            b = min(n, len(caches))
            # text tokens (the prompt's last ones again), routed as text routes: one token
            # repeated would share its experts and make large passes look cheap
            feeds = [p[-(n // b + (i < n % b)) :] for i, p in enumerate(prompts[:b])]
            lengths = [c.length for c in caches[:b]]
            kernel = KernelPolicy().for_pass(n)
            start = time.perf_counter()
            batch_pass(model, feeds, caches[:b], kernel=kernel, all_logits=True)
            times[n].append(time.perf_counter() - start)
            for cache, length in zip(caches[:b], lengths, strict=True):
                cache.rollback(length)
    return {n: statistics.median(v) for n, v in times.items()}


def batch_pass_times(model, prompts, batches, max_k: int, rounds: int) -> dict:
    """{(B, k): {kernel: median seconds}} of a batched pass of B sequences of k + 1 text
    tokens each (the prompts' last ones again; caches rolled back), both kernels, the cases
    interleaved in rounds."""
    caches = []
    for p in prompts[: max(batches)]:
        cache = model.new_cache(capacity=len(p) + 80)
        batch_pass(model, [p], [cache], kernel="dedup")
        caches.append(cache)
    cases = [
        (b, k, kernel) for b in batches for k in range(max_k + 1) for kernel in ("slot", "dedup")
    ]
    times = {case: [] for case in cases}
    for _ in range(rounds):
        for b, k, kernel in cases:
            feeds = [p[-(k + 1) :] for p in prompts[:b]]
            lengths = [c.length for c in caches[:b]]
            # twice, the second timed: the first pass after another case's (other sizes,
            # threads, kernel) ran up to 2.5x slow at one token on an AVX2 host
            for timed in (False, True):
                start = time.perf_counter()
                batch_pass(model, feeds, caches[:b], kernel=kernel, all_logits=True)
                if timed:
                    times[b, k, kernel].append(time.perf_counter() - start)
                for cache, length in zip(caches[:b], lengths, strict=True):
                    cache.rollback(length)
    out = {}
    for (b, k, kernel), values in times.items():
        out.setdefault((b, k), {})[kernel] = statistics.median(values)
    return out


def byte_bound(model, plan) -> dict[int, float]:
    """{B: B bytes(1) / bytes(B)}: the throughput over B = 1 of plain batched decoding were a
    pass bound by its weight bytes alone, bytes(B) = D + U^B(1) w (seed 000 eq. 5, without
    the KV cache), with the union of B sequences' experts the plan measured on its trace."""
    weights = model.parameter_bytes()
    blocks = model.moe_blocks.values()
    per_expert = weights["experts"] / sum(b.experts.num_experts for b in blocks)
    nbytes = {b: weights["dense"] + plan.batch.union[b][0] * per_expert for b in plan.batch.union}
    return {b: b * nbytes[1] / nbytes[b] for b in nbytes if 1 in nbytes}


def against_plan(plan, measured: dict, batches, max_k: int, acceptance: dict) -> list[dict]:
    """Per B: the plan's tau_hat_B(k) against the measured pass of its kernel, and k*(a, B) on
    the plan's V_B against k* on the measured V_B (the faster kernel's), at the acceptance
    measured in the fixed-k arms."""
    rows = []
    for b in batches:
        planned = plan.batch.verify_times(b) if plan.batch else None
        if planned is None:
            continue
        kernels = plan.batch.kernel.get(b) or [
            plan.kernel_policy().for_pass(b * (k + 1)) for k in range(len(planned))
        ]
        width = min(max_k + 1, len(planned))
        mine = [
            measured[b, k][kernels[k] if kernels[k] in measured[b, k] else "slot"]
            for k in range(width)
        ]
        fastest = [min(measured[b, k].values()) for k in range(width)]
        a = min(acceptance[b], 0.999)
        rows.append(
            {
                "batch": b,
                "plan_verify_seconds": planned[:width],
                "measured_verify_seconds": mine,
                "verify_error": [abs(p - m) / m for p, m in zip(planned, mine, strict=False)],
                "acceptance": acceptance[b],
                "plan_k": best_draft_length([t / b for t in planned[:width]], a),
                "measured_best_k": best_draft_length([t / b for t in fastest], a),
            }
        )
    return rows


def predicted_k(tau: dict[int, float], acceptance: float, batch: int, max_k: int) -> int:
    """argmax_k E(a, k) / tau(B (k + 1)): the suffix drafter's proposal is spent anyway."""
    rates = [expected_tokens(acceptance, k) / tau[batch * (k + 1)] for k in range(max_k + 1)]
    return max(range(max_k + 1), key=rates.__getitem__)


def model_for(args):
    if args.shape is None:
        from moespec.demo import demo_paths, describe

        target = args.model or str(demo_paths()[0])
        return target, describe(target), None
    from moespec.bench.checkpoints import streamed_random_checkpoint

    built = streamed_random_checkpoint(args.shape, Path(args.checkpoints))
    return str(built), f"{args.shape} (random weights of its shape)", built


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: the demo target)")
    parser.add_argument("--shape", help="build a random checkpoint of this shape (olmoe-1b-7b)")
    parser.add_argument("--checkpoints", default="benchmarks/checkpoints")
    parser.add_argument("--keep-checkpoints", action="store_true")
    parser.add_argument("--batch-sizes", default="1,2,4,8")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=96)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--max-k", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--plan", help="a plan of this model: adds its auto arm and scores its k*(a, B) table"
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    out = check_writable(args.out, force=args.force)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    path, name, built = model_for(args)
    try:
        result = measure(args, path, name, batches)
    finally:
        if built is not None and not args.keep_checkpoints:
            shutil.rmtree(built, ignore_errors=True)
    result["deleted_checkpoint"] = built is not None and not args.keep_checkpoints
    write_json(out, result, force=args.force)
    print(f"wrote {out}")
    return 0


def measure(args, path: str, name: str, batches: list[int]) -> dict:
    model, tokenizer = load_model(path, dtype="bf16")
    model.batch_invariant = True
    plan = load_plan(args.plan, model.config) if args.plan else None
    prompts = [
        p["ids"] for p in prompts_from_held_out(tokenizer, args.prompts, args.prompt_length, 0)
    ]
    modes = (None, *range(1, args.max_k + 1), "auto", *(("plan",) if plan else ()))
    arms = [(b, k) for b in batches for k in modes]
    run_arm(model, prompts[:2], 8, 2, 2)  # warm-up: every code path once
    rounds = []
    for r in range(args.rounds):
        order = arms[r % len(arms) :] + arms[: r % len(arms)]
        measured = {}
        for b, k in order:
            measured[(b, k)] = run_arm(model, prompts, args.tokens, b, k, plan, args.max_k)
            print(
                f"round {r + 1}: B={b} k={k}: {measured[(b, k)]['tokens_per_second']:.1f} tok/s",
                flush=True,
            )
        rounds.append(measured)
    reference = rounds[0][(batches[0], None)]["tokens"]
    same = all(m["tokens"] == reference for rnd in rounds for m in rnd.values())
    sizes = sorted({b * (k + 1) for b in batches for k in range(args.max_k + 1)})
    tau = pass_times(model, prompts, sizes, max(3, args.rounds))
    rows = summarize(rounds, batches, args.max_k, tau, plan is not None)
    scored = None
    if plan is not None and plan.batch is not None:
        bound = byte_bound(model, plan)
        for row in rows:
            row["byte_bound_vs_batch_1"] = bound.get(row["batch"])
        acceptance = {row["batch"]: row["measured_acceptance"] for row in rows}
        passes = batch_pass_times(model, prompts, batches, args.max_k, max(3, args.rounds))
        scored = against_plan(plan, passes, batches, args.max_k, acceptance)
    return {
        "benchmark": "batch_decode",
        "model": name,
        "provenance": provenance(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "force")},
        "peak_rss_mb": peak_rss_mb(),
        "same_tokens_in_every_arm": same,
        "per_batch": rows,
        "tau_seconds": {str(n): t for n, t in tau.items()},
        **({"plan": args.plan, "against_plan": scored} if plan is not None else {}),
    }


def summarize(rounds, batches, max_k, tau, with_plan: bool = False) -> list[dict]:
    def median(b, k, field):
        return statistics.median(rnd[(b, k)][field] for rnd in rounds)

    def ratios(b, k, field):
        return [rnd[(b, k)][field] / rnd[(1, None)][field] for rnd in rounds]

    rows = []
    for b in batches:
        fixed = {k: median(b, k, "tokens_per_second") for k in range(1, max_k + 1)}
        # the geometric acceptance's estimate: accepted drafts over accepted plus rejections
        accepted = sum(rnd[(b, k)]["accepted"] for rnd in rounds for k in fixed)
        rejected = sum(rnd[(b, k)]["rejected"] for rnd in rounds for k in fixed)
        acceptance = accepted / max(accepted + rejected, 1)
        plain = median(b, None, "tokens_per_second")
        best = max(fixed, key=fixed.get)
        rows.append(
            {
                "batch": b,
                "plain_tokens_per_second": plain,
                "plain_decode_tokens_per_second": median(b, None, "decode_tokens_per_second"),
                "decode_throughput_vs_batch_1": statistics.median(
                    ratios(b, None, "decode_tokens_per_second")
                ),
                "throughput_vs_batch_1": statistics.median(ratios(b, None, "tokens_per_second")),
                "throughput_vs_batch_1_range": [
                    min(ratios(b, None, "tokens_per_second")),
                    max(ratios(b, None, "tokens_per_second")),
                ],
                "latency_vs_alone": statistics.median(ratios(b, None, "mean_latency_seconds")),
                "fixed_k_tokens_per_second": {str(k): v for k, v in fixed.items()},
                "best_fixed_k": best if fixed[best] > plain else 0,
                # the draft lengths (0: plain) within 5% of the best: where the measured
                # curve is flat to within its noise, any of them is "the best"
                "fixed_k_within_5pct_of_best": [
                    k
                    for k, v in ((0, plain), *fixed.items())
                    if v >= 0.95 * max(plain, fixed[best])
                ],
                "auto_tokens_per_second": median(b, "auto", "tokens_per_second"),
                "auto_vs_plain": median(b, "auto", "tokens_per_second") / plain,
                "measured_acceptance": acceptance,
                "predicted_k": predicted_k(tau, acceptance, b, max_k),
            }
        )
        if with_plan:
            rows[-1]["plan_tokens_per_second"] = median(b, "plan", "tokens_per_second")
            rows[-1]["plan_vs_plain"] = median(b, "plan", "tokens_per_second") / plain
            rows[-1]["plan_vs_best_fixed"] = median(b, "plan", "tokens_per_second") / max(
                plain, fixed[best]
            )
    return rows


if __name__ == "__main__":
    sys.exit(main())
