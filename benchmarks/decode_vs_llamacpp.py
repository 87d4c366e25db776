"""llama.cpp as the peer: greedy decode tokens/s and verify step times tau(n), side by side.

    python benchmarks/decode_vs_llamacpp.py --shape olmoe --tokens 32 \\
        --out benchmarks/results/llamacpp_olmoe.json
    python benchmarks/decode_vs_llamacpp.py --demo target --tokens 128 \\
        --out benchmarks/results/llamacpp_demo_target.json

One checkpoint (a random-weight one of real expert shapes written by moespec.bench.checkpoints, a
demo model, or --model DIR), run by four engines in one process:

- "moespec": this tree, `--weights` (bf16, fp32 or int8; a new weight format adds an entry to
  MOESPEC_WEIGHTS), `--kernel` slot or dedup, its thread policy (moespec.kernels.threads)
  under torch.set_num_threads(T);
- "llama.cpp-bf16", "llama.cpp-q8_0": the same checkpoint written as GGUF by moespec's own
  exporter (moespec.export.gguf), run by llama-cpp-python with n_threads = T;
- "transformers": `generate` on the same checkpoint, bf16, greedy (MoE experts: grouped_mm).

Every arm is warmed up at every thread count first; then each round runs every arm at every
thread count (the order of arms reversed on odd rounds), so every engine sees the same drift
of a shared machine. Per arm and round:

- decode: (time of N + 1 greedy tokens - time of 1) / N from a fresh cache, the prefill and
  first token cancelling (median of --repeats);
- verify (moespec and llama.cpp): a pass of n = 1..--max-n tokens of held-out text with every
  row's logits, on a cache of --depth tokens, then removed (moespec: rolled back; llama.cpp:
  `llama_memory_seq_rm`), median of --verify-repeats per n: tau(n), seed 000 eq. (5).

Fixed time per step (as benchmarks/fixed_time.py): step time - B / beta, with B the bytes a
one-token step reads in that engine's format (dense weights incl. the head, m experts per MoE
layer, keys and values at the mean depth) and beta the best read bandwidth measured here at
the same thread count. Paired ratios are per round, with their range. The read bandwidth of a
shared host moves by a third from one minute to the next, so each decode is also set against
the read bandwidth probed just before and just after it (the better of the two, at its thread
count): `fraction_of_round_read_bandwidth`, median and range over the rounds.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from fixed_time import read_bandwidths  # noqa: E402

from moespec.bench.checkpoints import SHAPES, random_checkpoint  # noqa: E402
from moespec.bench.stats import ratio_range  # noqa: E402
from moespec.calibrate import llamacpp  # noqa: E402
from moespec.calibrate.plan import verify_documents  # noqa: E402
from moespec.calibrate.timing import beyond_last_level_cache, read_bandwidth  # noqa: E402
from moespec.calibrate.verify import measure_verify  # noqa: E402
from moespec.decoding import KernelPolicy, generate  # noqa: E402
from moespec.demo import describe  # noqa: E402
from moespec.files import check_writable, write_json  # noqa: E402
from moespec.models import load_config, load_model  # noqa: E402
from moespec.provenance import machine  # noqa: E402

PROMPT = "def fibonacci(n):"
# far above a last-level cache of tens of MiB; twice the cache where it is hundreds
PROBE_BYTES = beyond_last_level_cache(512 * 2**20)
MOESPEC_WEIGHTS = {
    "bf16": {"dtype": "bf16"},
    "fp32": {"dtype": "fp32"},
    "int8": {"dtype": "bf16", "weights": "int8"},  # experts and dense products, bf16 activations
}
GGUF_TYPES = ("bf16", "q8_0")
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")


class MoespecArm:
    def __init__(self, directory, weights, kernel):
        self.model, _ = load_model(directory, **MOESPEC_WEIGHTS[weights])
        self.kernel = kernel

    def threads(self, n):
        torch.set_num_threads(n)

    def decode(self, prompt, n):
        policy = KernelPolicy(self.kernel)
        for _ in generate(self.model, prompt, max_tokens=n, kernels=policy):
            pass

    def verify(self, tokens, args):
        """{kernel: tau(1..max_n)} of both expert kernels (llama.cpp's is deduplicating)."""
        records = measure_verify(
            self.model,
            tokens,
            depth=args.depth,
            pass_sizes=range(1, args.max_n + 1),
            kernels=("slot", "dedup"),
            repeats=args.verify_repeats,
            warmup=1,
        )
        return {k: [r["median"] for r in records if r["kernel"] == k] for k in ("slot", "dedup")}


class LlamaCppArm:
    def __init__(self, gguf):
        self.engine = llamacpp.LlamaCpp(gguf)

    def threads(self, n):
        self.engine.threads = n

    def decode(self, prompt, n):
        self.engine.greedy(prompt, n)

    def verify(self, tokens, args):
        records = llamacpp.measure_verify(
            self.engine,
            tokens,
            depth=args.depth,
            pass_sizes=range(1, args.max_n + 1),
            repeats=args.verify_repeats,
            warmup=1,
        )
        return {"llamacpp": [r["median"] for r in records]}


class TransformersArm:
    def __init__(self, directory):
        import transformers

        config = transformers.AutoConfig.from_pretrained(directory)
        moe = {"experts_implementation": "grouped_mm"} if hasattr(config, "num_experts") else {}
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.bfloat16, **moe
        ).eval()

    def threads(self, n):
        torch.set_num_threads(n)

    def decode(self, prompt, n):
        with torch.no_grad():
            self.model.generate(
                torch.tensor([prompt]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )

    verify = None


def per_token(arm, prompt, tokens, repeats) -> float:
    """Median over repeats of (time(N + 1) - time(1)) / N."""

    def run(n):
        start = time.perf_counter()
        arm.decode(prompt, n)
        return time.perf_counter() - start

    return statistics.median((run(tokens + 1) - run(1)) / tokens for _ in range(repeats))


def checkpoint(args) -> Path:
    if args.model:
        return Path(args.model)
    if args.demo:
        from moespec.demo import demo_paths

        return demo_paths()[("target", "draft").index(args.demo)]
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    return random_checkpoint(args.shape, args.cache_dir, args.layers)


def gguf_files(directory: Path, cache_dir: Path) -> dict[str, Path]:
    """The checkpoint as bf16 and Q8_0 GGUF (written once, kept beside the checkpoints)."""
    from moespec.export.gguf import export_gguf

    cache_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for kind in GGUF_TYPES:
        path = cache_dir / f"{directory.name}-{kind}.gguf"
        if not path.exists() or path.stat().st_mtime < (directory / "config.json").stat().st_mtime:
            export_gguf(directory, path, weight_type=kind, force=True)
        files[kind] = path
    return files


def moespec_step_bytes(model, depth: int) -> int:
    c = model.config
    kv = c.num_layers * 2 * c.num_kv_heads * c.head_dim * depth * model.embed.element_size()
    return model.step_bytes() + kv


def gguf_step_bytes(path: Path, config, depth: int) -> int:
    """Bytes a one-token step of llama.cpp reads from this file: every tensor but the
    embedding table (unless it is also the head) and the experts, plus m experts per MoE
    layer, plus f16 keys and values (llama.cpp's default cache type)."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    total = 0
    for name, nbytes in tensors.items():
        if name.endswith("_exps.weight"):
            total += nbytes * config.top_k // config.num_experts
        elif name != "token_embd.weight" or "output.weight" not in tensors:
            total += nbytes
    return total + config.num_layers * 2 * config.num_kv_heads * config.head_dim * depth * 2


def cpu_flags() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            present = set(line.split(":", 1)[1].split())
            return [f for f in CPU_FLAGS if f in present]
    return []


def paired(ours: list[float], theirs: list[float]) -> dict:
    """theirs / ours per round (ours' speedup when both are times), median and range."""
    return ratio_range([b / a for a, b in zip(ours, theirs, strict=True)])


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--shape", choices=sorted(SHAPES), default="olmoe")
    source.add_argument("--demo", choices=("target", "draft"))
    source.add_argument("--model", help="a checkpoint directory")
    parser.add_argument("--layers", type=int, help="layers of a --shape checkpoint")
    parser.add_argument("--weights", choices=sorted(MOESPEC_WEIGHTS), default="bf16")
    parser.add_argument("--kernel", choices=("slot", "dedup"), default="slot")
    parser.add_argument("--engines", default="moespec,llama.cpp-bf16,llama.cpp-q8_0,transformers")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--depth", type=int, default=256, help="cache depth of verify passes")
    parser.add_argument("--max-n", type=int, default=9)
    parser.add_argument("--verify-repeats", type=int, default=3)
    parser.add_argument("--cache-dir", type=Path, default=Path("benchmarks/checkpoints"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--force", action="store_true")
    return parser.parse_args(argv)


def build_arms(args, directory: Path) -> dict:
    names = [e.strip() for e in args.engines.split(",")]
    ggufs = gguf_files(directory, args.cache_dir) if any("llama" in n for n in names) else {}
    makers = {
        "moespec": lambda: MoespecArm(directory, args.weights, args.kernel),
        "llama.cpp-bf16": lambda: LlamaCppArm(ggufs["bf16"]),
        "llama.cpp-q8_0": lambda: LlamaCppArm(ggufs["q8_0"]),
        "transformers": lambda: TransformersArm(directory),
    }
    unknown = [n for n in names if n not in makers]
    if unknown:
        raise SystemExit(f"unknown engines {unknown}; choose from {list(makers)}")
    return {name: makers[name]() for name in names}, ggufs


def probe(threads: int) -> float:
    """The read bandwidth now, at `threads` threads (moespec.calibrate.timing.read_bandwidth:
    the best of 3 native reads of PROBE_BYTES, about 0.1 s at 512 MiB)."""
    torch.set_num_threads(threads)
    return read_bandwidth(PROBE_BYTES, repeats=3)


def measure(args, arms, prompt, text, threads):
    """Warm-up, then interleaved rounds: {(arm, threads): [per-round seconds per token]},
    {(arm, kernel, threads): [per-round [tau(1..max_n)]]} and {(arm, threads): [per-round read
    bandwidth]}: the best of a probe just before and one just after the arm's decode."""
    for t in threads:
        for arm in arms.values():
            arm.threads(t)
            per_token(arm, prompt, min(args.tokens, 8), 1)
    decode, verify, beside = {}, {}, {}
    for round_ in range(args.rounds):
        order = list(arms.items())
        if round_ % 2:
            order.reverse()
        for t in threads:
            for name, arm in order:
                before = probe(t)
                arm.threads(t)
                seconds = per_token(arm, prompt, args.tokens, args.repeats)
                decode.setdefault((name, t), []).append(seconds)
                beside.setdefault((name, t), []).append(max(before, probe(t)))
                arm.threads(t)
                line = f"round {round_ + 1} {name:15s} {t} thr: {1 / seconds:8.1f} tok/s"
                if arm.verify is not None:
                    for kernel, taus in arm.verify(text, args).items():
                        verify.setdefault((name, kernel, t), []).append(taus)
                        line += f"\n  tau(n) ms {kernel:8s} " + " ".join(
                            f"{x * 1e3:.2f}" for x in taus
                        )
                print(line, flush=True)
    return decode, verify, beside


def verify_summary(verify, name, t) -> dict:
    """Per kernel of the arm: median tau(n) over rounds (ms), every round, and the paired
    ratio tau_other(n) / tau_moespec(n) of llama.cpp's kernel against each moespec kernel."""
    out = {}
    for (arm, kernel, threads), rounds in verify.items():
        if (arm, threads) != (name, t):
            continue
        n_max = len(rounds[0])
        entry = {
            "median": [statistics.median(r[i] for r in rounds) * 1e3 for i in range(n_max)],
            "by_round": [[x * 1e3 for x in r] for r in rounds],
        }
        for ours in ("slot", "dedup"):
            if kernel == "llamacpp" and ("moespec", ours, t) in verify:
                base = verify[("moespec", ours, t)]
                entry[f"moespec_{ours}_speedup_paired_by_n"] = [
                    paired([r[i] for r in base], [r[i] for r in rounds]) for i in range(n_max)
                ]
        out[kernel] = entry
    return out


def summarize(decode, verify, nbytes, bandwidth, beside) -> dict:
    results = {}
    for (name, t), seconds in decode.items():
        median = statistics.median(seconds)
        beta = max(bandwidth[t].values())
        rounds = [nbytes[name] / s / b for s, b in zip(seconds, beside[(name, t)], strict=True)]
        entry = {
            "engine": name,
            "threads": t,
            "tokens_per_second": [1 / s for s in seconds],
            "median_tokens_per_second": 1 / median,
            "median_ms_per_token": median * 1e3,
            "bytes_per_step": nbytes[name],
            "bytes_ms": nbytes[name] / beta * 1e3,
            "fixed_ms": (median - nbytes[name] / beta) * 1e3,
            "fixed_ms_at_min": (min(seconds) - nbytes[name] / beta) * 1e3,
            "fraction_of_read_bandwidth": nbytes[name] / median / beta,
            # per round, against the read bandwidth probed just before and after that decode
            "round_read_bandwidth": beside[(name, t)],
            "fraction_of_round_read_bandwidth": ratio_range(rounds),
        }
        if ("moespec", t) in decode:
            entry["moespec_speedup_paired"] = paired(decode[("moespec", t)], seconds)
        entry["verify_ms_by_n"] = verify_summary(verify, name, t)
        results[f"{name}/{t}"] = entry
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    check_writable(args.out, force=args.force)
    threads = [int(t) for t in args.threads.split(",")]
    directory = checkpoint(args)
    arms, ggufs = build_arms(args, directory)
    from moespec.models import Tokenizer

    tokenizer = Tokenizer(directory / "tokenizer.json")
    prompt = tokenizer.encode(PROMPT)
    text = [t for d in verify_documents() for t in tokenizer.encode(d.text)]
    mean_depth = len(prompt) + args.tokens // 2
    config = load_config(directory)
    nbytes = {name: 0 for name in arms}
    for name, arm in arms.items():
        if isinstance(arm, LlamaCppArm):
            nbytes[name] = gguf_step_bytes(arm.engine.path, config, mean_depth)
        elif isinstance(arm, MoespecArm):
            nbytes[name] = moespec_step_bytes(arm.model, mean_depth)
    if "transformers" in arms:  # the same bf16 tensors as moespec's
        nbytes["transformers"] = nbytes.get("moespec") or nbytes["llama.cpp-bf16"]
    uses_llamacpp = any(isinstance(arm, LlamaCppArm) for arm in arms.values())
    bandwidth = {t: read_bandwidths(t) for t in threads}
    load = {"start": os.getloadavg()}
    decode, verify, beside = measure(args, arms, prompt, text, threads)
    load["end"] = os.getloadavg()
    for t in threads:  # again at the end; the best of the two is the denominator
        for kind, value in read_bandwidths(t).items():
            bandwidth[t][kind] = max(bandwidth[t][kind], value)
    report = {
        "benchmark": "decode_vs_llamacpp",
        "machine": {
            **machine(),
            "cpu_flags": cpu_flags(),
            # llama.cpp's versions where it ran (a run without it does not need it installed)
            **(llamacpp.versions() if uses_llamacpp else {}),
        },
        "settings": {
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "threads": threads,
            "checkpoint": describe(directory),  # the demo pair by its place in the package
            "gguf": {k: str(v) for k, v in ggufs.items()},
            "model_shape": SHAPES.get(args.shape) if not (args.demo or args.model) else None,
            "prompt": PROMPT,
            "prompt_tokens": len(prompt),
            "batch": 1,
            "verify_text": "verify_documents() of moespec.calibrate.plan (held-out stdlib)",
        },
        # other work on the machine while it ran (a shared machine: read the paired ratios)
        "load_average_1_5_15_min": load,
        "read_bandwidth_bytes_per_second": {str(t): b for t, b in bandwidth.items()},
        "results": summarize(decode, verify, nbytes, bandwidth, beside),
    }
    write_json(args.out, report, force=args.force)
    for key, r in report["results"].items():
        speedup = r.get("moespec_speedup_paired")
        ratio = f" moespec x{speedup['median']:.2f} ({speedup['min']:.2f}-{speedup['max']:.2f})"
        print(
            f"{key:20s} {r['median_tokens_per_second']:8.1f} tok/s  fixed {r['fixed_ms']:7.3f} ms"
            f"  {r['fraction_of_read_bandwidth']:4.0%} of read bw"
            f" ({r['fraction_of_round_read_bandwidth']['median']:4.0%} in its rounds)"
            + (ratio if speedup else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
