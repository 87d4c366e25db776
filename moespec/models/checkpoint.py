"""Reading a Hugging Face checkpoint directory: config.json, safetensors (single or sharded).

Tensors are read one at a time from the safetensors files (moespec.models.tensorfile) with
pread, into tensors of their own in the run's dtype: a source is copied into its final layout
anyway, and reading it so touches no mapped page (no page faults, nothing of the file resident
in this process; the page cache keeps it for the next load). A loader that finishes each layer
before reading the next holds one layer's source at a time. Experts
are stacked as [E, out, in] whatever the checkpoint's layout (per expert, as real
Qwen3/OLMoE/Mixtral checkpoints and `save_pretrained` write them, or fused). Every failure is a
`CheckpointError` naming the file and the tensor; nothing half-loaded is returned.
"""

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from moespec.models.tensorfile import SafetensorsFile, TensorFileError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class CheckpointError(ValueError):
    """A checkpoint directory that moespec cannot load, with the file and tensor at fault."""


@dataclass(frozen=True)
class WeightLayout:
    """Where a family keeps its MoE tensors (the rest of the names are shared)."""

    moe_prefix: str = "mlp"  # Mixtral: "block_sparse_moe"
    router: str = "gate"
    expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    correction_bias: str = "gate.e_score_correction_bias"  # MiniMax-M2: on the block
    shared_experts: str = "shared_experts"  # Qwen3.5: "shared_expert"
    shared_gate: str | None = None  # Qwen3.5: "shared_expert_gate", sigmoid(gate x) on them


def read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            value = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return value


class TensorReader:
    """The tensors of a checkpoint directory, read lazily from memory-mapped safetensors files."""

    device = torch.device("cpu")  # where the tensors it returns live

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._handles: dict[Path, SafetensorsFile] = {}
        self.file_of = self._index()

    def _index(self) -> dict[str, Path]:
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no 'weight_map' object")
            files = {name: self.directory / shard for name, shard in weight_map.items()}
            for path in set(files.values()):
                if not path.exists():
                    raise CheckpointError(f"{path} is listed in {index.name} but does not exist")
            return files
        single = self.directory / "model.safetensors"
        if not single.exists():
            raise CheckpointError(
                f"{self.directory} has neither model.safetensors nor model.safetensors.index.json"
            )
        return dict.fromkeys(self._open(single).names(), single)

    def _open(self, path: Path) -> SafetensorsFile:
        if path not in self._handles:
            try:
                self._handles[path] = SafetensorsFile(path)
            except TensorFileError as error:
                raise CheckpointError(str(error)) from None
        return self._handles[path]

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """(dtype, shape) of tensor `name` as stored."""
        if name not in self.file_of:
            raise CheckpointError(f"tensor {name!r} is missing from {self._where()}")
        return self._open(self.file_of[name]).spec(name)

    def source_tensors(self) -> dict[str, list]:
        """{name: [dtype name, shape]} of every tensor, for a converted model's manifest."""
        from moespec.models.tensorfile import NAMES

        out = {}
        for name in sorted(self.file_of):
            dtype, shape = self.spec(name)
            out[name] = [NAMES[dtype], list(shape)]
        return out

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor `name`, checked against `shape`, converted to `dtype` (a copy: the
        source's pages can be released)."""
        path, tensor = self._read(name, shape)
        if tensor.dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {tensor.dtype}; expected float32, "
                "float16 or bfloat16"
            )
        return tensor.to(dtype)  # a tensor of its own already: converted only if need be

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Copy the float tensor `name` (checked against out's shape) into `out`, converting."""
        path = self.check(name, tuple(out.shape))
        try:
            self._open(path).read_into(name, out)
        except (OSError, ValueError, RuntimeError) as error:
            raise CheckpointError(f"{path}: tensor {name!r} cannot be read: {error}") from None

    def get_bytes(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The uint8 tensor `name` (packed quantized weights or their scales), checked."""
        path, tensor = self._read(name, shape)
        if tensor.dtype != torch.uint8:
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {tensor.dtype}; expected uint8"
            )
        return tensor

    def check(self, name: str, shape: tuple[int, ...], floats: bool = True) -> Path:
        """The file of tensor `name`, after checking that it is there with this shape (and a
        float dtype); nothing is read."""
        if name not in self.file_of:
            raise CheckpointError(f"tensor {name!r} is missing from {self._where()}")
        path = self.file_of[name]
        dtype, stored = self.spec(name)
        if stored != tuple(shape):
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {list(stored)}, expected {list(shape)}"
            )
        if floats and dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {dtype}; expected float32, float16 or bfloat16"
            )
        return path

    def _read(self, name: str, shape: tuple[int, ...]) -> tuple[Path, torch.Tensor]:
        path = self.check(name, shape, floats=False)
        try:
            tensor = self._open(path).read(name)
        except (OSError, ValueError, RuntimeError) as error:
            raise CheckpointError(f"{path}: tensor {name!r} cannot be read: {error}") from None
        return path, tensor

    def _where(self) -> str:
        files = sorted({p.name for p in self.file_of.values()})
        return f"{self.directory} ({', '.join(files)})"


class ExpertSource:
    """A layer's experts as the checkpoint keeps them, one tensor per projection per expert:
    `expert(e)` reads expert e's (gate_up [2I, H], down [H, I]) in the run's dtype, so a
    loader can give each expert its final layout without stacking the layer first
    (moespec.kernels.experts.ExpertWeights with a source). What it returns is valid until
    the next call (the caller copies it into a layout of its own): two buffers take turns, so
    no expert costs a fresh allocation, and in order, expert e + 1 is read into the other one
    on a reading thread while the caller lays out expert e (reads and the native layout loops
    both run outside the interpreter's lock), so reading and laying out overlap."""

    def __init__(self, reader, prefix: str, layout, inter: int, hidden: int, dtype):
        self.reader, self.prefix, self.names = reader, prefix, layout.expert_projections
        self.inter, self.hidden, self.dtype, self.device = inter, hidden, dtype, reader.device
        self._buffers = None  # two (gate_up, down) pairs, made on the first read
        self._ahead = None  # (e, future) of the expert being read ahead

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        ahead, self._ahead = self._ahead, None
        weights = ahead[1].result() if ahead is not None and ahead[0] == e else self._read(e)
        if self.device.type == "cpu":
            self._ahead = (e + 1, _thread("read").submit(self._read, e + 1))
        return weights

    def _read(self, e: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        gate, up, down_name = (f"{self.prefix}.experts.{e}.{p}.weight" for p in self.names)
        if gate not in self.reader:
            return None  # past the last expert
        i, h = self.inter, self.hidden
        if self.device.type != "cpu":  # the meta skeleton: shapes only
            return (
                torch.empty(2 * i, h, dtype=self.dtype, device=self.device),
                torch.empty(h, i, dtype=self.dtype, device=self.device),
            )
        if self._buffers is None:
            self._buffers = [
                (torch.empty(2 * i, h, dtype=self.dtype), torch.empty(h, i, dtype=self.dtype))
                for _ in range(2)
            ]
        gate_up, down = self._buffers[e % 2]
        self.reader.read_into(gate, gate_up[:i])
        self.reader.read_into(up, gate_up[i:])
        self.reader.read_into(down_name, down)
        return gate_up, down

    def close(self) -> None:
        """Wait for a read ahead still under way, and drop the buffers."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead[1].result()
        self._buffers = None


@functools.cache
def _thread(name: str):
    """A thread of the loader's own ("read": the next expert)."""
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"moespec-{name}")


def expert_weights(
    reader, prefix: str, layout: WeightLayout, num_experts: int, hidden: int, inter: int, dtype
):
    """The ExpertWeights of the experts under `prefix`: read expert by expert from their
    per-expert tensors when the loader finishes them (every tensor checked first, so a missing
    or misshapen one fails before anything is built), else stacked (`load_experts`)."""
    from moespec.kernels.experts import ExpertWeights

    if f"{prefix}.experts.gate_up_proj" in reader:
        return ExpertWeights(
            *load_experts(reader, prefix, layout, num_experts, hidden, inter, dtype)
        )
    gate, up, down = layout.expert_projections
    for e in range(num_experts):
        for name, shape in (
            (gate, (inter, hidden)),
            (up, (inter, hidden)),
            (down, (hidden, inter)),
        ):
            full = f"{prefix}.experts.{e}.{name}.weight"
            reader.check(full, shape)
    return ExpertWeights(
        torch.empty(num_experts, 2 * inter, hidden, dtype=dtype, device="meta"),
        torch.empty(num_experts, hidden, inter, dtype=dtype, device="meta"),
        source=ExpertSource(reader, prefix, layout, inter, hidden, dtype),
    )


def load_experts(
    reader: TensorReader,
    prefix: str,
    layout: WeightLayout,
    num_experts: int,
    hidden: int,
    inter: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]) from per-expert or fused tensors under `prefix`."""
    fused_gate_up = f"{prefix}.experts.gate_up_proj"
    if fused_gate_up in reader:
        gate_up = reader.get(fused_gate_up, (num_experts, 2 * inter, hidden), dtype)
        down = reader.get(f"{prefix}.experts.down_proj", (num_experts, hidden, inter), dtype)
        return gate_up, down
    gate_name, up_name, down_name = layout.expert_projections
    gate_up = torch.empty(num_experts, 2 * inter, hidden, dtype=dtype, device=reader.device)
    down = torch.empty(num_experts, hidden, inter, dtype=dtype, device=reader.device)
    for e in range(num_experts):
        base = f"{prefix}.experts.{e}"
        reader.read_into(f"{base}.{gate_name}.weight", gate_up[e, :inter])
        reader.read_into(f"{base}.{up_name}.weight", gate_up[e, inter:])
        reader.read_into(f"{base}.{down_name}.weight", down[e])
    return gate_up, down
