"""The exact commands behind every file in benchmarks/results/, run from the repository root.

Each `Result` names what it makes (paths under benchmarks/results/) and the shell commands
that make them, in order; `benchmarks/regenerate` lists and runs them. A command's outputs
are overwritten (--force): the point is to make them again. Minutes are about those of a
2-core CPU.
"""

from dataclasses import dataclass

RESULTS_DIR = "benchmarks/results"
CHECKPOINTS = "benchmarks/checkpoints"  # random checkpoints of real shapes (not committed)
OLMOE_4L = f"{CHECKPOINTS}/olmoe-4L"
MAKE_OLMOE_4L = (
    "python -c 'from pathlib import Path; from moespec.bench.checkpoints import "
    f'random_checkpoint; random_checkpoint("olmoe", Path("{CHECKPOINTS}"))\''
)
OLMOE_FULL = f"{CHECKPOINTS}/olmoe-1b-7b-16L-streamed"  # 13.8 GB: delete it when done
MAKE_OLMOE_FULL = (
    "python -c 'from pathlib import Path; from moespec.bench.checkpoints import "
    "streamed_random_checkpoint; "
    f'streamed_random_checkpoint("olmoe-1b-7b", Path("{CHECKPOINTS}"))\''
)
BEFORE_TREE = f"{CHECKPOINTS}/before-9aca000"  # main before the native model pass
# the larger-than-memory run's routing per arm (ARM.SOURCE; a speculative arm's rejected drafts
# apart) and its replayed trace, for benchmarks/simulate_disk_tier.py
LTM_TRACES = (
    *(f"{arm}.{source}.parquet" for arm in ("lru", "static", "spac-ar", "spac+draft")
      for source in ("model", "replay")),
    "spac+draft.model.rejected.parquet",
    "spac+draft.replay.rejected.parquet",
    "replay.parquet",
)  # fmt: skip
PLAN_FIGURES = ("bandwidth.png", "ratio.png", "saving.png", "staircase.png", "report.md")
REPORT_FILES = ("report.md", "report.json", "table1.png", "table2.png", "figure5.png")


@dataclass(frozen=True)
class Result:
    name: str
    outputs: tuple[str, ...]  # relative to benchmarks/results/
    commands: tuple[str, ...]
    minutes: float  # about, on this project's 2-core machine


def _plan(folder: str, options: str, minutes: float, figures: bool = False) -> Result:
    outputs = ("plan.json", "bench.jsonl", *(PLAN_FIGURES if figures else ()))
    return Result(
        f"plan-{folder}",
        tuple(f"plans/{folder}/{name}" for name in outputs),
        (
            " ".join(
                ["moespec plan", *options.split(), f"--out {RESULTS_DIR}/plans/{folder} --force"]
            ),
        ),
        minutes,
    )


def _scored(folder: str, model: str, dtype: str, crossover: int, before=()) -> Result:
    """verify.json, sweep.json (+ .png) and score.json of a checkpoint's plan folder."""
    out = f"{RESULTS_DIR}/plans/{folder}"
    return Result(
        f"score-{folder}",
        tuple(
            f"plans/{folder}/{n}" for n in ("verify.json", "sweep.json", "sweep.png", "score.json")
        ),
        (
            *before,
            f"moespec measure-verify --model {model} --dtype {dtype} --repeats 20 "
            f"--out {out}/verify.json --force",
            f"python benchmarks/speculative_sweep.py --model {model} --dtype {dtype} --tokens 64 "
            f"--kernel auto --crossover {crossover} --out {out}/sweep.json --force",
            f"python benchmarks/score_plan.py {out}/plan.json {out}/verify.json {out}/sweep.json "
            f"--out {out}/score.json --force",
        ),
        10,
    )


RESULTS = [
    Result(
        "decode-olmoe",
        ("decode_olmoe.json",),
        (
            "python benchmarks/decode_vs_transformers.py --shape olmoe --repeats 7 "
            f"--experts grouped_mm,eager --out {RESULTS_DIR}/decode_olmoe.json --force",
        ),
        6,
    ),
    Result(
        "decode-small",
        ("decode_small.json",),
        (
            "python benchmarks/decode_vs_transformers.py --shape small --tokens 64 --repeats 7 "
            f"--experts grouped_mm,eager --out {RESULTS_DIR}/decode_small.json --force",
        ),
        3,
    ),
    Result(  # the same on an AVX2-only host
        "decode-small-avx2",
        ("decode_small_avx2.json",),
        (
            "python benchmarks/decode_vs_transformers.py --shape small --tokens 64 --repeats 7 "
            f"--experts grouped_mm,eager --out {RESULTS_DIR}/decode_small_avx2.json --force",
        ),
        1,
    ),
    Result(
        "assisted",
        ("assisted_demo.json",),
        (
            "python benchmarks/assisted_vs_transformers.py --draft-length 4 "
            f"--out {RESULTS_DIR}/assisted_demo.json --force",
        ),
        2,
    ),
    Result(
        "batch-invariance",
        ("batch_invariance_demo.json",),
        (
            "python benchmarks/batch_invariance.py "
            f"--out {RESULTS_DIR}/batch_invariance_demo.json --force",
        ),
        6,
    ),
    Result(
        "real-draft",
        ("real_draft_demo.json", "real_draft_demo.png"),
        (
            f"python benchmarks/real_draft_eval.py --quoting 8 --repeats 5 "
            f"--out {RESULTS_DIR}/real_draft_demo.json "
            f"--plot {RESULTS_DIR}/real_draft_demo.png --force",
        ),
        12,
    ),
    Result(  # AVX2-only host: the plan's arm (`generate --plan`) beside auto and the fixed
        "real-draft-demo-avx2",
        ("real_draft_demo_avx2.json", "real_draft_demo_avx2.png"),
        (
            f"moespec plan --draft moespec/demo/draft --out {RESULTS_DIR}/plans/demo-bf16-avx2 "
            "--force",
            f"python benchmarks/real_draft_eval.py --plan {RESULTS_DIR}/plans/demo-bf16-avx2/"
            "plan.json --quoting 8 --repeats 5 "
            f"--out {RESULTS_DIR}/real_draft_demo_avx2.json "
            f"--plot {RESULTS_DIR}/real_draft_demo_avx2.png --force",
        ),
        11,
    ),
    Result(
        "native-pass",
        ("native_pass_demo_threads1.json", "native_pass_demo_threads2.json"),
        tuple(
            f"python benchmarks/native_pass.py --threads {t} "
            f"--out {RESULTS_DIR}/native_pass_demo_threads{t}.json --force"
            for t in (1, 2)
        ),
        1,
    ),
    Result(
        "long-generation",
        ("long_generation_demo.json",),
        (
            "python benchmarks/long_generation.py "
            f"--out {RESULTS_DIR}/long_generation_demo.json --force",
        ),
        4,
    ),
    Result(
        "fixed-time",
        ("fixed_time.json",),
        (
            f"test -d {BEFORE_TREE} || git worktree add --detach {BEFORE_TREE} 9aca000",
            f"python benchmarks/fixed_time.py --before {BEFORE_TREE} "
            '--before-label "9aca000 (main before the native model pass)" '
            f"--gguf-target {CHECKPOINTS}/target-bf16.gguf "
            f"--gguf-draft {CHECKPOINTS}/draft-bf16.gguf "
            f"--out {RESULTS_DIR}/fixed_time.json --force",
        ),
        8,
    ),
    Result(
        "serve",
        ("serve_demo.json",),
        (
            "python benchmarks/serve_overhead.py --rounds 7 "
            f"--out {RESULTS_DIR}/serve_demo.json --force",
        ),
        2,
    ),
    Result(
        "serve-load",
        ("serve_load_demo.json",),
        (f"python benchmarks/serve_load.py --out {RESULTS_DIR}/serve_load_demo.json --force",),
        3,
    ),
    Result(
        "batch-decode-demo",
        ("batch_decode_demo.json",),
        (f"python benchmarks/batch_decode.py --out {RESULTS_DIR}/batch_decode_demo.json --force",),
        3,
    ),
    Result(  # builds a 13.8 GB random checkpoint of the real shape, deleted at the end
        "batch-decode-olmoe-1b-7b",
        ("batch_decode_olmoe-1b-7b.json",),
        (
            "python benchmarks/batch_decode.py --shape olmoe-1b-7b --batch-sizes 1,2,4,8 "
            "--max-k 2 --prompts 8 --prompt-length 32 --tokens 16 --rounds 1 "
            f"--out {RESULTS_DIR}/batch_decode_olmoe-1b-7b.json --force",
        ),
        16,
    ),
    Result(  # on an AVX2-only host (AMD EPYC, 2 cores): the plan's batch table scored
        "batch-decode-demo-avx2",
        (
            "plans/demo-bf16-avx2/plan.json",
            "plans/demo-bf16-avx2/bench.jsonl",
            *(f"plans/demo-bf16-avx2/{name}" for name in PLAN_FIGURES),
            "batch_decode_demo_avx2.json",
        ),
        (
            f"moespec plan --draft moespec/demo/draft --out {RESULTS_DIR}/plans/demo-bf16-avx2 "
            "--force",
            "python benchmarks/batch_decode.py "
            f"--plan {RESULTS_DIR}/plans/demo-bf16-avx2/plan.json --tokens 128 --rounds 5 "
            f"--out {RESULTS_DIR}/batch_decode_demo_avx2.json --force",
        ),
        2,
    ),
    Result(  # AVX2-only host; the checkpoint (13.8 GB) is deleted by the last command
        "batch-decode-olmoe-1b-7b-avx2",
        (
            "plans/olmoe-1b-7b-16L-bf16-avx2/plan.json",
            "plans/olmoe-1b-7b-16L-bf16-avx2/bench.jsonl",
            *(f"plans/olmoe-1b-7b-16L-bf16-avx2/{name}" for name in PLAN_FIGURES),
            "batch_decode_olmoe-1b-7b_avx2.json",
        ),
        (
            MAKE_OLMOE_FULL,
            f"moespec plan --model {OLMOE_FULL} "
            f"--out {RESULTS_DIR}/plans/olmoe-1b-7b-16L-bf16-avx2 --force",
            "python benchmarks/batch_decode.py --shape olmoe-1b-7b --batch-sizes 1,2,4,8 "
            f"--plan {RESULTS_DIR}/plans/olmoe-1b-7b-16L-bf16-avx2/plan.json "
            "--max-k 2 --prompts 8 --prompt-length 32 --tokens 16 --rounds 1 "
            f"--out {RESULTS_DIR}/batch_decode_olmoe-1b-7b_avx2.json --force",
        ),
        31,
    ),
    Result(  # AVX2-only host, quiet: the full-size plan at the defaults of this wave's end
        "plan-olmoe-1b-7b-avx2-default",
        (
            "plans/olmoe-1b-7b-16L-bf16-avx2-default/plan.json",
            "plans/olmoe-1b-7b-16L-bf16-avx2-default/bench.jsonl",
            *(f"plans/olmoe-1b-7b-16L-bf16-avx2-default/{name}" for name in PLAN_FIGURES),
        ),
        (
            MAKE_OLMOE_FULL,
            f"moespec plan --model {OLMOE_FULL} "
            f"--out {RESULTS_DIR}/plans/olmoe-1b-7b-16L-bf16-avx2-default --force",
        ),
        11,
    ),
    Result(  # AVX2-only host, quiet: the full-size plan with routing on 8192 corpus tokens
        "plan-olmoe-1b-7b-avx2-trace8k",
        (
            "plans/olmoe-1b-7b-16L-bf16-avx2-trace8k/plan.json",
            "plans/olmoe-1b-7b-16L-bf16-avx2-trace8k/bench.jsonl",
            *(f"plans/olmoe-1b-7b-16L-bf16-avx2-trace8k/{name}" for name in PLAN_FIGURES),
        ),
        (
            MAKE_OLMOE_FULL,
            f"moespec plan --model {OLMOE_FULL} "
            f"--out {RESULTS_DIR}/plans/olmoe-1b-7b-16L-bf16-avx2-trace8k --force",
        ),
        16,
    ),
    Result(  # AVX2-only host; the int8 conversion and the GGUF (14 GB) deleted at the end
        "larger-than-memory-olmoe-1b-7b",
        (
            "larger_than_memory/olmoe-1b-7b-int8.json",
            *(f"larger_than_memory/olmoe-1b-7b-int8.traces/{name}" for name in LTM_TRACES),
        ),
        (
            MAKE_OLMOE_FULL,
            f"python benchmarks/larger_than_memory.py --source {OLMOE_FULL} "
            f"--work-dir {CHECKPOINTS}/ltm --memory-budget 40% --hold auto --drop-caches global "
            "--tokens 48 --rounds 3 "
            f"--out {RESULTS_DIR}/larger_than_memory/olmoe-1b-7b-int8.json --force",
        ),
        26,
    ),
    Result(  # the engine's costs and dense passes as the measured run timed them each round
        "disk-tier-simulation-olmoe-1b-7b",
        ("offload_simulation/disk_tier_olmoe-1b-7b-int8.json",),
        (
            "python benchmarks/simulate_disk_tier.py "
            f"--measured {RESULTS_DIR}/larger_than_memory/olmoe-1b-7b-int8.json "
            f"--out {RESULTS_DIR}/offload_simulation/disk_tier_olmoe-1b-7b-int8.json --force",
        ),
        2,
    ),
    Result(  # AVX2-only host; builds a 4-layer OLMoE-1B-7B int8 model and deletes it after
        "disk-tier-overlap",
        ("larger_than_memory/disk_tier_overlap_avx2.json",),
        (
            "python benchmarks/disk_tier_overlap.py --build-layers 4 "
            f"--work-dir {CHECKPOINTS}/dto --arms before,no-overlap,after --memory-budget 40% "
            "--tokens 48 --prompt-tokens 64 --rounds 4 "
            f"--out {RESULTS_DIR}/larger_than_memory/disk_tier_overlap_avx2.json --force",
        ),
        10,
    ),
    Result(  # the same, with the chunked reads' option (1 MiB chunks, 8 in flight)
        "disk-tier-chunks",
        ("larger_than_memory/disk_tier_chunks_avx2.json",),
        (
            "python benchmarks/disk_tier_overlap.py --build-layers 4 "
            f"--work-dir {CHECKPOINTS}/dto --arms before,after,chunks --memory-budget 40% "
            "--tokens 48 --prompt-tokens 64 --rounds 4 "
            f"--out {RESULTS_DIR}/larger_than_memory/disk_tier_chunks_avx2.json --force",
        ),
        10,
    ),
    Result(
        "serve-batch",
        ("serve_batch_demo.json",),
        (f"python benchmarks/serve_batch.py --out {RESULTS_DIR}/serve_batch_demo.json --force",),
        5,
    ),
    Result(
        "offload-engine",
        ("offload_demo.json",),
        (
            f"python benchmarks/offload_engine.py --out {RESULTS_DIR}/offload_demo.json "
            "--tokens 128 --repeats 7 --kernel dedup --threads 1 --force",
        ),
        5,
    ),
    Result(
        "offload-engine-olmoe2L",
        ("offload_engine_olmoe2L.json",),
        (
            "python benchmarks/offload_engine.py --synthetic olmoe-1b-7b --layers 2 --dtype bf16 "
            "--tokens 96 --repeats 5 --policies lru,spac,static "
            f"--out {RESULTS_DIR}/offload_engine_olmoe2L.json --force",
        ),
        2,
    ),
    Result(
        "policy-overhead",
        ("policy_overhead.json",),
        (
            f"python benchmarks/policy_overhead.py --out {RESULTS_DIR}/policy_overhead.json "
            "--rounds 5 --tokens 128 --before-rev 0ba278f --force",
        ),
        12,
    ),
    Result(  # SpAc's decisions in C (spac_kernel.py) against the Python classes before it
        "policy-overhead-avx2",
        ("policy_overhead_avx2.json",),
        (
            f"python benchmarks/policy_overhead.py --out {RESULTS_DIR}/policy_overhead_avx2.json "
            "--rounds 5 --tokens 128 --before-rev 3dd3706 --force",
        ),
        13,
    ),
    Result(  # SpAc's kernel reading a layer's rows ahead, against the commit before it
        "policy-overhead-prefetch-avx2",
        ("policy_overhead_prefetch_avx2.json",),
        (
            "python benchmarks/policy_overhead.py --out "
            f"{RESULTS_DIR}/policy_overhead_prefetch_avx2.json --rounds 3 --tokens 64 "
            "--policies spac --before-rev 421236a --force",
        ),
        6,
    ),
    Result(
        "captured-step",
        ("captured_step.json",),
        (
            "python benchmarks/captured_step.py --rounds 3 --profile --force "
            f"--out {RESULTS_DIR}/captured_step.json",
        ),
        15,
    ),
    Result(
        "routing-locality",
        ("routing_locality_demo.json",),
        (
            "python benchmarks/routing_locality.py "
            f"--out {RESULTS_DIR}/routing_locality_demo.json --force",
        ),
        3,
    ),
    Result(
        "calibration-gate",
        ("offload_simulation/calibration_gate.json",),
        (
            "python benchmarks/calibration_gate.py "
            f"--out {RESULTS_DIR}/offload_simulation/calibration_gate.json --force",
        ),
        3,
    ),
    Result(
        "simulated-headline",
        ("offload_simulation/headline.json",),
        (
            f"python benchmarks/simulate_offload.py --out {RESULTS_DIR}/offload_simulation "
            "--tokens 1024 --no-report --ignore-gate --force",
        ),
        4,
    ),
    Result(
        "simulated-report",
        tuple(f"offload_simulation/report/{n}" for n in (*REPORT_FILES, "draft-length.png")),
        (
            "moespec simulate --synthetic qwen3-30b-a3b --reuse2 0.48 --profile rtx4090-avx2 "
            "--local-popularity 0.8 --fit-tokens 512 --fit-documents 4 --draft-stop 0.83203125 "
            "--policy spac,static-layers,static,lru,hybrid,spac-ar --acceptance 0.73 "
            f"--tokens 512 --report {RESULTS_DIR}/offload_simulation/report --force",
        ),
        15,
    ),
    Result(
        "estimator-readings",
        ("estimator_readings.json",),
        (
            "python benchmarks/estimator_readings.py "
            f"--out {RESULTS_DIR}/estimator_readings.json --force",
        ),
        2,
    ),
    _plan("demo-bf16", "", 1, figures=True),
    _scored("demo-bf16", "moespec/demo/target", "bf16", 3),
    Result(
        "scorecard-demo-bf16",
        tuple(
            f"scorecard/demo-bf16/{n}"
            for n in ("plan.json", "bench.jsonl", "evaluation.json", *PLAN_FIGURES)
        ),
        (
            "python benchmarks/scorecard.py demo-bf16 "
            f"--out {RESULTS_DIR}/scorecard/demo-bf16 --force",
        ),
        9,
    ),
    Result(
        "corruption-cost-demo",
        ("corruption_cost_demo.json",),
        (
            "python benchmarks/corruption_cost.py --rounds 100 "
            f"--out {RESULTS_DIR}/corruption_cost_demo.json --force",
        ),
        2,
    ),
    Result(
        "verify-modes-demo",
        ("verify_modes_demo.json",),
        (f"python benchmarks/verify_modes.py --out {RESULTS_DIR}/verify_modes_demo.json --force",),
        1,
    ),
    Result(
        "verify-modes-olmoe4L",
        ("verify_modes_olmoe4L.json",),
        (
            MAKE_OLMOE_4L,
            f"python benchmarks/verify_modes.py --model {OLMOE_4L} --prompts 1 --window 36 "
            f"--rounds 5 --warmup 1 --out {RESULTS_DIR}/verify_modes_olmoe4L.json --force",
        ),
        6,
    ),
    Result(
        "corruption-cost-olmoe4L",
        ("corruption_cost_olmoe4L.json",),
        (
            MAKE_OLMOE_4L,
            f"python benchmarks/corruption_cost.py --model {OLMOE_4L} --rounds 20 --warmup 2 "
            f"--out {RESULTS_DIR}/corruption_cost_olmoe4L.json --force",
        ),
        2,
    ),
    Result(
        "scorecard-olmoe4L-bf16",
        tuple(
            f"scorecard/olmoe4L-bf16/{n}"
            for n in ("plan.json", "bench.jsonl", "evaluation.json", *PLAN_FIGURES)
        ),
        (
            # a reduced sweep (3 prompts x 2 repeats x 64 tokens a cell): the default
            # 6 x 3 x 256 takes hours on 2 cores at this model's 30-110 ms a pass
            "python benchmarks/scorecard.py olmoe4L-bf16 --prompts 3 --repeats 2 --tokens 64 "
            f"--out {RESULTS_DIR}/scorecard/olmoe4L-bf16 --force",
        ),
        36,
    ),
    Result(
        "scorecard-olmoe4L-int8",
        tuple(
            f"scorecard/olmoe4L-int8/{n}"
            for n in ("plan.json", "bench.jsonl", "evaluation.json", *PLAN_FIGURES)
        ),
        (
            # the bf16 row's reduced sweep, on the same checkpoint converted to int8
            "python benchmarks/scorecard.py olmoe4L-int8 --prompts 3 --repeats 2 --tokens 64 "
            f"--threads 2 --out {RESULTS_DIR}/scorecard/olmoe4L-int8 --force",
        ),
        33,
    ),
    Result(
        "scorecard-olmoe4L-fp32",
        tuple(
            f"scorecard/olmoe4L-fp32/{n}"
            for n in ("plan.json", "bench.jsonl", "evaluation.json", *PLAN_FIGURES)
        ),
        (
            # the reduced sweep of olmoe4L-bf16, on fp32 weights (twice the bytes a pass)
            "python benchmarks/scorecard.py olmoe4L-fp32 --prompts 3 --repeats 2 --tokens 64 "
            f"--out {RESULTS_DIR}/scorecard/olmoe4L-fp32 --force",
        ),
        125,
    ),
    Result(
        "plan-olmoe4L-bf16",
        tuple(f"plans/olmoe4L-bf16/{n}" for n in ("plan.json", "bench.jsonl", *PLAN_FIGURES)),
        (
            MAKE_OLMOE_4L,
            f"moespec plan --model {OLMOE_4L} --out {RESULTS_DIR}/plans/olmoe4L-bf16 --force",
        ),
        4,
    ),
    _scored("olmoe4L-bf16", OLMOE_4L, "bf16", 2, before=(MAKE_OLMOE_4L,)),
    Result(
        "plan-olmoe4L-fp32",
        tuple(f"plans/olmoe4L-fp32/{n}" for n in ("plan.json", "bench.jsonl", *PLAN_FIGURES)),
        (
            MAKE_OLMOE_4L,
            f"moespec plan --model {OLMOE_4L} --dtype fp32 "
            f"--out {RESULTS_DIR}/plans/olmoe4L-fp32 --force",
        ),
        6,
    ),
    _scored("olmoe4L-fp32", OLMOE_4L, "fp32", 2, before=(MAKE_OLMOE_4L,)),
    Result(
        # timed batch-invariant, as decoding verifies (reduced: 3 repeats, 6 windows); scored
        # against scorecard-olmoe4L-fp32's evaluation by benchmarks/rescore.py
        "plan-olmoe4L-fp32-invariant",
        tuple(
            f"plans/olmoe4L-fp32-invariant/{n}" for n in ("plan.json", "bench.jsonl", *PLAN_FIGURES)
        ),
        (
            MAKE_OLMOE_4L,
            f"moespec plan --model {OLMOE_4L} --dtype fp32 --repeats 3 --windows 6 "
            f"--verify-repeats 4 --out {RESULTS_DIR}/plans/olmoe4L-fp32-invariant --force",
        ),
        8,
    ),
    *(
        Result(
            f"llamacpp-{name}",
            (f"llamacpp_{name.replace('-', '_')}.json",),
            (
                f"python benchmarks/decode_vs_llamacpp.py {source} --tokens {tokens} "
                f"--rounds {rounds} --threads 1,2 --verify-repeats {verify} "
                f"--out {RESULTS_DIR}/llamacpp_{name.replace('-', '_')}.json --force",
            ),
            minutes,
        )
        # the -avx2 files come from an AVX2-only host (their cpu_flags say so), the -amx ones
        # from an Intel host with AMX (llama.cpp built without its AMX path, which died there:
        # their system_info says so), the others from one with AVX-512-BF16: the same command
        for name, source, tokens, rounds, verify, minutes in (
            ("olmoe", "--shape olmoe", 48, 4, 2, 20),
            ("olmoe-avx2", "--shape olmoe", 48, 4, 2, 25),
            ("olmoe-amx", "--shape olmoe", 48, 4, 2, 12),
            (
                "olmoe-int8-avx2",
                "--shape olmoe --weights int8 --engines moespec,llama.cpp-q8_0,llama.cpp-bf16",
                48,
                4,
                2,
                15,
            ),
            (
                "olmoe-int8",
                "--shape olmoe --weights int8 --engines moespec,llama.cpp-q8_0,llama.cpp-bf16",
                48,
                4,
                2,
                12,
            ),
            (
                "olmoe-int8-amx",
                "--shape olmoe --weights int8 --engines moespec,llama.cpp-q8_0,llama.cpp-bf16",
                48,
                4,
                2,
                10,
            ),
            ("demo-target", "--demo target", 128, 2, 5, 5),
            ("demo-draft", "--demo draft", 128, 2, 5, 5),
        )
    ),
    Result(
        "llamacpp-plan-check",
        ("llamacpp_plan_check.json",),
        (
            "python benchmarks/llamacpp_plan_check.py --shape olmoe --types bf16,q8_0 "
            "--threads 1 --tokens 128 --rounds 3 --verify-repeats 10 "
            f"--trace-documents 2 --out {RESULTS_DIR}/llamacpp_plan_check.json --force",
        ),
        55,
    ),
    Result(
        "llamacpp-plan-check-bf16-rounds5",
        ("llamacpp_plan_check_bf16_rounds5.json",),
        (
            "python benchmarks/llamacpp_plan_check.py --shape olmoe --types bf16 "
            "--threads 1 --tokens 128 --rounds 5 --verify-repeats 10 --trace-documents 2 "
            f"--out {RESULTS_DIR}/llamacpp_plan_check_bf16_rounds5.json --force",
        ),
        30,
    ),
    Result(
        "int8-decode",
        ("int8_decode_olmoe2L.json",),
        (
            "python benchmarks/int8_decode.py --shape olmoe --layers 2 --threads 1,2 --rounds 4 "
            f"--tokens 24 --agreement-prompts 4 --out {RESULTS_DIR}/int8_decode_olmoe2L.json "
            "--force",
        ),
        15,
    ),
    Result(  # the same on an AVX2-only host
        "int8-decode-avx2",
        ("int8_decode_olmoe2L_avx2.json",),
        (
            "python benchmarks/int8_decode.py --shape olmoe --layers 2 --threads 1,2 --rounds 4 "
            f"--tokens 24 --agreement-prompts 4 --out {RESULTS_DIR}/int8_decode_olmoe2L_avx2.json "
            "--force",
        ),
        15,
    ),
    Result(  # the same on an Intel host with AMX
        "int8-decode-amx",
        ("int8_decode_olmoe2L_amx.json",),
        (
            "python benchmarks/int8_decode.py --shape olmoe --layers 2 --threads 1,2 --rounds 4 "
            f"--tokens 24 --agreement-prompts 4 --out {RESULTS_DIR}/int8_decode_olmoe2L_amx.json "
            "--force",
        ),
        10,
    ),
    Result(
        # on an Intel host with AMX, the pair loops against those of 3bad83d (before the
        # AVX-512 sweeps prefetched their weights)
        "cpu-paths-amx-host",
        tuple(f"cpu_paths_amx_host{s}.json" for s in ("", "_rows9", "_threads2")),
        tuple(
            f"python benchmarks/cpu_paths.py --rounds 9 --rows {rows} --threads {threads} "
            f"--before-rev 3bad83d --out {RESULTS_DIR}/cpu_paths_amx_host{suffix}.json --force"
            for rows, threads, suffix in ((1, 1, ""), (9, 1, "_rows9"), (1, 2, "_threads2"))
        ),
        4,
    ),
    Result(
        "cpu-paths-avx512",
        ("cpu_paths_avx512.json",),
        (
            "python benchmarks/cpu_paths.py --rounds 7 "
            f"--out {RESULTS_DIR}/cpu_paths_avx512.json --force",
        ),
        3,
    ),
    Result(
        "cpu-paths-avx512-rows9",
        ("cpu_paths_avx512_rows9.json",),
        (
            "python benchmarks/cpu_paths.py --rows 9 --rounds 5 "
            f"--out {RESULTS_DIR}/cpu_paths_avx512_rows9.json --force",
        ),
        3,
    ),
    Result(
        "attention-row",
        ("attention_row.json",),
        (f"python benchmarks/attention_row.py --out {RESULTS_DIR}/attention_row.json --force",),
        3,
    ),
    Result(
        "cpu-paths-avx2",
        ("cpu_paths_avx2.json",),
        (
            "python benchmarks/cpu_paths.py --avx2 --rounds 5 "
            f"--out {RESULTS_DIR}/cpu_paths_avx2.json --force",
        ),
        3,
    ),
    Result(
        # on an AVX2-only host, the AVX2 pair loops against those of 4314d1c (before their
        # accumulators were held in registers and their inputs broadcast once per pair)
        "cpu-paths-avx2-host",
        tuple(f"cpu_paths_avx2_host{s}.json" for s in ("", "_rows2", "_rows9")),
        (
            *(
                f"python benchmarks/cpu_paths.py --rounds 9 --rows {rows} --before-rev 4314d1c "
                f"--out {RESULTS_DIR}/cpu_paths_avx2_host{suffix}.json --force"
                for rows, suffix in ((1, ""), (2, "_rows2"), (9, "_rows9"))
            ),
        ),
        3,
    ),
    _plan("olmoe-1b-7b-bf16", "--shape olmoe-1b-7b", 1),
    _plan("olmoe-1b-7b-fp32", "--shape olmoe-1b-7b --dtype fp32", 1),
    _plan("qwen3-30b-a3b-bf16", "--shape qwen3-30b-a3b", 1),
    _plan("gpt-oss-20b-bf16", "--shape gpt-oss-20b", 1),
    # no published rho(2) for DeepSeek-V2-Lite: the synthetic routing is fitted to 0.4
    _plan("deepseek-v2-lite-bf16", "--shape deepseek-v2-lite --reuse2 0.4", 1),
    # These need a CUDA GPU (these files: an H200, PCIe 5.0 x16, 16 host cores).
    _plan("olmoe-1b-7b-bf16-h200", "--shape olmoe-1b-7b --device cuda", 1),
    Result(
        "gpu-expert-kernels-h200",
        ("gpu/gpu_expert_kernels_h200.json", "gpu/gpu_expert_kernels_h200.png"),
        (
            "python benchmarks/gpu_expert_kernels.py "
            f"--out {RESULTS_DIR}/gpu/gpu_expert_kernels_h200.json --force",
        ),
        1,
    ),
    Result(  # the launch settings tuned, then the kernels timed again on them
        "gpu-expert-kernels-h200-tuned",
        (
            "gpu/triton_settings_h200.json",
            "gpu/gpu_expert_kernels_h200_tuned.json",
            "gpu/gpu_expert_kernels_h200_tuned.png",
        ),
        (
            "python benchmarks/gpu_expert_kernels.py --tune "
            f"--out {RESULTS_DIR}/gpu/triton_settings_h200.json --force",
            "python benchmarks/gpu_expert_kernels.py "
            f"--settings {RESULTS_DIR}/gpu/triton_settings_h200.json "
            f"--out {RESULTS_DIR}/gpu/gpu_expert_kernels_h200_tuned.json --force",
        ),
        2,
    ),
    Result(
        "gpu-offload-engine-h200",
        ("gpu/offload_engine_h200.json",),
        (
            "python benchmarks/offload_engine.py --synthetic olmoe-1b-7b --layers 4 --device cuda "
            "--dtype bf16 --expert-cache-ratio 0.25 --draft-length 4 --acceptance 0.7 "
            f"--tokens 96 --repeats 3 --out {RESULTS_DIR}/gpu/offload_engine_h200.json --force",
        ),
        3,
    ),
    Result(  # builds a 13.8 GB random checkpoint (deleted at the end), converts and exports it
        "full-size-olmoe-1b-7b",
        ("full_size/olmoe-1b-7b.json",),
        (
            "python benchmarks/full_size.py --shape olmoe-1b-7b --threads 1,2 --rounds 3 "
            f"--tokens 32 --out {RESULTS_DIR}/full_size/olmoe-1b-7b.json --force",
        ),
        25,
    ),
    Result(  # the same checkpoint, moespec bf16 at 2 threads: the speculation arms with suffix
        "full-size-olmoe-1b-7b-speculation",
        ("full_size/olmoe-1b-7b-speculation.json",),
        (
            "python benchmarks/full_size.py --shape olmoe-1b-7b --arms moespec-bf16 --threads 2 "
            f"--rounds 1 --tokens 32 --out {RESULTS_DIR}/full_size/olmoe-1b-7b-speculation.json "
            "--force",
        ),
        10,
    ),
]


def by_name(name: str) -> Result:
    for result in RESULTS:
        if result.name == name:
            return result
    known = ", ".join(r.name for r in RESULTS)
    raise ValueError(f"no result named {name!r} (known: {known})")
