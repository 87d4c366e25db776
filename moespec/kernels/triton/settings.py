"""Tuned launch settings of the Triton expert kernels: data keyed by device and shape, not code.

A table has a "default" entry and per-device entries keyed by the expert shape "HxI" (hidden x
intermediate) or "*" for any shape of that device:

    {"default": {"slot": {"gate_up": {...}, "down": {...}}, "dedup": {...}},
     "devices": {"NVIDIA H200": {"2048x1024": {"dedup": {"down": {"split": 8}}}, "*": {...}}}}

A stage is {"block_n", "block_k", "split", "num_warps", "num_stages"}: rows of the output per
program, columns of the reduction per step, how many ways the stage's experts are split over
programs (slot gate_up has a program per slot and no split), and Triton's launch options.
Later entries override earlier ones key by key: default, then the device's "*", then its shape.
`benchmarks/gpu_expert_kernels.py --tune` measures and writes a table of this form (plus a
"measurements" entry recording every score), to be read with `load_table` or copied into TUNED.
"""

import json
from dataclasses import asdict, dataclass
from pathlib import Path

KERNEL_NAMES = ("slot", "dedup")
STAGES = ("gate_up", "down")

# Starting points for a card without tuned values (chosen for an H100/H200-class card before
# one was measured). Slot gate_up: a program per (slot, 8 rows) keeps >= 1000 programs even at
# one token.
TUNED: dict = {
    "default": {
        "slot": {
            "gate_up": {"block_n": 8, "block_k": 512, "split": 1, "num_warps": 4, "num_stages": 3},
            "down": {"block_n": 4, "block_k": 512, "split": 1, "num_warps": 4, "num_stages": 3},
        },
        "dedup": {
            "gate_up": {"block_n": 16, "block_k": 256, "split": 8, "num_warps": 4, "num_stages": 3},
            "down": {"block_n": 16, "block_k": 256, "split": 4, "num_warps": 4, "num_stages": 3},
        },
    },
    "devices": {
        # Measured on an H200 (benchmarks/gpu_expert_kernels.py --tune, bf16; the four shapes of
        # benchmarks/results/gpu/triton_settings_h200.json agree but for dedup's splits).
        "NVIDIA H200": {
            "*": {
                "slot": {
                    "gate_up": {"block_n": 8, "block_k": 1024, "split": 1},
                    "down": {"block_n": 8, "block_k": 512, "split": 2},
                },
                "dedup": {
                    "gate_up": {"block_n": 32, "block_k": 128, "split": 8},
                    "down": {"block_n": 32, "block_k": 256, "split": 8},
                },
            },
            "2048x768": {"dedup": {"gate_up": {"split": 16}}},  # Qwen3-30B-A3B
            "2880x2880": {"dedup": {"gate_up": {"split": 4}, "down": {"split": 4}}},  # gpt-oss
        },
    },
}


@dataclass(frozen=True)
class StageSettings:
    block_n: int
    block_k: int
    split: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"kernel setting {name} must be a positive integer, got {value!r}")
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"kernel setting {name} must be a power of two, got {value}")


@dataclass(frozen=True)
class KernelSettings:
    gate_up: StageSettings
    down: StageSettings


def _check_dedup(settings: KernelSettings) -> None:
    # Tensor-core products need at least 16 rows and 16 reduction columns per tile.
    for stage in STAGES:
        s = getattr(settings, stage)
        if s.block_n < 16 or s.block_k < 16:
            raise ValueError(
                f"dedup {stage}: block_n and block_k must be >= 16 (tensor-core tiles), "
                f"got {s.block_n} and {s.block_k}"
            )


def _merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def shape_key(hidden_size: int, intermediate_size: int) -> str:
    return f"{hidden_size}x{intermediate_size}"


def settings_for(
    kernel: str,
    hidden_size: int,
    intermediate_size: int,
    device_name: str | None = None,
    table: dict | None = None,
) -> KernelSettings:
    """The launch settings of `kernel` ("slot" or "dedup") for this shape and device."""
    if kernel not in KERNEL_NAMES:
        raise ValueError(f"unknown Triton expert kernel {kernel!r}; choose one of {KERNEL_NAMES}")
    table = TUNED if table is None else table
    chosen = table["default"]
    device = table.get("devices", {}).get(device_name or "", {})
    for key in ("*", shape_key(hidden_size, intermediate_size)):
        chosen = _merge(chosen, device.get(key, {}))
    try:
        stages = {stage: StageSettings(**chosen[kernel][stage]) for stage in STAGES}
    except (KeyError, TypeError) as error:
        raise ValueError(f"{kernel} kernel settings are incomplete or unknown: {error}") from None
    settings = KernelSettings(**stages)
    if kernel == "dedup":
        _check_dedup(settings)
    return settings


def load_table(path: str | Path) -> dict:
    """A settings table from JSON, merged over the built-in one (checked on every entry)."""
    path = Path(path)
    try:
        loaded = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable settings table ({error})") from None
    if not isinstance(loaded, dict) or not set(loaded) <= {"default", "devices", "measurements"}:
        raise ValueError(f"{path}: a settings table has 'default', 'devices' and 'measurements'")
    loaded.pop("measurements", None)  # how the tuner chose: kept in the file, not used here
    table = _merge(TUNED, loaded)
    for device, shapes in table["devices"].items():
        for key in shapes:
            hidden, _, inter = key.partition("x")
            if key != "*" and not (hidden.isdigit() and inter.isdigit()):
                raise ValueError(f"{path}: shape key {key!r} of {device!r} is not 'HxI' or '*'")
            size = (int(hidden), int(inter)) if key != "*" else (1, 1)
            for kernel in KERNEL_NAMES:
                try:
                    settings_for(kernel, *size, device_name=device, table=table)
                except ValueError as error:
                    raise ValueError(f"{path}: {device} {key}: {error}") from None
    return table
