"""safetensors files read through a memory map and written as a stream, without a second copy.

Reading (`SafetensorsFile`): the header is parsed and checked against the file's size (a
truncated or corrupt shard is refused, naming the file, before any tensor is read). A tensor
is either a view of the mapped file (`view`: no copy, read when touched; how a converted
model's final layouts are used) or read into a tensor of its own with pread (`read`,
`read_into`: how a checkpoint's tensors are copied into their final layout, touching no
mapped page, so nothing of the source stays resident in the process). The map is private
(copy on write): the weights are never written back, and two processes mapping the same file
share its pages in the page cache.

Writing (`write_safetensors`): the header is written first from the tensors' specs, then each
tensor's bytes in order as it is produced, so a converter holds one tensor (or one layer) at a
time. The file is the format's own (8-byte header length, JSON header, data), readable by the
`safetensors` package.
"""

import ctypes
import json
import mmap
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20  # the safetensors package's own bound
ALIGN = 64  # every tensor starts on a 64-byte boundary (the wider vector loads like it)
PADDING = "__padding__"  # the names of the gaps that align each tensor


class TensorFileError(ValueError):
    """A safetensors file that cannot be read, naming the file and what is wrong."""


class SafetensorsFile:
    """One safetensors file, memory-mapped; tensors are views of the map."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self.header, self.metadata, self.data_start = _read_header(f, size, self.path)
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        except OSError as error:
            raise TensorFileError(f"{self.path} cannot be read: {error.strerror}") from None
        self.size = size
        self._fd = None

    def names(self) -> list[str]:
        """The tensors' names (the alignment gaps left out)."""
        return [name for name in self.header if not name.startswith(PADDING)]

    def __contains__(self, name: str) -> bool:
        return name in self.header

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        if name not in self.header:
            raise TensorFileError(f"{self.path} holds no tensor {name!r}")
        entry = self.header[name]
        return DTYPES[entry["dtype"]], tuple(entry["shape"])

    def byte_range(self, name: str) -> tuple[int, int]:
        """The tensor's [start, end) in the file."""
        begin, end = self.header[name]["data_offsets"]
        return self.data_start + begin, self.data_start + end

    def view(self, name: str) -> torch.Tensor:
        """The tensor as a view of the mapped file (no copy; read when touched)."""
        dtype, shape = self.spec(name)
        start, end = self.byte_range(name)
        count = (end - start) // _itemsize(dtype)
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        if start % _itemsize(dtype):  # a writer that did not align: copy rather than misalign
            raw = torch.frombuffer(self._map, dtype=torch.uint8, count=end - start, offset=start)
            return raw.clone().view(dtype).view(shape)
        return torch.frombuffer(self._map, dtype=dtype, count=count, offset=start).view(shape)

    def read(self, name: str) -> torch.Tensor:
        """The tensor as a new tensor of its own (read with pread: no mapped page is touched,
        so nothing of the file stays in this process; the page cache keeps it)."""
        dtype, shape = self.spec(name)
        out = torch.empty(shape, dtype=dtype)
        self._read_bytes(name, out)
        return out

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Copy the tensor into `out` (its shape; converted to out's dtype where it differs)."""
        dtype, shape = self.spec(name)
        if tuple(out.shape) != shape:
            raise TensorFileError(
                f"{self.path}: tensor {name!r} is {list(shape)}, not {list(out.shape)}"
            )
        if out.dtype == dtype and out.is_contiguous():
            self._read_bytes(name, out)
        else:
            out.copy_(self.read(name))

    def _read_bytes(self, name: str, out: torch.Tensor) -> None:
        start, end = self.byte_range(name)
        if end == start:
            return
        view = memoryview(out.view(-1).view(torch.uint8).numpy())
        done = 0
        while done < end - start:
            got = os.preadv(self._descriptor(), [view[done:]], start + done)
            if got <= 0:
                raise TensorFileError(f"{self.path} ended while reading tensor {name!r}")
            done += got

    def _descriptor(self) -> int:
        """One descriptor for every read, so the kernel's read-ahead follows them."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return self._fd

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s bytes lie in this file's map (a view, not a copy)."""
        if self._map is None:
            return False
        start = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        return start <= tensor.data_ptr() < start + self.size

    def offset_of(self, tensor: torch.Tensor) -> int:
        """The byte of the file where a view's bytes begin (`view`: how a reader that does
        not map the file finds a mapped model's weights in it)."""
        if not self.holds(tensor):
            raise TensorFileError(f"a tensor of {list(tensor.shape)} is not a view of {self.path}")
        return tensor.data_ptr() - ctypes.addressof(ctypes.c_char.from_buffer(self._map))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _read_header(f, size: int, path: Path) -> tuple[dict, dict, int]:
    """(tensors {name: {dtype, shape, data_offsets}}, metadata, data start), checked."""
    if size < 8:
        raise TensorFileError(
            f"{path} is not a readable safetensors file: {size} bytes, too short for a header"
        )
    (length,) = struct.unpack("<Q", f.read(8))
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise TensorFileError(
            f"{path} is not a readable safetensors file (truncated, or not one): its header "
            f"claims {length} bytes and the file has {size}"
        )
    try:
        header = json.loads(f.read(length))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise TensorFileError(
            f"{path} is not a readable safetensors file: its header is not valid JSON ({error})"
        ) from None
    if not isinstance(header, dict):
        raise TensorFileError(
            f"{path} is not a readable safetensors file: its header is not a JSON object"
        )
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + length
    for name, entry in header.items():
        _check_entry(name, entry, size - data_start, path)
    return header, metadata, data_start


def _check_entry(name: str, entry, data_bytes: int, path: Path) -> None:
    try:
        dtype = DTYPES[entry["dtype"]]
        shape = [int(d) for d in entry["shape"]]
        begin, end = (int(x) for x in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        known = ", ".join(DTYPES)
        raise TensorFileError(
            f"{path}: tensor {name!r} has a malformed header entry {entry!r} "
            f"(dtype one of {known}, shape, data_offsets)"
        ) from None
    expected = _itemsize(dtype)
    for d in shape:
        expected *= d
    if min(shape, default=0) < 0 or not 0 <= begin <= end or end - begin != expected:
        raise TensorFileError(
            f"{path}: tensor {name!r} spans bytes {begin}..{end}, which does not fit its "
            f"dtype {entry['dtype']} and shape {shape}"
        )
    if end > data_bytes:
        raise TensorFileError(
            f"{path} is not a readable safetensors file: it is truncated (tensor {name!r} ends "
            f"at byte {end} of the data, which has {data_bytes})"
        )


def header_for(
    specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], metadata=None, align: int = ALIGN
):
    """(header bytes, {name: (start, end) in the data}) for tensors written in this order,
    each starting on an `align`-byte boundary. The format wants the data without gaps, so the
    bytes between two tensors are a tensor of their own, `PADDING`.i (uint8 zeros); align 1
    writes the tensors back to back, as `save_pretrained` does."""
    header, offset, ranges = {}, 0, {}
    for name, dtype, shape in specs:
        if name in header or name.startswith(PADDING):
            raise ValueError(f"tensor {name!r} is named twice, or takes a reserved name")
        if offset % align:
            gap = -offset % align
            header[f"{PADDING}.{len(header)}"] = {
                "dtype": "U8",
                "shape": [gap],
                "data_offsets": [offset, offset + gap],
            }
            offset += gap
        nbytes = _itemsize(dtype)
        for d in shape:
            nbytes *= d
        header[name] = {
            "dtype": NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        ranges[name] = (offset, offset + nbytes)
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)  # the data starts aligned
    return struct.pack("<Q", len(raw)) + raw, ranges


def write_safetensors(
    path: str | Path,
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
    tensors: Iterator[tuple[str, torch.Tensor]],
    metadata: dict | None = None,
) -> int:
    """Write the tensors of `specs`, in that order, as `tensors` yields them (each checked
    against its spec); returns the file's size. One tensor is held at a time."""
    head, ranges = header_for(specs, metadata)
    expected = {name: (dtype, tuple(shape)) for name, dtype, shape in specs}
    order = [name for name, _, _ in specs]
    written = 0
    with open(path, "wb") as f:
        f.write(head)
        for name, tensor in tensors:
            if written >= len(order) or name != order[written]:
                want = order[written] if written < len(order) else "nothing"
                raise ValueError(f"tensor {name!r} came where {want!r} was expected")
            if (tensor.dtype, tuple(tensor.shape)) != expected[name]:
                raise ValueError(
                    f"tensor {name!r} is {tensor.dtype} {list(tensor.shape)}, its spec "
                    f"{expected[name][0]} {list(expected[name][1])}"
                )
            start, end = ranges[name]
            f.seek(len(head) + start)
            if end > start:
                f.write(memoryview(tensor.detach().contiguous().view(torch.uint8).numpy()))
            written += 1
        if written != len(order):
            raise ValueError(f"{len(order) - written} tensors were never produced")
        end = max((e for _, e in ranges.values()), default=0)
        f.truncate(len(head) + end)
        f.flush()
        os.fsync(f.fileno())
        return len(head) + end
