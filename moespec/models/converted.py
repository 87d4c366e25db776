"""Converted models: the final weight layouts written once, memory-mapped by every later load.

    summary = convert("checkpoint/", "converted/", weights="int8")
    model, tokenizer = load_model("converted/")   # maps converted/weights.safetensors

`convert` reads the checkpoint one layer at a time (moespec.models.model_parts), gives each
layer its final layout (int8 for `int8`, then the native pair layout where this CPU's path
takes it) and writes it before reading the next, so it never holds the model: its header is
laid out first from a skeleton of the same build on the meta device (shapes, no bytes). The
directory is written beside its destination and renamed into place when complete, so nothing
half-written is ever loadable. It holds:

- `weights.safetensors`: every weight in its final layout, named by its place in the model
  (`layers.3.mlp.experts.packed_gate_up.5.pairs`, ...), 64-byte aligned;
- `moespec-converted.json`, the manifest: layout version, weights kind and dtype, the
  product paths the layouts are for (and the CPU family that wrote them), the source's
  fingerprint and its tensor index (names, dtypes, shapes: the skeleton's input);
- the source's config, generation config, tokenizer and chat template, as they were.

`load_converted` builds the same skeleton, then points each weight at its bytes in the
mapped file: no copy, nothing read until a pass touches it, and two processes share the
pages. Only weights that take oneDNN's opaque layout on this CPU (fp32 products) are packed
at load, as copies. A manifest of another layout version, or layouts this CPU's paths do not
read, is refused in one line with the command that converts again.
"""

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from moespec import __version__
from moespec.files import OutputExistsError
from moespec.kernels.experts import ExpertWeights
from moespec.kernels.linear import portable_layouts
from moespec.models.checkpoint import CheckpointError, TensorReader, read_json
from moespec.models.tensorfile import DTYPES, NAMES, SafetensorsFile, TensorFileError

MANIFEST = "moespec-converted.json"
WEIGHTS_FILE = "weights.safetensors"
FORMAT = "moespec-converted"
LAYOUT_VERSION = 1
WEIGHT_KINDS = ("bf16", "fp32", "int8", "int8-experts")
COPIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def is_converted(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def convert(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    weights: str = "bf16",
    force: bool = False,
    progress=None,
) -> dict:
    """Write `model_dir` in its final layouts to `out_dir` (see the module docstring).
    weights: "bf16", "fp32", "int8" (experts, attention, dense MLPs and head; bf16 beside)
    or "int8-experts". progress(done, total) is called after each part. Returns a summary."""
    from moespec.models import ARCHITECTURES, Finishing, load_config, model_parts

    if weights not in WEIGHT_KINDS:
        raise ValueError(f"unknown weights {weights!r}; choose {', '.join(WEIGHT_KINDS)}")
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if is_converted(model_dir):
        raise CheckpointError(f"{model_dir} is already converted; convert its source instead")
    if out_dir.exists() and not force:
        raise OutputExistsError(out_dir)
    if not out_dir.parent.is_dir():
        raise FileNotFoundError(f"directory {out_dir.parent} does not exist (for {out_dir})")
    config = load_config(model_dir)
    architecture = ARCHITECTURES[config.model_type]
    dtype = torch.float32 if weights == "fp32" else torch.bfloat16
    reader = TensorReader(model_dir)
    source = reader.source_tensors()
    finish = Finishing(None if weights in ("bf16", "fp32") else weights)
    skeleton = skeleton_parts(config, source, dtype, finish.weights, model_dir)
    specs = [(n, t.dtype, tuple(t.shape)) for n, t, _ in _stream(iter(skeleton.items()))]
    needed = sum(t.itemsize * _numel(shape) for _, t, shape in specs)
    free = shutil.disk_usage(out_dir.parent).free
    if free < needed:
        raise OSError(
            errno.ENOSPC,
            f"{out_dir.parent} has {free / 1e9:.2f} GB free and the converted weights need "
            f"{needed / 1e9:.2f} GB",
        )
    tmp = out_dir.parent / f".{out_dir.name}.converting"
    shutil.rmtree(tmp, ignore_errors=True)  # a run interrupted before
    tmp.mkdir()
    try:
        total = len(
            {".".join(n.split(".")[: 2 if n.startswith("layers.") else 1]) for n, _, _ in specs}
        )
        done = [0]

        def tensors():
            with portable_layouts():
                parts = model_parts(config, reader, architecture, dtype, finish)
                for name, tensor, new_part in _stream(parts):
                    if new_part and progress is not None:
                        done[0] += 1
                        progress(done[0], total)
                    yield name, tensor

        size = _write_weights(tmp / WEIGHTS_FILE, specs, tensors())
        for name in COPIED_FILES:
            if (model_dir / name).is_file():
                shutil.copy(model_dir / name, tmp / name)
        manifest = {
            "format": FORMAT,
            "layout_version": LAYOUT_VERSION,
            "moespec_version": __version__,
            "weights": weights,
            "dtype": NAMES[dtype],
            "layouts": layout_paths(),
            "source": {"path": str(model_dir.resolve()), "fingerprint": fingerprint(reader)},
            "files": {WEIGHTS_FILE: size},
            "tensors": len(specs),
            "source_tensors": source,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        _publish(tmp, out_dir)
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        what = "the disk filled up" if error.errno == errno.ENOSPC else "a write failed"
        raise OSError(
            error.errno, f"{what} writing {out_dir} ({error.strerror}); nothing was written"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": str(out_dir), "weights": weights, "bytes": size, "tensors": len(specs)}


def skeleton_parts(config, index: dict, dtype, weights: str | None, directory=None) -> dict:
    """{part name: part} of a model built from a tensor index alone, on the meta device, in
    the final layouts a converted file holds (portable ones: the pair layout and int8): the
    shapes and dtypes, and the places, of every weight; no bytes."""
    from moespec.models import ARCHITECTURES, Finishing, model_parts

    reader = MetaReader(index, directory)
    with portable_layouts():
        architecture = ARCHITECTURES[config.model_type]
        return dict(model_parts(config, reader, architecture, dtype, Finishing(weights)))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _write_weights(path: Path, specs, tensors) -> int:
    from moespec.models.tensorfile import write_safetensors

    return write_safetensors(path, specs, tensors, metadata={"format": FORMAT})


def _publish(tmp: Path, out_dir: Path) -> None:
    """Rename the finished directory into place (an old one, with --force, goes after)."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.replaced"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def layout_paths() -> dict:
    """The product paths whose layouts a converted file holds, and the CPU family here."""
    from moespec.kernels.cpu import cpu_paths

    paths = cpu_paths()
    return {"bf16": paths.bf16, "int8": paths.int8, "cpu_family": paths.family}


def fingerprint(reader: TensorReader) -> str:
    """sha256 over the source's files: each one's name, size and safetensors header (cheap;
    a changed tensor layout or a re-saved file changes it)."""
    digest = hashlib.sha256()
    for path in sorted({p for p in reader.file_of.values()}):
        handle = reader._open(path)
        digest.update(f"{path.name}\0{handle.size}\0".encode())
        digest.update(json.dumps(handle.header, sort_keys=True).encode())
    return digest.hexdigest()


def _stream(parts):
    """(name, tensor, first of its part) for every weight of each (part name, part), in
    order; a weight met twice within a part (or the head that is the embeddings) once."""
    embed = None
    for part_name, part in parts:
        seen = {}
        if part_name == "embed":
            embed = part
        elif part_name == "lm_head" and part is embed:
            continue  # tied and unchanged: the embeddings are the head (load_converted)
        first = True
        for name, _, _, tensor in weight_leaves(part, part_name):
            if id(tensor) in seen:
                continue
            seen[id(tensor)] = tensor
            yield name, tensor, first
            first = False


def weight_leaves(obj, prefix: str):
    """(name, owner, key, tensor) for every weight tensor held under `obj`: moespec's own
    objects (attributes and slots), lists and dicts, walked in a fixed order. The stacked
    shape-holders of packed experts (meta tensors) are not weights and are skipped."""
    if isinstance(obj, torch.Tensor):
        yield prefix, None, None, obj
        return
    for key, value in _children(obj):
        name = f"{prefix}.{key}"
        if isinstance(value, torch.Tensor):
            if isinstance(obj, ExpertWeights) and key in ("gate_up", "down") and obj.is_packed:
                continue
            yield name, obj, key, value
        elif isinstance(value, list | dict) or _is_ours(value):
            yield from weight_leaves(value, name)


def _children(obj):
    if isinstance(obj, list):
        return list(enumerate(obj))
    if isinstance(obj, dict):
        return sorted(obj.items())
    names = list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        names += [s for s in getattr(cls, "__slots__", ()) if s not in names]
    return [(n, getattr(obj, n, None)) for n in names if n != "config"]


def _is_ours(value) -> bool:
    return type(value).__module__.startswith("moespec.") and not isinstance(value, type)


def _set(owner, key, value) -> None:
    if isinstance(owner, list | dict):
        owner[key] = value
    else:
        setattr(owner, key, value)


class MetaReader:
    """A TensorReader over a tensor index alone: every tensor is an empty one on the meta
    device (the skeleton a converted model's layout is read from)."""

    device = torch.device("meta")

    def __init__(self, index: dict[str, list], directory: Path | None = None):
        self.index = index
        self.directory = directory
        self.file_of = dict.fromkeys(index)

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def spec(self, name: str):
        dtype, shape = self.index[name]
        return DTYPES[dtype], tuple(shape)

    def check(self, name: str, shape, floats: bool = True) -> None:
        self._checked(name, shape)

    def _checked(self, name: str, shape) -> None:
        if name not in self.index:
            raise CheckpointError(f"tensor {name!r} is missing from {self.directory}")
        if tuple(self.index[name][1]) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {self.index[name][1]}, expected {list(shape)}"
            )

    def get(self, name: str, shape, dtype) -> torch.Tensor:
        self._checked(name, shape)
        return torch.empty(shape, dtype=dtype, device="meta")

    def get_bytes(self, name: str, shape) -> torch.Tensor:
        self._checked(name, shape)
        return torch.empty(shape, dtype=torch.uint8, device="meta")

    def read_into(self, name: str, out: torch.Tensor) -> None:
        self._checked(name, out.shape)


def read_manifest(path: Path) -> dict:
    manifest = read_json(path / MANIFEST)
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path / MANIFEST} is not a moespec converted-model manifest")
    source = manifest.get("source", {}).get("path", "SOURCE")
    again = f"moespec convert {source} {path} --weights {manifest.get('weights', 'bf16')} --force"
    if manifest.get("layout_version") != LAYOUT_VERSION:
        raise CheckpointError(
            f"{path} was converted with layout version {manifest.get('layout_version')}; this "
            f"moespec reads version {LAYOUT_VERSION}: convert again with `{again}`"
        )
    for key in ("weights", "dtype", "layouts", "source_tensors", "files"):
        if key not in manifest:
            raise CheckpointError(f"{path / MANIFEST} has no {key!r}")
    if manifest["weights"] not in WEIGHT_KINDS or manifest["dtype"] not in ("BF16", "F32"):
        raise CheckpointError(
            f"{path / MANIFEST}: weights {manifest['weights']!r} in {manifest['dtype']!r} "
            "is not a kind this moespec writes"
        )
    here, there = layout_paths(), manifest["layouts"]
    used = ["bf16"] if manifest["dtype"] == "BF16" else []
    if manifest["weights"].startswith("int8") and manifest["dtype"] == "BF16":
        used.append("int8")
    for kind in used:
        if there.get(kind) != here[kind]:
            raise CheckpointError(
                f"{path} holds {kind} layouts for the {there.get(kind)} path "
                f"({there.get('cpu_family')} CPU); this CPU ({here['cpu_family']}) takes "
                f"{here[kind]}: convert again here with `{again}`"
            )
    return manifest


def load_converted(
    path: str | Path,
    dtype=None,
    *,
    weights: str | None = None,
    pack: bool = True,
    pack_experts: bool = True,
):
    """(model, tokenizer) of a converted directory, its weights mapped from the file (see
    the module docstring). dtype and weights, when given, must be what it was converted to."""
    from moespec.models import (
        Tokenizer,
        assemble,
        load_config,
        parse_dtype,
    )

    path = Path(path)
    manifest = read_manifest(path)
    kind, stored = manifest["weights"], DTYPES[manifest["dtype"]]
    if dtype is not None and parse_dtype(dtype) != stored:
        raise CheckpointError(
            f"{path} was converted to {manifest['dtype'].lower()} weights; it runs in that "
            f"dtype (asked: {parse_dtype(dtype)})"
        )
    if weights is not None and weights != kind:
        raise CheckpointError(
            f"{path} was converted to {kind} weights; convert the source again for "
            f"{weights} weights"
        )
    config = load_config(path)
    tokenizer = Tokenizer(path / "tokenizer.json")
    quantized = None if kind in ("bf16", "fp32") else kind
    parts = skeleton_parts(config, manifest["source_tensors"], stored, quantized, path)
    try:
        handle = SafetensorsFile(path / WEIGHTS_FILE)
    except TensorFileError as error:
        raise CheckpointError(str(error)) from None
    expected = manifest["files"].get(WEIGHTS_FILE)
    if expected is not None and handle.size != expected:
        raise CheckpointError(
            f"{path / WEIGHTS_FILE} has {handle.size} bytes, its manifest {expected}: the "
            "file changed after it was converted"
        )
    _map_weights(parts, handle, path)
    model = assemble(config, parts, stored)
    if pack:  # what oneDNN takes in its own layout here (fp32 products): copies
        model.pack(experts=pack_experts)
    model.weights_file = handle
    model._weights_changed()
    return model, tokenizer


def _map_weights(parts: dict, handle: SafetensorsFile, path: Path) -> None:
    """Point every weight of the skeleton's parts at its bytes in the mapped file."""
    mapped, tied = set(), parts["lm_head"] is parts["embed"]
    for part_name in list(parts):
        if part_name == "lm_head" and tied:
            continue  # the embeddings themselves: placed below
        seen = {}
        for name, owner, key, tensor in list(weight_leaves(parts[part_name], part_name)):
            if id(tensor) in seen:
                value = seen[id(tensor)]
            else:
                if name not in handle:
                    raise CheckpointError(
                        f"{path / WEIGHTS_FILE} has no tensor {name!r}: the file does not "
                        "match this moespec's layout (convert it again)"
                    )
                value = handle.view(name)
                if value.dtype != tensor.dtype or value.shape != tensor.shape:
                    raise CheckpointError(
                        f"{path / WEIGHTS_FILE}: tensor {name!r} is {value.dtype} "
                        f"{list(value.shape)}, this moespec's layout wants {tensor.dtype} "
                        f"{list(tensor.shape)} (convert it again)"
                    )
                seen[id(tensor)] = value
                mapped.add(name)
            if owner is None:
                parts[part_name] = value
            else:
                _set(owner, key, value)
    if tied:
        parts["lm_head"] = parts["embed"]
    extra = set(handle.names()) - mapped
    if extra:
        raise CheckpointError(
            f"{path / WEIGHTS_FILE} holds {len(extra)} tensors this moespec's layout does not "
            f"place (e.g. {sorted(extra)[0]!r}): convert it again"
        )
