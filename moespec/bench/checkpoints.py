"""Random checkpoints of real shapes for the benchmark scripts, written by transformers, with
the demo pair's text tokenizer (machine and version facts: `moespec.provenance`)."""

from pathlib import Path

import torch

# Random-weight shapes (time does not depend on the values). Expert shapes are the real models';
# `layers` is cut so the checkpoint fits a few GB.
SHAPES = {
    "olmoe": {
        "model_type": "olmoe",
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 50304,
        "num_hidden_layers": 4,
    },
    "small": {
        "model_type": "olmoe",
        "hidden_size": 1024,
        "intermediate_size": 512,
        "num_experts": 16,
        "num_experts_per_tok": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "num_hidden_layers": 4,
    },
    # Full-size shapes (every layer): far too large for `random_checkpoint`, which builds the
    # model in memory; write them with `streamed_random_checkpoint`.
    "olmoe-1b-7b": {
        "model_type": "olmoe",
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 50304,
        "max_position_embeddings": 4096,
        "num_hidden_layers": 16,
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "moe_intermediate_size": 768,
        "intermediate_size": 6144,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "num_hidden_layers": 48,
    },
}
# The full-size shapes, written tensor by tensor (`streamed_random_checkpoint`).
FULL_SIZE = ("olmoe-1b-7b", "qwen3-30b-a3b")
SHARD_BYTES = 4 * 10**9  # about the size of a Hugging Face shard
CHUNK_BYTES = 32 * 2**20  # the most random data held at once while writing


def random_checkpoint(shape: str, directory: Path, layers: int | None = None) -> Path:
    """A bf16 checkpoint of random weights written by transformers (reused if present), with a
    real text tokenizer (`write_text_tokenizer`)."""
    import transformers

    settings = dict(SHAPES[shape])
    if layers is not None:
        settings["num_hidden_layers"] = layers
    model_type = settings.pop("model_type")
    target = directory / f"{shape}-{settings['num_hidden_layers']}L"
    if (target / "config.json").exists():
        if not has_text_tokenizer(target):  # written before checkpoints had one
            write_text_tokenizer(target)
        return target
    config = transformers.AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):
                param.normal_(0, 0.02)  # routers start at zero; give them real logits
    tmp = directory / f".{target.name}.tmp"
    model.save_pretrained(tmp)
    write_text_tokenizer(tmp)
    tmp.rename(target)
    return target


def write_text_tokenizer(directory: Path) -> None:
    """The demo pair's byte-level BPE (4,096 tokens, trained on the standard library's
    training files), so that text becomes a real token stream and routes as text does: a
    random-weight model of a real shape then sees the same workload in its trace, its
    benchmark windows and its verify passes. Ids stay below 4,096, within every shape's
    vocabulary."""
    import json
    import shutil

    from moespec.demo import demo_paths

    vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    if vocab < 4096:
        raise ValueError(
            f"{directory}: a vocabulary of {vocab} is too small for the text tokenizer"
        )
    shutil.copy(demo_paths()[0] / "tokenizer.json", directory / "tokenizer.json")


def has_text_tokenizer(directory: Path) -> bool:
    import json

    path = directory / "tokenizer.json"
    return path.exists() and json.loads(path.read_text())["model"]["type"] == "BPE"


def streamed_random_checkpoint(
    shape: str | dict, directory: Path, layers: int | None = None, *, seed: int = 0
) -> Path:
    """A bf16 checkpoint of random weights of `shape` (a name in SHAPES, or such a dict with
    an optional "name"), written without ever holding the model: the tensor names and shapes
    are those of transformers' own model built on the meta device (no memory), in the layout
    `save_pretrained` writes (one tensor per expert), and each tensor is generated a chunk at a
    time (normal, std 0.02; norms 1.0), written into safetensors shards of about SHARD_BYTES
    and dropped. With model.safetensors.index.json, config.json and the text tokenizer
    (`write_text_tokenizer`). Written beside its place and renamed into it when complete, so a
    directory that exists is complete and is reused."""
    import json
    import shutil

    settings = dict(SHAPES[shape]) if isinstance(shape, str) else dict(shape)
    name = shape if isinstance(shape, str) else settings.pop("name", "custom")
    if layers is not None:
        settings["num_hidden_layers"] = layers
    config = _config(settings)
    directory = Path(directory)
    target = directory / f"{name}-{config.num_hidden_layers}L-streamed"
    if (target / "model.safetensors.index.json").exists() and (target / "config.json").exists():
        return target
    specs = checkpoint_tensors(config)
    shards = _shards(specs, SHARD_BYTES)
    tmp = directory / f".{target.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    weight_map, total, index = {}, 0, 0
    for number, shard in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        for tensor_name, _, _ in shard:
            weight_map[tensor_name] = file
        total += sum(_nbytes(s) for _, _, s in shard)
        _write_random_shard(tmp / file, shard, seed, index)
        index += len(shard)
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    config.save_pretrained(tmp)
    write_text_tokenizer(tmp)
    tmp.rename(target)
    return target


def _config(settings: dict):
    import transformers

    settings = dict(settings)
    model_type = settings.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **settings)
    config.dtype = torch.bfloat16
    if getattr(config, "eos_token_id", None) is not None and config.eos_token_id >= (
        config.vocab_size
    ):
        config.eos_token_id = None  # a small test vocabulary
    return config


def checkpoint_tensors(config) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, bf16, shape) of every tensor of `config`'s checkpoint, in model order, as
    transformers' `save_pretrained` names them: the parameters of its model built on the meta
    device, the fused experts (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
    [E, H, I]) written one tensor per expert, and a tied head left out."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tied = getattr(config, "tie_word_embeddings", False)
    specs = []
    for name, tensor in model.state_dict().items():
        shape = tuple(tensor.shape)
        if tied and name == "lm_head.weight":
            continue
        if name.endswith("experts.gate_up_proj"):
            prefix, (experts, rows, _) = name[: -len("gate_up_proj")], shape
            for e in range(experts):
                for part in ("gate_proj", "up_proj"):
                    specs.append(
                        (f"{prefix}{e}.{part}.weight", torch.bfloat16, (rows // 2, shape[2]))
                    )
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(shape[0]):
                specs.append((f"{prefix}{e}.down_proj.weight", torch.bfloat16, shape[1:]))
        elif name.endswith(("gate_up_proj", "down_proj")) and len(shape) == 3:
            raise ValueError(f"{name}: a fused tensor whose checkpoint names are not known here")
        else:
            specs.append((name, torch.bfloat16, shape))
    return specs


def _nbytes(shape) -> int:
    n = 2  # bf16
    for d in shape:
        n *= d
    return n


def _shards(specs, limit: int) -> list[list]:
    shards, current, size = [], [], 0
    for spec in specs:
        nbytes = _nbytes(spec[2])
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def _write_random_shard(path: Path, specs, seed: int, first: int) -> None:
    """Write one safetensors file, each tensor generated CHUNK_BYTES at a time (its own
    generator, seeded by its place in the checkpoint), written and dropped."""
    import os

    from moespec.models.tensorfile import header_for

    # the tensors back to back, as `save_pretrained` writes them (no alignment gaps)
    head, ranges = header_for(specs, {"format": "pt"}, align=1)
    size = max((end for _, end in ranges.values()), default=0)
    generator = torch.Generator()
    with open(path, "wb") as f:
        f.write(head)
        for i, (name, _, shape) in enumerate(specs):
            is_norm = len(shape) == 1 and "norm" in name
            generator.manual_seed(seed * 1_000_003 + first + i)
            remaining = _nbytes(shape) // 2
            while remaining:
                n = min(remaining, CHUNK_BYTES // 2)
                chunk = torch.empty(n, dtype=torch.bfloat16)
                if is_norm:
                    chunk.fill_(1.0)
                else:
                    chunk.normal_(0, 0.02, generator=generator)
                f.write(memoryview(chunk.view(torch.uint8).numpy()))
                remaining -= n
                del chunk
        if f.tell() != len(head) + size:
            raise RuntimeError(f"{path}: wrote {f.tell()} bytes, expected {len(head) + size}")
        f.flush()
        os.fsync(f.fileno())
