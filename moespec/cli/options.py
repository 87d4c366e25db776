"""Argument types shared by the commands, checked by argparse before anything heavy imports.

A wrong number or name is an argparse error (usage line, one message, exit 2) within a tenth
of a second, instead of after torch has loaded.
"""

import argparse

# The dtype names the commands accept (ours and torch's), each to the name used downstream.
DTYPE_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32", "float32": "fp32"}


def dtype_name(text: str) -> str:
    """'bf16' or 'fp32' from either spelling (bf16/bfloat16, fp32/float32)."""
    key = text.strip().lower().removeprefix("torch.")
    if key not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}; choose bf16 (bfloat16) or fp32 (float32)"
        )
    return DTYPE_NAMES[key]


def add_dtype(parser: argparse.ArgumentParser, default: str = "bf16") -> None:
    parser.add_argument(
        "--dtype",
        default=default,
        type=dtype_name,
        metavar="bf16|fp32",
        help=f"weight dtype: bf16 (bfloat16) or fp32 (float32); default {default}",
    )


WEIGHT_NAMES = {**DTYPE_NAMES, "int8": "int8", "int8-experts": "int8-experts"}


def weights_name(text: str) -> str:
    """'bf16', 'fp32', 'int8' or 'int8-experts' from any accepted spelling."""
    key = text.strip().lower().removeprefix("torch.")
    if key not in WEIGHT_NAMES:
        raise argparse.ArgumentTypeError(
            f"unknown weight format {text!r}; choose bf16, fp32, int8 or int8-experts"
        )
    return WEIGHT_NAMES[key]


def add_batch_invariant(parser: argparse.ArgumentParser, help: str) -> None:
    """--batch-invariant on|off (default on), as each command explains in `help`."""
    parser.add_argument("--batch-invariant", default="on", choices=["on", "off"], help=help)


def add_verify_mode(parser: argparse.ArgumentParser) -> None:
    """--verify-mode (calibrate.verify.VERIFY_MODES, not imported here: it pulls in torch)."""
    parser.add_argument(
        "--verify-mode",
        choices=("stream", "isolated"),
        default="stream",
        help="how a verify pass is timed: within a run of consecutive passes through the text, "
        "as decoding runs them (default), or alone, rolled back",
    )


def add_weights(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--weights",
        type=weights_name,
        metavar="bf16|fp32|int8|int8-experts",
        help="weights: int8 quantizes the experts, attention and head at load (one scale per "
        "output channel; routers, norms and embeddings stay in --dtype), int8-experts the "
        "experts alone; bf16/fp32 must equal --dtype (default: --dtype)",
    )


def resolve_weights(args: argparse.Namespace) -> str | None:
    """--weights checked against --dtype: None (every weight in --dtype) or an int8 format."""
    if args.weights is None or args.weights.startswith("int8"):
        return args.weights
    if args.weights != args.dtype:
        raise ValueError(
            f"--weights {args.weights} disagrees with --dtype {args.dtype}: float weights run "
            f"in --dtype (pass --dtype {args.weights}); int8 weights run in either"
        )
    return None


def add_offload(parser: argparse.ArgumentParser) -> None:
    """The offloaded experts' settings (`moespec.session.OffloadSettings`, by the same names)."""
    offload = parser.add_argument_group("offloaded experts")
    offload.add_argument(
        "--offload",
        metavar="POLICY",
        help="keep experts in host memory behind a device cache run by POLICY: spac, lru, "
        "static, static-layers (llama.cpp's whole layers), hybrid, spac-ar (spac without "
        "speculation), or a SpAc ablation",
    )
    budget = offload.add_mutually_exclusive_group()
    budget.add_argument(
        "--expert-cache-ratio",
        type=positive_number,
        metavar="R",
        help="expert cache budget: this share of all expert bytes (default 0.25)",
    )
    budget.add_argument(
        "--expert-cache-bytes",
        type=non_negative_int,
        metavar="B",
        help="expert cache budget in bytes",
    )
    budget.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="keep the experts in a converted model's file, read with direct I/O into a RAM "
        "cache of SIZE (6G, 512M, or auto: available memory less the dense weights and a "
        "margin)",
    )
    offload.add_argument(
        "--offload-device",
        default="auto",
        metavar="cpu|cuda[:N]|auto",
        help="the expert cache's device (default: cuda when available, else cpu)",
    )
    offload.add_argument(
        "--offload-fit",
        metavar="TRACE",
        type=existing_file,
        help="a routing trace (moespec trace) to fit the policy on (default: the first prompt "
        "decoded)",
    )


def offload_settings(args: argparse.Namespace):
    """The `moespec.session.OffloadSettings` of `add_offload`'s arguments (checked later)."""
    from moespec.session import OffloadSettings

    return OffloadSettings(
        offload=args.offload,
        expert_cache_ratio=args.expert_cache_ratio,
        expert_cache_bytes=args.expert_cache_bytes,
        offload_device=args.offload_device,
        offload_fit=args.offload_fit,
        memory_budget=args.memory_budget,
    )


def device_name(text: str) -> str:
    """An argparse type: "cpu", "cuda" or "cuda:N" (whether this machine has it is checked
    when the command runs: `require_device`)."""
    name = text.strip().lower()
    index = name.removeprefix("cuda:")
    if name in ("cpu", "cuda") or (name.startswith("cuda:") and index.isdigit()):
        return name
    raise argparse.ArgumentTypeError(f"unknown device {text!r}; choose cpu, cuda or cuda:N")


def require_device(name: str, flag: str = "--device") -> str:
    """The device name, after checking this machine has it (one line naming the flag if not)."""
    if name == "cpu":
        return name
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"{flag} {name}: CUDA is not available on this machine")
    index, count = int(name.partition(":")[2] or 0), torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"{flag} {name}: this machine has {count} CUDA devices")
    return name


def at_least(low: int):
    """An argparse type: an integer >= low."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


positive_int = at_least(1)
non_negative_int = at_least(0)


def batch_sizes(text: str) -> tuple[int, ...]:
    """An argparse type: batch sizes >= 1, comma-separated, each once ("1": none beyond one)."""
    parts = [part.strip() for part in text.split(",")]
    try:
        sizes = tuple(sorted({int(part) for part in parts}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of integers") from None
    if not sizes or sizes[0] < 1 or len(sizes) != len(parts):
        raise argparse.ArgumentTypeError(f"need distinct batch sizes >= 1, got {text!r}")
    return sizes


def number_in(low: float, high: float, *, low_open: bool = False, high_open: bool = False):
    """An argparse type: a float in [low, high], either end open when asked."""
    left, right = "(" if low_open else "[", ")" if high_open else "]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        if not (above and below):
            raise argparse.ArgumentTypeError(f"must be in {left}{low}, {high}{right}, got {text}")
        return value

    parse.__name__ = f"number in {left}{low}, {high}{right}"
    return parse


def positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def checkpoint_dir(text: str) -> str:
    """An argparse type: a directory (what is inside is checked when the model loads)."""
    from pathlib import Path

    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a checkpoint directory")
    return text


def existing_file(text: str) -> str:
    """An argparse type: a file that exists (its content is checked when it is read)."""
    from pathlib import Path

    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text
