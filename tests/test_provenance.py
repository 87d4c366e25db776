"""The provenance record every plan and benchmark result carries."""

import subprocess
from pathlib import Path

import torch

from moespec.provenance import git_commit, provenance

ROOT = Path(__file__).resolve().parent.parent


def test_provenance_names_the_device_capability_versions_and_settings():
    record = provenance("cpu", {"repeats": 3})
    assert record["device"] == "cpu" and record["settings"] == {"repeats": 3}
    assert record["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert record["versions"]["torch"] == torch.__version__
    assert record["threads"] == torch.get_num_threads()
    assert {"platform", "cpu", "cpu_count", "python"} <= set(record["machine"])


def test_the_commit_is_the_checkouts_head_or_none_outside_a_checkout(tmp_path):
    if (ROOT / ".git").exists():
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        assert git_commit().removesuffix("+dirty") == head
    assert git_commit(tmp_path) is None
