"""A full-size MoE checkpoint on this machine: build, convert, load, export and decode, moespec
against llama.cpp.

    python benchmarks/full_size.py --shape olmoe-1b-7b --threads 1,2 --rounds 3 --tokens 32 \\
        --out benchmarks/results/full_size/olmoe-1b-7b.json --force

A random-weight checkpoint of the real shape (every layer, bf16; time does not depend on the
values) is written tensor by tensor (moespec.bench.checkpoints.streamed_random_checkpoint),
then, each step in its own process, timed, with its peak resident memory (`/usr/bin/time -v`
where present):

- build: the checkpoint itself; convert: `moespec convert --weights bf16|int8`;
- load: `load_model` of the Hugging Face checkpoint ("first load", one layer at a time into
  the final layouts) and of each converted directory (its weights mapped from the file), with
  VmHWM, RssAnon and RssFile after the load; set against the time to read the same files
  (large sequential reads). The page cache is dropped before each where this process may
  (root); otherwise the figures say "cached only";
- export: `moespec export-gguf --type bf16|q8_0` for llama.cpp.

Decode: a model of 13 GB in 24 GB leaves room for one engine at a time, so every arm
(moespec bf16 / int8 from the converted directories, llama.cpp bf16 / q8_0 from the GGUF
files) runs in its own process per round, the arms interleaved round by round with the order
rotated each round. A worker reads its files once (into the page cache), loads, warms up at
every thread count, then per thread count: greedy tokens/s as (time of N + 1 tokens - time of
1) / N from a fixed text prompt, beside the read bandwidth probed just before and after
(moespec.calibrate.timing.read_bandwidth), so tok/s x bytes per token / bandwidth is the
fraction of the read bandwidth a token uses. Bytes per token: moespec's `step_bytes` plus the
KV cache at the mean depth; llama.cpp's the same count over the GGUF's own tensors (bf16: the
same bytes; q8_0: 34 bytes per 32 weights).

The JSON is written after every round (an interrupted run keeps what finished); the large
files it built are deleted at the end unless --keep-checkpoints.
"""

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

ARMS = ("moespec-bf16", "moespec-int8", "llamacpp-bf16", "llamacpp-q8_0")
PAIRS = {
    "bf16": ("moespec-bf16", "llamacpp-bf16"),
    "int8_vs_q8_0": ("moespec-int8", "llamacpp-q8_0"),
}
READ_BLOCK = 64 * 2**20
RESULT = "RESULT "


# --- measurements inside a worker process ---------------------------------------------------


def memory_status() -> dict:
    """VmHWM (peak), VmRSS, RssAnon and RssFile of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def model_files(directory: Path) -> list[Path]:
    if directory.is_file():
        return [directory]
    return sorted(p for p in directory.rglob("*") if p.is_file())


def read_files(paths) -> dict:
    """Read every file once with large reads (`cat files > /dev/null`): seconds and bytes."""
    buffer = bytearray(READ_BLOCK)
    view = memoryview(buffer)
    total = 0
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "bytes": total, "bytes_per_second": total / seconds}


def worker_build(args) -> dict:
    from moespec.bench.checkpoints import streamed_random_checkpoint

    start = time.perf_counter()
    directory = streamed_random_checkpoint(args.shape, args.work_dir, args.layers)
    return {"path": str(directory), "seconds": time.perf_counter() - start, **memory_status()}


def worker_load(args) -> dict:
    import torch

    from moespec.models import load_model

    torch.set_num_threads(max(int(t) for t in args.threads.split(",")))
    from moespec.decoding import generate

    weights = {"weights": args.weights} if args.weights else {}
    start = time.perf_counter()
    model, tokenizer = load_model(args.path, **weights)
    seconds = time.perf_counter() - start
    loaded = memory_status()
    # ready to decode: a mapped model reads its pages as the first passes touch them
    prompt = tokenizer.encode("def main():\n")
    start = time.perf_counter()
    list(generate(model, prompt, max_tokens=1))
    first_token = time.perf_counter() - start
    return {
        "seconds": seconds,
        "first_token_seconds": first_token,
        "step_bytes": model.step_bytes(),
        **loaded,
        "after_first_token": memory_status(),
    }


def worker_hold(args) -> dict:
    """Load, decode a few tokens (the pages they read become resident), report, then hold the
    model until stdin closes: the driver runs two at once to see what a second process adds."""
    from moespec.decoding import generate
    from moespec.models import load_model

    model, tokenizer = load_model(args.path)
    list(generate(model, tokenizer.encode(PROMPT_TEXT), max_tokens=args.tokens))
    print(RESULT + json.dumps({"pid": os.getpid(), **memory_status()}), flush=True)
    sys.stdin.read()
    return {}


PROMPT_TEXT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


def proportional_set_size(pid: int) -> int:
    """A process's resident memory with each shared page split among its sharers (Pss)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"no Pss for process {pid}")


def two_processes(args, path: Path) -> dict:
    """Two processes decoding the same converted model: each one's Pss alone and together,
    and what the second adds to the first's resident memory (its pages are the first's)."""
    processes, out = [], {}

    def start():
        proc = subprocess.Popen(
            worker_cmd(args, "hold", "--path", str(path)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for line in proc.stdout:
            if line.startswith(RESULT):
                processes.append(proc)
                return json.loads(line[len(RESULT) :])
        raise RuntimeError(f"hold worker exited with {proc.wait()}")

    try:
        out["first"] = start()
        out["first_alone_pss"] = proportional_set_size(processes[0].pid)
        out["second"] = start()
        together = [proportional_set_size(p.pid) for p in processes]
        out["together_pss"] = together
        out["second_adds"] = sum(together) / out["first_alone_pss"] - 1
    finally:
        for proc in processes:
            proc.stdin.close()
            proc.wait()
    return out


def worker_decode(args) -> dict:
    import torch
    from decode_vs_llamacpp import (
        PROMPT,
        LlamaCppArm,
        MoespecArm,
        gguf_step_bytes,
        moespec_step_bytes,
        per_token,
        probe,
    )

    from moespec.models import Tokenizer, load_config

    threads = [int(t) for t in args.threads.split(",")]
    prompt = Tokenizer(Path(args.tokenizer) / "tokenizer.json").encode(PROMPT)
    mean_depth = len(prompt) + args.tokens // 2
    record = {"arm": args.worker_arm, "prompt_tokens": len(prompt)}
    # into the page cache first, so that the decode reads memory, not the disk
    record["file_read"] = read_files(model_files(Path(args.path)))
    start = time.perf_counter()
    if args.worker_arm.startswith("moespec"):
        arm = MoespecArm(args.path, args.worker_arm.split("-")[1], "slot")
        record["bytes_per_token"] = moespec_step_bytes(arm.model, mean_depth)
    else:
        arm = LlamaCppArm(Path(args.path))
        if args.worker_arm == "llamacpp-q8_0":
            arm.decode = tokenwise_greedy(arm.engine)
            record["prefill"] = TOKENWISE
        config = load_config(args.tokenizer)
        record["bytes_per_token"] = gguf_step_bytes(Path(args.path), config, mean_depth)
    record["load_seconds"] = time.perf_counter() - start
    record["memory_after_load"] = memory_status()
    warm = time.perf_counter()
    for t in threads:  # touches the weights (most experts) at every thread count
        arm.threads(t)
        arm.decode(prompt, args.warmup_tokens)
    record["warmup_seconds"] = time.perf_counter() - warm
    record["by_threads"] = {}
    for t in threads:
        before = probe(t)
        arm.threads(t)
        seconds = per_token(arm, prompt, args.tokens, 1)
        after = probe(t)
        bandwidth = max(before, after)
        record["by_threads"][str(t)] = {
            "seconds_per_token": seconds,
            "tokens_per_second": 1 / seconds,
            "read_bandwidth_before": before,
            "read_bandwidth_after": after,
            "fraction_of_read_bandwidth": record["bytes_per_token"] / seconds / bandwidth,
        }
    if args.worker_arm.startswith("moespec"):
        record["speculation"] = speculation(arm.model, prompt, args.tokens, threads[-1])
    record["memory_end"] = memory_status()
    del arm
    torch.set_num_threads(threads[-1])
    return record


SPECULATION = ("oracle:0.6", "oracle:0.9", "lookup", "suffix")
OWN_LENGTH = ("suffix",)  # drafters whose draft length is their own (from their counts)
DRAFT_LENGTH = 4
SPECULATION_ROUNDS = 2


def speculation(model, prompt, tokens: int, threads: int) -> dict:
    """Greedy speculative decoding at k = DRAFT_LENGTH (the suffix drafter: its own length,
    from its counts and the measured verify times) against plain decoding, in the same
    process, the arms alternated over SPECULATION_ROUNDS rounds: tokens/s as (time of N + 1
    tokens - time of 1) / N, accepted drafts per step, and the paired ratio to plain. The
    drafters that apply to random weights: the oracle (the target's own greedy continuation,
    each draft wrong with probability 1 - a; its reference is made before the clock starts),
    prompt lookup and the suffix drafter."""
    import torch

    from moespec.decoding import DraftLengthPolicy, Sampler, generate
    from moespec.decoding.setup import build_drafter

    torch.set_num_threads(threads)

    def run(spec, n):
        drafter = policy = None
        if spec != "plain":
            drafter = build_drafter(
                spec,
                target=model,
                tokenizer=None,
                sampler=Sampler(),
                prompt=prompt,
                max_tokens=n,
                dtype=model.dtype,
            )
            policy = DraftLengthPolicy("auto" if spec in OWN_LENGTH else DRAFT_LENGTH)
        start = time.perf_counter()
        records = list(generate(model, prompt, max_tokens=n, drafter=drafter, draft_policy=policy))
        seconds = time.perf_counter() - start
        steps = [r for r in records[1:] if r.draft_length]
        accepted = sum(r.accepted for r in steps) / len(steps) if steps else 0.0
        return seconds, accepted

    arms = ("plain", *SPECULATION)
    results = {a: {"tokens_per_second": [], "accepted_per_step": []} for a in arms}
    for round_ in range(SPECULATION_ROUNDS):
        for spec in arms if round_ % 2 == 0 else arms[::-1]:
            whole, accepted = run(spec, tokens + 1)
            first, _ = run(spec, 1)
            results[spec]["tokens_per_second"].append(tokens / (whole - first))
            results[spec]["accepted_per_step"].append(accepted)
    plain = results["plain"]["tokens_per_second"]
    for spec in SPECULATION:
        ratios = [s / p for s, p in zip(results[spec]["tokens_per_second"], plain, strict=True)]
        results[spec]["over_plain"] = {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        }
    return {"threads": threads, "draft_length": DRAFT_LENGTH, "arms": results}


TOKENWISE = (
    "one token per pass: a pass of several tokens of this llama.cpp build's Q8_0 path (AMX "
    "tiles) dies with SIGILL on this virtual machine; one-token passes (every decode step) "
    "run; the prefill cancels in (time of N + 1 - time of 1) / N"
)


def tokenwise_greedy(engine):
    """Greedy decoding as LlamaCpp.greedy, the prompt fed one token per pass."""

    def decode(prompt, n):
        engine.reset()
        for token in prompt:
            logits = engine.forward([token], all_logits=False)
        token = int(logits[-1].argmax())
        out = [token]
        while len(out) < n:
            token = int(engine.forward([token], all_logits=False)[-1].argmax())
            out.append(token)
        return out

    return decode


WORKERS = {
    "build": worker_build,
    "load": worker_load,
    "decode": worker_decode,
    "hold": worker_hold,
}


# --- the driver -----------------------------------------------------------------------------


def timed(cmd: list[str]) -> dict:
    """Run `cmd` (a worker or the CLI) as a child: wall seconds, peak RSS (GNU time's maximum
    resident set, else the largest child's ru_maxrss so far) and the worker's RESULT line."""
    import resource

    gnu_time = Path("/usr/bin/time")
    full = [str(gnu_time), "-v", *cmd] if gnu_time.exists() else cmd
    start = time.perf_counter()
    proc = subprocess.run(full, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    shown = ["python", *cmd[1:]] if cmd[0] == sys.executable else cmd
    out = {"command": repo_relative(" ".join(shown))}
    out["wall_seconds"] = seconds
    match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    if match:
        out["peak_rss_bytes"] = int(match.group(1)) * 1024
        out["peak_rss_source"] = "/usr/bin/time -v"
    else:
        out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        out["peak_rss_source"] = "getrusage(RUSAGE_CHILDREN), the largest child so far"
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            out["result"] = json.loads(line[len(RESULT) :])
        elif line.startswith("{"):  # the CLI's --json summary
            with contextlib.suppress(json.JSONDecodeError):
                out["summary"] = json.loads(repo_relative(proc.stdout[proc.stdout.index("{") :]))
            break
    return out


def repo_relative(text: str) -> str:
    """Paths under this checkout written relative to it (results name no machine's paths)."""
    return text.replace(str(HERE.parent) + os.sep, "")


def worker_cmd(args, worker: str, *extra: str) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", worker]
    cmd += ["--shape", args.shape, "--work-dir", str(args.work_dir), "--threads", args.threads]
    cmd += ["--tokens", str(args.tokens), "--warmup-tokens", str(args.warmup_tokens)]
    if args.layers is not None:
        cmd += ["--layers", str(args.layers)]
    return cmd + list(extra)


def drop_caches() -> bool:
    """Empty the page cache (root only): True where it was dropped."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def cold(report) -> str:
    dropped = drop_caches()
    report["page_cache"] = "dropped before each load" if dropped else "cached only"
    return "cold" if dropped else "cached"


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in model_files(path))


def has_llamacpp() -> str | None:
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"not importable: {e}"
    return None


def summarize(report, arms, threads) -> None:
    rounds = report["rounds"]
    medians = {}
    for arm in arms:
        for t in threads:
            runs = [r[arm]["by_threads"][str(t)] for r in rounds if arm in r]
            if not runs:
                continue
            medians[f"{arm}/{t}"] = {
                "tokens_per_second": statistics.median(x["tokens_per_second"] for x in runs),
                "fraction_of_read_bandwidth": statistics.median(
                    x["fraction_of_read_bandwidth"] for x in runs
                ),
                "by_round": [x["tokens_per_second"] for x in runs],
            }
        runs = [r[arm] for r in rounds if arm in r]
        if runs:
            medians[arm] = {
                "bytes_per_token": runs[0]["bytes_per_token"],
                "load_seconds": statistics.median(x["load_seconds"] for x in runs),
                "peak_rss_bytes": max(x["peak_rss_bytes"] for x in runs),
                "rss_anon_after_load": statistics.median(
                    x["memory_after_load"]["RssAnon"] for x in runs
                ),
                "rss_file_end": statistics.median(x["memory_end"]["RssFile"] for x in runs),
            }
    report["medians"] = medians
    from moespec.bench.stats import ratio_range

    paired = {}
    for ours, theirs in PAIRS.values():
        for t in threads:
            both = [r for r in rounds if ours in r and theirs in r]
            if not both:
                continue
            ratios = [
                r[ours]["by_threads"][str(t)]["tokens_per_second"]
                / r[theirs]["by_threads"][str(t)]["tokens_per_second"]
                for r in both
            ]
            paired[f"{ours}/{theirs}/{t}"] = {**ratio_range(ratios), "by_round": ratios}
    report["paired_tokens_per_second_ratios"] = paired


def run(args) -> int:
    from moespec.bench.checkpoints import SHAPES
    from moespec.files import check_writable, write_json
    from moespec.provenance import machine

    check_writable(args.out, force=args.force)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    threads = [int(t) for t in args.threads.split(",")]
    arms = [a.strip() for a in args.arms.split(",")]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; choose from {list(ARMS)}")
    missing = has_llamacpp()
    skipped = {}
    if missing:
        skipped = {a: f"llama.cpp {missing}" for a in arms if a.startswith("llamacpp")}
        arms = [a for a in arms if a not in skipped]
    versions = {}
    if not missing:
        from moespec.calibrate import llamacpp

        versions = llamacpp.versions()
    import torch
    import transformers
    from decode_vs_llamacpp import cpu_flags

    report = {
        "benchmark": "full_size",
        "machine": {**machine(), "cpu_flags": cpu_flags()},
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            **versions,
        },
        "settings": {
            **{
                k: repo_relative(str(v)) if isinstance(v, Path) else v
                for k, v in vars(args).items()
            },
            "threads": threads,
            "arms": arms,
            "model_shape": SHAPES[args.shape],
            "batch": 1,
            "decode": "greedy, (time of N + 1 tokens - time of 1) / N, fresh cache",
        },
        "skipped": skipped,
        "load_average_start": os.getloadavg(),
    }

    def save():
        write_json(args.out, report, force=True)

    built: list[Path] = []
    phases = report["phases"] = {}
    # the checkpoint
    existed = {p.name for p in args.work_dir.iterdir()}
    phases["build"] = timed(worker_cmd(args, "build"))
    source = Path(phases["build"]["result"]["path"])
    phases["build"]["reused"] = source.name in existed
    if not phases["build"]["reused"]:
        built.append(source)
    phases["build"]["bytes"] = size(source)
    phases["build"]["result"]["path"] = repo_relative(str(source))
    print(f"checkpoint {source} {phases['build']['bytes'] / 1e9:.1f} GB", flush=True)
    save()
    # converted directories
    converted = {}
    for weights in ("bf16", "int8"):
        out = args.work_dir / f"{source.name}-converted-{weights}"
        if out.exists() and not args.force:
            converted[weights] = out
            continue
        cmd = [
            sys.executable,
            "-m",
            "moespec",
            "convert",
            str(source),
            str(out),
            "--weights",
            weights,
            "--force",
        ]
        phases[f"convert_{weights}"] = timed(cmd + ["--json"])
        phases[f"convert_{weights}"]["bytes"] = size(out)
        converted[weights] = out
        built.append(out)
        print(
            f"convert {weights}: {phases[f'convert_{weights}']['wall_seconds']:.1f} s", flush=True
        )
        save()
    # loads, each from a dropped page cache where possible, against reading the same files
    loads = report["loads"] = {}
    for name, path, weights in (
        ("first_load_bf16", source, None),
        ("first_load_int8", source, "int8"),
        ("converted_load_bf16", converted["bf16"], None),
        ("converted_load_int8", converted["int8"], None),
    ):
        state = cold(report)
        read = read_files(model_files(path))
        state = cold(report)
        extra = ["--path", str(path)] + (["--weights", weights] if weights else [])
        entry = timed(worker_cmd(args, "load", *extra))
        entry["page_cache"] = state
        entry["file_read"] = read
        entry["load_over_file_read"] = entry["result"]["seconds"] / read["seconds"]
        loads[name] = entry
        print(
            f"{name}: {entry['result']['seconds']:.1f} s, first token after "
            f"{entry['result']['first_token_seconds']:.1f} s (read {read['seconds']:.1f} s, "
            f"x{entry['load_over_file_read']:.2f}), peak {entry['peak_rss_bytes'] / 2**30:.2f} GiB",
            flush=True,
        )
        save()
    # two processes on one converted model: what the second adds
    report["two_processes"] = two_processes(args, converted["bf16"])
    print(f"second process adds {report['two_processes']['second_adds']:.1%}", flush=True)
    save()
    # GGUF files for llama.cpp
    ggufs = {}
    if any(a.startswith("llamacpp") for a in arms):
        for kind in ("bf16", "q8_0"):
            path = args.work_dir / f"{source.name}-{kind}.gguf"
            if not path.exists() or args.force:
                cmd = [
                    sys.executable,
                    "-m",
                    "moespec",
                    "export-gguf",
                    str(source),
                    str(path),
                    "--type",
                    kind,
                ]
                phases[f"export_gguf_{kind}"] = timed(cmd + ["--force", "--json"])
                phases[f"export_gguf_{kind}"]["bytes"] = path.stat().st_size
                built.append(path)
                print(
                    f"export {kind}: {phases[f'export_gguf_{kind}']['wall_seconds']:.1f} s",
                    flush=True,
                )
                save()
            ggufs[kind] = path
    paths = {
        "moespec-bf16": converted["bf16"],
        "moespec-int8": converted["int8"],
        "llamacpp-bf16": ggufs.get("bf16"),
        "llamacpp-q8_0": ggufs.get("q8_0"),
    }
    # decode rounds, one process per arm, the order rotated each round
    report["rounds"] = []
    for round_ in range(args.rounds):
        order = arms[round_ % len(arms) :] + arms[: round_ % len(arms)]
        record = {"order": order}
        report["rounds"].append(record)
        for arm in order:
            extra = ["--worker-arm", arm, "--path", str(paths[arm]), "--tokenizer", str(source)]
            entry = timed(worker_cmd(args, "decode", *extra))
            record[arm] = {**entry.pop("result"), **entry}
            print(
                f"round {round_ + 1} {arm:14s} "
                + "  ".join(
                    f"{t} thr {r['tokens_per_second']:6.2f} tok/s "
                    f"({r['fraction_of_read_bandwidth']:.0%} of read bw)"
                    for t, r in record[arm]["by_threads"].items()
                )
                + f"  peak {entry['peak_rss_bytes'] / 2**30:.2f} GiB",
                flush=True,
            )
            summarize(report, arms, threads)
            save()
    report["load_average_end"] = os.getloadavg()
    summarize(report, arms, threads)
    for key, value in report["paired_tokens_per_second_ratios"].items():
        print(f"{key}: x{value['median']:.2f} ({value['min']:.2f}-{value['max']:.2f})")
    if not args.keep_checkpoints:
        for path in built:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        report["deleted"] = [p.name for p in built]
    save()
    return 0


def parse_args(argv):
    from moespec.bench.checkpoints import SHAPES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="olmoe-1b-7b")
    parser.add_argument("--layers", type=int, help="layers (default: the shape's, all)")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--warmup-tokens", type=int, default=16, help="per thread count")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--work-dir", type=Path, default=HERE / "checkpoints")
    parser.add_argument(
        "--out", type=Path, default=HERE / "results" / "full_size" / "olmoe-1b-7b.json"
    )
    parser.add_argument("--force", action="store_true", help="replace --out and rebuild")
    parser.add_argument("--keep-checkpoints", action="store_true")
    # a worker process (one step of the driver)
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--worker-arm", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        result = WORKERS[args.worker](args)
        print(RESULT + json.dumps(result), flush=True)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
