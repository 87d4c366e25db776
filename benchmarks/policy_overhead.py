"""Benchmark: the offload policies' own time per layer, the Python on a decode step's hot path.

Every MoE layer of an offloaded pass waits for its decisions: the layer driver's plan (the
policy's `plan_layer`, the plan check, pins, fetch admission) between the router's output and
the experts' compute, and its finish (`end_layer`: the estimator, the balancer, the prefetch
queue) before the next layer. The engine and the simulator run the same driver and policies, so
this times them in the simulator, where nothing else runs: the thread CPU time of
`LayerDriver.plan` and `LayerDriver.finish`, per layer pass, for each policy on two workloads:

- `qwen3`: seed 003's setting (Qwen3-30B-A3B shapes, 48 layers of 128 experts, top 8, passes of
  k + 1 = 9 tokens, 25% cache; the calibration gate's routing and profile);
- `olmoe`: OLMoE-1B-7B shapes (16 layers of 64 experts, top 8) at its published rho(2), k = 4,
  25% cache, the same profile.

The clock: each call is timed by two `time.thread_time()` readings, and each reading is a
system call of its own (~0.75 us on the AVX2 host), so every timed call carries about one
reading's cost whatever it does: with SpAc's kernel that was ~1.5 us of the ~12 us of a layer
pass. Each run measures that floor (the mean time between back-to-back readings, `clock_us`)
and subtracts it from every call it times; `plan_us` and `finish_us` are net of it, the
`raw_*` figures are not. A timed call still includes calling the driver's method (as the
engine does). `ms_per_step` is the net total times the layers of a pass.

--before-rev REV times the moespec package as of git revision REV (extracted to a temporary
folder) in the same rounds: each round runs this tree and REV in two child processes, in an
order alternating per round, so the paired ratio before/after per round has its range. It also
checks that both decided alike: the same simulated tokens/s, hit rate and bytes copied (these
profiles keep decisions off the virtual clock, so a change that only makes them faster changes
none of the three).

    python benchmarks/policy_overhead.py --out FILE [--rounds 5] [--tokens 128]
        [--policies spac,static,lru,hybrid] [--before-rev REV]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOADS = ("qwen3", "olmoe")


def measure(workload: str, policies: list[str], tokens: int) -> dict:
    """{policy: plan and finish us per layer pass, the passes, and the run's simulated tokens/s,
    hit rate and bytes copied}: one simulated run per policy (in a child process)."""
    from moespec.offload import get_profile, make_policy
    from moespec.offload.driver import LayerDriver
    from moespec.offload.sim.calibration import GATE_PROFILE, gate_settings, gate_workload
    from moespec.offload.sim.experiments import settings_for
    from moespec.offload.sim.simulator import simulate
    from moespec.offload.sim.workload import synthetic_workload

    spent = {"plan": 0.0, "finish": 0.0, "passes": 0}
    floor = clock_floor()

    def timed(method, key: str):
        def wrapper(self, *args, **kwargs):
            start = time.thread_time()
            try:
                return method(self, *args, **kwargs)
            finally:
                spent[key] += time.thread_time() - start
                spent["passes"] += key == "plan"

        return wrapper

    LayerDriver.plan = timed(LayerDriver.plan, "plan")
    LayerDriver.finish = timed(LayerDriver.finish, "finish")
    profile = get_profile(GATE_PROFILE)
    if workload == "qwen3":
        work = gate_workload(tokens + 9)
        settings = gate_settings(work, tokens=tokens)
    else:
        work = synthetic_workload("olmoe-1b-7b", tokens=tokens + 5, fit_tokens=256, seed=0)
        settings = settings_for(
            work, cache_ratio=0.25, draft_length=4, acceptance=0.7, tokens=tokens
        )
    out = {}
    for name in policies:
        spent.update(plan=0.0, finish=0.0, passes=0)
        policy = make_policy(name).fit(work.fit_trace())
        result = simulate(work.trace, policy, profile, settings)
        n = max(spent["passes"], 1)
        plan, finish = spent["plan"] / n, spent["finish"] / n  # one call of each per pass
        out[name] = {
            "plan_us": 1e6 * (plan - floor),
            "finish_us": 1e6 * (finish - floor),
            "raw_plan_us": 1e6 * plan,
            "raw_finish_us": 1e6 * finish,
            "clock_us": 1e6 * floor,
            "layers": int(work.trace.expert_ids.shape[1]),
            "layer_passes": spent["passes"],
            "tokens_per_second": result.tokens_per_second,
            "hit_rate": result.hit_rate,
            "bytes_copied": result.stats.bytes_copied,
        }
    return out


def clock_floor(calls: int = 20000, batches: int = 7) -> float:
    """Seconds between two back-to-back `time.thread_time()` readings (what timing a call adds
    to it): the median over batches of the mean time per reading."""
    clock, means = time.thread_time, []
    for _ in range(batches):
        start = clock()
        for _ in range(calls):
            clock()
        means.append((clock() - start) / (calls + 1))
    return statistics.median(means)


def before_tree(rev: str) -> Path:
    """The moespec package as of git revision `rev`, extracted into a temporary folder."""
    done = subprocess.run(
        ["git", "archive", "--format=tar", rev, "moespec"], cwd=HERE.parent, capture_output=True
    )
    if done.returncode != 0:
        raise SystemExit(f"--before-rev {rev}: git archive failed: {done.stderr.decode().strip()}")
    folder = Path(tempfile.mkdtemp(prefix="moespec-before-"))
    with tarfile.open(fileobj=BytesIO(done.stdout)) as tar:
        tar.extractall(folder, filter="data")
    return folder


def child(tree: Path | None, workload: str, policies: list[str], tokens: int) -> dict:
    """measure() in a fresh process, importing moespec from `tree` (None: this tree)."""
    env = dict(os.environ)
    root = tree if tree is not None else HERE.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        json.dumps({"workload": workload, "policies": policies, "tokens": tokens}),
    ]
    done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"child run failed ({workload}, {root}): {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(rounds: list[dict], policies: list[str], arms: list[str]) -> dict:
    """Per workload, policy and arm: median plan, finish and total us per layer pass; with a
    before arm, the paired per-round ratio before / after of the total, median and range."""
    out = {}
    for workload in WORKLOADS:
        out[workload] = {}
        for name in policies:
            row = {}
            for arm in arms:
                runs = [r[arm][workload][name] for r in rounds]
                totals = [x["plan_us"] + x["finish_us"] for x in runs]
                layers = runs[0]["layers"]
                row[arm] = {
                    "plan_us": statistics.median(x["plan_us"] for x in runs),
                    "finish_us": statistics.median(x["finish_us"] for x in runs),
                    "total_us": statistics.median(totals),
                    "ms_per_step": statistics.median(totals) * layers / 1e3,
                    "total_us_by_round": totals,
                    "raw_total_us": statistics.median(
                        x["raw_plan_us"] + x["raw_finish_us"] for x in runs
                    ),
                    "clock_us": statistics.median(x["clock_us"] for x in runs),
                    "layers": layers,
                    "tokens_per_second": runs[0]["tokens_per_second"],
                    "hit_rate": runs[0]["hit_rate"],
                    "bytes_copied": runs[0]["bytes_copied"],
                }
            if "before" in arms:
                # The simulation is deterministic on these profiles (decisions off the clock):
                # a faster policy must decide exactly as before.
                row["same_decisions"] = all(
                    row["before"][key] == row["after"][key]
                    for key in ("tokens_per_second", "hit_rate", "bytes_copied")
                )
                ratios = [
                    b / a
                    for a, b in zip(
                        row["after"]["total_us_by_round"],
                        row["before"]["total_us_by_round"],
                        strict=True,
                    )
                ]
                row["before_over_after"] = {
                    "median": statistics.median(ratios),
                    "min": min(ratios),
                    "max": max(ratios),
                }
            out[workload][name] = row
    return out


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        spec = json.loads(sys.argv[2])
        print(json.dumps(measure(spec["workload"], spec["policies"], spec["tokens"])))
        return 0
    from moespec.files import check_writable, write_json
    from moespec.provenance import provenance

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128, help="tokens emitted per run")
    parser.add_argument("--policies", default="spac,static,lru,hybrid")
    parser.add_argument("--before-rev", metavar="REV")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    check_writable(args.out, force=args.force)
    if args.rounds < 1 or args.tokens < 1:
        raise SystemExit("--rounds and --tokens must be at least 1")
    policies = [p for p in args.policies.split(",") if p]
    from moespec.offload import make_policy

    for name in policies:
        try:
            make_policy(name)
        except ValueError as e:
            raise SystemExit(f"--policies: {e}") from None
    trees = {"after": None}
    if args.before_rev:
        trees["before"] = before_tree(args.before_rev)
    arms = list(trees)
    rounds, interrupted = [], False
    try:
        for i in range(args.rounds):
            order = arms if i % 2 == 0 else arms[::-1]
            result = {}
            for arm in order:
                result[arm] = {w: child(trees[arm], w, policies, args.tokens) for w in WORKLOADS}
            rounds.append(result)
            print(f"round {i + 1}/{args.rounds} done", flush=True)
    except KeyboardInterrupt:  # keep the rounds finished
        if not rounds:
            raise
        interrupted = True
        print(f"interrupted: writing the {len(rounds)} rounds finished", flush=True)
    finally:
        if "before" in trees:
            shutil.rmtree(trees["before"], ignore_errors=True)
    summary = summarize(rounds, policies, arms)
    for workload, rows in summary.items():
        for name, row in rows.items():
            line = "  ".join(
                f"{a} {row[a]['plan_us']:6.1f} + {row[a]['finish_us']:5.1f} us"
                f" ({row[a]['ms_per_step']:.2f} ms a step)"
                for a in arms
            )
            ratio = row.get("before_over_after")
            extra = (
                f"  before/after x{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})"
                if ratio
                else ""
            )
            if row.get("same_decisions") is False:
                extra += "  (the arms decided differently: tokens/s, hit rate or bytes differ)"
            print(f"{workload:6s} {name:8s} plan + finish per layer: {line}{extra}")
    write_json(
        args.out,
        {
            "benchmark": "policy decision time per layer pass (simulator, thread CPU time)",
            "settings": {**vars(args), "out": str(args.out)},
            "rounds_finished": len(rounds),
            "interrupted": interrupted,
            "results": summary,
            "provenance": provenance(),
        },
        force=args.force,
    )
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
