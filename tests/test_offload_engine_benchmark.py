"""benchmarks/offload_engine.py's expert mode: the engine and the simulator replay one routing.

Its engine runs every pass on the trace's own window, rejected drafts included, so the
simulation it is scored against must route them the same way; LRU's decisions do not depend
on time, so both sides then count the same hits, copies and CPU experts exactly."""

import json
from pathlib import Path

from tests.checkpoints import run_script

ROOT = Path(__file__).resolve().parent.parent


def test_expert_mode_simulates_the_routing_the_engine_ran(tmp_path):
    out = tmp_path / "offload.json"
    done = run_script(
        ROOT / "benchmarks" / "offload_engine.py",
        [
            *("--out", str(out), "--synthetic", "olmoe-1b-7b", "--layers", "1"),
            *("--dtype", "bf16", "--tokens", "12", "--fit-tokens", "16", "--repeats", "1"),
            *("--policies", "lru", "--threads", "2"),
        ],
    )
    assert done.returncode in (0, 1), done.stderr  # 1: the timing gate missed, still written
    lru = json.loads(out.read_text())["results"]["lru"]
    measured, simulated = lru["measured"], lru["simulated"]
    assert measured["steps"] == simulated["steps"]
    assert measured["tokens"] == simulated["tokens"] == 12
    assert measured["bytes_copied"] > 0
    for key in ("hit_rate", "bytes_copied", "cpu_experts"):
        assert measured[key] == simulated[key], key
