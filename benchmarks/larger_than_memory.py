"""Benchmark: a model decoded in less memory than it takes, its experts on disk (issue 53).

    python benchmarks/larger_than_memory.py --model CONVERTED_DIR [--gguf MODEL.gguf] \\
        --memory-budget 40% --hold auto --tokens 64 --rounds 3 --out FILE
    python benchmarks/larger_than_memory.py --build small --build-layers 4 --work-dir /tmp/x ...
    python benchmarks/larger_than_memory.py --source HF_CHECKPOINT --work-dir DIR ...

One int8-converted model (`moespec convert SRC DST --weights int8`), the same prompt (the first
--prompt-tokens tokens of held-out text) and greedy decoding of --tokens tokens in every arm:

    in-memory    moespec with every weight mapped and resident: the reference. Its greedy
                 tokens must be every moespec arm's. It runs once a round, before that
                 round's hold (it cannot fit the memory the others get), and the engine's own
                 costs are timed right after it each round (`engine_costs_job`: what the
                 simulator's disk profile is fitted from; the in-memory runs check it);
                 --skip-in-memory leaves it out (the reference is then the first plain disk
                 arm's run, taken under the hold and not timed in)
    POLICY       moespec's disk tier (`open_engine(disk=True)`): experts read with direct I/O
                 into a RAM cache of --memory-budget, run by lru, static (the most used
                 resident), spac-ar (SpAc without speculation), ...
    POLICY+draft the same with speculation: the oracle drafter (the reference continuation,
                 each draft wrong with probability 1 - --acceptance, flags fixed per position),
                 whose proposals cost no target time
    llama.cpp    the GGUF Q8_0 of the same checkpoint through llama-cpp-python, mmap'd
                 (use_mmap, llama.cpp's own paging): its own greedy tokens, not compared

Memory condition: the budget is the expert cache's; a helper process allocates, mlocks where
permitted (else only touches: every page written) and holds --hold bytes, so that the page
cache of every arm, llama.cpp's included, sees the same room: `--hold auto` holds
MemAvailable - (budget + dense weights + --hold-margin). Each arm runs in a process of its
own (its peak RSS, VmHWM, is its own), after the page cache is dropped (`--drop-caches`: global
through /proc/sys/vm/drop_caches where permitted, else POSIX_FADV_DONTNEED on the model's
files; the files' resident share is measured after, with mincore).

Routing sources (`--routing`): "model", the checkpoint's own routers (random weights: no
locality), and "replay", every position's experts forced to a synthetic trace's
(`moespec.routing.synthetic.LocalityProcess` on the model's experts and layers, fitted to a
measured rho(2): the published value of the routing shape with the same experts and top-k,
else --replay-reuse2) through `moespec.offload.engine.replay.RoutingReplay`; llama.cpp runs
the model's routing only.

Before the rounds the script measures this disk's direct-I/O random-read bandwidth over the
model file (1 and 4 MiB O_DIRECT preads, 1 and --io-depth in flight). A round runs the
in-memory arm (each routing), times the engine's costs, starts the hold, runs every held arm
once, in an order turned by one place each round, and releases the hold; per arm the JSON
holds the median run and the range of tokens/s, with hit rate, bytes read per token, stall
per token, the disk read rate during decode beside the probe, peak RSS, and whether the
tokens are the reference's; `targets` scores issue 53's. Bad input is one line and exit status 2.

Traces (`--save-traces`, on by default): beside the JSON, in FILE's stem + ".traces/", each
arm's routing as moespec routing traces (Parquet; `moespec.routing.store`), so that the
simulator can replay the runs (benchmarks/simulate_disk_tier.py): per moespec arm and routing
source, ARM.SOURCE.parquet holds the expert ids of the sequence's positions (the prompt, then
each emitted token's), its metadata the fit split (the prompt's tokens), the draft length and
the accepted drafts of every step of the median run; a speculative arm's
ARM.SOURCE.rejected.parquet holds, at each position, the routing a rejected draft got there
(the position's own elsewhere). The replay source's positions are its trace's
(replay.parquet): the routers' own choices are not what ran.
"""

import argparse
import ctypes
import json
import mmap
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

PAGE = 4096
DEFAULT_ARMS = "in-memory,lru,static,spac-ar,spac+draft,llama.cpp"
KERNEL_THREADS = 1  # the engine's costs as simulate_disk_tier.py times them (--kernel-threads)
RSS_ALLOWANCE = 512 << 20  # issue 53: peak RSS <= budget + dense weights + 0.5 GB
TARGETS = {  # issue 53's
    "memory_share_of_model": 0.6,
    "moespec_over_llamacpp": 3.0,
    "spac_over_lru": 1.3,
    "speculation_gain": 1.2,
    "read_rate_share": 0.7,
}


class Refused(Exception):
    """Bad input or a failed arm: one line, exit status 2."""


# Arms and settings.
def parse_arm(name: str) -> dict:
    """{"name", "kind": in-memory | disk | llama.cpp, "policy", "draft"} of an arm name."""
    if name in ("in-memory", "llama.cpp"):
        return {"name": name, "kind": name, "policy": None, "draft": False}
    policy, draft = name.removesuffix("+draft"), name.endswith("+draft")
    from moespec.offload import make_policy

    try:
        chosen = make_policy(policy)
    except ValueError as error:
        raise Refused(f"arm {name!r}: {error}") from None
    if draft and not chosen.speculative:
        raise Refused(f"arm {name!r}: {policy} plans for decoding without a draft")
    return {"name": name, "kind": "disk", "policy": policy, "draft": draft}


def parse_budget(text: str, all_expert_bytes: int) -> int:
    """Bytes of "40%" (of every expert's bytes) or a size of `parse_size` ("6G")."""
    from moespec.offload.engine.disk import parse_size

    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100
        except ValueError:
            raise Refused(f"--memory-budget {text!r} is not a percentage") from None
        if not 0 < share <= 1:
            raise Refused(f"--memory-budget {text} must be a share in (0%, 100%]")
        return int(share * all_expert_bytes)
    return parse_size(text)


def hold_bytes(spec: str, available: int, budget: int, dense: int, margin: int) -> int:
    """Bytes the helper holds: "auto" (available - budget - dense - margin, at least 0),
    "none" / 0, or a size; refused above what is available or where it leaves less than the
    budget and the dense weights."""
    from moespec.offload.engine.disk import parse_size

    if spec in ("none", "0"):
        return 0
    room = budget + dense
    if spec == "auto":
        return max(available - room - margin, 0)
    nbytes = parse_size(spec)
    if nbytes > available:
        raise Refused(
            f"--hold {spec} is more than the {available / 2**30:.1f} GiB available on this machine"
        )
    if available - nbytes < room:
        raise Refused(
            f"--hold {spec} leaves {(available - nbytes) / 2**30:.2f} GiB: the arms need the "
            f"budget and the dense weights, {room / 2**30:.2f} GiB (try --hold auto)"
        )
    return nbytes


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise Refused("/proc/meminfo has no MemAvailable: this benchmark needs Linux")


# The memory-holding helper.
def hold(nbytes: int) -> int:
    """The helper's body: hold `nbytes` (mlocked where permitted, every page written) until
    killed, after one JSON line on stdout."""
    region = mmap.mmap(-1, max(nbytes, PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    libc = ctypes.CDLL(None, use_errno=True)
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    locked = libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(len(region))) == 0
    reason = None if locked else os.strerror(ctypes.get_errno())
    np.frombuffer(region, dtype=np.uint8)[::PAGE] = 1  # touched: private pages of its own
    print(json.dumps({"held": len(region), "mlocked": locked, "mlock_error": reason}), flush=True)
    while True:
        signal.pause()


class Holder:
    """The helper process, started with the bytes to hold; stop() ends it."""

    def __init__(self, nbytes: int):
        self.nbytes, self.process, self.report = nbytes, None, {"held": 0, "mlocked": None}
        if nbytes <= 0:
            return
        command = [sys.executable, __file__, "--holder", str(nbytes)]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()
        if not line:
            self.stop()
            raise Refused(f"the helper holding {nbytes / 2**30:.1f} GiB ended (out of memory?)")
        self.report = json.loads(line)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=60)


# The page cache.
def drop_page_cache(mode: str, files: list[Path]) -> dict:
    """Drop the page cache (global where permitted, else the files' pages); the files'
    resident share after, measured."""
    done = {"method": "none"}
    if mode in ("auto", "global"):
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3")
            done = {"method": "global"}
        except OSError as error:
            if mode == "global":
                raise Refused(f"cannot drop the page cache: {error.strerror}") from None
            done = {"method": "files", "global_refused": error.strerror}
    if mode == "files" or done["method"] == "files":
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        done["method"] = "files"
    done["resident_share"] = {str(p): resident_share(p) for p in files}
    return done


def resident_share(path: Path) -> float | None:
    """The share of a file's pages in the page cache (mincore), or None where unknown."""
    size = path.stat().st_size
    if size == 0:
        return 0.0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            return None
        pages = -(-size // PAGE)
        vector = (ctypes.c_ubyte * pages)()
        ok = libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) == 0
        libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(size))
        return float(np.frombuffer(vector, np.uint8).astype(bool).mean()) if ok else None
    finally:
        os.close(fd)


# The disk's direct-I/O random-read bandwidth.
def direct_read_bandwidth(path: Path, block: int, depth: int, seconds: float) -> dict:
    """Random `block`-byte O_DIRECT preads over `path`, `depth` in flight, for `seconds`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError) as error:
        return {"block_bytes": block, "depth": depth, "error": str(error)}
    size = os.fstat(fd).st_size
    last = max((size - block) // PAGE, 0)
    totals = [0] * depth
    deadline = time.perf_counter() + seconds

    def reader(i: int) -> None:
        buffer, rng = mmap.mmap(-1, block), random.Random(i)
        while time.perf_counter() < deadline:
            totals[i] += os.preadv(fd, [buffer], rng.randint(0, last) * PAGE)

    start = time.perf_counter()
    threads = [threading.Thread(target=reader, args=(i,)) for i in range(depth)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    os.close(fd)
    nbytes = sum(totals)
    return {"block_bytes": block, "depth": depth, "bytes": nbytes, "seconds": elapsed,
            "bytes_per_second": nbytes / elapsed}  # fmt: skip


# The replay's trace.
def replay_trace(facts: dict, tokens: int, reuse2: float | None, skew: float | None, seed: int):
    """(expert ids [tokens, L, m], its description): a LocalityProcess on the model's experts,
    fitted to rho(2) of the routing shape with the same experts and top-k (else `reuse2`)."""
    from moespec.routing.shapes import SHAPES
    from moespec.routing.synthetic import LocalityProcess

    experts, top_k = facts["num_experts"], facts["top_k"]
    match = next((s for s in SHAPES.values() if (s.num_experts, s.top_k) == (experts, top_k)), None)
    if reuse2 is None:
        if match is None or match.published_reuse2 is None:
            raise Refused(
                f"no routing shape has {experts} experts and top-{top_k}: pass --replay-reuse2"
            )
        reuse2 = match.published_reuse2
    if skew is None:
        published = match is not None and reuse2 == match.published_reuse2
        skew = match.popularity_skew if published and match.popularity_skew else 0.5
    process = LocalityProcess(experts, top_k, popularity_skew=skew).fit(reuse2, seed=seed)
    ids = next(process.documents(len(facts["layer_indices"]), [tokens], seed)).astype(np.int64)
    same = (ids[1:, :, :, None] == ids[:-1, :, None, :]).any(-1)  # [T-1, L, m]
    return ids, {
        "process": process.metadata(),
        "target_reuse2": reuse2,
        "matched_shape": None if match is None else match.name,
        "trace_reuse2": float(same.mean()),
        "tokens": tokens,
        "seed": seed,
    }


# Workers: one process per run.
def run_worker(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    out = Path(job["result"])
    try:
        import torch

        torch.set_num_threads(job["threads"])
        work = {
            "facts": facts_job,
            "moespec": moespec_run,
            "llama.cpp": llamacpp_run,
            "engine-costs": engine_costs_job,
        }
        result = work[job["job"]](job)
        result["peak_rss_bytes"] = peak_rss()
        code = 0
    except (ValueError, OSError, RuntimeError) as error:  # one-line faults of the library
        from moespec.errors import cli_message

        result, code = {"error": cli_message(error).splitlines()[0]}, 2
    out.write_text(json.dumps(result))
    return code


def peak_rss() -> int:
    """This process image's peak resident set (VmHWM: unlike ru_maxrss, not inherited from
    the parent that forked it)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def engine_costs_job(job: dict) -> dict:
    """The engine's own costs on this model, timed in the phase of the in-memory runs they
    are fitted beside: the model's dense passes of 1 and k + 1 rows with its routed experts
    skipped (`disk_tier.measure_dense_passes`, at the arms' threads, eager and
    batch-invariant as the arms run), then its kernel per expert slot at one row on the
    arms' threads (a layer that awaits no read), and at `kernel_threads` with a call's fixed
    time and an expert's checksum (`disk_tier.measure_engine_costs`)."""
    import torch

    from moespec.models import load_model
    from moespec.offload.sim.disk_tier import measure_dense_passes, measure_engine_costs

    torch.set_num_threads(job["threads"])
    model, _ = load_model(job["model"], pack_experts=False)
    model.native, model.batch_invariant = False, True  # as every arm runs it
    model.warm_invariance(offloaded=True)
    rows = sorted({1, max(2, job["draft_length"] + 1)})
    dense = measure_dense_passes(model, job["prompt"], rows)
    config = model.config
    model = None  # its mapped weights released before the kernel's store is made
    shape = (config.hidden_size, config.moe_intermediate_size, job["expert_slot_bytes"])
    every = measure_engine_costs(*shape, kernel=job["kernel"], top_k=job["top_k"])  # threads
    torch.set_num_threads(job["kernel_threads"])
    costs = measure_engine_costs(
        *shape, kernel=job["kernel"], top_k=job["top_k"], checksum=job["checksum"]
    )
    return {
        **costs,
        "slot_seconds_all_threads": every["slot_seconds"],
        "threads": job["kernel_threads"],
        "dense_pass_seconds": [[n, dense[n]] for n in rows],
        "dense_threads": job["threads"],
        "timed": "after the in-memory runs",
    }


def median_costs(runs: list[dict]) -> dict:
    """The engine's costs of every round: each figure's median over the rounds, the rounds'
    own beside them (`by_round`)."""
    import statistics

    figures = ("slot_seconds", "call_seconds", "checksum_seconds")
    figures += tuple(k for k in ("slot_seconds_all_threads",) if all(k in r for r in runs))
    dense = [dict(r["dense_pass_seconds"]) for r in runs if "dense_pass_seconds" in r]
    return {
        **runs[0],
        **{k: statistics.median(r[k] for r in runs) for k in figures},
        **(
            {"dense_pass_seconds": [[n, statistics.median(d[n] for d in dense)] for n in dense[0]]}
            if dense
            else {}
        ),
        "medians_seconds": {
            k: statistics.median(r["medians_seconds"][k] for r in runs)
            for k in runs[0]["medians_seconds"]
        },
        "timed": "after the in-memory runs of every round; each figure the rounds' median",
        "by_round": [{k: r[k] for k in (*figures, "dense_pass_seconds") if k in r} for r in runs],
    }


def facts_job(job: dict) -> dict:
    """The model's sizes, the prompt's tokens and the budget decided once (`disk_budget`:
    refused below one layer's active experts, capped above what is available)."""
    from moespec.calibrate.plan import verify_documents
    from moespec.models import load_model
    from moespec.offload.engine.disk import DiskLayout, disk_budget

    model, tokenizer = load_model(job["model"], pack_experts=False)
    layout = DiskLayout(model)
    requested = parse_budget(job["budget"], layout.all_expert_bytes)
    budget, note = disk_budget(model, requested)
    text = "".join(d.text for d in verify_documents())
    prompt = tokenizer.encode(text)[: job["prompt_tokens"]]
    return {
        "model_bytes": layout.file_size,
        "dense_bytes": layout.dense_bytes,
        "all_expert_bytes": layout.all_expert_bytes,
        "expert_slot_bytes": layout.stride,
        "least_budget": layout.least_budget,
        "num_experts": layout.num_experts,
        "top_k": layout.top_k,
        "layer_indices": layout.layer_indices,
        "vocab_size": model.config.vocab_size,
        "budget": budget,
        "budget_requested": requested,
        "budget_note": note,
        "prompt": prompt,
    }


def proc_io() -> dict:
    """This process's bytes fetched from storage, and its major page faults."""
    with open("/proc/self/io") as f:
        read = next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    return {"storage_read_bytes": read, "major_faults": resource.getrusage(0).ru_majflt}


def moespec_run(job: dict) -> dict:
    """One greedy generation; with a policy, through the disk tier (its preload timed apart)."""
    from moespec.decoding import (
        DraftLengthPolicy,
        KernelPolicy,
        OracleDrafter,
        generate,
        summarize,
    )
    from moespec.models import load_model
    from moespec.offload.engine.open import open_engine
    from moespec.offload.engine.replay import RoutingReplay

    available = mem_available()
    model, _ = load_model(job["model"], pack_experts=False)
    model.native = False  # the eager pass in every arm: the offloaded passes run it
    # as `moespec generate` decodes: each verify row with its one-token bits, so speculative
    # greedy tokens are the plain ones (off, int8 products of several rows took other bits)
    model.batch_invariant = True
    prompt, k = job["prompt"], job["draft_length"] if job["draft"] else 0
    engine = executor = None
    if job["policy"] is not None:
        engine = executor = open_engine(
            model, job["policy"], draft_length=k, budget_bytes=job["budget"], disk=True
        )
    if job["replay"] is not None:
        ids = np.load(job["replay"])
        layers = sorted(model.moe_blocks)
        executor = RoutingReplay(ids, layers, engine, experts=None if engine else model)
    extra = {}
    recorder = PassRecorder(sorted(model.moe_blocks)) if job.get("record_routing") else None
    if recorder is not None:
        extra["routing_sink"] = recorder
    if k:
        drafter = OracleDrafter(
            job["reference"], len(prompt), job["acceptance"], model.config.vocab_size,
            job["seed"], positional=True,
        )  # fmt: skip
        extra.update(drafter=drafter, draft_policy=DraftLengthPolicy(k))  # the sink stays
    try:
        stream = generate(
            model, prompt, max_tokens=job["tokens"], kernels=KernelPolicy(job["kernel"]),
            offload=executor, **extra,
        )  # fmt: skip
        records = [next(stream)]  # the prefill (the prompt on the CPU tier when offloaded)
        preload = time.perf_counter()
        if engine is not None:
            engine.start()  # fitted on the prompt's routing; the policy's preload read
        preload = time.perf_counter() - preload
        before, io_before = engine.summary() if engine else {}, proc_io()
        records += list(stream)
        after, io_after = engine.summary() if engine else {}, proc_io()
    finally:
        if engine is not None:
            engine.close()
    s = summarize(records)
    decode = records[1:]
    result = {
        "tokens": [t for r in records for t in r.tokens],
        "decode_tokens": s["generated_tokens"] - 1,
        "decode_seconds": s["decode_seconds"],
        "tokens_per_second": s["tokens_per_second"],
        "prefill_seconds": records[0].seconds,
        "preload_seconds": preload,
        "steps": s["decode_steps"],
        "mean_accepted_per_step": s["mean_accepted_per_step"],
        "mem_available_at_start": available,
        **{f"decode_{name}": io_after[name] - io_before[name] for name in io_after},
        "accepted_per_step": [r.accepted for r in decode],
    }
    if recorder is not None:
        ids, rejected = recorder.positions(len(prompt), [(r.n_tokens, r.accepted) for r in decode])
        result["routing"] = {"expert_ids": ids.tolist(), "rejected": rejected.tolist()}
    if engine is not None:
        needed = sum(r.hits + r.misses for r in decode)
        delta = {k: after[k] - before[k] for k in ("disk_bytes_read", "read_seconds")}
        stall = after["stall_seconds"] - before["stall_seconds"]
        result.update(
            hit_rate=sum(r.hits for r in decode) / needed if needed else None,
            decode_disk_bytes_read=delta["disk_bytes_read"],
            decode_read_seconds=delta["read_seconds"],
            decode_stall_seconds=stall,
            preload_bytes=after["preload_bytes"],
            o_direct=after["o_direct"],
            slots=after["slots"],
            cpu_experts=sum(r.cpu_experts for r in decode),
        )
    return result


class PassRecorder:
    """A routing sink keeping every pass's expert ids per MoE layer, in call order;
    `positions` turns them into the sequence's routing."""

    def __init__(self, layer_indices):
        self.rows = {layer: [] for layer in layer_indices}

    def __call__(self, layer: int, expert_ids, expert_weights) -> None:
        self.rows[layer].append(expert_ids.detach().cpu().numpy().astype(np.int16))

    def positions(self, prompt_tokens: int, passes) -> tuple[np.ndarray, np.ndarray]:
        """(ids [T, L, m] of the prompt's and the emitted tokens' positions, rejected [T, L, m]:
        the routing of the rejected draft verified last at each position, else the
        position's own) from the decode passes' (n_tokens, accepted)."""
        rows = np.stack([np.concatenate(r) for r in self.rows.values()], axis=1)  # [R, L, m]
        kept, rejected = [rows[:prompt_tokens]], {}
        row, position = prompt_tokens, prompt_tokens
        for n, accepted in passes:
            kept.append(rows[row : row + accepted + 1])
            for i in range(accepted + 1, n):  # verified after the first rejected draft
                rejected[position + i] = rows[row + i]
            row, position = row + n, position + accepted + 1
        ids = np.concatenate(kept)
        wrong = ids.copy()
        for p, value in rejected.items():
            if p < len(wrong):
                wrong[p] = value
        return ids, wrong


def llamacpp_run(job: dict) -> dict:
    """llama.cpp's greedy decoding of the prompt, mmap'd: prefill, then one-token passes."""
    from moespec.calibrate.llamacpp import LlamaCpp

    available = mem_available()
    prompt = job["prompt"]
    engine = LlamaCpp(job["gguf"], context=len(prompt) + job["tokens"] + 8, threads=job["threads"])
    params = getattr(engine.llm, "model_params", None)
    start = time.perf_counter()
    token = int(engine.prefill(prompt)[-1].argmax())
    prefill = time.perf_counter() - start
    tokens, io_before = [token], proc_io()
    start = time.perf_counter()
    while len(tokens) < job["tokens"]:
        token = int(engine.forward([token], all_logits=False)[-1].argmax())
        tokens.append(token)
    seconds = time.perf_counter() - start
    io_after = proc_io()
    return {
        "tokens": tokens,
        "decode_tokens": len(tokens) - 1,
        "decode_seconds": seconds,
        "tokens_per_second": (len(tokens) - 1) / seconds if seconds else None,
        "prefill_seconds": prefill,
        "load_mode": load_mode(params),
        "mem_available_at_start": available,
        **{f"decode_{name}": io_after[name] - io_before[name] for name in io_after},
    }


def load_mode(params) -> str | None:
    """How llama.cpp holds the GGUF: "mmap" (its own paging), "mmap+mlock", ..."""
    if params is None:
        return None
    if hasattr(params, "use_mmap"):  # llama-cpp-python before load modes
        return "mmap" if params.use_mmap else "read"
    import llama_cpp

    names = {
        "MMAP": "mmap", "MMAP_MLOCK": "mmap+mlock", "MLOCK": "mlock", "NONE": "read",
        "DIRECT_IO": "direct-io", "AUTO": "auto",
    }  # fmt: skip
    return next(
        (
            v
            for k, v in names.items()
            if getattr(llama_cpp, f"LLAMA_LOAD_MODE_{k}", -1) == params.load_mode
        ),
        str(params.load_mode),
    )


def spawn(job: dict, scratch: Path, timeout: float) -> dict:
    """Run a job in a fresh process; its result, or Refused with its one line."""
    handle, job_path = tempfile.mkstemp(suffix=".json", dir=scratch)
    os.close(handle)
    job = {**job, "result": job_path + ".out"}
    Path(job_path).write_text(json.dumps(job))
    log = Path(job_path + ".log")
    with open(log, "w") as stderr:
        try:
            done = subprocess.run(
                [sys.executable, __file__, "--worker", job_path],
                stdout=subprocess.DEVNULL, stderr=stderr, timeout=timeout,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            raise Refused(f"{job['label']}: no result within --arm-timeout {timeout:g} s") from None
    out = Path(job["result"])
    result = json.loads(out.read_text()) if out.exists() else None
    if result is None or "error" in result:
        lines = log.read_text().strip().splitlines()
        why = result["error"] if result else (lines[-1] if lines else f"exit {done.returncode}")
        raise Refused(f"{job['label']}: {why}")
    return result


# The rounds and their summary.
def run(args) -> int:
    from moespec.files import check_writable, write_json
    from moespec.models.converted import is_converted
    from moespec.provenance import provenance

    check_writable(args.out, force=args.force)
    arms = [parse_arm(a.strip()) for a in args.arms.split(",") if a.strip()]
    sources = [s.strip() for s in args.routing.split(",") if s.strip()]
    if unknown := set(sources) - {"model", "replay"}:
        raise Refused(f"--routing takes model and/or replay, got {', '.join(sorted(unknown))}")
    if args.skip_in_memory:
        arms = [a for a in arms if a["kind"] != "in-memory"]
    if not any(a["kind"] == "disk" for a in arms):
        raise Refused("--arms names no disk-tier arm (lru, static, spac-ar, spac+draft, ...)")
    scratch = Path(tempfile.mkdtemp(prefix="larger-than-memory-"))
    built, holder = [], None
    try:
        model_dir, gguf, built = prepare(args, any(a["kind"] == "llama.cpp" for a in arms))
        if not is_converted(model_dir):
            raise Refused(
                f"{model_dir} is not a converted model: convert it first with "
                f"`moespec convert {model_dir} DST --weights int8` and pass --model DST"
            )
        if gguf is None and any(a["kind"] == "llama.cpp" for a in arms):
            print("note: no --gguf: the llama.cpp arm is left out", file=sys.stderr)
            arms = [a for a in arms if a["kind"] != "llama.cpp"]
        common = {"model": str(model_dir), "threads": args.threads}
        facts = spawn(
            {**common, "job": "facts", "label": "the model", "budget": args.memory_budget,
             "prompt_tokens": args.prompt_tokens},
            scratch, args.arm_timeout,
        )  # fmt: skip
        if facts["budget_note"]:
            print(facts["budget_note"], file=sys.stderr)
        budget, dense = facts["budget"], facts["dense_bytes"]
        files = [model_dir / "weights.safetensors"] + ([gguf] if gguf else [])
        bandwidth = [
            direct_read_bandwidth(files[0], block, depth, args.probe_seconds)
            for block in (1 << 20, 4 << 20)
            for depth in sorted({1, args.io_depth})
        ]
        replays, replay_facts = {"model": None}, None
        if "replay" in sources:
            length = len(facts["prompt"]) + args.tokens + args.draft_length + 2
            ids, replay_facts = replay_trace(
                facts, length, args.replay_reuse2, args.replay_skew, args.seed
            )
            replays["replay"] = str(scratch / "replay.npy")
            np.save(replays["replay"], ids)
        base = {
            **common, "prompt": facts["prompt"], "tokens": args.tokens, "budget": budget,
            "kernel": args.kernel, "draft_length": args.draft_length,
            "acceptance": args.acceptance, "seed": args.seed, "gguf": str(gguf) if gguf else None,
            "record_routing": args.save_traces,
        }  # fmt: skip

        def job(arm: dict, source: str, reference=None) -> dict:
            return {
                **base, **arm, "job": "llama.cpp" if arm["kind"] == "llama.cpp" else "moespec",
                "label": f"{arm['name']} ({source} routing)", "replay": replays[source],
                "reference": reference,
            }  # fmt: skip

        def measured(arm, source, reference=None) -> dict:
            cache = drop_page_cache(args.drop_caches, files)
            result = spawn(job(arm, source, reference), scratch, args.arm_timeout)
            print(f"  {arm['name']:>12} ({source}): {result['tokens_per_second']:.2f} tok/s",
                  file=sys.stderr)  # fmt: skip
            return {**result, "page_cache": cache}

        # Rounds: the in-memory reference (before the hold: it cannot fit the room the others
        # get), the engine's own costs, then the hold and every held arm, then the hold
        # released; so the reference and the costs the simulator fits share each round's
        # phase of the host with the arms they are compared with (this host's decode moved
        # 9.9-16.3 tok/s between runs minutes apart). The first in-memory run's tokens are
        # the reference; the median run gives the figures (one 3-second decode is not a time).
        references, reference_runs, memory_runs = {}, {}, {}
        memory_arm = next((a for a in arms if a["kind"] == "in-memory"), None)
        costs_job = {
            **common, "job": "engine-costs", "label": "engine costs",
            "kernel": args.kernel, "kernel_threads": KERNEL_THREADS,
            "expert_slot_bytes": facts["expert_slot_bytes"], "top_k": facts["top_k"],
            "checksum": engine_facts()["checksum"], "prompt": facts["prompt"],
            "draft_length": args.draft_length,
        }  # fmt: skip
        cost_runs, holds = [], []
        runs = {}
        order = [
            (arm, source)
            for source in sources
            for arm in arms
            if arm["kind"] != "in-memory" and (arm["kind"] != "llama.cpp" or source == "model")
        ]
        for r in range(args.rounds):
            print(f"round {r + 1} of {args.rounds}", file=sys.stderr)
            if memory_arm is not None:
                for source in sources:
                    memory_runs.setdefault(source, []).append(measured(memory_arm, source))
                    reference_runs.setdefault(source, memory_runs[source][0])
            cost = spawn(costs_job, scratch, args.arm_timeout)
            cost.pop("peak_rss_bytes", None)
            cost_runs.append(cost)
            available = mem_available()
            holder = Holder(hold_bytes(args.hold, available, budget, dense, args.hold_margin))
            holds.append({**holder.report, "available_before": available,
                          "available_while_held": mem_available()})  # fmt: skip
            if not reference_runs:  # --skip-in-memory: the first plain disk arm, held
                plain = next((a for a in arms if a["kind"] == "disk" and not a["draft"]), None)
                if plain is None:
                    raise Refused(
                        "--skip-in-memory needs a plain disk arm for the reference tokens"
                    )
                for source in sources:
                    reference_runs[source] = measured(plain, source)
            for source in sources:
                references[source] = reference_runs[source]["tokens"]
            turn = r % len(order)
            for arm, source in order[turn:] + order[:turn]:
                key = f"{arm['name']}|{source}"
                run = measured(arm, source, references[source] if arm["draft"] else None)
                runs.setdefault(key, []).append(run)
            holder.stop()
            holder = None
        engine_cost = median_costs(cost_runs)
        routings = {
            key: [r.pop("routing", None) for r in arm_runs] for key, arm_runs in runs.items()
        }
        for run in [*reference_runs.values(), *(r for rs in memory_runs.values() for r in rs)]:
            run.pop("routing", None)
        results = summarize_runs(runs, references, facts, budget, bandwidth, memory_arm)
        if args.save_traces:
            traces = save_traces(args.out, runs, routings, facts, args, replays)
            print(f"wrote {len(traces)} routing traces beside it", file=sys.stderr)
        for source, run in reference_runs.items():
            results[f"reference|{source}"] = {
                **arm_row(run, references[source], facts, budget, bandwidth),
                "arm": (memory_arm or plain)["name"], "routing": source,
                "memory_condition": "none (round 1, before its hold)" if memory_arm else "held",
            }  # fmt: skip
        for key, row in summarize_runs(
            {f"in-memory|{source}": rs for source, rs in memory_runs.items()},
            references, facts, budget, bandwidth, memory_arm,
        ).items():  # fmt: skip
            results[key] = {**row, "memory_condition": "none (each round, before its hold)"}
        targets = score_targets(results, facts, budget, sources, runs)
        write_json(
            args.out,
            {
                "benchmark": "larger than memory (issue 53)",
                "settings": {
                    k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                },
                "model": {
                    "converted": str(model_dir),
                    "gguf": str(gguf) if gguf else None,
                    "weights_bytes": facts["model_bytes"],
                    "gguf_bytes": gguf.stat().st_size if gguf else None,
                    **{
                        k: facts[k]
                        for k in (
                            "dense_bytes",
                            "all_expert_bytes",
                            "expert_slot_bytes",
                            "least_budget",
                            "num_experts",
                            "top_k",
                            "layer_indices",
                        )
                    },
                },  # fmt: skip
                "memory": {
                    "budget_bytes": budget,
                    "budget_requested_bytes": facts["budget_requested"],
                    "budget_note": facts["budget_note"],
                    "available_before_hold": holds[0]["available_before"],
                    "hold": holds[0],
                    "holds_by_round": holds,
                    "hold_margin_bytes": args.hold_margin,
                    "available_while_held": holds[0]["available_while_held"],
                    "room_bytes": budget + dense,
                    "swap_total_bytes": swap_total(),
                },  # fmt: skip
                "prompt_tokens": len(facts["prompt"]),
                "decoding": {
                    "greedy": True,
                    "kernel": args.kernel,
                    "pass": "eager (model.native off)",
                    "drafter": (
                        f"oracle: the reference continuation, each draft wrong with "
                        f"probability {1 - args.acceptance:g} (flags fixed per position,"
                        f" seed {args.seed}); proposals cost no target time"
                    ),
                    "draft_length": args.draft_length,
                },  # fmt: skip
                "reference": "in-memory (run each round before its hold)"
                if memory_arm
                else (
                    "the first plain disk arm's run under the hold (--skip-in-memory): tokens "
                    "compared between moespec arms only"
                ),  # fmt: skip
                "routing": {
                    "model": "the checkpoint's own routers",
                    "replay": replay_facts,
                    "llama.cpp": "model routing only (it cannot be forced)",
                },
                "direct_read_bandwidth": bandwidth,
                "engine": engine_facts(),
                "engine_costs": engine_cost,
                "results": results,
                "targets": targets,
                "provenance": provenance(settings={"threads": args.threads}),
            },
            force=args.force,
        )
        print_table(results, targets)
        print(f"wrote {args.out}", file=sys.stderr)
        return 0
    finally:
        if holder is not None:
            holder.stop()
        shutil.rmtree(scratch, ignore_errors=True)
        if built and not args.keep:
            for path in built:
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(True)


def engine_facts() -> dict:
    """How the disk tier that ran reads and computes, from its module's own settings (the
    simulator models the engine a result says it was measured on; a result without this
    block predates it: crc32 checks, a layer's experts computed once all had arrived)."""
    from moespec.offload.engine import disk

    backend = disk.DiskBackend(disk.IO_THREADS)
    return {
        "checksum": "page-sum" if hasattr(disk, "expert_checksum") else "crc32",
        "compute_while_reading": bool(getattr(backend, "compute_on_arrival", False)),
        "io_threads": disk.IO_THREADS,
        "read_depth": getattr(disk, "READ_DEPTH", 1),
        "chunk_bytes": getattr(disk, "CHUNK_BYTES", None),
    }


def traces_dir(out: Path) -> Path:
    """Where the routing traces of result `out` go: FILE's stem + ".traces/" beside it."""
    return out.parent / f"{out.stem}.traces"


def save_traces(out: Path, runs: dict, routings: dict, facts: dict, args, replays) -> list:
    """Write each arm's routing (its median run's, as `summarize_runs` picks it) as routing
    traces (see the module docstring); the paths written."""
    from moespec.routing import RoutingTrace
    from moespec.routing.store import write_trace

    folder = traces_dir(Path(out))
    folder.mkdir(parents=True, exist_ok=True)
    layers, experts = facts["layer_indices"], facts["num_experts"]
    prompt = len(facts["prompt"])

    def trace(ids, name: str, **metadata) -> RoutingTrace:
        ids = np.asarray(ids, dtype=np.int64)
        return RoutingTrace(
            ids, [0, len(ids)], [name], experts, [facts["expert_slot_bytes"]] * len(layers),
            list(layers), metadata={"fit_tokens": prompt, **metadata},
        )  # fmt: skip

    written, replay = [], None
    if replays.get("replay") is not None:
        replay = np.load(replays["replay"])
        path = folder / "replay.parquet"
        write_trace(trace(replay, "replay"), path, force=True)
        written.append(path)
    for key, arm_runs in runs.items():
        name, source = key.split("|")
        middle = sorted(range(len(arm_runs)), key=lambda i: arm_runs[i]["tokens_per_second"])
        i = middle[len(arm_runs) // 2]
        run, routing = arm_runs[i], routings[key][i]
        if routing is None:  # llama.cpp: not recorded
            continue
        draft = args.draft_length if name.endswith("+draft") else 0
        meta = {"arm": name, "routing": source, "draft_length": draft,
                "accepted_per_step": run["accepted_per_step"], "seed": args.seed}  # fmt: skip
        ids, wrong = routing["expert_ids"], routing["rejected"]
        if source == "replay":  # the routers' choices did not run: the replay's ids did (a
            ids = wrong = replay[: len(ids)]  # wrong draft too is routed as its position's)
        path = folder / f"{name}.{source}.parquet"
        write_trace(trace(ids, key, **meta), path, force=True)
        written.append(path)
        if draft:
            rejected = folder / f"{name}.{source}.rejected.parquet"
            write_trace(trace(wrong, key + " rejected", **meta), rejected, force=True)
            written.append(rejected)
    return written


def swap_total() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("SwapTotal:"))


def arm_row(run: dict, reference: list, facts: dict, budget: int, bandwidth: list) -> dict:
    """The figures of one run."""
    tokens = max(run["decode_tokens"], 1)
    seconds = run["decode_seconds"] or float("nan")
    row = {k: v for k, v in run.items() if k not in ("tokens", "page_cache")}
    row["tokens_equal_reference"] = run["tokens"] == reference
    row["tokens_agreeing_with_reference"] = sum(
        a == b for a, b in zip(run["tokens"], reference, strict=False)
    ) / max(len(reference), 1)
    row["page_cache"] = run["page_cache"]
    row["storage_bytes_per_token"] = run["decode_storage_read_bytes"] / tokens
    if "decode_disk_bytes_read" in run:
        best = max((b.get("bytes_per_second", 0) for b in bandwidth), default=0)
        rate = run["decode_disk_bytes_read"] / seconds
        row.update(
            bytes_read_per_token=run["decode_disk_bytes_read"] / tokens,
            stall_seconds_per_token=run["decode_stall_seconds"] / tokens,
            disk_read_rate=rate,
            read_rate_share_of_probe=rate / best if best else None,
            rss_bound_bytes=budget + facts["dense_bytes"] + RSS_ALLOWANCE,
            rss_within_bound=run["peak_rss_bytes"] <= budget + facts["dense_bytes"] + RSS_ALLOWANCE,
        )
    return row


def summarize_runs(runs, references, facts, budget, bandwidth, memory_arm) -> dict:
    """Per arm and source: the median run's figures, tokens/s median and range, all runs'."""
    out = {}
    for key, arm_runs in runs.items():
        name, source = key.split("|")
        speeds = [r["tokens_per_second"] for r in arm_runs]
        middle = sorted(arm_runs, key=lambda r: r["tokens_per_second"])[len(arm_runs) // 2]
        row = arm_row(middle, references[source], facts, budget, bandwidth)
        row.update(
            arm=name, routing=source, memory_condition="held",
            tokens_per_second=float(np.median(speeds)),
            tokens_per_second_range=[min(speeds), max(speeds)],
            runs_tokens_per_second=speeds,
            all_runs_equal_reference=all(r["tokens"] == references[source] for r in arm_runs),
        )  # fmt: skip
        if name == "llama.cpp":  # Q8_0 blocks are not moespec's int8: its own tokens
            row["tokens_compared"] = False
        out[key] = row
    return out


def paired(runs: dict, mine: str, theirs: str) -> dict | None:
    """My tokens/s over theirs, round by round: median, low, high (None if either is absent)."""
    if mine not in runs or theirs not in runs:
        return None
    a = np.array([r["tokens_per_second"] for r in runs[mine]])
    b = np.array([r["tokens_per_second"] for r in runs[theirs]])
    ratio = a / b
    return {"median": float(np.median(ratio)), "low": float(ratio.min()),
            "high": float(ratio.max()), "of": [mine, theirs]}  # fmt: skip


def score_targets(results: dict, facts: dict, budget: int, sources: list, runs: dict) -> dict:
    """Issue 53's targets, each {value, target, met}, per routing source where they apply."""

    def scored(value, target, at_least=True):
        if value is None:
            return None
        return {"value": value, "target": target,
                "met": value >= target if at_least else value <= target}  # fmt: skip

    share = (budget + facts["dense_bytes"]) / facts["model_bytes"]
    out = {"memory_share_of_model": scored(share, TARGETS["memory_share_of_model"], False)}
    for source in sources:
        disk = {k: v for k, v in results.items() if k == f"{v['arm']}|{source}" and "slots" in v}
        best = max(disk, key=lambda k: disk[k]["tokens_per_second"], default=None)
        over_llama = paired(runs, best, "llama.cpp|model") if best and source == "model" else None
        gain = paired(runs, f"spac+draft|{source}", f"spac-ar|{source}")
        spac = paired(runs, f"spac-ar|{source}", f"lru|{source}")
        out[source] = {
            "best_disk_arm": best,
            "moespec_over_llamacpp": over_llama and {
                **over_llama, **scored(over_llama["median"], TARGETS["moespec_over_llamacpp"])},
            "spac_over_lru": spac and {**spac, **scored(spac["median"], TARGETS["spac_over_lru"])},
            "spac_draft_over_lru": paired(runs, f"spac+draft|{source}", f"lru|{source}"),
            "speculation_gain": gain and {
                **gain, **scored(gain["median"], TARGETS["speculation_gain"])},
            "read_rate_share": {k: scored(v["read_rate_share_of_probe"],
                                          TARGETS["read_rate_share"]) for k, v in disk.items()},
            "rss_within_bound": {k: v["rss_within_bound"] for k, v in disk.items()},
            "tokens_equal_reference": {k: v["all_runs_equal_reference"] for k, v in disk.items()},
        }  # fmt: skip
    return out


def print_table(results: dict, targets: dict) -> None:
    print(f"{'arm':>24} {'tok/s':>8} {'range':>15} {'hit':>5} {'MB/tok':>7} {'stall ms/tok':>12} "
          f"{'GB/s':>5} {'RSS MB':>7} same")  # fmt: skip
    for key, row in results.items():
        low, high = row.get("tokens_per_second_range", [row["tokens_per_second"]] * 2)
        hit = row.get("hit_rate")
        print(
            f"{key:>24} {row['tokens_per_second']:8.2f} {low:7.2f}-{high:<7.2f} "
            f"{'' if hit is None else f'{hit:.2f}':>5} "
            f"{row.get('bytes_read_per_token', row['storage_bytes_per_token']) / 2**20:7.1f} "
            f"{1e3 * row.get('stall_seconds_per_token', 0):12.1f} "
            f"{row.get('disk_read_rate', 0) / 1e9:5.2f} {row['peak_rss_bytes'] / 2**20:7.0f} "
            f"{row['tokens_equal_reference'] if row.get('tokens_compared', True) else '-'}"
        )
    for source, scores in targets.items():
        if source == "memory_share_of_model":
            print(f"memory (budget + dense) / model: {scores['value']:.2f} (target <= 0.6)")
            continue
        for name in ("moespec_over_llamacpp", "spac_over_lru", "speculation_gain"):
            if scores[name] is not None:
                s = scores[name]
                print(f"{source}: {name} {s['median']:.2f} ({s['low']:.2f}-{s['high']:.2f}), "
                      f"target {s['target']}: {'met' if s['met'] else 'missed'}")  # fmt: skip


# The model: given, or built (a random checkpoint of a shape) or converted from a source.
def prepare(args, wants_gguf: bool) -> tuple[Path, Path | None, list[Path]]:
    """(converted directory, GGUF or None, what was made here to delete unless --keep)."""
    if args.model is not None:
        if not args.model.is_dir():
            raise Refused(f"{args.model}: no such model directory")
        if args.gguf is not None and not args.gguf.is_file():
            raise Refused(f"{args.gguf}: no such GGUF file")
        return args.model, args.gguf, []
    from moespec.models.converted import convert, is_converted

    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    made = []
    if args.build is not None:
        from moespec.bench.checkpoints import SHAPES, streamed_random_checkpoint

        if args.build not in SHAPES:
            raise Refused(f"--build {args.build}: unknown shape (known: {', '.join(SHAPES)})")
        print(f"building a random {args.build} checkpoint in {work}", file=sys.stderr)
        source = streamed_random_checkpoint(args.build, work, args.build_layers)
        made.append(source)
    else:
        source = args.source
        if not (source / "config.json").is_file():
            raise Refused(f"{source}: no checkpoint there (config.json missing)")
        if is_converted(source):
            raise Refused(f"{source} is already converted: pass it as --model")
    converted = work / f"{source.name}-int8"
    if not is_converted(converted):
        print(f"converting to int8: {converted}", file=sys.stderr)
        convert(source, converted, weights="int8", force=converted.exists())
        made.append(converted)
    gguf = None
    if wants_gguf:
        gguf = work / f"{source.name}-q8_0.gguf"
        if not gguf.is_file():
            try:
                from moespec.export.gguf import export_gguf
            except ImportError as error:
                raise Refused(
                    f"exporting GGUF needs {error.name}: pip install -e '.[llamacpp]'"
                ) from None
            print(f"exporting GGUF Q8_0: {gguf}", file=sys.stderr)
            export_gguf(source, gguf, weight_type="q8_0")
            made.append(gguf)
    if args.build is not None:  # the bf16 source is no longer needed: free its disk now
        shutil.rmtree(source, ignore_errors=True)
    return converted, gguf, made


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", type=Path, help="an int8-converted model directory")
    model.add_argument("--build", metavar="SHAPE", help="a random checkpoint of a built-in shape")
    model.add_argument("--source", type=Path, help="a Hugging Face checkpoint to convert")
    parser.add_argument("--gguf", type=Path, help="with --model: its GGUF Q8_0 for llama.cpp")
    parser.add_argument("--build-layers", type=int, help="--build: decoder layers kept")
    parser.add_argument("--work-dir", type=Path, default=Path("benchmarks/checkpoints"))
    parser.add_argument("--keep", action="store_true", help="keep what --build/--source made")
    parser.add_argument("--out", type=Path, help="results JSON")
    parser.add_argument("--arms", default=DEFAULT_ARMS)
    parser.add_argument("--routing", default="model,replay", help="model and/or replay")
    parser.add_argument("--memory-budget", default="40%", help="SIZE (6G) or N%% of the experts")
    parser.add_argument("--hold", default="none", help="auto, none or SIZE held by a helper")
    parser.add_argument("--hold-margin", type=_size, default="1G", help="--hold auto's margin")
    parser.add_argument(
        "--drop-caches", default="auto", choices=["auto", "global", "files", "none"]
    )
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per run")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-in-memory", action="store_true")
    parser.add_argument("--draft-length", type=int, default=4)
    parser.add_argument("--acceptance", type=float, default=0.7, help="the oracle's")
    parser.add_argument("--replay-reuse2", type=float, help="rho(2) of the replay's trace")
    parser.add_argument("--replay-skew", type=float, help="its popularity skew")
    parser.add_argument("--kernel", default="slot", choices=["slot", "dedup"])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--io-depth", type=int, default=4, help="the probe's reads in flight")
    parser.add_argument("--probe-seconds", type=float, default=2.0)
    parser.add_argument("--arm-timeout", type=float, default=1800.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--save-traces",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each arm's routing beside the JSON (for benchmarks/simulate_disk_tier.py)",
    )
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--holder", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is None and args.holder is None:
        if args.out is None:
            parser.error("--out is required")
        if args.model is None and args.build is None and args.source is None:
            parser.error("one of --model, --build or --source is required")
        for name in ("tokens", "prompt_tokens", "rounds", "threads", "io_depth"):
            if getattr(args, name) < 1:
                parser.error(f"--{name.replace('_', '-')} must be >= 1")
        if args.draft_length < 1 or not 0 <= args.acceptance <= 1:
            parser.error("--draft-length must be >= 1 and --acceptance in [0, 1]")
    return args


def _size(text: str) -> int:
    from moespec.offload.engine.disk import parse_size

    return parse_size(text)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.holder is not None:
        return hold(args.holder)
    if args.worker is not None:
        return run_worker(args.worker)
    from moespec.errors import cli_message

    try:
        return run(args)
    except (Refused, ValueError, OSError) as error:  # bad input, one line
        print(f"error: {cli_message(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
