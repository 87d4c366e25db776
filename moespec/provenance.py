"""Where and how a result was made: one record for every plan and benchmark result.

`provenance(device, settings)` gives the machine (platform, CPU model, cores, Python), the
CPU capability torch dispatches to (e.g. AVX2, AVX512), the versions of the packages the
numbers depend on, the git commit of the checkout moespec runs from (None outside one),
the device the work ran on, the intra-op threads, and the caller's settings.
"""

import contextlib
import functools
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

# Packages whose versions a result may depend on (recorded when installed).
PACKAGES = ("torch", "numpy", "transformers", "tokenizers", "safetensors", "pyarrow", "triton")


def provenance(device="cpu", settings: dict | None = None) -> dict:
    """The record of `moespec.plan.Provenance`: machine, CPU capability, versions, commit,
    device (as used: "cpu", "cuda:0", ...), threads and settings."""
    import torch

    return {
        "device": str(device),
        "threads": torch.get_num_threads(),
        "versions": versions(),
        "machine": machine(device),
        "cpu_capability": cpu_capability(),
        "commit": git_commit(),
        "settings": dict(settings or {}),
    }


def machine(device="cpu") -> dict:
    """Platform, CPU model and cores, Python; a CUDA device's name and memory when used."""
    info = {
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }
    if str(device).startswith("cuda"):
        import torch

        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            gpu_capability=list(torch.cuda.get_device_capability(device)),
            gpu_memory_bytes=props.total_memory,
            cuda=torch.version.cuda,
        )
    return info


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo where there is one)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def cpu_capability() -> str | None:
    """The vector ISA torch's CPU kernels dispatch to ("AVX2", "AVX512", ...)."""
    import torch

    with contextlib.suppress(AttributeError, RuntimeError):
        return torch.backends.cpu.get_cpu_capability()
    return None


def versions() -> dict[str, str]:
    """moespec's version and those of the installed packages in PACKAGES."""
    import moespec

    out = {"moespec": moespec.__version__}
    for name in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


@functools.cache
def git_commit(root: Path | None = None) -> str | None:
    """The commit of the git checkout at `root` (default: the one moespec is imported from);
    None outside one (an installed wheel) or without git. A checkout with uncommitted
    changes to tracked files is marked "+dirty"."""
    root = Path(__file__).resolve().parent.parent if root is None else Path(root)
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{head}+dirty" if dirty else head
